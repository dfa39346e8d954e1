"""qcoll.fsdp.qcoll_group: the ProcessGroups FSDP2 hands the comms map to qcoll Groups, one
per set of ranks (FSDP2 makes a ProcessGroup per module sharded with hpZ), but not across
timeouts, node sizes, or a ProcessGroup destroyed since. Only the all-gather's groups are
shared: a reduce-scatter group of the shard group's ranks (set_separate_reduce_scatter_group)
exists to overlap the all-gathers, and qcoll's own resolve_group keeps every ProcessGroup
apart (a caller may drive two of the same ranks from two threads)."""

from __future__ import annotations

import math
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tests.plugins.test_fsdp import EncoderLM, _mesh, _train
from tests.support import fsdp_training
from tests.support.distributed import run_ranks


def _groups_worker(rank, world):
    import qcoll.fsdp
    from qcoll import group as groups

    torch.manual_seed(0)
    model = fsdp_training.shard_blocks(EncoderLM(20, 4, 36), _mesh(world), reshard_after_forward=2)
    qcoll.fsdp.use_qcoll(model, node_size=2)
    losses, _ = _train(model, 2, rank, world)
    post_forward = {id(g.post_forward_mesh_info.shard_process_group) for m in model.modules()
                    if isinstance(m, qcoll.fsdp.FSDPModule) for g in m._get_fsdp_state()._fsdp_param_groups}
    live = [len(g.global_ranks) for g in groups._live_groups if g._role == "group" and not g._closed]
    return len(post_forward), sorted(live), losses


@pytest.mark.parametrize("world", [4, 6], ids=["2x2", "3x2"])
def test_hpz_modules_share_one_qcoll_group(world):
    """Each post-forward ProcessGroup got a qcoll Group (a worker thread, its own ProcessGroups,
    on GPUs NCCL communicators): 5 modules, 6 Groups."""
    for post_forward, live, losses in run_ranks(world, _groups_worker, timeout=240):
        assert post_forward == 5  # 4 blocks and the root, each with its own ProcessGroup
        assert live == [2, world], live  # one Group for the 2-rank node groups, one for the world
        assert all(math.isfinite(x) for x in losses)


def _sum(group, rank) -> float:
    import qcoll

    x = torch.full((8,), float(rank + 1))
    qcoll.quantized_all_reduce(x, group, op="sum", bits=None)
    return x[0].item()


def _mapping_worker(rank, world):
    from functools import partial

    from qcoll.fsdp import qcoll_group as own_group
    from qcoll.group import resolve_group

    qcoll_group = partial(own_group, share_same_ranks=True)  # the all-gather's
    a, b = dist.new_group([0, 1]), dist.new_group([0, 1])
    slow = dist.new_group([0, 1], timeout=timedelta(seconds=77))
    whole = qcoll_group(dist.group.WORLD)  # collective over all three ranks
    if rank not in (0, 1):
        return None
    ga, gb = qcoll_group(a), qcoll_group(b)
    facts = {"same ranks share": ga is gb, "sum over b": _sum(gb, rank),
             "other timeout apart": qcoll_group(slow) is not ga,
             "other node_size apart": qcoll_group(b, node_size=1) is not ga,
             "world apart": whole is not ga and whole.size == 3,
             "resolve_group apart": resolve_group(a) is not resolve_group(b),
             "reduce-scatter's apart": own_group(b) is not ga}  # set_separate_reduce_scatter_group
    dist.destroy_process_group(a)  # the shared Group's exchanges ran over a: b gets its own
    gb2 = qcoll_group(b)
    facts.update({"remade after destroy": gb2 is not ga and gb2.pg is b, "sum after": _sum(gb2, rank),
                  "kept": qcoll_group(b) is gb2})
    return facts


def test_same_rank_process_groups_map_to_one_group():
    for rank, facts in enumerate(run_ranks(3, _mapping_worker, timeout=120)[:2]):
        assert facts == {"same ranks share": True, "sum over b": 3.0, "other timeout apart": True,
                         "other node_size apart": True, "world apart": True, "resolve_group apart": True,
                         "reduce-scatter's apart": True,
                         "remade after destroy": True, "sum after": 3.0, "kept": True}, (rank, facts)

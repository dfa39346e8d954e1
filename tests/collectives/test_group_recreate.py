"""qcoll.destroy(), then new groups, several times over: the ProcessGroups qcoll creates
for a group that is not the whole world (a sub-ProcessGroup's group, an HSDP replicate
group) must not meet the rendezvous keys their destroyed predecessors left in the store,
nor the names of live groups over the same ranks. Each round's collectives match the
simulation bit for bit, and destroyed groups leave no threads, ProcessGroups or sockets
behind. The whole world's groups, made and destroyed the same way, too."""

from __future__ import annotations

import gc
import os
import threading
import weakref
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import qcoll
from tests.support.distributed import run_ranks
from tests.collectives.test_collectives_quantized import assert_bits, gradient_like, simulate_reduce_scatter
from tests.support import reference as ref

ROUNDS = 3
N = 40  # elements per rank: several groups of 8, a short tail
GROUP_SIZE = 8
TIMEOUT = timedelta(seconds=15)  # a rendezvous on stale addresses fails well within the test's limit


def _check_round(group, members: list, node_size: int, tag) -> None:
    """quantized_allgather and quantized_reduce_scatter on `group` (its ranks: `members`,
    global ranks, `node_size` of them per node) against the simulation."""
    size, me = len(members), members.index(dist.get_rank())
    pieces = [gradient_like(N, torch.float32, "ag", tag, r) for r in range(size)]
    out = torch.full((size * N,), float("nan"))
    qcoll.quantized_allgather(out, pieces[me].clone(), group, bits=8, group_size=GROUP_SIZE)
    expected = torch.cat([ref.dequantize(ref.quantize(p, bits=8, group_size=GROUP_SIZE)) for p in pieces])
    assert_bits(out, expected, f"allgather {tag}")

    inputs = [gradient_like(size * N, torch.float32, "rs", tag, r) for r in range(size)]
    out = torch.full((N,), float("nan"))
    qcoll.quantized_reduce_scatter(out, inputs[me].clone(), group, intra_bits=8, inter_bits=4,
                                   group_size=GROUP_SIZE, pipeline_stages=1)
    expected, _ = simulate_reduce_scatter(inputs, me, N, node_size, op="avg", intra_bits=8,
                                          inter_bits=4, group_size=GROUP_SIZE, stages=1,
                                          hierarchical=None, dtype=torch.float32)
    assert_bits(out, expected, f"reduce_scatter {tag}")


def _open_sockets() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except FileNotFoundError:  # the listing's own descriptor, closed since
            pass
    return count


def _check_destroyed(round_, baseline: list) -> None:
    """After destroy(): none of qcoll's ProcessGroups left, and as many threads,
    ProcessGroups and sockets as after the first round."""
    names = dist.distributed_c10d._world.pg_names.values()
    assert not [n for n in names if n.startswith("qcoll-")], f"round {round_}: {list(names)}"
    now = (threading.active_count(), len(dist.distributed_c10d._world.pg_map), _open_sockets())
    if not baseline:
        baseline.extend(now)
    assert list(now) == baseline, (f"round {round_}: (threads, ProcessGroups, sockets) after "
                                   f"destroy() = {now}, after the first round {tuple(baseline)}")


def _sub_group_worker(rank, world):
    # A strict sub-group (ranks 0-3 of 6) as 2 nodes x 2, and HSDP's replicate groups
    # ({0, 2} and {1, 3}) as plain ProcessGroups resolved by qcoll; ranks 4 and 5 never
    # take part in qcoll's groups (nothing may ask them to).
    sub_ranks = [0, 1, 2, 3]
    sub_pg = dist.new_group(sub_ranks, timeout=TIMEOUT)
    replicas = [[0, 2], [1, 3]]
    replicate_pgs = [dist.new_group(r, timeout=TIMEOUT) for r in replicas]
    if rank not in sub_ranks:
        return None
    baseline = []
    for round_ in range(ROUNDS):
        first = qcoll.new_group(sub_pg, node_size=2, timeout=TIMEOUT)
        group = qcoll.new_group(sub_pg, node_size=2, timeout=TIMEOUT)
        # One closed while another over the same ranks lives: the next one's ProcessGroups
        # must not take the live group's names either.
        first.close()
        again = qcoll.new_group(sub_pg, node_size=2, timeout=TIMEOUT)
        _check_round(group, sub_ranks, 2, ("sub", round_))
        _check_round(again, sub_ranks, 2, ("sub again", round_))
        _check_round(replicate_pgs[rank % 2], replicas[rank % 2], 1, ("replicate", round_))
        qcoll.destroy()
        del first, group, again
        _check_destroyed(round_, baseline)
    return ROUNDS


def _world_worker(rank, world):
    baseline = []
    for round_ in range(ROUNDS):
        group = qcoll.new_group(node_size=2, timeout=TIMEOUT)
        qcoll.new_group(node_size=2, timeout=TIMEOUT)  # dropped, never closed
        _check_round(group, list(range(world)), 2, ("world", round_))
        qcoll.destroy()
        del group
        _check_destroyed(round_, baseline)
    return ROUNDS


def _kept_sub_group_worker(rank, world):
    # `qcoll.new_group(...).intra`: the parent is dropped at once, the caller keeps its
    # sub-groups (their CPU calls had ended with the parent's worker thread: "the group was
    # closed"); closing one of them leaves the other working (it had stopped their worker).
    baseline = []
    _check_destroyed("before", baseline)
    parent = qcoll.new_group(node_size=2, timeout=TIMEOUT)
    intra, inter, dropped = parent.intra, parent.inter, weakref.ref(parent)
    other = qcoll.new_group(node_size=2, timeout=TIMEOUT).inter  # alone in its family
    del parent
    gc.collect()
    assert dropped() is None and intra._family is inter._family and intra._family._open == 2
    for round_ in range(2):  # the second round's calls go through the families' worker threads
        for g in (intra, inter, other):
            work = qcoll.quantized_allgather(torch.empty(g.size * N), torch.ones(N), g, async_op=True)
            _check_round(g, g.global_ranks, g.node_size, ("kept", g._role, round_))
            work.wait()
    del g, work
    intra.close()
    workers = (inter._calls, other._calls)
    assert intra._owned_pg is None and not workers[0]._closed  # its own ProcessGroups destroyed
    _check_round(inter, inter.global_ranks, 1, ("after its sibling was closed", 0))
    del other  # the last of its family: its worker stops, the other family's goes on
    gc.collect()
    assert workers[1]._closed and not workers[0]._closed
    _check_round(inter, inter.global_ranks, 1, ("after the other family was dropped", 0))
    qcoll.destroy()  # closes the kept sub-group too, and the ProcessGroups of all four Groups
    assert inter._closed and workers[0]._closed
    del intra, inter
    _check_destroyed("after", baseline)
    return True


HOSTS = {r: {"QCOLL_HOST_ID": f"host{r // 2}"} for r in range(6)}  # nodes of 2 ranks


def test_sub_groups_are_recreated_after_destroy():
    results = run_ranks(6, _sub_group_worker, env=HOSTS, timeout=150)
    assert results == [ROUNDS] * 4 + [None] * 2


def test_world_groups_are_recreated_after_destroy():
    assert run_ranks(4, _world_worker, env=HOSTS, timeout=150) == [ROUNDS] * 4


@pytest.mark.parametrize("world", [4, 6], ids=["2x2", "3x2"])
def test_a_kept_sub_group_outlives_its_dropped_parent_until_destroy(world):
    assert run_ranks(world, _kept_sub_group_worker, env=HOSTS, timeout=150) == [True] * world


def _fallback_worker(rank, world):
    # A torch whose private helper does not fit: torch's own new_group names the groups.
    from qcoll import _process_groups

    _process_groups._NAMED = False
    group = qcoll.new_group(node_size=2, timeout=TIMEOUT)
    _check_round(group, list(range(world)), 2, ("fallback", 0))
    names = list(dist.distributed_c10d._world.pg_names.values())
    qcoll.destroy()
    return [n for n in names if n.startswith("qcoll-")]


def test_unfitting_torch_helper_falls_back_to_torch_names():
    assert run_ranks(4, _fallback_worker, env=HOSTS, timeout=150) == [[]] * 4

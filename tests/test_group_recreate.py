"""qcoll.destroy(), then new groups, several times over: the ProcessGroups qcoll creates
for a group that is not the whole world (a sub-ProcessGroup's group, an HSDP replicate
group) must not meet the rendezvous keys their destroyed predecessors left in the store.
Each round's collectives match the simulation bit for bit, and destroyed groups leave no
threads, ProcessGroups or sockets behind."""

from __future__ import annotations

import os
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

import qcoll
from distributed import run_ranks
from test_collectives_quantized import assert_bits, gradient_like, simulate_reduce_scatter
import reference as ref

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


def _recreate_worker(rank, world):
    # A strict sub-group (ranks 0-3 of 6) as 2 nodes x 2, and HSDP's replicate groups
    # ({0, 2} and {1, 3}) as plain ProcessGroups resolved by qcoll; ranks 4 and 5 never
    # take part in qcoll's groups (nothing may ask them to).
    sub_ranks = [0, 1, 2, 3]
    sub_pg = dist.new_group(sub_ranks, timeout=TIMEOUT)
    replicas = [[0, 2], [1, 3]]
    replicate_pgs = [dist.new_group(r, timeout=TIMEOUT) for r in replicas]
    if rank not in sub_ranks:
        return None
    mine = replicas[rank % 2]
    replicate_pg = replicate_pgs[rank % 2]
    baseline_threads = baseline_pgs = baseline_sockets = None
    for round_ in range(ROUNDS):
        group = qcoll.new_group(sub_pg, node_size=2, timeout=TIMEOUT)
        _check_round(group, sub_ranks, 2, ("sub", round_))
        _check_round(replicate_pg, mine, 1, ("replicate", round_))  # via resolve_group
        qcoll.destroy()
        del group
        threads = threading.active_count()
        pgs = len(dist.distributed_c10d._world.pg_map)
        sockets = _open_sockets()
        if baseline_threads is None:
            baseline_threads, baseline_pgs, baseline_sockets = threads, pgs, sockets
        assert (threads, pgs, sockets) == (baseline_threads, baseline_pgs, baseline_sockets), (
            f"round {round_}: (threads, ProcessGroups, sockets) after destroy() = "
            f"{(threads, pgs, sockets)}, after the first round "
            f"{(baseline_threads, baseline_pgs, baseline_sockets)}")
    return ROUNDS


def test_groups_are_recreated_after_destroy():
    hosts = {r: {"QCOLL_HOST_ID": f"host{r // 2}"} for r in range(6)}  # 3 nodes x 2
    results = run_ranks(6, _recreate_worker, env=hosts, timeout=150)
    assert results == [ROUNDS] * 4 + [None] * 2

"""Issue 14.2 / 9.5 / 9.6: a dead or silent peer is an error within the group's timeout,
2-hop paths included, never a hang; the error names the qcoll call and the exchange; the
pipelined reduce-scatter's lanes are joined on the error path; the failed group refuses
further calls; qcoll's ProcessGroups inherit the parent's timeout."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import qcoll
from tests.support.distributed import run_ranks

TIMEOUT = 5.0  # seconds: the groups' timeout in these tests
SLACK = 6.0  # spawn jitter on a shared 2-core machine


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _failure_worker(rank, world, node_size, when, async_op):
    from qcoll import _torch_transport as tt

    qcoll._runtime.steps.MIN_STAGE_BYTES = 0  # 4 real stages: both lanes busy
    g = qcoll.new_group(node_size=node_size, timeout=timedelta(seconds=TIMEOUT))
    x = torch.randn(world * 4096)
    out = torch.empty(4096)
    # Warm: the worker thread (async calls only), the lanes, the PGs.
    qcoll.quantized_reduce_scatter(out, x, g, pipeline_stages=4, async_op=True).wait()
    threads = _threads()
    victim = world - 1
    if rank == victim:
        if when == "before":
            os._exit(0)  # dies before the collective
        if when == "during":  # passes the call check, dies in its first hop
            tt.ProcessGroupTransport.all_to_all = lambda *a: os._exit(0)
        if when == "stalls":  # passes the call check, then hangs in its first hop
            def stall(*args):
                time.sleep(TIMEOUT + SLACK + 2)
                os._exit(0)
            tt.ProcessGroupTransport.all_to_all = stall
        if when == "silent":  # alive, but never makes the call (killed once the others report)
            time.sleep(TIMEOUT + SLACK + 2)
            os._exit(0)
    start = time.monotonic()
    try:
        work = qcoll.quantized_reduce_scatter(out, x, g, pipeline_stages=4, async_op=async_op)
        if async_op:
            assert work is not None and time.monotonic() - start < TIMEOUT
            work.wait()
    except qcoll.CommunicationError as exc:
        elapsed = time.monotonic() - start
        msg = str(exc)
    else:
        raise AssertionError(f"rank {rank}: the call returned although rank {victim} is gone")
    time.sleep(0.2)  # the C++ lane thread, if any, has been joined before the error surfaced
    leaked = _threads() - threads
    try:
        qcoll.quantized_allgather(torch.empty(world * 8), torch.ones(8), g)
    except qcoll.CommunicationError as exc:
        refused = "unusable" in str(exc)
    else:
        refused = False
    return elapsed, msg, leaked, refused


@pytest.mark.parametrize("when,async_op", [("before", False), ("during", True), ("stalls", False),
                                           ("silent", False)])
def test_dead_or_silent_peer_raises_within_the_timeout(when, async_op):
    world, node_size = 4, 2
    dead = (world - 1,)  # dies, or stalls (or stays silent) until the others have reported
    results = run_ranks(world, _failure_worker, node_size, when, async_op, timeout=60, dead=dead)
    for rank, res in enumerate(results[: world - 1]):
        elapsed, msg, leaked, refused = res
        assert elapsed < TIMEOUT + SLACK, f"rank {rank} raised after {elapsed:.1f} s"
        assert "qcoll.quantized_reduce_scatter" in msg, msg
        assert any(w in msg for w in ("intra-node group", "inter-node group", "the group (global")), msg
        assert leaked <= 0, f"rank {rank}: {leaked} thread(s) left running after the error"
        assert refused, f"rank {rank}: the failed group accepted another call"
    if when == "stalls":
        # Ranks 0 and 1 finished the intra-node hop and waited in the inter-node hop for a
        # peer that never came: released by the group's timeout, not torch's 30 minutes.
        for rank in (0, 1):
            elapsed, msg = results[rank][:2]
            assert "inter-node group" in msg and "Timed out" in msg, msg
            assert elapsed > TIMEOUT - 1, elapsed
    if when == "during":
        # Rank 0's inter-node peer (rank 2) gave up in its intra-node hop: rank 0 waited in
        # the inter-node hop, and was released by the timeout, not by torch's 30 minutes.
        msgs = {rank: results[rank][1] for rank in range(world - 1)}
        assert "intra-node group" in msgs[2], msgs[2]
        assert any("inter-node group" in m for m in msgs.values()), msgs


def _timeout_worker(rank, world):
    parent = dist.new_group(list(range(world)), timeout=timedelta(seconds=7))
    g = qcoll.new_group(parent, node_size=2)
    from qcoll.group import pg_timeout

    inherited = [pg_timeout(p).total_seconds() for p in (g._owned_pg, g.intra._owned_pg, g.inter._owned_pg)]
    h = qcoll.new_group(parent, node_size=2, timeout=timedelta(seconds=3))
    explicit = [pg_timeout(p).total_seconds() for p in (h._owned_pg, h.intra._owned_pg, h.inter._owned_pg)]
    assert g._owned_pg is not parent and g.timeout == timedelta(seconds=7)
    bad = []
    for value in (5, timedelta(0), [timedelta(seconds=1)]):
        try:
            qcoll.new_group(parent, timeout=value)
        except ValueError as exc:
            bad.append("timeout" in str(exc))
    return inherited, explicit, bad


def test_qcoll_process_groups_inherit_the_parent_timeout():
    for inherited, explicit, bad in run_ranks(4, _timeout_worker, timeout=60):
        assert inherited == [7.0, 7.0, 7.0]
        assert explicit == [3.0, 3.0, 3.0]
        assert bad == [True, True, True]

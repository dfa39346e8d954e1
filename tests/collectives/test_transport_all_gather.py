"""The gloo transport's all-gather: posted as one send and one receive per peer where
that is faster than gloo's ring (3 or more ranks, or 1 MB gathered on 2), gloo's own
all-gather otherwise; both place every rank's bytes at its offset, and a peer that dies
or stalls mid-exchange is an error within the group's timeout."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch

import qcoll
from qcoll import _torch_transport as tt
from tests.support.distributed import run_ranks

TIMEOUT = 5.0
SLACK = 6.0  # spawn jitter on a shared 2-core machine


def _gather(rank, world, sizes):
    g = qcoll.new_group(node_size=world)  # one node: the flat group's transport
    used = []
    pairwise = tt.ProcessGroupTransport._pairwise_all_gather

    def recording(self, send, recv):
        used.append(send.nbytes)
        return pairwise(self, send, recv)

    tt.ProcessGroupTransport._pairwise_all_gather = recording
    out = []
    try:
        for numel in sizes:
            shard = torch.arange(numel, dtype=torch.float32) + rank * numel  # rank r's values: r*n ...
            full = torch.empty(world * numel)
            before = len(used)
            qcoll.quantized_allgather(full, shard, g, bits=None)
            out.append((torch.equal(full, torch.arange(world * numel, dtype=torch.float32)),
                        len(used) > before))
    finally:
        tt.ProcessGroupTransport._pairwise_all_gather = pairwise
    g.close()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_lands_at_its_offset_on_either_path(world):
    small, large = 1000, (1 << 20) // 4 // world + 17  # below and above 1 MB gathered
    results = run_ranks(world, _gather, [small, large], timeout=120)
    for per_rank in results:
        (small_ok, small_pairwise), (large_ok, large_pairwise) = per_rank
        assert small_ok and large_ok
        assert small_pairwise == (world >= tt._PAIRWISE_MIN_RANKS)
        assert large_pairwise


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _dies_in_the_gather(rank, world, how):
    g = qcoll.new_group(node_size=world, timeout=timedelta(seconds=TIMEOUT))
    shard = torch.ones(4096)
    full = torch.empty(world * 4096)
    qcoll.quantized_allgather(full, shard, g, bits=None)  # warm: connections, worker
    threads = _threads()
    if rank == world - 1:
        if how == "dies":  # posts nothing, gone
            tt.ProcessGroupTransport._pairwise_all_gather = lambda *a: os._exit(0)
        else:  # alive, but its sends never come
            def stall(*args):
                time.sleep(TIMEOUT + SLACK + 2)
                os._exit(0)
            tt.ProcessGroupTransport._pairwise_all_gather = stall
    start = time.monotonic()
    try:
        qcoll.quantized_allgather(full, shard, g, bits=None)
    except qcoll.CommunicationError as exc:
        elapsed, msg = time.monotonic() - start, str(exc)
    else:
        raise AssertionError(f"rank {rank}: the all-gather returned although rank {world - 1} is gone")
    time.sleep(0.2)
    return elapsed, msg, _threads() - threads


@pytest.mark.parametrize("how", ["dies", "stalls"])
def test_a_peer_lost_mid_gather_is_an_error_within_the_timeout(how):
    world = 3
    results = run_ranks(world, _dies_in_the_gather, how, timeout=60, dead=(world - 1,))
    for rank, (elapsed, msg, leaked) in enumerate(results[: world - 1]):
        assert elapsed < TIMEOUT + SLACK, f"rank {rank} raised after {elapsed:.1f} s"
        assert "qcoll.quantized_allgather" in msg and "all-gather over" in msg, msg
        # gloo's own error: the connection lost, or the timeout.
        assert ("Timed out" if how == "stalls" else "peer") in msg, msg
        assert leaked <= 0, f"rank {rank}: {leaked} thread(s) left running after the error"

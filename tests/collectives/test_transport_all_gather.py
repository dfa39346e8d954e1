"""The gloo transport's all-gather: an all-to-all of the rank's bytes sent to every rank, on
a ProcessGroup of its own (ProcessGroupTransport.gather_pg), except past a size limit over
nodes of several ranks (gloo's ring there). Every rank's bytes land at its offset for every
dtype the core sends, on either path; the send buffer is kept only up to its size limit;
a peer that dies or stalls mid-gather is an error within the group's timeout."""

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


def _recording(seen: list):
    """ProcessGroupTransport._replicated, recording the transport and the bytes it sends."""
    original = tt.ProcessGroupTransport._replicated

    def replicated(self, send):
        seen.append((self, send.numel() * send.element_size()))
        return original(self, send)
    return original, replicated


def _gather(rank, world, sizes, keep_bytes, node_size):
    tt._KEEP_REPLICAS_BYTES = keep_bytes
    g = qcoll.new_group(node_size=node_size)  # the flat group's transport: bits=None, bits=8
    seen = []
    original, tt.ProcessGroupTransport._replicated = _recording(seen)
    out = []
    try:
        for numel in sizes:
            for dtype in (torch.float32, torch.bfloat16):
                base = torch.arange(world * numel, dtype=torch.float64).remainder(251).to(dtype)
                shard = base[rank * numel:(rank + 1) * numel].clone()
                full = torch.full((world * numel,), float("nan"), dtype=dtype)
                before = len(seen)
                qcoll.quantized_allgather(full, shard, g, bits=None)
                # The payload's exchange (not the 32-byte call check of a new signature).
                through = any(b >= numel * dtype.itemsize for _, b in seen[before:])
                kept = seen[-1][0]._replicas.numel() if seen else None
                out.append((numel, str(dtype), torch.equal(full, base), through, kept))
            # A quantized all-gather: its codes travel through the same exchange.
            xs = [torch.randn(numel, generator=torch.Generator().manual_seed(r)) for r in range(world)]
            q = torch.empty(world * numel)
            before = len(seen)
            qcoll.quantized_allgather(q, xs[rank], g, bits=8)
            every = torch.cat(xs)
            close = bool((q - every).abs().max() <= every.abs().max() / 100)
            out.append((numel, "int8", close, any(b >= numel for _, b in seen[before:]),
                        seen[-1][0]._replicas.numel()))
        distinct = all(t.gather_pg is not None and t.gather_pg is not t.pg for t, _ in seen)
    finally:
        tt.ProcessGroupTransport._replicated = original
    g.close()
    return out, distinct


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_lands_at_its_offset(world):
    small, large = 1000, (1 << 20) // 4 // world + 17  # odd sizes: unaligned chunk tails
    keep = 64 << 10  # the small gathers' buffer is kept, the large ones' is not
    results = run_ranks(world, _gather, [small, large], keep, world, timeout=120)
    for out, distinct in results:
        assert distinct, "the all-gathers must run on a ProcessGroup of their own"
        for numel, dtype, placed, through_all_to_all, kept in out:
            assert placed, (numel, dtype)
            assert through_all_to_all, (numel, dtype)  # one node: always
            # Kept: the first (small) gather's buffer; the large ones' (over `keep`) are
            # allocated per call and dropped.
            assert kept == world * small * 4, (numel, dtype, kept)


@pytest.mark.parametrize("world", [4, 6])  # 2 and 3 nodes of 2 ranks
def test_over_nodes_of_several_ranks_large_gathers_take_the_ring(world):
    node_size = 2
    small, large = 1000, tt.ALL_TO_ALL_GATHER_SPANNING_MAX_BYTES // 4 // world + 17
    results = run_ranks(world, _gather, [small, large], 64 << 20, node_size, timeout=120)
    for out, _ in results:
        paths = {(numel, dtype): through for numel, dtype, placed, through, _ in out if placed}
        assert len(paths) == len(out), out  # every gather placed, on either path
        assert paths[(small, "torch.float32")] and paths[(small, "torch.bfloat16")]
        assert not paths[(large, "torch.float32")]  # past the limit: the ring
        assert paths[(large, "torch.bfloat16")]  # half the bytes: within it


def test_the_rule():
    limit = tt.ALL_TO_ALL_GATHER_SPANNING_MAX_BYTES
    assert tt.gathers_by_all_to_all(6, 6, 1 << 30) and tt.gathers_by_all_to_all(6, 1, 1 << 30)
    assert tt.gathers_by_all_to_all(6, 2, limit) and not tt.gathers_by_all_to_all(6, 2, limit + 1)


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
            tt.ProcessGroupTransport._replicated = lambda *a: os._exit(0)
        else:  # alive, but its sends never come
            def stall(*args):
                time.sleep(TIMEOUT + SLACK + 2)
                os._exit(0)
            tt.ProcessGroupTransport._replicated = stall
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

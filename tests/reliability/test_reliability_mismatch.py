"""Issue 14.1: ranks that disagree never get wrong data, with or without QCOLL_DEBUG.

The first CPU call of each signature first all-gathers a fixed-size call header, so a
disagreement (size, dtype, code format, op, stages, hop layout; an all-reduce's element
count) raises the same ValueError on every rank, listing each rank's values, before any
message whose size depends on them is sent; the group stays usable. A rank that moves on
alone to a new call while its peers repeat an agreed one (they skip the check) waits on the
check's own channel: every rank raises CommunicationError within the timeout. Every wire chunk also carries a header that the receiver checks before decoding:
a stale or misrouted chunk raises instead of being decoded. Header bytes are counted in
qcoll.stats() and stay under 1% at the default group size for chunks >= 64 KB."""

from __future__ import annotations

import pytest
import torch

import qcoll
from tests.support.distributed import run_ranks

N = 1000


def _rs(n, **kw):
    return lambda g, w: qcoll.quantized_reduce_scatter(torch.empty(n), torch.ones(w * n), g, **kw)


def _ag(n, **kw):
    return lambda g, w: qcoll.quantized_allgather(torch.empty(w * n), torch.ones(n), g, **kw)


def _ar(n, **kw):
    return lambda g, w: qcoll.quantized_all_reduce(torch.ones(n), g, **kw)


# name -> (rank 0's call, everyone else's call, words every rank's message must contain)
MISMATCHES = {
    "rs_numel": (_rs(N + 24), _rs(N), ["quantized_reduce_scatter", "1024 float32", "1000 float32"]),
    "rs_intra_bits": (_rs(N, intra_bits=4), _rs(N), ["int4", "int8"]),
    "rs_dtype": (lambda g, w: qcoll.quantized_reduce_scatter(
        torch.empty(N, dtype=torch.bfloat16), torch.ones(w * N, dtype=torch.bfloat16), g),
        _rs(N), ["bfloat16", "float32"]),
    "rs_op": (_rs(N, op="sum"), _rs(N), ["op sum", "op avg"]),
    "rs_group_size": (_rs(N, group_size=64), _rs(N), ["group_size 64", "group_size 256"]),
    "rs_raw_numel": (_rs(N + 8, intra_bits=None, inter_bits=None, hierarchical=False),
                     _rs(N, intra_bits=None, inter_bits=None, hierarchical=False),
                     ["1008 float32", "1000 float32"]),
    "ag_numel": (_ag(N + 24), _ag(N), ["quantized_allgather", "1024 float32", "1000 float32"]),
    "ag_bits": (_ag(N, bits=4), _ag(N), ["int4", "int8"]),
    "ag_bits_none": (_ag(N, bits=None), _ag(N), ["raw", "int8"]),
    "ag_fp8": (_ag(N, bits="fp8_e4m3"), _ag(N, bits="int8"), ["fp8_e4m3", "int8"]),
    # Both pad to the same shard (251 elements on 4 ranks, 501 on 2): the check compares numel.
    "ar_numel": (_ar(N + 1), _ar(N + 2), ["quantized_all_reduce", "1001 float32 elements",
                                          "1002 float32 elements"]),
}
TWO_HOP_ONLY = {  # on one node these arguments do not change the call
    "rs_hierarchical": (_rs(N, hierarchical=False), _rs(N), ["1-hop", "2-hop"]),
    "rs_inter_bits": (_rs(N, inter_bits=8), _rs(N), ["int8 then int8", "int8 then int4"]),
}


def _mismatch_worker(rank, world, node_size, names):
    g = qcoll.new_group(node_size=node_size)
    cases = {**MISMATCHES, **TWO_HOP_ONLY}
    seen = {}
    for name in names:
        mine = cases[name][0] if rank == 0 else cases[name][1]
        try:
            mine(g, world)
        except ValueError as exc:
            seen[name] = str(exc)
        else:
            seen[name] = None
        # The group is still usable, and exact (small integers, raw on the wire).
        x = torch.arange(world * 8, dtype=torch.float32) + rank
        out = torch.empty(8)
        qcoll.quantized_reduce_scatter(out, x, g, op="sum", intra_bits=None, inter_bits=None)
        want = world * (torch.arange(8, dtype=torch.float32) + rank * 8) + sum(range(world))
        assert torch.equal(out, want), f"after {name}"
    return seen


@pytest.mark.parametrize("debug", ["0", "1"])
@pytest.mark.parametrize("world,node_size", [(2, 2), (4, 2)])
def test_disagreeing_ranks_all_raise_and_the_group_survives(world, node_size, debug):
    names = list(MISMATCHES) + (list(TWO_HOP_ONLY) if world // node_size > 1 else [])
    env = {r: {"QCOLL_DEBUG": debug} for r in range(world)}
    results = run_ranks(world, _mismatch_worker, node_size, names, env=env, timeout=90)
    words = {**MISMATCHES, **TWO_HOP_ONLY}
    for rank, seen in enumerate(results):
        for name in names:
            msg = seen[name]
            assert msg is not None, f"{name}: rank {rank} returned instead of raising"
            assert "disagree" in msg, (name, rank, msg)
            if debug == "0":  # the call check names the call and every rank's values
                for word in words[name][2] + ["member 0", f"member {world - 1}"]:
                    assert word in msg, f"{name}: rank {rank}: {word!r} not in {msg!r}"


# ---- the per-chunk header -----------------------------------------------------------------
def _stale_chunk_worker(rank, world, node_size, stages):
    from datetime import timedelta

    from qcoll import _torch_transport as tt

    qcoll._runtime.steps.MIN_STAGE_BYTES = 0
    original = tt.ProcessGroupTransport.all_to_all
    # Peers of the rank that rejects a chunk are left waiting for it: 5 s, then they raise.
    g = qcoll.new_group(node_size=node_size, timeout=timedelta(seconds=5))
    x = torch.randn(world * 64, generator=torch.Generator().manual_seed(rank))
    good = torch.empty(64)
    qcoll.quantized_reduce_scatter(good, x, g, pipeline_stages=stages)

    def stale(self, buffers, send_id, send_off, recv_id, recv_off, nbytes):
        original(self, buffers, send_id, send_off, recv_id, recv_off, nbytes)
        # What a message shorter than its slot would leave: the previous call's bytes in
        # the slot of the last member (its header says call 0, this is call 1).
        slot = buffers.bytes(recv_id, recv_off + (self.size - 1) * nbytes, nbytes)
        header = slot[:32].view(torch.int32)
        header[3] -= 1  # the sequence field (bytes 12..15)

    if rank == 0:
        tt.ProcessGroupTransport.all_to_all = stale
    out = torch.full((64,), 7.0)
    try:
        qcoll.quantized_reduce_scatter(out, x, g, pipeline_stages=stages)
    except qcoll.CommunicationError as exc:
        # The group is left mid-call on some ranks: it refuses further calls.
        try:
            qcoll.quantized_reduce_scatter(out, x, g)
        except qcoll.CommunicationError as again:
            assert "unusable" in str(again)
        else:
            raise AssertionError("a call ran on a group left mid-call")
        return "raised", str(exc), None
    finally:
        tt.ProcessGroupTransport.all_to_all = original
    return "ok", torch.equal(out, good), None


@pytest.mark.parametrize("world,node_size,stages,exchange", [
    (2, 2, 1, "all-to-all"), (4, 2, 2, "intra-node hop")])
def test_stale_chunk_is_rejected_before_decoding(world, node_size, stages, exchange):
    results = run_ranks(world, _stale_chunk_worker, node_size, stages, timeout=60)
    status, msg, _ = results[0]
    assert status == "raised", f"rank 0 decoded a stale chunk: {results[0]}"
    assert exchange in msg and f"member {node_size - 1} sent" in msg and "call 0" in msg, msg
    assert "quantized_reduce_scatter (call 1" in msg, msg
    for rank, (status, detail, _) in enumerate(results[1:], 1):
        # Never wrong data: a rank finished with the right values, or raised.
        assert (status, detail) == ("ok", True) or status == "raised", (rank, status, detail)
    if world == 2:  # the other rank's chunks were fine: it finished, and right
        assert results[1][:2] == ("ok", True), results[1]


# ---- header overhead ------------------------------------------------------------------------
def _overhead_worker(rank, world, node_size, n):
    g = qcoll.new_group(node_size=node_size)
    x = torch.randn(world * n)
    qcoll.reset_stats()
    qcoll.quantized_reduce_scatter(torch.empty(n), x, g)  # 2-hop: int8 then int4
    qcoll.quantized_allgather(torch.empty(world * n), x[:n], g)  # int8
    qcoll.quantized_allgather(torch.empty(world * n // 2), x[: n // 2], g, bits=4)
    return qcoll.stats()


def test_header_bytes_stay_under_one_percent_for_64kb_chunks():
    # n = 131072 (default group size 256): int4 chunks of 64 KB + scales on the inter-node hop,
    # int8 chunks of 128 KB + scales inside the node and in the gathers.
    world, node_size, n = 4, 2, 131072
    for st in run_ranks(world, _overhead_worker, node_size, n, timeout=60):
        for kind in ("reduce_scatter", "allgather"):
            s = st[kind]
            total = s["intra_bytes"] + s["inter_bytes"]
            assert s["header_bytes"] > 0 and s["header_bytes"] / total < 0.01, (kind, s)
            assert s["header_bytes"] / total < 0.001, (kind, s)  # 32-byte headers on 64 KB+


# ---- a rank that moves on to a call its peers do not make ---------------------------------
TIMEOUT_S = 4.0


def _diverging_worker(rank, world, case):
    """Every rank makes call A (its signature agreed), then rank 1 makes a new call B while
    the others make A again, which they skip checking: every rank raises within the
    timeout, none returns (wrong data), none is killed by gloo."""
    import time
    from datetime import timedelta

    g = qcoll.new_group(node_size=2, timeout=timedelta(seconds=TIMEOUT_S))
    a, b = {"ag_raw_numel": (_ag(16, bits=None), _ag(17, bits=None)),
            "rs_op": (_rs(N), _rs(N, op="sum")),
            "ar_numel": (_ar(N + 1), _ar(N + 3))}[case]
    a(g, world)
    start = time.monotonic()
    try:
        (b if rank == 1 else a)(g, world)
    except qcoll.CommunicationError as exc:
        return time.monotonic() - start, str(exc)
    return time.monotonic() - start, None


@pytest.mark.parametrize("world", [4, 6])  # 2 x 2 and 3 x 2
@pytest.mark.parametrize("case", ["ag_raw_numel", "rs_op", "ar_numel"])
def test_a_rank_moving_on_to_a_new_call_alone_fails_every_rank_within_the_timeout(case, world):
    results = run_ranks(world, _diverging_worker, case, timeout=90)
    for rank, (elapsed, msg) in enumerate(results):
        assert msg is not None, f"rank {rank} returned from a call its peers did not make"
        assert elapsed < TIMEOUT_S + 5.0, (rank, elapsed)
    assert "call check" in results[1][1] and "QCOLL_DEBUG=1" in results[1][1], results[1][1]

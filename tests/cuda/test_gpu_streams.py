"""qcoll's CUDA calls on a GPU: the group's own communication stream (an async all-gather, and
the ZeRO engine's prefetch, overlap matrix products on the compute stream, seen in
torch.profiler's trace), CUDA-graph capture and replay (same bits as the eager call, no
allocation inside the capture), and failures that surface instead of hanging (a peer that
never joins ncclCommInitRankConfig, a peer that dies before a call: Work.wait() raises).
Several NCCL ranks share one GPU as in test_nccl.py. Skipped without a GPU."""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import qcoll
from tests.support import reference as ref
from tests.support.distributed import run_ranks
from tests.cuda.test_nccl import _REASON, _nccl_env

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]


def _env(world: int) -> dict:
    return {r: _nccl_env(r) for r in range(world)}


def _kernels(prof, rank: int, tag: str) -> list:
    """(name, stream, start, end) of every GPU kernel in the profile (chrome-trace µs)."""
    path = f"/tmp/qcoll-trace-{tag}-{os.getpid()}-{rank}.json"
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    os.unlink(path)
    return [(e["name"], e["args"]["stream"], e["ts"], e["ts"] + e["dur"])
            for e in events if e.get("cat") == "kernel"]


def _overlap(kernels: list) -> tuple:
    """(NCCL kernels, compute kernels on other streams, whether any pair overlaps in time)."""
    nccl = [k for k in kernels if "nccl" in k[0].lower()]
    comm_streams = {k[1] for k in nccl}
    compute = [k for k in kernels if k[1] not in comm_streams]
    overlaps = any(c[2] < n[3] and n[2] < c[3] for n in nccl for c in compute)
    return nccl, compute, overlaps


def _async_gather_overlaps_matmul(rank: int, world: int):
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    g = qcoll.new_group(None, node_size=1, backend="nccl")
    n = 1 << 22
    x = torch.randn(n, device=dev)
    out = torch.empty(world * n, device=dev)
    a = torch.randn(4096, 4096, device=dev)
    qcoll.quantized_allgather(out, x, g, bits=8)  # communicator, workspace, cuBLAS warmed up
    want = out.clone()
    a @ a
    torch.cuda.synchronize()
    dist.barrier()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out.fill_(float("nan"))
        work = qcoll.quantized_allgather(out, x, g, bits=8, async_op=True)
        for _ in range(8):
            a @ a
        work.wait()
        got = out.clone()  # on the compute stream, after wait()
        torch.cuda.synchronize()
    ref.assert_same_bits(got, want, "async all-gather after wait()")
    kernels = _kernels(prof, rank, "gather")
    nccl, compute, overlaps = _overlap(kernels)
    assert nccl and compute, (nccl, compute)
    ours = [k for k in kernels if k[1] == nccl[0][1]]
    assert len(ours) >= 3, f"encode, NCCL and decode on the communication stream: {ours}"
    assert overlaps, f"the all-gather did not overlap the matmuls:\nNCCL {nccl}\ncompute {compute[:4]}"
    g.close()


def test_async_allgather_overlaps_matmul_on_the_compute_stream():
    run_ranks(2, _async_gather_overlaps_matmul, env=_env(2), timeout=240)


def _zero_prefetch_overlaps(rank: int, world: int):
    from qcoll.zero import ZeroConfig, ZeroEngine

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    g = qcoll.new_group(None, node_size=1, backend="nccl")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(8)]).to(dev)
    engine = ZeroEngine(model, lambda params: torch.optim.SGD(params, lr=1e-3), g,
                        config=ZeroConfig(compute_dtype=torch.float32, hpz=False))
    batch = torch.randn(1024, 2048, device=dev)

    def step():
        loss = engine(batch).square().mean()
        engine.backward(loss)
        engine.step()

    step()  # records the unit order: prefetch starts with the second step
    step()
    torch.cuda.synchronize()
    dist.barrier()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        with torch.no_grad():
            engine(batch)
        torch.cuda.synchronize()
    nccl, compute, overlaps = _overlap(_kernels(prof, rank, "zero"))
    assert nccl and compute, (nccl, compute)
    assert overlaps, "the engine's prefetched all-gathers never overlapped the forward's matmuls"
    g.close()


def test_zero_engine_prefetch_overlaps_forward_compute():
    run_ranks(2, _zero_prefetch_overlaps, env=_env(2), timeout=300)


def _graph_replay(rank: int, world: int):
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    g = qcoll.new_group(None, node_size=2, backend="nccl")  # 2 nodes: 2-hop, lanes captured too
    gen = torch.Generator().manual_seed(50 + rank)
    n = 20011  # odd: tail groups
    x = torch.randn(n, generator=gen).to(dev)
    inp = (torch.randn(world * n, generator=gen) * 3).to(dev)
    gathered = torch.empty(world * n, device=dev)
    reduced = torch.empty(n, device=dev)
    rs = dict(intra_bits=8, inter_bits=4, pipeline_stages=3)

    def calls():
        qcoll.quantized_allgather(gathered, x, g, bits=8)
        qcoll.quantized_reduce_scatter(reduced, inp, g, **rs)

    side = torch.cuda.Stream()  # torch's recipe: warm up on a side stream
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            calls()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    want = (gathered.clone(), reduced.clone())

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        before = torch.cuda.memory_stats()["allocation.all.allocated"]
        calls()
        allocated = torch.cuda.memory_stats()["allocation.all.allocated"] - before
    assert allocated == 0, f"{allocated} allocations inside the captured calls"

    for _ in range(2):
        gathered.fill_(float("nan"))
        reduced.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref.assert_same_bits(gathered, want[0], "replayed all-gather")
        ref.assert_same_bits(reduced, want[1], "replayed reduce-scatter")

    # New inputs written in place: a replay equals an eager call on them.
    x.copy_(torch.randn(n, generator=gen).to(dev))
    inp.copy_((torch.randn(world * n, generator=gen) * 3).to(dev))
    graph.replay()
    torch.cuda.synchronize()
    replayed = (gathered.clone(), reduced.clone())
    calls()
    torch.cuda.synchronize()
    ref.assert_same_bits(replayed[0], gathered, "replay vs eager all-gather, new input")
    ref.assert_same_bits(replayed[1], reduced, "replay vs eager reduce-scatter, new input")
    del graph
    g.close()


def test_cuda_graph_capture_replays_the_same_bits():
    run_ranks(4, _graph_replay, env=_env(4), timeout=300)


def _dead_peer(rank: int, world: int):
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    g = qcoll.new_group(None, node_size=1, backend="nccl", timeout=timedelta(seconds=5))
    x = torch.ones(1 << 16, device=dev)
    out = torch.empty(world * x.numel(), device=dev)
    early = qcoll.quantized_allgather(out, x, g, bits=8, async_op=True)  # communicators exist
    torch.cuda.synchronize()
    dist.barrier()
    if rank == 1:
        os._exit(0)  # dies before the next call
    work = qcoll.quantized_allgather(out, x, g, bits=8, async_op=True)
    start = time.monotonic()
    while not work.is_completed():
        assert time.monotonic() - start < 60, "the watchdog never ended the call"
        time.sleep(0.05)
    with pytest.raises(qcoll.CommunicationError, match=r"quantized_allgather \(call 1 "):
        work.wait()
    early.wait()  # completed before the failure: not failed by it
    with pytest.raises(RuntimeError, match="aborted"):
        qcoll.quantized_allgather(out, x, g, bits=8)  # the communicator is unusable now
    return time.monotonic() - start


def test_a_dead_peer_makes_work_wait_raise_within_the_timeout():
    seconds = run_ranks(2, _dead_peer, env=_env(2), timeout=180, dead=(1,))
    assert seconds[0] < 60, seconds


def _peer_never_joins(rank: int, world: int):
    from qcoll import _nccl

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    g = qcoll.new_group(None, node_size=1, backend="nccl", timeout=timedelta(seconds=5))
    if rank == 1:  # joins the unique-id exchange, then dies instead of creating its communicator
        class Dies:
            def __getattr__(self, name):
                return getattr(_nccl_C, name)

            @staticmethod
            def NcclCommunicator(*args, **kwargs):
                os._exit(0)

        _nccl_C = _nccl._C
        _nccl._C = Dies()
    x = torch.ones(16, device=dev)
    out = torch.empty(world * 16, device=dev)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="did not all join within the timeout"):
        qcoll.quantized_allgather(out, x, g, bits=8)
    return time.monotonic() - start


def test_nccl_init_is_bounded_by_the_group_timeout():
    seconds = run_ranks(2, _peer_never_joins, env=_env(2), timeout=180, dead=(1,))
    assert 4 < seconds[0] < 60, seconds

"""What each rank runs under the virtual GPU (virtual_gpu.py launches them; the checks are
in test_virtual_gpu.py). Every function returns plain data; a failed check raises.

The reference of every quantized call is the same call over the torch backend (gloo) on
the CPU branch (_vgpu.cpu_branch), in the same process: qcoll's NCCL driver, streams and
kernels (emulated) must give the same bits."""

from __future__ import annotations

import time

import numpy as np
import torch

import qcoll
import qcoll._runtime.steps
from tests.support import reference as ref
from qcoll import _nccl, _vgpu

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _groups(node_size: int, timeout_s: float = 60.0):
    from datetime import timedelta

    ours = qcoll.new_group(None, node_size=node_size, backend="nccl",
                           timeout=timedelta(seconds=timeout_s))
    gloo = qcoll.new_group(None, node_size=node_size, backend="torch")
    return ours, gloo


def _comms(group) -> list:
    """The group family's NCCL communicators created so far."""
    return [g._nccl_comm for g in (group, group._intra, group._inter)
            if g is not None and g._nccl_comm is not None]


def _check_setup() -> str:
    assert _vgpu.ENABLED and qcoll._C.__name__ == "qcoll._C_emu", qcoll._C.__name__
    qcoll._runtime.steps.MIN_STAGE_BYTES = 0  # every requested pipeline stage runs (stream lanes)
    version = _nccl.nccl_version()
    assert version == "2.28.3", f"expected the NCCL stand-in, got {version!r}"
    return version


def collectives(rank: int, world: int, node_size: int) -> dict:
    """The four collectives over qcoll's NCCL driver == over gloo, bit for bit."""
    version = _check_setup()
    ours, gloo = _groups(node_size)
    gen = torch.Generator().manual_seed(1000 + rank)
    n = 1237  # odd: partial groups and unaligned chunk tails
    checked = []

    def same(make, call, what):
        got, want = make(), make()
        call(got, ours)
        with _vgpu.cpu_branch():
            call(want, gloo)
        ref.assert_same_bits(got, want, what)
        checked.append(what)

    for dtype in DTYPES:
        x = torch.randn(n, generator=gen).to(dtype)
        for bits in (8, 4, None):
            same(lambda: torch.full((world * n,), float("nan"), dtype=dtype),
                 lambda out, g: qcoll.quantized_allgather(out, x, g, bits=bits),
                 f"allgather bits={bits} {dtype}")
        inp = (torch.randn(world * n, generator=gen) * 3).to(dtype)
        variants = [dict(intra_bits=8, inter_bits=4),
                    dict(intra_bits=4, inter_bits=8, pipeline_stages=2, hierarchical=True),
                    dict(intra_bits=None, inter_bits=8),
                    dict(intra_bits=8, inter_bits=4, hierarchical=False)]
        for op in ("sum", "avg"):
            for kw in variants if dtype == torch.float32 else variants[:1]:
                same(lambda: torch.full((n,), float("nan"), dtype=dtype),
                     lambda out, g: qcoll.quantized_reduce_scatter(out, inp, g, op=op, **kw),
                     f"reduce_scatter {op} {kw} {dtype}")
        # bits=None, one hop: NCCL's own reduce-scatter; integer values: exact either way.
        ints = torch.randint(-8, 9, (world * n,), generator=gen).to(dtype)
        same(lambda: torch.full((n,), float("nan"), dtype=dtype),
             lambda out, g: qcoll.quantized_reduce_scatter(out, ints, g, op="sum", intra_bits=None,
                                                           inter_bits=None, hierarchical=False),
             f"reduce_scatter raw {dtype}")
        # bits=None all-reduce, flat: bf16/fp16 take the raw exchange (the all-to-all of the
        # raw inputs, straight from the tensor when partitions fill whole 16-byte slots:
        # 1024 elements), the CPU branch the transport's fp32 all-reduce; integer values:
        # exact either way.
        for numel in (world * n + 5, world * 1024):
            t_ints = torch.randint(-8, 9, (numel,), generator=gen).to(dtype)
            same(lambda: t_ints.clone(),
                 lambda t, g: qcoll.quantized_all_reduce(t, g, op="sum", bits=None, hierarchical=False),
                 f"all_reduce bits=None flat numel={numel} {dtype}")
        t0 = (torch.randn(world * n + 5, generator=gen) * 2).to(dtype)
        same(lambda: t0.clone(), lambda t, g: qcoll.quantized_all_reduce(t, g, bits=8, inter_bits=4),
             f"all_reduce {dtype}")
        old = torch.randn(world * n, generator=torch.Generator().manual_seed(7)).to(dtype)
        shard = (old[rank * n:(rank + 1) * n].float() + 0.01 * torch.randn(n, generator=gen)).to(dtype)
        same(lambda: old.clone(), lambda full, g: qcoll.delta_allgather(full, shard, g, bits=8),
             f"delta_allgather {dtype}")
    checked += _nccl_reductions(rank, world, ours)
    comms = _comms(ours)
    ops = sum(c.ops_enqueued for c in comms)
    assert len(comms) == 3 if world > node_size else 1, comms
    start = time.monotonic()
    ours.close()  # finalize meets the peers: quick when every rank destroys in one order
    assert time.monotonic() - start < 10.0, f"close() took {time.monotonic() - start:.1f} s"
    assert not _nccl._live_comms, "close() must destroy the family's NCCL communicators"
    return {"version": version, "checked": checked, "nccl_ops": ops}


def _nccl_reductions(rank: int, world: int, ours) -> list:
    """The stand-in's own reduce-scatter (bits=None, one hop) of random fp16/fp32 values:
    NCCL's ring order with a rounding per step, against numpy."""
    n = 301
    done = []
    for dtype, npt in ((torch.float16, np.float16), (torch.float32, np.float32)):
        inputs = [torch.randn(world * n, generator=torch.Generator().manual_seed(r)).to(dtype) * 50
                  for r in range(world)]
        for op in ("sum", "avg"):
            out = torch.empty(n, dtype=dtype)
            qcoll.quantized_reduce_scatter(out, inputs[rank], ours, op=op, intra_bits=None,
                                           inter_bits=None, hierarchical=False)
            blocks = [inputs[p][rank * n:(rank + 1) * n].numpy() for p in range(world)]
            scale = npt(1.0 / world)
            order = [(rank + k) % world for k in range(1, world + 1)]
            acc = None
            for p in order:
                x = blocks[p] * scale if op == "avg" else blocks[p]  # numpy rounds per op
                acc = x if acc is None else (acc + x).astype(npt)
            ref.assert_same_bits(out, torch.from_numpy(np.ascontiguousarray(acc)), f"{op} {dtype}")
            done.append(f"nccl reduce_scatter {op} {dtype}")
    return done


def async_calls(rank: int, world: int, node_size: int) -> dict:
    """async_op=True returns before the call completes, several calls stay in flight and
    wait() orders the caller after each; a caller stream's pending work is waited for."""
    _check_setup()
    ours, gloo = _groups(node_size)
    n = 1000
    xs = [torch.randn(n, generator=torch.Generator().manual_seed(10 * rank + i)) for i in range(3)]
    qcoll.quantized_allgather(torch.empty(world * n), xs[0], ours)  # warm-up: communicators
    want = []
    with _vgpu.cpu_branch():
        for x in xs:
            w = torch.empty(world * n)
            qcoll.quantized_allgather(w, x, gloo)
            want.append(w)
    torch.distributed.barrier()
    if rank == world - 1:
        time.sleep(3.0)  # the others' calls cannot complete before this rank joins
    outs = [torch.full((world * n,), float("nan")) for _ in xs]
    start = time.monotonic()
    works = [qcoll.quantized_allgather(o, x, ours, async_op=True) for o, x in zip(outs, xs)]
    issued = time.monotonic() - start
    pending = [not w.is_completed() for w in works]
    for w in reversed(works):
        w.wait()
    for i, (o, w) in enumerate(zip(outs, want)):
        ref.assert_same_bits(o, w, f"async allgather {i}")
    # The caller's own stream: a slow copy fills the input there; the call must wait for it.
    side = _vgpu.Stream()
    staged = torch.randn(n, generator=torch.Generator().manual_seed(99 + rank))
    x = torch.zeros(n)
    out = torch.full((world * n,), float("nan"))
    with _vgpu.stream(side):
        _vgpu._C.vgpu_sleep(side.cuda_stream, 0.3)
        _vgpu._C.vgpu_memcpy_async(x.data_ptr(), staged.data_ptr(), 4 * n, side.cuda_stream)
        qcoll.quantized_allgather(out, x, ours)
    side.synchronize()
    want_staged = torch.empty(world * n)
    with _vgpu.cpu_branch():
        qcoll.quantized_allgather(want_staged, staged, gloo)
    ref.assert_same_bits(out, want_staged, "allgather after the caller stream's copy")
    ours.close()
    return {"issued_s": issued, "pending": pending}


def graph_replay(rank: int, world: int, node_size: int) -> list:
    """CUDA-graph capture of the collectives, replayed on new data == eager == gloo."""
    _check_setup()
    ours, gloo = _groups(node_size)
    n = 1237
    x, ag = torch.randn(n), torch.empty(world * n)
    rs_in, rs = torch.randn(world * n), torch.empty(n)
    kw = dict(intra_bits=8, inter_bits=4, pipeline_stages=2)
    qcoll.quantized_allgather(ag, x, ours, bits=8)  # warm-up, as before torch.cuda.graph
    qcoll.quantized_reduce_scatter(rs, rs_in, ours, **kw)
    # An eager call still in flight while the capture runs (the last rank joins it late):
    # the watchdog queries its event meanwhile, which must not touch the capture.
    torch.distributed.barrier()
    if rank == world - 1:
        time.sleep(0.3)
    eager = qcoll.quantized_allgather(torch.empty(world * n), x, ours, async_op=True)
    graph = _vgpu.Graph()
    with graph.capture():
        qcoll.quantized_allgather(ag, x, ours, bits=8)
        qcoll.quantized_reduce_scatter(rs, rs_in, ours, **kw)
        time.sleep(0.05)  # a few watchdog ticks inside the capture
    eager.wait()
    done = []
    for step in range(2):
        gen = torch.Generator().manual_seed(100 * step + rank)
        x.copy_(torch.randn(n, generator=gen))
        rs_in.copy_(torch.randn(world * n, generator=gen))
        ag.fill_(float("nan"))
        rs.fill_(float("nan"))
        graph.replay()
        want_ag, want_rs = torch.empty(world * n), torch.empty(n)
        with _vgpu.cpu_branch():
            qcoll.quantized_allgather(want_ag, x, gloo, bits=8)
            qcoll.quantized_reduce_scatter(want_rs, rs_in, gloo, **kw)
        ref.assert_same_bits(ag, want_ag, f"replay {step} allgather")
        ref.assert_same_bits(rs, want_rs, f"replay {step} reduce_scatter")
        done.append(step)
    ours.close()
    return done


def dead_peer(rank: int, world: int, node_size: int, timeout_s: float) -> dict:
    """QCOLL_NCCL_EMU_FAULT makes one rank die or stall in its second all-gather: every
    other rank's call fails within the timeout through the watchdog."""
    _check_setup()
    ours, _ = _groups(node_size, timeout_s)
    n = 1000
    out = torch.empty(world * n)
    qcoll.quantized_allgather(out, torch.randn(n), ours)  # op 0: every rank joins
    start = time.monotonic()
    error = raised = None
    try:
        work = qcoll.quantized_allgather(out, torch.randn(n), ours, async_op=True)  # op 1
        work.wait()  # the host is the null stream: blocks until the watchdog aborted the call
        error = type(work.exception()).__name__
        try:
            work.wait()
        except qcoll.CommunicationError as e:
            raised = str(e)
    except RuntimeError as e:  # NCCL reported the dead peer already when the call was enqueued
        error, raised = f"at enqueue: {type(e).__name__}", str(e)
    elapsed = time.monotonic() - start
    later = later_type = None
    try:
        qcoll.quantized_allgather(out, torch.randn(n), ours)
    except RuntimeError as e:
        later, later_type = str(e), type(e).__name__
    ours.close()
    return {"elapsed": elapsed, "error": error, "raised": raised, "later": later,
            "later_type": later_type}


def never_joins(rank: int, world: int, timeout_s: float) -> dict:
    """One rank never joins ncclCommInitRankConfig: the creation fails on every rank
    within the timeout and the half-made communicators are aborted."""
    _check_setup()
    ours, _ = _groups(2, timeout_s)
    start = time.monotonic()
    error = error_type = None
    try:
        qcoll.quantized_allgather(torch.empty(world * 10), torch.randn(10), ours)
    except RuntimeError as e:
        error, error_type = str(e), type(e).__name__
    elapsed = time.monotonic() - start
    ours.close()
    return {"elapsed": elapsed, "error": error, "error_type": error_type,
            "live": len(_nccl._live_comms)}


_KEPT = []  # exit_with_live_communicators(keep=True): alive until the interpreter exits


def exit_with_live_communicators(rank: int, world: int, keep: bool = True) -> str:
    """The process exits with its communicators alive (no close()): atexit aborts them.
    keep=False: the Group, the Work and the tensors are dropped while the async call may
    still run; the call's memory must outlive the Group (streams.py: _ORPHANS), not be
    freed under the running stream."""
    _check_setup()
    ours, _ = _groups(2)
    out = torch.empty(world * 100)
    qcoll.quantized_reduce_scatter(torch.empty(100), torch.randn(world * 100), ours)
    work = qcoll.quantized_allgather(out, torch.randn(100), ours, async_op=True)
    if keep:
        _KEPT.append((ours, out, work))
    return "exiting"



def dropped_while_a_peer_keeps_it(rank: int, world: int, timeout_s: float) -> dict:
    """Rank 0 drops its Group (no close()) while rank 1 still holds its own, which it drops
    only after a barrier that rank 0 reaches after its drop. The drop must not wait for
    rank 1 (ncclCommFinalize meets the other members: done on the dropping thread, it
    waited out the timeout, then aborted); the communicator is then freed once rank 1
    drops too, long before the timeout (the finalize met the peer: an abort comes only at
    the timeout)."""
    import gc
    import weakref

    import torch.distributed as dist

    _check_setup()
    ours, _ = _groups(2, timeout_s)
    qcoll.quantized_allgather(torch.empty(world * 100), torch.randn(100), ours)
    comms = [weakref.ref(c) for c in _comms(ours)]  # no reference that keeps them alive
    assert comms
    dropped = None
    if rank == 0:
        start = time.monotonic()
        del ours
        gc.collect()
        dropped = time.monotonic() - start
    dist.barrier()
    if rank != 0:
        del ours
        gc.collect()
    start = time.monotonic()
    while any(c() is not None for c in comms) and time.monotonic() - start < timeout_s:
        time.sleep(0.01)
    return {"dropped_s": dropped, "freed_s": time.monotonic() - start,
            "freed": all(c() is None for c in comms), "live": len(_nccl._live_comms)}


def exit_while_a_release_waits(rank: int, world: int, timeout_s: float) -> float:
    """Rank 0 drops its Group while rank 1 keeps its own until it exits: rank 0's release
    thread waits in the finalize for a peer that never comes, and the abort at rank 0's
    exit must end that wait at once, not at the timeout. Returns when the scenario ended
    (time.time()), so the test times the exit alone."""
    import gc

    _check_setup()
    ours, _ = _groups(2, timeout_s)
    qcoll.quantized_allgather(torch.empty(world * 100), torch.randn(100), ours)
    if rank == 0:
        del ours
        gc.collect()
        time.sleep(0.5)  # the release is waiting in ncclCommFinalize now
    else:
        _KEPT.append(ours)
    return time.time()


def sub_group_outlives_its_parent(rank: int, world: int) -> dict:
    """The parent and its inter-node sub-group, both with NCCL communicators, are dropped
    while the caller keeps the intra-node sub-group: their communicators are freed, the kept
    one still runs calls on its own; dropped in turn, it releases that one without waiting."""
    import gc
    import weakref

    import torch.distributed as dist

    _check_setup()
    ours, _ = _groups(2)
    sub = ours.intra
    n = 100
    for g in (ours, ours.inter, sub):
        qcoll.quantized_allgather(torch.empty(g.size * n), torch.randn(n), g, bits=None)
    released = [weakref.ref(g._nccl_comm) for g in (ours, ours.inter)]
    del g, ours
    gc.collect()
    start = time.monotonic()
    while any(c() is not None for c in released) and time.monotonic() - start < 30:
        time.sleep(0.01)
    parent_freed = not any(c() is not None for c in released)
    out = torch.empty(sub.size * n)
    qcoll.quantized_allgather(out, torch.full((n,), float(rank + 1)), sub, bits=None)
    first = rank - sub.rank  # the node's first global rank
    want = torch.cat([torch.full((n,), float(first + i + 1)) for i in range(sub.size)])
    ref.assert_same_bits(out, want, "all-gather on the kept sub-group")
    comm = weakref.ref(sub._nccl_comm)
    dist.barrier()
    start = time.monotonic()
    del sub
    gc.collect()
    dropped = time.monotonic() - start
    while comm() is not None and time.monotonic() - start < 30:
        time.sleep(0.01)
    return {"parent_freed": parent_freed, "dropped_s": dropped,
            "freed_s": time.monotonic() - start, "freed": comm() is None}

def _same_state(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        ref.assert_same_bits(a[k].float(), b[k].float(), f"{what}: {k}")


def training(rank: int, world: int, steps: int) -> dict:
    """The DDP hook, the FSDP2 plug-in and the ZeRO engine train a few quantized steps
    with their collectives over qcoll's NCCL driver: the same losses and parameters, bit
    for bit, as with the collectives over gloo on the CPU branch."""
    import functools

    from tests.plugins import test_ddp, test_fsdp
    from tests.support import zero_helpers
    from qcoll.zero import ZeroConfig, ZeroEngine

    _check_setup()
    out = {}

    def ddp():
        r = test_ddp._train(rank, world, "qcoll", steps, shape=(20, 1, 36))
        return r["losses"], r["params"]

    def fsdp():
        model = test_fsdp._build("qcoll", world, node_size=2, reshard=2, shape=(20, 1, 36))
        losses, _ = test_fsdp._train(model, steps, rank, world)
        return losses, test_fsdp._full_params(model)

    def zero():
        group = qcoll.new_group(node_size=2)
        torch.manual_seed(0)
        engine = ZeroEngine(zero_helpers.OddNet(), zero_helpers.OptimizerFactory("adamw"), group,
                            config=ZeroConfig())
        batch = functools.partial(zero_helpers.oddnet_batch, batch_size=4 * world)
        losses = zero_helpers.train_engine(engine, batch, steps, rank, world)
        return losses, engine.full_state_dict()

    for name, train in (("ddp", ddp), ("fsdp", fsdp), ("zero", zero)):
        losses, state = train()
        with _vgpu.cpu_branch():
            want_losses, want_state = train()
        assert losses == want_losses, f"{name}: losses {losses} != {want_losses}"
        _same_state(state, want_state, name)
        out[name] = losses
    return out


def loader(rank: int, world: int, tmp: str) -> dict:
    """qcoll's unchanged NCCL loader against the stand-in: an explicit QCOLL_NCCL_PATH that
    does not load, a library without NCCL's symbols, and (no QCOLL_NCCL_PATH) the libnccl.so
    already mapped into the process, which is reused. A failed load is retried later."""
    import ctypes
    import os
    import shutil

    assert _vgpu.ENABLED
    standin = os.environ["QCOLL_NCCL_PATH"]
    out = {}
    for case, path in (("missing", os.path.join(tmp, "no-such-libnccl.so.2")),
                       ("not-nccl", os.path.join(os.path.dirname(standin), "libqcoll_cudart_emu.so"))):
        os.environ["QCOLL_NCCL_PATH"] = path
        assert qcoll._C.nccl_version() == "", case
        try:
            qcoll._C.nccl_unique_id()
        except RuntimeError as e:
            out[case] = str(e)
    del os.environ["QCOLL_NCCL_PATH"]
    mapped = os.path.join(tmp, "libnccl.so.2")  # the name torch's NCCL has (a copy: the maps
    shutil.copy(standin, mapped)                 # list a symlink's target)
    ctypes.CDLL(mapped, mode=ctypes.RTLD_GLOBAL)
    out["mapped"] = qcoll._C.nccl_version()
    out["unique_id"] = len(qcoll._C.nccl_unique_id())
    return out


def backend_none_agrees(rank: int, world: int, without: int) -> dict:
    """backend=None where rank `without` cannot load NCCL: every rank takes the torch
    transport (agreed at the first GPU call) and the all-gather matches gloo's, bit for bit."""
    import os
    from datetime import timedelta

    if rank == without:
        os.environ["QCOLL_NCCL_PATH"] = "/nonexistent/libnccl.so.2"
    g = qcoll.new_group(None, node_size=world, timeout=timedelta(seconds=20))
    gloo = qcoll.new_group(None, node_size=world, backend="torch")
    x = torch.randn(1000, generator=torch.Generator().manual_seed(rank))
    got, want = torch.empty(world * 1000), torch.empty(world * 1000)
    qcoll.quantized_allgather(got, x, g, bits=8)
    with _vgpu.cpu_branch():
        qcoll.quantized_allgather(want, x, gloo, bits=8)
    ref.assert_same_bits(got, want, "allgather, backend=None")
    return {"nccl": g._nccl_comm is not None, "usable": g._nccl_usable}


def residuals_kept(rank: int, world: int, node_size: int) -> dict:
    """An async call with error feedback keeps its residuals referenced until it has run,
    as it keeps its input and output: reset() before wait() frees nothing the call's
    stream still writes."""
    _check_setup()
    g, _ = _groups(node_size)
    out = {}
    for name, call in (("all_reduce", lambda x, ef: qcoll.quantized_all_reduce(
                           x, g, bits=8, inter_bits=4, error_feedback=ef, async_op=True)),
                       ("reduce_scatter", lambda x, ef: qcoll.quantized_reduce_scatter(
                           torch.empty(x.numel() // world), x, g, intra_bits=8, inter_bits=4,
                           error_feedback=ef, async_op=True))):
        ef = qcoll.ErrorFeedback()
        work = call(torch.randn(world * 512), ef)
        residuals = {id(r) for r in ef._residuals.values()}
        kept = {id(t) for t in work._cuda.tensors}
        out[name] = (sorted(ef._residuals), residuals <= kept)
        ef.reset()
        work.wait()
    return out

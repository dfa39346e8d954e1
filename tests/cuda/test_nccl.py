"""qcoll's raw-NCCL transport (backend="nccl") on a GPU: several ranks share ONE GPU, each
its own NCCL "host" talking over loopback sockets (docs/emulators.md, "Several NCCL ranks on
one GPU").

Unquantized, non-hierarchical calls are NCCL's own collectives: they must equal torch's
ProcessGroupNCCL exactly. Quantized calls run the same algorithm as over gloo; the CUDA
kernels match the CPU ones bit for bit, so results must equal the torch (gloo, CPU) backend
bit for bit. Skipped without a GPU, torch's NCCL, qcoll's CUDA build or a loadable NCCL."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import qcoll
from tests.support import reference as ref
from tests.support.distributed import run_ranks

WORLD, NODE = 4, 2  # two emulated nodes of two ranks: the 2-hop path runs too
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TORCH_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG}


def _skip_reason():
    if not torch.cuda.is_available():
        return "needs a CUDA device"
    if not (dist.is_available() and dist.is_nccl_available()):
        return "needs torch.distributed with NCCL"
    if not qcoll.build_info()["cuda_available"]:
        return "needs a qcoll build with CUDA kernels and a usable GPU"
    from qcoll import _nccl

    if not _nccl.nccl_version():
        return "qcoll could not load NCCL (set QCOLL_NCCL_PATH to a libnccl.so.2)"
    return None


_REASON = _skip_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]


def _nccl_env(rank: int) -> dict:
    # Set before the child's first NCCL call: one NCCL host per rank, sockets over lo.
    return {"CUDA_VISIBLE_DEVICES": "0", "NCCL_HOSTID": f"qhost{rank}", "NCCL_NET": "Socket",
            "NCCL_SOCKET_IFNAME": "lo", "NCCL_MNNVL_ENABLE": "0", "NCCL_PAT_ENABLE": "0"}


def _mapped_nccl_libraries() -> set:
    with open("/proc/self/maps") as f:
        paths = {line.split(None, 5)[-1].strip() for line in f if "/" in line}
    return {p for p in paths if p.rsplit("/", 1)[-1].startswith("libnccl.so")}


def _nccl_checks(rank: int, world: int) -> str:
    from qcoll import _nccl

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    gen = torch.Generator().manual_seed(1000 + rank)
    torch_nccl = dist.new_group(backend="nccl")  # torch's own NCCL, the exact baseline
    ours = qcoll.new_group(None, node_size=NODE, backend="nccl")
    gloo = qcoll.new_group(None, node_size=NODE, backend="torch")  # CPU tensors over gloo

    # One NCCL in the process: qcoll reuses the library torch loaded.
    version = _nccl.nccl_version()
    assert version.count(".") == 2, version
    libs = _mapped_nccl_libraries()
    assert len(libs) == 1, f"expected one libnccl in the process, found {sorted(libs)}"

    n = 1237  # odd: partial groups and unaligned chunk tails
    for dtype in DTYPES:
        # bits=None: NCCL's all-gather; bytes must match torch's exactly.
        x = torch.randn(n, generator=gen).to(dtype).to(dev)
        out = torch.full((world * n,), float("nan"), dtype=dtype, device=dev)
        qcoll.quantized_allgather(out, x, ours, bits=None)
        want = torch.empty_like(out)
        dist.all_gather_into_tensor(want, x, group=torch_nccl)
        ref.assert_same_bits(out, want, f"allgather bits=None {dtype}")

        # bits=None, hierarchical=False: NCCL's reduce-scatter. Integer values keep sums
        # and averages over 4 ranks exact, so NCCL's reduction order cannot matter.
        inp = torch.randint(-8, 9, (world * n,), generator=gen).to(dtype).to(dev)
        for op in ("sum", "avg"):
            out = torch.full((n,), float("nan"), dtype=dtype, device=dev)
            qcoll.quantized_reduce_scatter(out, inp, ours, op=op, intra_bits=None, inter_bits=None,
                                           hierarchical=False)
            want = torch.empty_like(out)
            dist.reduce_scatter_tensor(want, inp, op=TORCH_OPS[op], group=torch_nccl)
            ref.assert_same_bits(out, want, f"reduce_scatter {op} bits=None {dtype}")

        # Quantized: raw-NCCL on the GPU == torch backend over gloo on the CPU.
        x = torch.randn(n, generator=gen).to(dtype)
        for bits in (8, 4):
            out = torch.empty(world * n, dtype=dtype, device=dev)
            qcoll.quantized_allgather(out, x.to(dev), ours, bits=bits)
            want = torch.empty(world * n, dtype=dtype)
            qcoll.quantized_allgather(want, x, gloo, bits=bits)
            ref.assert_same_bits(out, want, f"allgather bits={bits} {dtype}")

        inp = (torch.randn(world * n, generator=gen) * 3).to(dtype)
        variants = [
            dict(intra_bits=8, inter_bits=4),  # 2-hop, the default shape
            dict(intra_bits=8, inter_bits=4, pipeline_stages=3),
            dict(intra_bits=4, inter_bits=8, pipeline_stages=2, hierarchical=True),
            dict(intra_bits=None, inter_bits=8),
            dict(intra_bits=8, inter_bits=4, hierarchical=False),  # one all-to-all
        ]
        for op in ("sum", "avg"):
            for kw in variants:
                out = torch.empty(n, dtype=dtype, device=dev)
                qcoll.quantized_reduce_scatter(out, inp.to(dev), ours, op=op, **kw)
                want = torch.empty(n, dtype=dtype)
                qcoll.quantized_reduce_scatter(want, inp, gloo, op=op, **kw)
                ref.assert_same_bits(out, want, f"reduce_scatter {op} {kw} {dtype}")

        # bits=None all-reduce, flat: on the GPU bf16/fp16 take the raw exchange (the raw
        # inputs to their owner in one all-to-all, straight from the tensor when partitions
        # fill whole 16-byte slots: 1024 elements per rank here; else through slots), fp32
        # sum, rounded once. Integer values: exact, so it must equal torch's NCCL all-reduce.
        for numel in (world * n + 5, world * 1024):
            t = torch.randint(-8, 9, (numel,), generator=gen).to(dtype).to(dev)
            want = t.clone()
            dist.all_reduce(want, group=torch_nccl)
            qcoll.quantized_all_reduce(t, ours, op="sum", bits=None, hierarchical=False)
            ref.assert_same_bits(t, want, f"all_reduce bits=None flat numel={numel} {dtype}")

        # Quantized all-reduce and delta all-gather: the same bits as over gloo.
        t0 = (torch.randn(world * n + 5, generator=gen) * 2).to(dtype)
        got, want = t0.to(dev), t0.clone()
        qcoll.quantized_all_reduce(got, ours, bits=8, inter_bits=4)
        qcoll.quantized_all_reduce(want, gloo, bits=8, inter_bits=4)
        ref.assert_same_bits(got, want, f"all_reduce bits=8/4 {dtype}")
        old = torch.randn(world * n, generator=torch.Generator().manual_seed(7)).to(dtype)
        shard = (old[rank * n:(rank + 1) * n].float() + 0.01 * torch.randn(n, generator=gen)).to(dtype)
        got, want = old.to(dev), old.clone()
        qcoll.delta_allgather(got, shard.to(dev), ours, bits=8)
        qcoll.delta_allgather(want, shard, gloo, bits=8)
        ref.assert_same_bits(got, want, f"delta_allgather {dtype}")
    torch.cuda.synchronize()
    return version


def test_nccl_transport_matches_torch_nccl_and_gloo():
    versions = run_ranks(WORLD, _nccl_checks, env={r: _nccl_env(r) for r in range(WORLD)},
                         timeout=300)
    assert len(set(versions)) == 1, versions
    print(f"NCCL {versions[0]}: {WORLD} ranks on one GPU, node_size={NODE}")


def _nccl_smoke(rank: int, world: int) -> str:
    """The smallest end-to-end check: one raw-NCCL all-gather equals torch's NCCL, one
    quantized reduce-scatter equals the gloo one, the group closes cleanly."""
    from qcoll import _nccl

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    ours = qcoll.new_group(None, node_size=1, backend="nccl")
    gloo = qcoll.new_group(None, node_size=1, backend="torch")
    x = torch.arange(1000, dtype=torch.float32) + 1000 * rank
    out = torch.empty(world * 1000, dtype=torch.float32, device=dev)
    qcoll.quantized_allgather(out, x.to(dev), ours, bits=None)
    ref.assert_same_bits(out.cpu(), torch.cat([torch.arange(1000.0) + 1000 * r
                                               for r in range(world)]), "smoke allgather")
    inp = torch.randn(world * 1000, generator=torch.Generator().manual_seed(rank))
    got = torch.empty(1000, device=dev)
    qcoll.quantized_reduce_scatter(got, inp.to(dev), ours, intra_bits=8, inter_bits=4)
    want = torch.empty(1000)
    qcoll.quantized_reduce_scatter(want, inp, gloo, intra_bits=8, inter_bits=4)
    ref.assert_same_bits(got.cpu(), want, "smoke reduce_scatter")
    torch.cuda.synchronize()
    ours.close()
    assert not _nccl._live_comms, "close() must destroy the group's NCCL communicator"
    return _nccl.nccl_version()


def test_nccl_smoke_two_ranks():
    versions = run_ranks(2, _nccl_smoke, env={r: _nccl_env(r) for r in range(2)}, timeout=40)
    assert len(set(versions)) == 1, versions

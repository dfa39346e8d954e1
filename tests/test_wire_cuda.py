"""The CUDA wire kernels agree with the CPU ones bit for bit: encode_chunks and
reduce_chunks over the grid of test_wire.py, plus unaligned buffers (element paths instead
of 16-byte vectors), groups larger than a team holds (the split path), and many chunks."""

from __future__ import annotations

import pytest
import torch

import qcoll
import reference as ref
from qcoll import _C
from conftest import generator, make_values
from test_wire import (CODE, DTYPES, GARBAGE, OUTS, REDUCE_CASES, SIZES, TOPOLOGIES,
                       chunk_bytes, make_sources, out_spec, run_encode, run_reduce)

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and qcoll.build_info()["cuda_available"]),
    reason="needs a CUDA device and a qcoll build with CUDA kernels",
)

DEVICE = torch.device("cuda")


def cuda_args():
    return (1, torch.cuda.current_device(), torch.cuda.current_stream().cuda_stream)


def shifted(t: torch.Tensor, shift_bytes: int) -> torch.Tensor:
    """A copy of t on the GPU starting `shift_bytes` past a 16-byte boundary (same dtype)."""
    esize = t.element_size()
    extra = shift_bytes // esize
    buf = torch.empty(t.numel() + extra + 16, dtype=t.dtype, device=DEVICE)
    view = buf[extra : extra + t.numel()]
    view.copy_(t.reshape(-1))
    return view


def same_output(got_dev: torch.Tensor, got_cpu: torch.Tensor, what: str):
    if got_cpu.dtype == torch.uint8:
        ref.assert_same_bytes(got_dev.cpu(), got_cpu, what)
    else:
        ref.assert_same_bits(got_dev.cpu(), got_cpu, what)


def check_encode(x, partition_elems, slice_begin, n, count, node_size, nodes, bits, gs,
                 x_shift=0, out_shift=0):
    args = (partition_elems, slice_begin, n, count, node_size, nodes, bits, gs)
    want, stride = run_encode(x, *args)
    xd = shifted(x, x_shift)
    out = shifted(torch.full((count * stride,), GARBAGE, dtype=torch.uint8), out_shift)
    run_encode(xd, *args, stride=stride, device=cuda_args(), out=out)
    torch.cuda.synchronize()
    ref.assert_same_bytes(out.cpu(), want, f"encode {args}")


@pytest.mark.parametrize("bits,n,group_size", [(b, n, gs) for b in (4, 8, 0) for n, gs in SIZES
                                              if b or gs == 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_encode_cuda_matches_cpu(dtype, bits, n, group_size):
    for t, (node_size, nodes, count) in enumerate(TOPOLOGIES):
        for slice_begin, x_shift in [(0, 0), (3, 0), (8, 4)]:  # aligned; odd slice; odd base
            partition_elems = slice_begin + n + (0 if t % 2 else 5)
            x = make_values(count * partition_elems, dtype, "normal", group_size,
                            gen=generator("cuda-enc", dtype, bits, n, group_size, t))
            check_encode(x, partition_elems, slice_begin, n, count, node_size, nodes, bits,
                         group_size, x_shift=x_shift, out_shift=4 if slice_begin else 0)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_encode_cuda_hard_values_and_big_groups(dtype, bits):
    # Subnormals to the dtype's max, zero groups, NaN/Inf groups; groups larger than a
    # team's registers (the split path), and many chunks (grid-stride loops).
    for n, gs, count, node_size, nodes in [(20011, 16, 6, 3, 2), (40000, 16384, 4, 2, 2),
                                           (3 * 8192 + 8, 8200, 2, 0, 1),
                                           (24, 8, 4096, 64, 64)]:
        x = make_values(count * n, dtype, "wide", gs)
        x[32:48] = 0.0
        x[64:80] = -0.0
        x[100] = float("nan")
        x[min(200, n - 1)] = float("inf")
        check_encode(x, n, 0, n, count, node_size, nodes, bits, gs)


def check_reduce(buf, in_bits, gs, dtype, n, sources, ss, outputs, os_, divisor, out,
                 buf_shift=0, out_shift=0):
    want = run_reduce(buf, in_bits, gs, dtype, n, sources, ss, outputs, os_, divisor, out)
    bd = shifted(buf, buf_shift)
    if out[0] == "wire":
        dst = shifted(torch.full((outputs * out[2],), GARBAGE, dtype=torch.uint8), out_shift)
        got = run_reduce(bd, in_bits, gs, dtype, n, sources, ss, outputs, os_, divisor, out,
                         device=cuda_args(), out_wire=dst)
    else:
        dst = shifted(torch.full((outputs * out[2],), 7.0, dtype=out[1]), out_shift)
        got = run_reduce(bd, in_bits, gs, dtype, n, sources, ss, outputs, os_, divisor, out,
                         device=cuda_args(), out_values=dst)
    torch.cuda.synchronize()
    same_output(got, want, f"reduce in {in_bits} out {out} {sources}x{outputs} /{divisor}")


@pytest.mark.parametrize("n,group_size", SIZES)
@pytest.mark.parametrize("out_name", OUTS)
@pytest.mark.parametrize("in_bits", [4, 8, 0])
def test_reduce_cuda_matches_cpu(in_bits, out_name, n, group_size):
    for i, (sources, outputs, divisor, dtype, source_major, slack) in enumerate(REDUCE_CASES):
        buf, ss, os_ = make_sources(outputs, sources, n, in_bits, group_size, dtype,
                                    source_major, slack, ("cuda", in_bits, n, group_size, i),
                                    nan_at=(0, sources - 1, n // 2) if i == 2 else None)
        out, _ = out_spec(out_name, dtype, n, group_size, outputs, DTYPES[i % 3])
        # Aligned, then shifted by 4 bytes (codes and values lose their vector paths).
        check_reduce(buf, in_bits, group_size, dtype, n, sources, ss, outputs, os_, divisor, out)
        check_reduce(buf, in_bits, group_size, dtype, n, sources, ss, outputs, os_, divisor, out,
                     buf_shift=4, out_shift=4)


@pytest.mark.parametrize("out_name", OUTS)
@pytest.mark.parametrize("in_bits", [4, 8, 0])
def test_reduce_cuda_big_groups_and_many_outputs(in_bits, out_name):
    dtype = torch.bfloat16
    for n, gs, sources, outputs in [(40000, 16384, 3, 2), (3 * 8192 + 8, 8200, 2, 1),
                                    (24, 8, 4, 4096)]:
        # Inputs made by the CPU encode (checked against the reference in test_wire.py):
        # outputs x sources chunks, output-major.
        x = make_values(outputs * sources * n, dtype, "normal", gs,
                        gen=generator("cuda-big", in_bits, n))
        buf, cb = run_encode(x, n, 0, n, outputs * sources, 0, 1, in_bits, gs)
        out, _ = out_spec(out_name, dtype, n, gs, outputs, torch.float16)
        check_reduce(buf, in_bits, gs, dtype, n, sources, cb, outputs, sources * cb, 2.0, out)


def test_wire_cuda_runs_on_the_given_stream():
    n, gs, count = 1 << 16, 256, 4
    x = torch.randn(count * n, device=DEVICE)
    stride = chunk_bytes(8, gs, torch.float32, n)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())  # x is ready
    with torch.cuda.stream(s):
        out = torch.empty(count * stride, dtype=torch.uint8, device=DEVICE)
        run_encode(x, n, 0, n, count, 2, 2, 8, gs, stride=stride, device=cuda_args(), out=out)
        vals = torch.empty(n, device=DEVICE)
        _C.reduce_chunks(out.data_ptr(), 8, gs, CODE[torch.float32], n, count, stride, 1, 0,
                         4.0, 0, 0, 0, vals.data_ptr(), CODE[torch.float32], n, *cuda_args())
    s.synchronize()
    want, _ = run_encode(x.cpu(), n, 0, n, count, 2, 2, 8, gs)
    ref.assert_same_bytes(out.cpu(), want)
    exp = run_reduce(want, 8, gs, torch.float32, n, count, stride, 1, 0, 4.0,
                     ("values", torch.float32, n))
    ref.assert_same_bits(vals.cpu(), exp)


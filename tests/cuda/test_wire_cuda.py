"""The CUDA wire kernels agree with the CPU ones bit for bit: encode_chunks and
reduce_chunks over the grid of test_wire.py, plus unaligned buffers (element paths instead
of 16-byte vectors), groups larger than a team holds (the split path), many chunks and 1..8
sources: the cases of cuda_cases.py, which CI runs on the CPU emulator (test_cuda_emu.py)."""

from __future__ import annotations

import pytest
import torch

from tests.support import cuda_cases as cases
import qcoll
from tests.support import reference as ref
from qcoll import _C
from tests.quantize.test_wire import CODE, DTYPES, OUTS, chunk_bytes, run_encode, run_reduce, wire_code

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not (torch.cuda.is_available() and qcoll.build_info()["cuda_available"]),
    reason="needs a CUDA device and a qcoll build with CUDA kernels",
)]

DEVICE = torch.device("cuda")


def cuda_args():
    return (1, torch.cuda.current_device(), torch.cuda.current_stream().cuda_stream)


GPU = cases.GpuBackend()


# ---- the shared cases (tests/support/cuda_cases.py), also run by CI on the CPU emulator ------------------
@pytest.mark.parametrize("dtype,bits,n,group_size", cases.ENCODE)
def test_encode_cuda_matches_cpu(dtype, bits, n, group_size):
    cases.check_encode_case(GPU, dtype, bits, n, group_size)


@pytest.mark.parametrize("bits", [4, 8, cases.FP8])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_encode_cuda_hard_values_and_big_groups(dtype, bits):
    # Subnormals to the dtype's max, zero groups, NaN/Inf groups; groups larger than a
    # team's registers (the split path), and many chunks (grid-stride loops).
    cases.check_encode_big(GPU, dtype, bits)


@pytest.mark.parametrize("in_bits,out_name,n,group_size", cases.REDUCE)
def test_reduce_cuda_matches_cpu(in_bits, out_name, n, group_size):
    cases.check_reduce_case(GPU, in_bits, out_name, n, group_size)


@pytest.mark.parametrize("in_bits,in_h,out_bits,out_h,n,group_size,size", cases.REDUCE_RESIDUAL)
def test_reduce_cuda_residual(in_bits, in_h, out_bits, out_h, n, group_size, size):
    cases.check_reduce_residual(GPU, in_bits, in_h, out_bits, out_h, n, group_size, size)


@pytest.mark.parametrize("in_bits,out_name,sources", cases.REDUCE_SOURCES)
def test_reduce_cuda_one_to_eight_sources(in_bits, out_name, sources):
    cases.check_reduce_sources(GPU, in_bits, out_name, sources)


@pytest.mark.parametrize("out_name", OUTS)
@pytest.mark.parametrize("in_bits", cases.WIRE_BITS)
def test_reduce_cuda_big_groups_and_many_outputs(in_bits, out_name):
    cases.check_reduce_big(GPU, in_bits, out_name)


@pytest.mark.parametrize("dtype,bits,n,group_size,size", cases.HADAMARD_ENCODE)
def test_encode_cuda_hadamard(dtype, bits, n, group_size, size):
    cases.check_encode_case(GPU, dtype, bits, n, group_size, hadamard=size)


@pytest.mark.parametrize("bits", [4, 8])
def test_encode_cuda_hadamard_big_groups(bits):
    cases.check_encode_big(GPU, DTYPES[2], bits, hadamard=256)


@pytest.mark.parametrize("in_bits,in_h,out_name,out_h,n,group_size,size", cases.HADAMARD_REDUCE)
def test_reduce_cuda_hadamard(in_bits, in_h, out_name, out_h, n, group_size, size):
    cases.check_reduce_hadamard(GPU, in_bits, in_h, out_name, out_h, n, group_size, size)


# ---- CUDA behaviour ----------------------------------------------------------------------------------
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
        _C.reduce_chunks(out.data_ptr(), wire_code(8), gs, CODE[torch.float32], n, count, stride, 1, 0,
                         4.0, 0, 0, 0, vals.data_ptr(), CODE[torch.float32], n, *cuda_args())
    s.synchronize()
    want, _ = run_encode(x.cpu(), n, 0, n, count, 2, 2, 8, gs)
    ref.assert_same_bytes(out.cpu(), want)
    exp = run_reduce(want, 8, gs, torch.float32, n, count, stride, 1, 0, 4.0,
                     ("values", torch.float32, n))
    ref.assert_same_bits(vals.cpu(), exp)


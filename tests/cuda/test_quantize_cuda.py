"""The CUDA kernels agree with the CPU kernels bit for bit (nearest and stochastic), for
every dtype x width x mode, odd sizes, unaligned views, tiny/huge groups and grids past the
cap: the cases of cuda_cases.py, which CI runs on the CPU emulator (test_cuda_emu.py); plus
the CUDA-specific API behaviour (strides, streams, devices, out=)."""

import pytest
import torch

from tests.support import cuda_cases as cases
import qcoll
from tests.support import reference as ref
from tests.support.values import make_values

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not (torch.cuda.is_available() and qcoll.build_info()["cuda_available"]),
    reason="needs a CUDA device and a qcoll build with CUDA kernels",
)]

DEVICE = torch.device("cuda")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


GPU = cases.GpuBackend()


def check_same(x_cpu, x_dev, *, out_dtypes=(None,), **kw):
    """quantize/dequantize of x_dev (on the GPU) == of x_cpu (same values on the CPU)."""
    q_c = qcoll.quantize(x_cpu, **kw)
    q_d = qcoll.quantize(x_dev, **kw)
    assert (q_d.shape, q_d.dtype, q_d.format, q_d.group_size) == (
        q_c.shape, q_c.dtype, q_c.format, q_c.group_size)
    ref.assert_same_bytes(q_d.data.cpu(), q_c.data, "codes")
    ref.assert_same_bits(q_d.scales.cpu(), q_c.scales, "scales")
    for dtype in out_dtypes:
        ref.assert_same_bits(qcoll.dequantize(q_d, dtype=dtype).cpu(),
                             qcoll.dequantize(q_c, dtype=dtype), f"dequantize {dtype}")


# ---- the shared cases (tests/support/cuda_cases.py), also run by CI on the CPU emulator ------------------
@pytest.mark.parametrize("dtype,bits,symmetric,group_size,n,rounding,seed", cases.QUANTIZE)
def test_cuda_matches_cpu(dtype, bits, symmetric, group_size, n, rounding, seed):
    x = make_values(n, dtype, "normal", group_size, bits, symmetric)
    cases.check_quantize(GPU, x, bits=bits, group_size=group_size, symmetric=symmetric,
                         rounding=rounding, seed=seed)


@pytest.mark.parametrize("dtype,bits,symmetric,rounding,seed,kind", cases.QUANTIZE_HARD)
def test_cuda_matches_cpu_hard_values(dtype, bits, symmetric, rounding, seed, kind):
    cases.check_quantize(GPU, cases.hard_values(dtype, bits, symmetric, kind), bits=bits,
                         group_size=16, symmetric=symmetric, rounding=rounding, seed=seed,
                         out_dtypes=(None,) + tuple(DTYPES))


@pytest.mark.parametrize("dtype,bits,symmetric,group_size,size,n,rounding,seed",
                         cases.HADAMARD_QUANTIZE)
def test_cuda_matches_cpu_hadamard(dtype, bits, symmetric, group_size, size, n, rounding, seed):
    cases.check_quantize_hadamard(GPU, dtype, bits, symmetric, group_size, size, n, rounding, seed)


@pytest.mark.parametrize("kind", ["wide", "grid"])
@pytest.mark.parametrize("bits,symmetric", [(4, True), (8, False)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_matches_cpu_hadamard_hard_values(dtype, bits, symmetric, kind):
    cases.check_quantize_hadamard_hard(GPU, dtype, bits, symmetric, kind)


@pytest.mark.parametrize("bits,symmetric,dtype,group_size,rounding,seed", cases.QUANTIZE_LARGE)
def test_cuda_matches_cpu_large(bits, symmetric, dtype, group_size, rounding, seed):
    x = make_values(cases.LARGE_N, dtype, "normal", group_size, bits, symmetric)
    cases.check_quantize(GPU, x, bits=bits, group_size=group_size, symmetric=symmetric,
                         rounding=rounding, seed=seed)


@pytest.mark.parametrize("dtype,bits,symmetric,rounding,seed,offset", cases.QUANTIZE_UNALIGNED)
def test_cuda_unaligned_views(dtype, bits, symmetric, rounding, seed, offset):
    # x[offset:] starts off any vector alignment; element 0 of the view is index 0 for the
    # stochastic draws, exactly as on the CPU.
    base = make_values(10007 + offset, dtype, "normal", 64, bits, symmetric)
    shift = offset * base.element_size()
    cases.check_quantize(GPU, base[offset:], shift=shift, bits=bits, group_size=64,
                         symmetric=symmetric, rounding=rounding, seed=seed)
    cases.check_quantize(GPU, base[offset:offset + 999], shift=shift, bits=bits, group_size=8,
                         symmetric=symmetric, rounding=rounding, seed=seed)


@pytest.mark.parametrize("kernel,dtype,bits,group_size,n", cases.PAST_GRID_CAP)
def test_cuda_past_grid_cap(kernel, dtype, bits, group_size, n):
    cases.check_past_grid_cap(GPU, kernel, dtype, bits, group_size, n)


# ---- CUDA API behaviour ------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [4, 8])
def test_cuda_strided_inputs(bits):
    base = make_values(3 * 40 * 24, torch.float32, "normal", 8).reshape(3, 40, 24)
    base_d = base.to(DEVICE)
    for view in (lambda t: t.transpose(0, 2), lambda t: t[:, ::3, 1::2],
                 lambda t: t[0, 0, :9].reshape(9, 1).expand(9, 13), lambda t: t[1, 2, 3]):
        check_same(view(base), view(base_d), bits=bits, group_size=16, symmetric=False)


def test_cuda_zero_size():
    for shape in [(0,), (4, 0)]:
        q = qcoll.quantize(torch.empty(shape, device=DEVICE))
        assert q.data.numel() == 0 and q.scales.numel() == 0
        assert qcoll.dequantize(q).shape == torch.Size(shape)


def test_cuda_dequantize_out():
    x = make_values(1000, torch.float32, "normal", 16)
    q_d = qcoll.quantize(x.to(DEVICE), bits=4, group_size=16, symmetric=False)
    expect = qcoll.dequantize(qcoll.quantize(x, bits=4, group_size=16, symmetric=False))
    buf = torch.zeros(1200, device=DEVICE)
    res = qcoll.dequantize(q_d, out=buf[1:1001])  # unaligned output view
    assert res.data_ptr() == buf[1:].data_ptr()
    ref.assert_same_bits(buf[1:1001].cpu(), expect)
    assert not buf[:1].any() and not buf[1001:].any()
    with pytest.raises(ValueError, match=r"out must be a contiguous tensor of 1000 elements on "
                       r"cuda"):
        qcoll.dequantize(q_d, out=torch.empty(1000))
    cpu_scales = type(q_d)(q_d.data, q_d.scales.cpu(), q_d.offsets, q_d.shape, q_d.dtype, 4, 16)
    with pytest.raises(ValueError, match=r"q.scales is on cpu but q.data is on cuda"):
        qcoll.dequantize(cpu_scales)


def test_cuda_runs_on_current_stream():
    x = make_values(1 << 20, torch.float32, "normal", 256)
    expect = qcoll.quantize(x)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        x_d = x.to(DEVICE, non_blocking=False)
        x_d.mul_(1.0)  # queued work on the side stream that the kernel must follow
        q = qcoll.quantize(x_d)
        y = qcoll.dequantize(q)
    side.synchronize()
    assert torch.equal(q.data.cpu(), expect.data)
    ref.assert_same_bits(y.cpu(), qcoll.dequantize(expect))


@pytest.mark.gpu(count=2)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_cuda_second_device():
    x = make_values(5000, torch.bfloat16, "normal", 64)
    check_same(x, x.to("cuda:1"), bits=4, group_size=64, symmetric=True)

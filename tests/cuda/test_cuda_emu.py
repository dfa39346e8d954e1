"""The CUDA kernels of src/cuda, executed on the CPU by the SIMT emulator (qcoll._cuda_emu),
on the cases the GPU tests run (cuda_cases.py): bit-identical to the CPU kernels in every
case, while the emulator checks barriers, shuffle masks, shared-memory races, alignment and
bounds. Each case runs under the ordered schedule and under a seeded random one."""

import pytest

from tests.support import cuda_cases as cases
from tests.support.values import make_values
from tests.support.cuda_emu import EMU, EmuBackend

pytestmark = pytest.mark.cuda_emu

SCHEDULES = ["ordered", "random"]
DTYPES = cases.DTYPES


@pytest.fixture(params=SCHEDULES)
def emu(request):
    """The emulator under one schedule; the random one is seeded by the test's name."""
    seed = sum(map(ord, request.node.name)) if request.param == "random" else 0
    return EmuBackend(request.param, seed)


@pytest.mark.parametrize("dtype,bits,symmetric,group_size,n,rounding,seed", cases.QUANTIZE)
def test_emu_quantize(emu, dtype, bits, symmetric, group_size, n, rounding, seed):
    x = make_values(n, dtype, "normal", group_size, bits, symmetric)
    cases.check_quantize(emu, x, bits=bits, group_size=group_size, symmetric=symmetric,
                         rounding=rounding, seed=seed)


@pytest.mark.parametrize("dtype,bits,symmetric,rounding,seed,kind", cases.QUANTIZE_HARD)
def test_emu_quantize_hard_values(emu, dtype, bits, symmetric, rounding, seed, kind):
    cases.check_quantize(emu, cases.hard_values(dtype, bits, symmetric, kind), bits=bits,
                         group_size=16, symmetric=symmetric, rounding=rounding, seed=seed,
                         out_dtypes=(None,) + tuple(DTYPES))


@pytest.mark.parametrize("dtype,bits,symmetric,rounding,seed,offset", cases.QUANTIZE_UNALIGNED)
def test_emu_quantize_unaligned(emu, dtype, bits, symmetric, rounding, seed, offset):
    base = make_values(10007 + offset, dtype, "normal", 64, bits, symmetric)
    shift = offset * base.element_size()
    cases.check_quantize(emu, base[offset:], shift=shift, bits=bits, group_size=64,
                         symmetric=symmetric, rounding=rounding, seed=seed)
    cases.check_quantize(emu, base[offset:offset + 999], shift=shift, bits=bits, group_size=8,
                         symmetric=symmetric, rounding=rounding, seed=seed)


@pytest.mark.parametrize("bits,symmetric,dtype,group_size,rounding,seed", cases.QUANTIZE_LARGE)
def test_emu_quantize_large(bits, symmetric, dtype, group_size, rounding, seed):
    # Ordered schedule only: 3M elements take seconds per run.
    x = make_values(cases.LARGE_N, dtype, "normal", group_size, bits, symmetric)
    cases.check_quantize(EmuBackend(), x, bits=bits, group_size=group_size,
                         symmetric=symmetric, rounding=rounding, seed=seed)


@pytest.mark.skipif(not EMU.ACCESS_CHECKS, reason="written bytes are tracked by the access hooks")
@pytest.mark.parametrize("kernel,dtype,bits,group_size,n", cases.PAST_GRID_CAP)
def test_emu_past_grid_cap(kernel, dtype, bits, group_size, n):
    # 65536 blocks and more: a seeded sample of 12 (the first and last two among them).
    cases.check_past_grid_cap(EmuBackend("random", 7, max_blocks=12), kernel, dtype, bits,
                              group_size, n)
    (name, grid, block, blocks_run), = EMU.last_call()["launches"]
    # quantize is the shared team kernel, dequantize the shared elementwise kernel.
    launched = {"quantize": "team_kernel", "dequantize": "elementwise_kernel"}[kernel]
    assert name.startswith(launched) and (grid, block, blocks_run) == (65536, 256, 12)


@pytest.mark.parametrize("dtype,bits,n,group_size", cases.ENCODE)
def test_emu_encode(emu, dtype, bits, n, group_size):
    cases.check_encode_case(emu, dtype, bits, n, group_size)


@pytest.mark.parametrize("bits", [4, 8, cases.FP8])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_emu_encode_hard_values_and_big_groups(emu, dtype, bits):
    cases.check_encode_big(emu, dtype, bits)


@pytest.mark.parametrize("in_bits,out_name,n,group_size", cases.REDUCE)
def test_emu_reduce(emu, in_bits, out_name, n, group_size):
    cases.check_reduce_case(emu, in_bits, out_name, n, group_size)


@pytest.mark.parametrize("in_bits,in_h,out_bits,out_h,n,group_size,size", cases.REDUCE_RESIDUAL)
def test_emu_reduce_residual(emu, in_bits, in_h, out_bits, out_h, n, group_size, size):
    cases.check_reduce_residual(emu, in_bits, in_h, out_bits, out_h, n, group_size, size)


@pytest.mark.parametrize("in_bits,out_name,sources", cases.REDUCE_SOURCES)
def test_emu_reduce_one_to_eight_sources(emu, in_bits, out_name, sources):
    cases.check_reduce_sources(emu, in_bits, out_name, sources)


@pytest.mark.parametrize("out_name", cases.OUTS)
@pytest.mark.parametrize("in_bits", cases.WIRE_BITS)
def test_emu_reduce_big_groups_and_many_outputs(emu, in_bits, out_name):
    cases.check_reduce_big(emu, in_bits, out_name)


@pytest.mark.parametrize("dtype,bits,symmetric,group_size,size,n,rounding,seed",
                         cases.HADAMARD_QUANTIZE)
def test_emu_quantize_hadamard(emu, dtype, bits, symmetric, group_size, size, n, rounding, seed):
    cases.check_quantize_hadamard(emu, dtype, bits, symmetric, group_size, size, n, rounding, seed)


@pytest.mark.parametrize("kind", ["wide", "grid"])
@pytest.mark.parametrize("bits,symmetric", [(4, True), (8, False)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_emu_quantize_hadamard_hard_values(emu, dtype, bits, symmetric, kind):
    cases.check_quantize_hadamard_hard(emu, dtype, bits, symmetric, kind)


@pytest.mark.parametrize("dtype,bits,n,group_size,size", cases.HADAMARD_ENCODE)
def test_emu_encode_hadamard(emu, dtype, bits, n, group_size, size):
    cases.check_encode_case(emu, dtype, bits, n, group_size, hadamard=size)


@pytest.mark.parametrize("bits", [4, 8])
def test_emu_encode_hadamard_big_groups(emu, bits):
    cases.check_encode_big(emu, cases.DTYPES[2], bits, hadamard=256)


@pytest.mark.parametrize("in_bits,in_h,out_name,out_h,n,group_size,size", cases.HADAMARD_REDUCE)
def test_emu_reduce_hadamard(emu, in_bits, in_h, out_name, out_h, n, group_size, size):
    cases.check_reduce_hadamard(emu, in_bits, in_h, out_name, out_h, n, group_size, size)

"""The CUDA kernels of src/cuda, executed on the CPU by the SIMT emulator (qcoll._cuda_emu),
on the cases the GPU tests run (cuda_cases.py): bit-identical to the CPU kernels in every
case, while the emulator checks barriers, shuffle masks, shared-memory and global races,
alignment and bounds. Each case runs under the ordered schedule with the launch code's grid,
and under a seeded random schedule with the grid capped at GRID_CAP blocks, so that every
kernel's grid-stride loop wraps."""

import re
from pathlib import Path

import pytest
import torch

from tests.support import cuda_cases as cases
from tests.support.values import make_values
from tests.support.cuda_emu import EMU, GRID_CAP, EmuBackend

pytestmark = pytest.mark.cuda_emu

DTYPES = cases.DTYPES


@pytest.fixture(params=["ordered", "random-capped"])
def emu(request):
    """The emulator in thread and block order on the full grid, or in a random order (seeded
    by the test's name) on a grid capped at GRID_CAP blocks."""
    if request.param == "ordered":
        return EmuBackend("ordered")
    return EmuBackend("random", sum(map(ord, request.node.name)), grid_cap=GRID_CAP)


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
    (name, grid, block, blocks_run, _), = EMU.last_call()["launches"]
    # quantize is the shared team kernel, dequantize the shared elementwise kernel.
    launched = {"quantize": "team_kernel", "dequantize": "elementwise_kernel"}[kernel]
    assert name.startswith(launched) and (grid, block, blocks_run) == (65536, 256, 12)


class RecordingEmu:
    """The emulator module, keeping the launches of every kernel call made through it."""

    def __init__(self):
        self.launches = []

    def __getattr__(self, name):
        f = getattr(EMU, name)
        if name not in ("quantize", "dequantize", "encode_chunks", "reduce_chunks"):
            return f

        def call(*args, **kw):
            try:
                return f(*args, **kw)
            finally:
                self.launches += EMU.last_call()["launches"]

        return call


def _kernels_in_sources():
    root = Path(__file__).resolve().parents[2] / "src" / "cuda"
    pattern = r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)\s*\("
    return {k for f in root.glob("*.cu*") for k in re.findall(pattern, f.read_text())}


def _x(n, dtype, group_size):
    return make_values(n, dtype, "normal", group_size)


# (id, the call, the kernels (name prefixes) whose grid-stride loops must wrap under GRID_CAP).
# team_reduce's shared partials are reused by a block's next unit in team-128-lanes and
# split (team_kernel with 128 and 256 lanes). finalize_kernel runs a thread per group of
# more than 8192 elements, so it wraps only past GRID_CAP x 256 such groups (6.3M elements).
LOOPING = [
    ("team-1-lane", lambda be: cases.check_quantize(
        be, _x(8 * 256 * GRID_CAP + 9, torch.float32, 8), bits=8, group_size=8), ["team_kernel"]),
    ("team-128-lanes", lambda be: cases.check_quantize(
        be, _x(4096 * 2 * GRID_CAP + 4103, torch.bfloat16, 4096), bits=4, group_size=4096,
        symmetric=False), ["team_kernel"]),
    ("split", lambda be: cases.check_quantize(
        be, _x(65536 + 4103, torch.float16, 65536), bits=cases.FP8, group_size=65536),
     ["team_kernel<qcoll::CodeFormat::kFp8E4M3, Pass::kStats",
      "team_kernel<qcoll::CodeFormat::kFp8E4M3, Pass::kCode"]),
    ("dequantize", lambda be: cases.check_quantize(
        be, _x(8 * 256 * GRID_CAP + 5, torch.float32, 64), bits=4, group_size=64,
        out_dtypes=(torch.float16,)), ["elementwise_kernel"]),
    ("encode", lambda be: cases.check_encode_big(
        be, torch.float16, 8, cases=[(1000, 8, 8, 2, 4)]), ["team_kernel"]),
    ("encode-raw", lambda be: cases.check_encode_big(
        be, torch.float16, 0, cases=[(1000, 8, 8, 2, 4)]), ["copy_kernel"]),
    ("reduce", lambda be: [cases.check_reduce_big(be, 4, out, cases=[(24, 8, 4, 4096)])
                           for out in ("wire8", "values")],
     ["team_kernel", "elementwise_kernel"]),
    ("split-many-groups", lambda be: cases.check_encode_big(
        be, torch.bfloat16, 8, cases=[(8200, 8200, 256 * GRID_CAP + 1, 0, 1)]),
     ["prepare_kernel", "team_kernel", "finalize_kernel"]),
]


@pytest.mark.parametrize("call,kernels", [pytest.param(*c[1:], id=c[0]) for c in LOOPING])
def test_emu_grid_cap_makes_every_kernel_loop(call, kernels):
    # Each kernel runs on fewer blocks than its launch code asked for, every check on (the
    # race check included; ASan's in that build), and still gives the CPU's bytes: its
    # blocks looped over the rest.
    be = EmuBackend("random", 11, grid_cap=GRID_CAP)
    be.lib = RecordingEmu()
    call(be)
    for prefix in kernels:
        runs = [(grid, run, asked) for name, grid, _, run, asked in be.lib.launches
                if name.startswith(prefix)]
        assert runs and all(grid == run == GRID_CAP < asked for grid, run, asked in runs), \
            (prefix, runs)


def test_emu_grid_cap_cases_cover_every_kernel():
    covered = {k.split("<")[0] for c in LOOPING for k in c[2]}
    assert covered == _kernels_in_sources()


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

"""The cases the CUDA kernels are checked on, shared by the GPU tests (test_quantize_cuda.py,
test_wire_cuda.py) and the CPU emulator's tests (test_cuda_emu.py), so a GPU run and CI's
emulator run check the same cases. In every case the CUDA kernels' bytes must equal the CPU
kernels' bytes (codes, scales, chunks with their padding, values; NaN payloads included:
both store CUDA's canonical NaN for computed values).

A Backend is how a test reaches the CUDA kernels: qcoll on a GPU, or the emulator module on
CPU memory. It places inputs (optionally a few bytes past 16-byte alignment), runs the
kernels and compares what they wrote.
"""

from __future__ import annotations

import pytest
import torch

import qcoll
from tests.support import reference as ref
from tests.support.values import generator, make_values
from tests.quantize.test_wire import (CODE, DTYPES, GARBAGE, OUTS, REDUCE_CASES, SIZES, TOPOLOGIES,
                       chunk_bytes, run_encode, run_reduce, make_sources, out_spec, wire_code)
from tests.quantize.test_wire_residual import IDS as RESIDUAL_IDS
from tests.quantize.test_wire_residual import LAYOUTS as RESIDUAL_LAYOUTS
from tests.quantize.test_wire_residual import RESIDUAL_CASES, make_case, run_reduce_residual

# ---- the cases ------------------------------------------------------------------------------------
MODES = [("nearest", None), ("stochastic", 0), ("stochastic", 2**64 - 1)]
MODE_IDS = ["nearest", "stoch0", "stochmax"]


def _params(rows, ids):
    return [pytest.param(*row, id="-".join(map(str, i))) for row, i in zip(rows, ids)]


def _dt(d):
    return str(d).replace("torch.", "")


# The code formats with their symmetries (fp8_e4m3 is symmetric only).
FORMATS = [(4, True), (4, False), (8, True), (8, False), (ref.FP8, True)]
FP8 = ref.FP8


def _sym(s):
    return "sym" if s else "asym"


# dtype x format x symmetric x group size (8 .. the split path) x numel (tails of packets and
# groups) x rounding.
QUANTIZE = _params(
    [(d, b, s, gs, n, r, seed) for d in DTYPES for b, s in FORMATS
     for gs in (8, 24, 256, 65536) for n in (1, 7, 9, 255, 4103, 65537)
     for r, seed in MODES],
    [(_dt(d), b, _sym(s), gs, n, m) for d in DTYPES for b, s in FORMATS
     for gs in (8, 24, 256, 65536) for n in (1, 7, 9, 255, 4103, 65537)
     for m in MODE_IDS])

# Subnormals to the dtype's max (overflowing asymmetric ranges; fp8: saturation and the
# E4M3 subnormals), exact ties, zero groups and NaN/Inf groups, dequantized into every
# output dtype.
QUANTIZE_HARD = _params(
    [(d, b, s, r, seed, k) for d in DTYPES for b, s in FORMATS
     for r, seed in MODES[:2] for k in ("wide", "grid")],
    [(_dt(d), b, _sym(s), m, k) for d in DTYPES for b, s in FORMATS
     for m in MODE_IDS[:2] for k in ("wide", "grid")])

# Many blocks: grid-stride loops, groups of one lane, and the split path (huge groups).
LARGE_FORMATS = [(8, True, torch.float32), (4, False, torch.bfloat16), (4, True, torch.float16),
                 (FP8, True, torch.bfloat16)]
QUANTIZE_LARGE = _params(
    [(b, s, d, gs, r, seed) for b, s, d in LARGE_FORMATS
     for gs in (8, 65536, 1 << 20) for r, seed in MODES[:2]],
    [(b, _sym(s), _dt(d), gs, m) for b, s, d in LARGE_FORMATS
     for gs in (8, 65536, 1 << 20) for m in MODE_IDS[:2]])
LARGE_N = 3_000_017

# x[offset:] starts off any vector alignment: element loads instead of 16-byte vectors.
QUANTIZE_UNALIGNED = _params(
    [(d, b, s, r, seed, off) for d in DTYPES for b, s in FORMATS
     for r, seed in MODES[:2] for off in (1, 2, 3, 5, 7)],
    [(_dt(d), b, _sym(s), m, off) for d in DTYPES for b, s in FORMATS
     for m in MODE_IDS[:2] for off in (1, 2, 3, 5, 7)])

# Past the grid cap (65536 blocks of 256 threads): the launch is capped and blocks loop
# (grid stride); the work past 65536 x 256 packets (dequantize) or one-lane teams (quantize
# with groups of 8) falls to blocks 0 and 1. (kernel, dtype, bits, group size, numel)
PAST_GRID_CAP = [
    pytest.param("dequantize", torch.bfloat16, 4, 256, (1 << 27) + 8 * 400 + 3, id="dequant"),
    pytest.param("quantize", torch.bfloat16, 4, 8, (1 << 27) + 8 * 500 + 5, id="quant-team1"),
    pytest.param("dequantize", torch.float16, FP8, 64, (1 << 27) + 8 * 300 + 1, id="dequant-fp8"),
]

WIRE_BITS = (4, 8, FP8, 0)  # a hop's format: codes, or raw (0)
ENCODE = _params(
    [(d, b, n, gs) for d in DTYPES for b in WIRE_BITS for n, gs in SIZES if b or gs == 8],
    [(_dt(d), b, n, gs) for d in DTYPES for b in WIRE_BITS for n, gs in SIZES if b or gs == 8])

# (n, group size, count, node_size, nodes): groups past a team (split path), many chunks.
ENCODE_BIG = [(20011, 16, 6, 3, 2), (40000, 16384, 4, 2, 2), (3 * 8192 + 8, 8200, 2, 0, 1),
              (24, 8, 4096, 64, 64)]

REDUCE = _params(
    [(ib, o, n, gs) for ib in WIRE_BITS for o in OUTS for n, gs in SIZES],
    [(ib, o, n, gs) for ib in WIRE_BITS for o in OUTS for n, gs in SIZES])

# The fused dequantize-reduce-quantize over 1..8 sources (in order, fp32), every output.
REDUCE_SOURCES = _params(
    [(ib, o, k) for ib in WIRE_BITS[:3] for o in OUTS for k in range(1, 9)],
    [(ib, o, k) for ib in WIRE_BITS[:3] for o in OUTS for k in range(1, 9)])

# (n, group size, sources, outputs): the split path, and many outputs.
REDUCE_BIG = [(40000, 16384, 3, 2), (3 * 8192 + 8, 8200, 2, 1), (24, 8, 4, 4096)]

# Error feedback in the fused reduce (test_wire_residual.py's cases: every code format out,
# Hadamard domains, tails, the split path), residual and codes bit for bit.
REDUCE_RESIDUAL = _params(RESIDUAL_CASES, [(i,) for i in RESIDUAL_IDS])


# ---- backends -------------------------------------------------------------------------------------
class Backend:
    """How the tests reach the CUDA kernels. Subclasses: GPU (qcoll on cuda tensors) and the
    emulator (qcoll._cuda_emu on CPU tensors)."""

    lib = None  # module with quantize / dequantize / encode_chunks / reduce_chunks

    def place(self, t: torch.Tensor, shift_bytes: int = 0) -> torch.Tensor:
        """A copy of t (flat) in kernel memory, starting shift_bytes past 16-byte alignment."""
        raise NotImplementedError

    def device_args(self) -> tuple:
        raise NotImplementedError

    def quantize(self, x, **kw):
        """(codes, scales, offsets or None) of x, in kernel memory."""
        raise NotImplementedError

    def dequantize(self, codes, scales, offsets, n, bits, group_size, dtype, hadamard_size=0):
        raise NotImplementedError

    def sync(self):
        pass

    def written(self, t: torch.Tensor):
        """Byte ranges [lo, hi) of t that the last call wrote, or None: compare all of t."""
        return None

    def same_bytes(self, got: torch.Tensor, want: torch.Tensor, what: str):
        self.sync()
        g = got.detach().reshape(-1).view(torch.uint8).cpu()
        w = want.detach().reshape(-1).view(torch.uint8)
        ranges = self.written(got)
        if ranges is None:
            ref.assert_same_bytes(g, w, what)
            return
        assert ranges, f"{what}: the blocks run wrote nothing here"
        for lo, hi in ranges:
            ref.assert_same_bytes(g[lo:hi], w[lo:hi], f"{what} [bytes {lo}:{hi}]")

    def same_values(self, got: torch.Tensor, want: torch.Tensor, what: str):
        """Bitwise, NaN payloads included (both store CUDA's canonical NaN)."""
        self.sync()
        ranges = self.written(got)
        if ranges is None:
            ref.assert_same_bits(got.cpu(), want, what)
            ref.assert_same_bytes(got.detach().cpu().reshape(-1).view(torch.uint8),
                                  want.detach().reshape(-1).view(torch.uint8), what)
            return
        assert ranges, f"{what}: the blocks run wrote nothing here"
        g, w, e = got.cpu().reshape(-1), want.reshape(-1), got.element_size()
        for lo, hi in ranges:
            assert lo % e == 0 and hi % e == 0, f"{what}: a partial element was written"
            ref.assert_same_bits(g[lo // e : hi // e], w[lo // e : hi // e],
                                 f"{what} [elements {lo // e}:{hi // e}]")
            ref.assert_same_bytes(g[lo // e : hi // e].view(torch.uint8),
                                  w[lo // e : hi // e].contiguous().view(torch.uint8),
                                  f"{what} [elements {lo // e}:{hi // e}]")


class GpuBackend(Backend):
    """The CUDA kernels on a GPU: quantize/dequantize through qcoll's API on cuda tensors, the
    wire kernels through qcoll._C."""

    lib = qcoll._C

    def place(self, t, shift_bytes=0):
        esize = t.element_size()
        buf = torch.empty(t.numel() + shift_bytes // esize + 16, dtype=t.dtype, device="cuda")
        view = buf[shift_bytes // esize :][: t.numel()]
        view.copy_(t.reshape(-1))
        return view

    def device_args(self):
        return (1, torch.cuda.current_device(), torch.cuda.current_stream().cuda_stream)

    def quantize(self, x, **kw):
        q = qcoll.quantize(x, **kw)
        assert q.data.device == x.device and q.scales.device == x.device
        return q.data, q.scales, q.offsets

    def dequantize(self, codes, scales, offsets, n, bits, group_size, dtype, hadamard_size=0):
        q = qcoll.QuantizedTensor(codes, scales, offsets, (n,), dtype, ref.format_name(bits),
                                  group_size, hadamard_size)
        y = qcoll.dequantize(q, dtype=dtype)
        assert y.device == codes.device
        return y

    def sync(self):
        torch.cuda.synchronize()


# ---- checks -----------------------------------------------------------------------------------------
def check_quantize(be: Backend, x: torch.Tensor, *, shift=0, out_dtypes=(None,), **kw):
    """Backend quantize (and dequantize into each of out_dtypes) == the CPU kernels'."""
    q = qcoll.quantize(x, **kw)
    codes, scales, offsets = be.quantize(be.place(x, shift), **kw)
    be.same_bytes(codes, q.data, "codes")
    be.same_values(scales, q.scales, "scales")
    covers_both_ends(be, codes, "codes")
    covers_both_ends(be, scales, "scales")
    assert (offsets is None) == (q.offsets is None)
    if q.offsets is not None:
        be.same_values(offsets, q.offsets, "offsets")
    for dtype in out_dtypes:
        # Decode the CPU's codes, so dequantize is checked on its own.
        y = be.dequantize(be.place(q.data), be.place(q.scales),
                          None if q.offsets is None else be.place(q.offsets), x.numel(),
                          q.format, q.group_size, dtype or x.dtype, q.hadamard_size)
        be.same_values(y, qcoll.dequantize(q, dtype=dtype).reshape(-1), f"dequantize {dtype}")


def hard_values(dtype, bits, symmetric, kind):
    x = make_values(20011, dtype, kind, 16, bits, symmetric)
    x[32:48] = 0.0
    x[64:80] = -0.0
    x[100] = float("nan")
    x[200] = float("inf")
    x[300] = float("-inf")
    if dtype == torch.float32:  # groups that reach FLT_MAX: scales stepped below the quotient
        top = torch.finfo(torch.float32).max
        x[400:416] = torch.linspace(-1e30, 1e30, 16)  # symmetric int8: one step
        x[400], x[401] = top, -top  # (asymmetric: a range past fp32, a NaN group)
        x[416:432] = torch.linspace(2.0**111, 2.0**127, 16)  # asymmetric: one step
        x[431] = top
        x[432:448] = torch.tensor([0x7EF3C447], dtype=torch.int32).view(torch.float32)  # asymmetric: two
        x[447] = top
    x[20000:] = 3.0  # constant tail group
    return x


def check_encode(be: Backend, x, partition_elems, slice_begin, n, count, node_size, nodes, bits,
                 gs, x_shift=0, out_shift=0, hadamard=0):
    args = (partition_elems, slice_begin, n, count, node_size, nodes, bits, gs)
    want, stride = run_encode(x, *args, hadamard=hadamard)
    out = be.place(torch.full((count * stride,), GARBAGE, dtype=torch.uint8), out_shift)
    run_encode(be.place(x, x_shift), *args, stride=stride, device=be.device_args(), out=out,
               lib=be.lib, hadamard=hadamard)
    be.same_bytes(out, want, f"encode {args}")


def check_encode_case(be: Backend, dtype, bits, n, group_size, hadamard=0):
    for t, (node_size, nodes, count) in enumerate(TOPOLOGIES):
        for slice_begin, x_shift in [(0, 0), (3, 0), (8, 4)]:  # aligned; odd slice; odd base
            partition_elems = slice_begin + n + (0 if t % 2 else 5)
            x = make_values(count * partition_elems, dtype, "normal", group_size,
                            gen=generator("cuda-enc", dtype, bits, n, group_size, t))
            if hadamard:
                x[::97] *= 40  # outliers to smooth
            check_encode(be, x, partition_elems, slice_begin, n, count, node_size, nodes, bits,
                         group_size, x_shift=x_shift, out_shift=4 if slice_begin else 0,
                         hadamard=hadamard)


def check_encode_big(be: Backend, dtype, bits, cases=ENCODE_BIG, hadamard=0):
    for n, gs, count, node_size, nodes in cases:
        x = make_values(count * n, dtype, "wide", gs)
        x[32:48] = 0.0
        x[64:80] = -0.0
        x[100] = float("nan")
        x[min(200, n - 1)] = float("inf")
        check_encode(be, x, n, 0, n, count, node_size, nodes, bits, gs,
                     hadamard=min(hadamard, gs & -gs))


def check_reduce(be: Backend, buf, in_bits, gs, dtype, n, sources, ss, outputs, os_, divisor,
                 out, buf_shift=0, out_shift=0, in_hadamard=0, out_hadamard=0):
    h = dict(in_hadamard=in_hadamard, out_hadamard=out_hadamard)
    want = run_reduce(buf, in_bits, gs, dtype, n, sources, ss, outputs, os_, divisor, out, **h)
    bd = be.place(buf, buf_shift)
    what = f"reduce in {in_bits} out {out} {sources}x{outputs} /{divisor} hadamard {h}"
    if out[0] == "wire":
        dst = be.place(torch.full((outputs * out[2],), GARBAGE, dtype=torch.uint8), out_shift)
        run_reduce(bd, in_bits, gs, dtype, n, sources, ss, outputs, os_, divisor, out,
                   device=be.device_args(), out_wire=dst, lib=be.lib, **h)
        be.same_bytes(dst, want, what)
    else:
        dst = be.place(torch.full((outputs * out[2],), 7.0, dtype=out[1]), out_shift)
        run_reduce(bd, in_bits, gs, dtype, n, sources, ss, outputs, os_, divisor, out,
                   device=be.device_args(), out_values=dst, lib=be.lib, **h)
        be.same_values(dst, want, what)


def check_reduce_case(be: Backend, in_bits, out_name, n, group_size):
    for i, (sources, outputs, divisor, dtype, source_major, slack) in enumerate(REDUCE_CASES):
        buf, ss, os_ = make_sources(outputs, sources, n, in_bits, group_size, dtype,
                                    source_major, slack, ("cuda", in_bits, n, group_size, i),
                                    nan_at=(0, sources - 1, n // 2) if i in (0, 1, 2) else None)
        out, _ = out_spec(out_name, dtype, n, group_size, outputs, DTYPES[i % 3])
        # Aligned, then shifted by 4 bytes (codes and values lose their vector paths).
        check_reduce(be, buf, in_bits, group_size, dtype, n, sources, ss, outputs, os_, divisor,
                     out)
        check_reduce(be, buf, in_bits, group_size, dtype, n, sources, ss, outputs, os_, divisor,
                     out, buf_shift=4, out_shift=4)


def check_reduce_sources(be: Backend, in_bits, out_name, sources):
    n, gs, outputs, dtype = 1000, 24, 2, torch.bfloat16
    buf, ss, os_ = make_sources(outputs, sources, n, in_bits, gs, dtype, sources % 2 == 0, 0,
                                ("cuda-src", in_bits, sources))
    out, _ = out_spec(out_name, dtype, n, gs, outputs, torch.float16)
    check_reduce(be, buf, in_bits, gs, dtype, n, sources, ss, outputs, os_, float(sources), out)


def check_reduce_big(be: Backend, in_bits, out_name, cases=REDUCE_BIG):
    dtype = torch.bfloat16
    for n, gs, sources, outputs in cases:
        # Inputs made by the CPU encode (checked against the reference in test_wire.py):
        # outputs x sources chunks, output-major.
        x = make_values(outputs * sources * n, dtype, "normal", gs,
                        gen=generator("cuda-big", in_bits, n))
        buf, cb = run_encode(x, n, 0, n, outputs * sources, 0, 1, in_bits, gs)
        out, _ = out_spec(out_name, dtype, n, gs, outputs, torch.float16)
        check_reduce(be, buf, in_bits, gs, dtype, n, sources, cb, outputs, sources * cb, 2.0, out)


def check_reduce_residual(be: Backend, in_bits, in_h, out_bits, out_h, n, group_size, size):
    """Chunks and updated residual == the CPU kernel's, for each layout; residual, sources
    and chunks aligned, then 4 bytes past (the residual's scalar path)."""
    h = dict(in_h=size if in_h else 0, out_h=size if out_h else 0)
    for i, layout in enumerate(RESIDUAL_LAYOUTS):
        sources, outputs, divisor, dtype, *_ = layout
        buf, ss, os_, residual, rstride = make_case(
            in_bits, n, group_size, layout, ("cuda-res", in_bits, out_bits, n, group_size, i))
        want_res = residual.clone()
        want, stride = run_reduce_residual(buf, in_bits, group_size, dtype, n, sources, ss,
                                           outputs, os_, divisor, out_bits, want_res, rstride, **h)
        for shift in (0, 4):
            got_res = be.place(residual.clone(), shift)  # updated in place
            dst = be.place(torch.full((outputs * stride,), GARBAGE, dtype=torch.uint8), shift)
            run_reduce_residual(be.place(buf, shift), in_bits, group_size, dtype, n, sources, ss,
                                outputs, os_, divisor, out_bits, got_res, rstride,
                                device=be.device_args(), lib=be.lib, out_wire=dst, **h)
            what = f"reduce residual in {in_bits} out {out_bits} layout {i} shift {shift} {h}"
            be.same_bytes(dst, want, what)
            be.same_values(got_res, want_res, what + " residual")


def covers_both_ends(be: Backend, t: torch.Tensor, what: str):
    """A sampled run (first and last blocks among them) wrote t's first and last bytes."""
    ranges = be.written(t)
    if ranges is not None:
        nbytes = t.numel() * t.element_size()
        assert min(lo for lo, _ in ranges) == 0, f"{what}: first bytes not written"
        assert max(hi for _, hi in ranges) == nbytes, f"{what}: last bytes not written"


def check_past_grid_cap(be: Backend, kernel, dtype, bits, group_size, n):
    """One kernel past 65536 blocks: random codes (dequantize) or random finite values
    (quantize) of n elements. A backend that runs a sample of the blocks compares what they
    wrote, which must reach both ends of the output."""
    gen = generator("past-cap", kernel, n)
    if kernel == "dequantize":
        codes = torch.randint(0, 256, (-(-n * ref.width(bits) // 8),), generator=gen,
                              dtype=torch.uint8)  # fp8: NaN bytes among them
        groups = -(-n // group_size)
        scales = torch.rand(groups, generator=gen) * 2.0**-4
        y = be.dequantize(be.place(codes), be.place(scales), None, n, bits, group_size, dtype)
        want = torch.empty(n, dtype=dtype)
        qcoll._C.dequantize(codes.data_ptr(), scales.data_ptr(), 0, n, wire_code(bits), group_size,
                            True, want.data_ptr(), CODE[dtype], 0, 0, 0)
        be.same_values(y, want, "dequantize")
        covers_both_ends(be, y, "dequantize")
        return
    x = torch.randn(n, generator=gen, dtype=dtype)
    q = qcoll.quantize(x, bits=bits, group_size=group_size)
    codes, scales, _ = be.quantize(be.place(x), bits=bits, group_size=group_size)
    be.same_bytes(codes, q.data, "codes")
    be.same_values(scales, q.scales, "scales")
    covers_both_ends(be, codes, "codes")
    covers_both_ends(be, scales, "scales")


# ---- Hadamard smoothing, fused into every kernel ------------------------------------------------
# (dtype, bits, symmetric, group size, hadamard size, numel, rounding): blocks across lanes
# (shuffles) and across a lane's registers (group 64 = 2 lanes of 4 packets), whole blocks
# and partial tails, the split path (group 65536).
_HQ = [(d, b, s, gs, h, n, r, seed) for d in DTYPES
       for b, s in ((4, True), (8, True), (8, False), (ref.FP8, True))
       for gs, h in ((8, 8), (24, 8), (64, 64), (256, 32), (256, 256), (65536, 128))
       for n in ((7, 20011) if gs == 65536 else (7, 4103))
       for r, seed in (MODES[:2] if b == 4 else MODES[:1])]
HADAMARD_QUANTIZE = _params(_HQ, [(_dt(d), b, "sym" if s else "asym", gs, h, n,
                                   "stoch0" if r == "stochastic" else "nearest")
                                  for d, b, s, gs, h, n, r, seed in _HQ])

# (dtype, bits, n, group size, hadamard size), every topology of check_encode_case.
_HE = [(d, b, n, gs, h) for d in DTYPES for b in (4, 8, ref.FP8)
       for n, gs, h in ((13, 8, 8), (1000, 24, 8), (1000, 64, 64), (1000, 256, 256))]
HADAMARD_ENCODE = _params(_HE, [(_dt(d), b, n, gs, h) for d, b, n, gs, h in _HE])

# (in bits, in hadamard, out, out hadamard, n, group size, hadamard size): every pair of
# domains (wire.h): forward, inverse, or none (sums of transformed values, re-encoded).
_HR = [(ib, ih, o, oh, n, gs, h)
       for ib, ih in ((4, 1), (8, 1), (8, 0), (0, 0))
       for o, oh in (("wire4", 1), ("wire8", 1), ("wire4", 0), ("wire0", 0), ("values", 0))
       if ih or oh
       for n, gs, h in ((13, 8, 8), (1000, 64, 64), (1000, 256, 256), (9001, 4096, 256))]
HADAMARD_REDUCE = _params(_HR, [(ib, f"h{ih}", o, f"h{oh}", n, gs, h)
                                for ib, ih, o, oh, n, gs, h in _HR])


def check_quantize_hadamard(be: Backend, dtype, bits, symmetric, group_size, size, n, rounding,
                            seed):
    x = make_values(n, dtype, "normal", group_size, bits, symmetric)
    x[::97] *= 40  # outliers to smooth
    check_quantize(be, x, bits=bits, group_size=group_size, symmetric=symmetric,
                   rounding=rounding, seed=seed, hadamard=True, hadamard_size=size,
                   out_dtypes=(None, torch.float32))


def check_quantize_hadamard_hard(be: Backend, dtype, bits, symmetric, kind):
    """Subnormals to the dtype's max (sums past fp32's range: non-finite groups), zeros,
    NaN/Inf, with blocks of a group's size."""
    check_quantize(be, hard_values(dtype, bits, symmetric, kind), bits=bits, group_size=16,
                   symmetric=symmetric, hadamard=True, hadamard_size=16,
                   out_dtypes=(None,) + tuple(DTYPES))


def check_reduce_hadamard(be: Backend, in_bits, in_h, out_name, out_h, n, group_size, size):
    for i, (sources, outputs, divisor, dtype, source_major, slack) in enumerate(REDUCE_CASES[:3]):
        buf, ss, os_ = make_sources(outputs, sources, n, in_bits, group_size, dtype,
                                    source_major, slack, ("cuda-h", in_bits, n, group_size, i),
                                    nan_at=(0, sources - 1, n // 2) if i == 2 else None)
        out, _ = out_spec(out_name, dtype, n, group_size, outputs, DTYPES[i % 3])
        h = dict(in_hadamard=size if in_h else 0, out_hadamard=size if out_h else 0)
        check_reduce(be, buf, in_bits, group_size, dtype, n, sources, ss, outputs, os_, divisor,
                     out, **h)
        check_reduce(be, buf, in_bits, group_size, dtype, n, sources, ss, outputs, os_, divisor,
                     out, buf_shift=4, out_shift=4, **h)

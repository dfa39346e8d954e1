"""An independent pure-PyTorch reference for qcoll's block quantization.

It is written from the contract (README / include/qcoll/quant_spec.h / quant_math.h), not
from the kernels, and never calls qcoll. All arithmetic is float32 on the CPU, with
elementwise tensor-tensor ops only: a tensor divided by a (broadcast) scalar may be
computed as a multiply by the reciprocal, which is not the IEEE quotient the contract asks
for, so per-group values are always materialized per element first.

Contract, per group of ``group_size`` consecutive elements of ``x.reshape(-1)`` (the last
group may be shorter):
  symmetric:  scale = absmax / qmax (qmax = 2**(bits-1) - 1); code = rne(x / scale),
              clamped to [-qmax, qmax]; stored two's complement.
  asymmetric: scale = (hi - lo) / (2**bits - 1), offset = lo; code = rne((x - lo) / scale),
              clamped to [0, 2**bits - 1]; stored unsigned.
  either:     while the largest code's value (qmax * scale, or levels * scale + lo)
              overflows fp32, scale steps down to the next smaller float (groups that reach
              FLT_MAX: 127 * fl(FLT_MAX / 127) is inf).
  scale == 0 -> code 0. A group with a NaN/Inf, or (asymmetric) whose fp32 hi - lo
  overflows, gets scale NaN (and offset NaN) and codes 0.
  stochastic: code = floor(v + u) with u from a SplitMix64 counter keyed by (seed, index).
  int4: element 2k in the low nibble, 2k+1 in the high one; an odd tail leaves it 0.
  fp8_e4m3 (symmetric only): scale = absmax / 448; code = the OCP E4M3FN byte of x / scale
              (torch.float8_e4m3fn's conversion: nearest even), saturated to +-448 first;
              stochastic: floor(v / ulp + u) * ulp with ulp the E4M3 spacing at |v|.
  dequantize: code * scale (+ offset, as a separate fp32 add), then cast to the dtype.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
import torch

F32 = torch.float32
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# ---- the stochastic-rounding generator (numpy uint64, wrapping arithmetic) --------------
_MASK64 = (1 << 64) - 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_SEED_XOR = 0x5851F42D4C957F2D


def mix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer on a uint64 array (arithmetic mod 2**64)."""
    z = np.asarray(z, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def rng_key(seed: int) -> np.uint64:
    return mix64(np.array([(seed ^ _SEED_XOR) & _MASK64], dtype=np.uint64))[0]


def uniforms(seed: int, n: int, index_base: int = 0) -> torch.Tensor:
    """u_i in [0, 1) for elements index_base .. index_base + n - 1, as float32."""
    key = rng_key(seed)
    idx = np.arange(n, dtype=np.uint64) + np.uint64(index_base)
    with np.errstate(over="ignore"):
        z = mix64(key + (idx + np.uint64(1)) * _GOLDEN)
    top24 = (z >> np.uint64(40)).astype(np.float32)  # < 2**24: exact in fp32
    return torch.from_numpy(top24 * np.float32(2.0**-24))


# ---- quantize -----------------------------------------------------------------------------
# The public spellings of the code formats (README "Code formats").
_FORMAT_NAMES = {8: "int8", 4: "int4", "int8": "int8", "int4": "int4", "fp8_e4m3": "fp8_e4m3"}
FP8 = "fp8_e4m3"
FP8_MAX = 448.0


def format_name(bits) -> str:
    return _FORMAT_NAMES[bits]


def width(bits) -> int:
    """Bits per code."""
    return 4 if format_name(bits) == "int4" else 8


@dataclasses.dataclass
class RefQuantized:
    codes: torch.Tensor  # int32, one integer code (fp8: the byte) per element (unpacked)
    data: torch.Tensor  # uint8, packed as qcoll stores it
    scales: torch.Tensor  # float32 per group
    offsets: Optional[torch.Tensor]  # float32 per group, or None (symmetric)
    shape: torch.Size
    dtype: torch.dtype
    format: str
    group_size: int

    @property
    def bits(self) -> int:
        return width(self.format)


def qmax(bits) -> int:
    return int(FP8_MAX) if format_name(bits) == FP8 else 2 ** (width(bits) - 1) - 1


def levels(bits) -> int:
    return 2 ** width(bits) - 1


def fp8_stochastic(v: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """v rounded onto the E4M3 grid, down or up with probability given by the remainder."""
    _, e = torch.frexp(v.abs())  # |v| = m * 2**e, m in [0.5, 1)
    ulp = torch.exp2((torch.clamp(e - 1, min=-6) - 3).to(F32))
    q = torch.floor(v / ulp + u) * ulp
    return torch.where(v.abs() >= FP8_MAX, torch.sign(v) * FP8_MAX, q)


def _full(like: torch.Tensor, value: float) -> torch.Tensor:
    return torch.full(like.shape, value, dtype=F32)


def _group_index(n: int, group_size: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.int64) // group_size


def _reduce(vals: torch.Tensor, groups: int, group_size: int, how: str) -> torch.Tensor:
    """Per-group amax/amin (float) or any/all (bool) of a flat run."""
    if vals.dtype == torch.bool:
        v = vals.to(torch.int32)
        init = torch.zeros(groups, dtype=torch.int32) if how == "amax" else torch.ones(
            groups, dtype=torch.int32)
        return init.scatter_reduce(0, _group_index(vals.numel(), group_size), v, how) != 0
    init = torch.full((groups,), float("-inf") if how == "amax" else float("inf"), dtype=F32)
    return init.scatter_reduce(0, _group_index(vals.numel(), group_size), vals, how)


def _per_element(per_group: torch.Tensor, group_size: int, n: int) -> torch.Tensor:
    return per_group.index_select(0, _group_index(n, group_size))


def _group_min_max(flat: torch.Tensor, groups: int, group_size: int):
    """Per-group min and max of a finite float32 run, ordering -0.0 below +0.0."""
    lo = _reduce(flat, groups, group_size, "amin")
    hi = _reduce(flat, groups, group_size, "amax")
    neg_zero = _reduce((flat == 0) & torch.signbit(flat), groups, group_size, "amax")
    pos_zero = _reduce((flat == 0) & ~torch.signbit(flat), groups, group_size, "amax")
    lo = torch.where((lo == 0) & neg_zero, _full(lo, -0.0), lo)
    lo = torch.where((lo == 0) & ~neg_zero, _full(lo, 0.0), lo)
    hi = torch.where((hi == 0) & pos_zero, _full(hi, 0.0), hi)
    hi = torch.where((hi == 0) & ~pos_zero, _full(hi, -0.0), hi)
    return lo, hi


def _with_finite_top(scales: torch.Tensor, top: float, offsets: Optional[torch.Tensor]) -> torch.Tensor:
    """Each positive scale stepped down a float at a time while top * scale (+ offset)
    overflows fp32: the largest code must decode to a finite value."""
    zero = torch.zeros_like(scales)
    while True:
        value = _full(scales, top) * scales
        if offsets is not None:
            value = value + torch.where(torch.isfinite(offsets), offsets, zero)  # a separate add
        step = (scales > 0) & torch.isinf(value)
        if not step.any():
            return scales
        scales = torch.where(step, torch.nextafter(scales, zero), scales)


def quantize(
    x: torch.Tensor,
    *,
    bits: int = 8,
    group_size: int = 256,
    symmetric: bool = True,
    rounding: str = "nearest",
    seed: Optional[int] = None,
) -> RefQuantized:
    fmt = format_name(bits)
    fp8 = fmt == FP8
    assert x.dtype in FLOAT_DTYPES and rounding in ("nearest", "stochastic")
    assert symmetric or not fp8
    flat = x.detach().to("cpu").reshape(-1).to(F32)  # fp16/bf16 -> fp32 is exact
    n = flat.numel()
    groups = -(-n // group_size)
    finite = torch.isfinite(flat)
    group_finite = _reduce(finite, groups, group_size, "amin")
    safe = torch.where(finite, flat, torch.zeros_like(flat))  # stats of finite groups only
    nan = _full(group_finite, float("nan"))

    if symmetric:
        absmax = _reduce(safe.abs(), groups, group_size, "amax")
        scales = torch.where(group_finite, absmax / _full(absmax, qmax(bits)), nan)
        offsets = None
    else:
        lo, hi = _group_min_max(safe, groups, group_size)
        rng = hi - lo
        ok = group_finite & torch.isfinite(rng)
        scales = torch.where(ok, rng / _full(rng, levels(bits)), nan)
        offsets = torch.where(ok, lo, nan)

    top = FP8_MAX if fp8 else qmax(bits) if symmetric else levels(bits)
    scales = _with_finite_top(scales, top, None if symmetric else offsets)
    s = _per_element(scales, group_size, n)
    coded = s > 0  # false for scale 0 and for NaN
    s_safe = torch.where(coded, s, torch.ones_like(s))
    if symmetric:
        num = torch.where(coded, flat, torch.zeros_like(flat))
    else:
        o = _per_element(offsets, group_size, n)
        num = torch.where(coded, flat - torch.where(coded, o, torch.zeros_like(o)),
                          torch.zeros_like(flat))
    v = num / s_safe
    assert rounding == "nearest" or seed is not None, "the reference needs an explicit seed"
    if fp8:
        q = v if rounding == "nearest" else fp8_stochastic(v, uniforms(seed, n))
        q = torch.where(coded, torch.clamp(q, -FP8_MAX, FP8_MAX), torch.zeros_like(q))
        data = q.to(torch.float8_e4m3fn).view(torch.uint8)
        return RefQuantized(data.to(torch.int32), data, scales, offsets, x.shape, x.dtype, fmt,
                            group_size)
    if rounding == "nearest":
        q = torch.round(v)  # round half to even
    else:
        q = torch.floor(v + uniforms(seed, n))
    lo_c, hi_c = (-qmax(bits), qmax(bits)) if symmetric else (0, levels(bits))
    q = torch.clamp(q, lo_c, hi_c)
    codes = torch.where(coded, q, torch.zeros_like(q)).to(torch.int32)
    return RefQuantized(codes, pack(codes, bits), scales, offsets, x.shape, x.dtype, fmt,
                        group_size)


# ---- byte layout ------------------------------------------------------------------------
def pack(codes: torch.Tensor, bits) -> torch.Tensor:
    """int32 codes -> qcoll's bytes (two's complement for negative codes)."""
    if width(bits) == 8:
        return (codes & 0xFF).to(torch.uint8)
    nib = codes & 0xF
    if nib.numel() % 2:
        nib = torch.cat([nib, torch.zeros(1, dtype=nib.dtype)])
    return (nib[0::2] | (nib[1::2] << 4)).to(torch.uint8)


def unpack(data: torch.Tensor, n: int, bits, symmetric: bool) -> torch.Tensor:
    """qcoll's bytes -> int32 codes (sign-extended when symmetric; fp8: the bytes)."""
    data = data.to("cpu").reshape(-1)
    if format_name(bits) == FP8:
        return data.to(torch.int32)[:n]
    if width(bits) == 8:
        return (data.view(torch.int8) if symmetric else data).to(torch.int32)[:n]
    b = data.to(torch.int32)
    nib = torch.stack([b & 0xF, b >> 4], dim=1).reshape(-1)[:n]
    return torch.where(nib >= 8, nib - 16, nib) if symmetric else nib


# ---- dequantize -------------------------------------------------------------------------
def decoded_codes(data, n: int, bits, symmetric: bool) -> torch.Tensor:
    """The value of each code before scaling, float32 (fp8: torch's E4M3FN conversion)."""
    if format_name(bits) == FP8:
        return data.to("cpu").reshape(-1)[:n].contiguous().view(torch.float8_e4m3fn).to(F32)
    return unpack(data, n, bits, symmetric).to(F32)


def dequantize_parts(data, scales, offsets, shape, bits, group_size, dtype) -> torch.Tensor:
    n = torch.Size(shape).numel()
    symmetric = offsets is None
    codes = decoded_codes(data, n, bits, symmetric)
    y = codes * _per_element(scales.to("cpu"), group_size, n)
    if not symmetric:
        y = y + _per_element(offsets.to("cpu"), group_size, n)  # separate add: no FMA
    return y.to(dtype).reshape(shape)


def dequantize(q, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Works on a RefQuantized or on a qcoll.QuantizedTensor (same field names)."""
    return dequantize_parts(q.data, q.scales, q.offsets, q.shape, q.format, q.group_size,
                            dtype or q.dtype)


# ---- the error bound ----------------------------------------------------------------------
# Half a unit in the last place of each output dtype: relative, and absolute (subnormals).
OUT_ROUNDING = {
    torch.float32: (0.0, 0.0),
    torch.float16: (2.0**-11, 2.0**-25),
    torch.bfloat16: (2.0**-8, 2.0**-134),
}


def error_bound(x: torch.Tensor, q, out_dtype: torch.dtype) -> torch.Tensor:
    """Allowed |x - dequantize(q)| per element (float64), q quantized from x.

    scale/2 is the rounding error of the integer formats; fp8_e4m3's is half an E4M3 ulp of
    x / scale: |x| / 16 (normal codes, 3 mantissa bits) plus scale / 1024 (half the subnormal
    spacing 2**-9). The rest is fp32 rounding: a few units of 2**-24 relative to |x| and
    |offset| from (x - offset) / scale and code * scale (+ offset); 2**-142 for subnormal
    scales (or scales that underflow to 0), whose own relative error is large; then the
    output dtype's rounding of the result.
    """
    n = x.numel()
    s = _per_element(q.scales.to("cpu"), q.group_size, n).double()
    o = (_per_element(q.offsets.to("cpu"), q.group_size, n).double().abs()
         if q.offsets is not None else torch.zeros(n, dtype=torch.float64))
    ax = x.detach().to("cpu").reshape(-1).double().abs()
    if format_name(q.format) == FP8:
        rounding = (ax / 16 + s / 1024) * (1 + 1e-6)
    else:
        rounding = s / 2 * (1 + 1e-6)
    bound = rounding + 2.0**-21 * (ax + o) + 2.0**-142
    rel, absolute = OUT_ROUNDING[out_dtype]
    return bound + rel * (ax + s) + absolute


def assert_within_bound(x: torch.Tensor, y: torch.Tensor, q, mask=None) -> None:
    """|x - y| <= error_bound for every element (or those where `mask` is true); a NaN in y
    counts as a violation."""
    xd = x.detach().to("cpu").reshape(-1).double()
    yd = y.detach().to("cpu").reshape(-1).double()
    err = (xd - yd).abs()
    bound = error_bound(x, q, y.dtype)
    bad = ~(err <= bound)
    if mask is not None:
        bad &= mask.reshape(-1)
    if bad.any():
        i = int(bad.nonzero()[0])
        raise AssertionError(
            f"{int(bad.sum())} elements exceed the bound; first at {i}: x={xd[i].item()!r} "
            f"y={yd[i].item()!r} err={err[i].item():.6g} bound={bound[i].item():.6g} "
            f"scale={q.scales[i // q.group_size].item():.6g}"
        )


# ---- bit-level comparison ---------------------------------------------------------------
_INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def float_bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous().view(_INT_VIEW[t.dtype])


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Bitwise equality of floating tensors; every NaN matches every NaN (payloads vary).

    -0.0 and +0.0 are different here.
    """
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    a = actual.detach().to("cpu").reshape(-1)
    e = expected.detach().to("cpu").reshape(-1)
    a_nan, e_nan = torch.isnan(a), torch.isnan(e)
    ab = torch.where(a_nan, torch.zeros_like(float_bits(a)), float_bits(a))
    eb = torch.where(e_nan, torch.zeros_like(float_bits(e)), float_bits(e))
    bad = (a_nan != e_nan) | (ab != eb)
    if bad.any():
        i = int(bad.nonzero()[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {a.numel()} elements differ; first at flat index "
            f"{i}: got {a[i].item()!r} (bits {ab[i].item():#x}), expected {e[i].item()!r} "
            f"(bits {eb[i].item():#x})"
        )


def assert_same_bytes(actual: torch.Tensor, expected: torch.Tensor, what: str = "codes") -> None:
    assert actual.dtype == torch.uint8, f"{what}: dtype {actual.dtype}"
    a = actual.to("cpu").reshape(-1)
    e = expected.to("cpu").reshape(-1)
    assert a.numel() == e.numel(), f"{what}: {a.numel()} bytes, expected {e.numel()}"
    bad = a != e
    if bad.any():
        i = int(bad.nonzero()[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {a.numel()} bytes differ; first at byte {i}: got "
            f"{int(a[i]):#04x}, expected {int(e[i]):#04x}"
        )


def assert_matches_reference(q, ref: RefQuantized) -> None:
    """q (a qcoll.QuantizedTensor) has exactly the reference's fields, codes and scales."""
    assert (q.shape, q.dtype, q.format, q.group_size) == (
        ref.shape, ref.dtype, ref.format, ref.group_size)
    assert_same_bytes(q.data, ref.data, "codes")
    assert_same_bits(q.scales, ref.scales, "scales")
    if ref.offsets is None:
        assert q.offsets is None, "symmetric quantization must have offsets=None"
    else:
        assert q.offsets is not None, "asymmetric quantization must have offsets"
        assert_same_bits(q.offsets, ref.offsets, "offsets")


# ---- Hadamard smoothing --------------------------------------------------------------------
def hadamard_norm(size: int) -> float:
    """fl32(1 / sqrt(size))."""
    return float(torch.tensor(1.0 / size**0.5, dtype=F32))


def hadamard(x: torch.Tensor, size: int) -> torch.Tensor:
    """The orthonormal Walsh-Hadamard transform of every whole block of `size` elements of
    the flat float32 run x (the contract of quant_math.h): stages with element strides 1, 2,
    ..., size/2, each turning the pair (a, b) at (i, i + stride) into (a + b, a - b) in fp32,
    then a multiply by fl32(1/sqrt(size)). A partial last block stays as it is. Its own
    inverse. tests/quantize/test_hadamard.py checks it against the Sylvester matrix in float64."""
    flat = x.detach().to("cpu").reshape(-1).to(F32).clone()
    whole = flat.numel() // size * size
    b = flat[:whole].reshape(-1, size)
    s = 1
    while s < size:
        v = b.reshape(-1, size // (2 * s), 2, s)
        lo, hi = v[:, :, 0, :], v[:, :, 1, :]
        b = torch.stack([lo + hi, lo - hi], dim=2).reshape(-1, size)
        s *= 2
    flat[:whole] = (b * torch.full_like(b, hadamard_norm(size))).reshape(-1)
    return flat

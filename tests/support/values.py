"""Deterministic test data for the quantization tests: per-group varied values."""

from __future__ import annotations

import zlib

import torch

from tests.support import reference as ref

_FINITE_BITS = {  # (bit-pattern dtype, exponent mask) of each float dtype
    torch.float32: (torch.int32, 0x7F800000),
    torch.float16: (torch.int16, 0x7C00),
    torch.bfloat16: (torch.int16, 0x7F80),
}


def generator(*key) -> torch.Generator:
    """A torch.Generator seeded from the test's parameters (stable across runs)."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def random_finite(n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Uniformly random bit patterns with NaN/Inf replaced by 0: every binade is as likely as
    any other, so values range from subnormals to the dtype's maximum, with both zeros."""
    int_dtype, exp_mask = _FINITE_BITS[dtype]
    width = 32 if int_dtype == torch.int32 else 16
    raw = torch.randint(-(2 ** (width - 1)), 2 ** (width - 1), (n,), generator=gen,
                        dtype=torch.int64).to(int_dtype)
    raw = torch.where((raw & exp_mask) == exp_mask, torch.zeros_like(raw), raw)
    return raw.view(dtype)


def make_values(n: int, dtype: torch.dtype, kind: str, group_size: int, bits: int = 8,
                symmetric: bool = True, gen: torch.Generator | None = None) -> torch.Tensor:
    """n values of `dtype`. kinds:

    normal: randn times 2**e with e varying per group, plus some +0.0 and -0.0.
    grid:   every value a multiple of half a quantization step of its group, with the group's
            absmax (symmetric) or min and max (asymmetric) pinned, so the scale is a power
            of two and about half the values are exact ties.
    wide:   random finite bit patterns (subnormals to the dtype's maximum).
    tiny:   magnitudes around the dtype's subnormals, varying per group.
    """
    gen = gen or generator(n, dtype, kind, group_size, bits, symmetric)
    groups = max(1, -(-n // group_size))
    if kind == "wide":
        return random_finite(n, dtype, gen)
    if kind == "tiny":
        # Around the dtype's subnormal range, where the scales (and, for fp16 and bf16,
        # the dequantized values) are subnormal or underflow.
        lo_e = {torch.float32: -150, torch.float16: -25, torch.bfloat16: -134}[dtype]
        e = torch.randint(lo_e, lo_e + 28, (groups,), generator=gen).to(torch.float32)
        x = torch.randn(n, generator=gen, dtype=torch.float64)
        x = x * torch.exp2(e.double()).repeat_interleave(group_size)[:n]
        return x.to(dtype)
    if kind == "normal":
        e = torch.randint(-8, 9, (groups,), generator=gen).to(torch.float32)
        x = torch.randn(n, generator=gen) * torch.exp2(e).repeat_interleave(group_size)[:n]
        r = torch.rand(n, generator=gen)
        x = torch.where(r < 0.03, torch.zeros_like(x), x)
        x = torch.where(r > 0.98, torch.full_like(x, -0.0), x)
        return x.to(dtype)
    assert kind == "grid", kind
    step = torch.exp2(torch.randint(-6, 7, (groups,), generator=gen).to(torch.float32))
    step = step.repeat_interleave(group_size)[:n]
    if symmetric:
        m = ref.qmax(bits)
        half_steps = torch.randint(-2 * m, 2 * m + 1, (n,), generator=gen).to(torch.float32)
        x = half_steps * 0.5 * step
        pin = torch.arange(n) % group_size == 0
        sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
        x = torch.where(pin, sign * m * step, x)
    else:
        levels = ref.levels(bits)
        lo = -torch.randint(0, levels + 1, (groups,), generator=gen).to(torch.float32)
        lo = lo.repeat_interleave(group_size)[:n] * step
        half_steps = torch.randint(0, 2 * levels + 1, (n,), generator=gen).to(torch.float32)
        x = lo + half_steps * 0.5 * step
        pos = torch.arange(n) % group_size
        x = torch.where(pos == 0, lo, x)
        x = torch.where(pos == 1, lo + levels * step, x)
    return x.to(dtype)

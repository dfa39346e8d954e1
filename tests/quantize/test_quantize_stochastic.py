"""Stochastic rounding: exact codes from the counter-based generator, reproducibility by
seed (and by torch's generator when seed=None), and unbiasedness."""

import math

import numpy as np
import pytest
import torch

import qcoll
from tests.support import reference as ref
from tests.support.values import make_values

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SEEDS = [0, 1, 12345, 2**63 + 7, 2**64 - 1]


def stochastic(x, seed, **kw):
    return qcoll.quantize(x, rounding="stochastic", seed=seed, **kw)


# ---- the generator itself -------------------------------------------------------------------
def test_reference_generator_known_values():
    # SplitMix64 from state 0: its first output is the published 0xe220a8397b1dcdaf.
    assert int(ref.mix64(np.array([0x9E3779B97F4A7C15], dtype=np.uint64))[0]) == 0xE220A8397B1DCDAF
    # u_i for seed 0 computed by hand from the formula, in Python integers.
    m = (1 << 64) - 1

    def mix(z):
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
        return z ^ (z >> 31)

    for seed in (0, 2**64 - 1):
        key = mix(seed ^ 0x5851F42D4C957F2D)
        expect = [(mix((key + (i + 1) * 0x9E3779B97F4A7C15) & m) >> 40) / 2**24 for i in range(5)]
        assert ref.uniforms(seed, 5).tolist() == expect


# ---- exact codes -----------------------------------------------------------------------------
@pytest.mark.parametrize("n,group_size", [(1, 8), (9, 8), (1000, 24), (4103, 256)])
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_stochastic_matches_reference(dtype, bits, symmetric, seed, n, group_size):
    x = make_values(n, dtype, "normal", group_size)
    q = stochastic(x, seed, bits=bits, group_size=group_size, symmetric=symmetric)
    r = ref.quantize(x, bits=bits, group_size=group_size, symmetric=symmetric,
                     rounding="stochastic", seed=seed)
    ref.assert_matches_reference(q, r)
    ref.assert_same_bits(qcoll.dequantize(q), ref.dequantize(r), "dequantize")


@pytest.mark.parametrize("kind", ["wide", "grid"])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("bits", [4, 8])
def test_stochastic_matches_reference_hard_values(bits, symmetric, kind):
    x = make_values(3000, torch.float32, kind, 16, bits, symmetric)
    x[100] = float("nan")
    x[2000] = float("-inf")
    q = stochastic(x, 99, bits=bits, group_size=16, symmetric=symmetric)
    r = ref.quantize(x, bits=bits, group_size=16, symmetric=symmetric, rounding="stochastic",
                     seed=99)
    ref.assert_matches_reference(q, r)


@pytest.mark.parametrize("bits,symmetric,dtype", [(8, True, torch.float32),
                                                   (4, False, torch.bfloat16)], ids=str)
def test_stochastic_matches_reference_large(bits, symmetric, dtype):
    # Multi-threaded path: each element's draw depends on its global index only.
    x = make_values(1000003, dtype, "normal", 4096)
    q = stochastic(x, 2024, bits=bits, group_size=4096, symmetric=symmetric)
    r = ref.quantize(x, bits=bits, group_size=4096, symmetric=symmetric, rounding="stochastic",
                     seed=2024)
    ref.assert_matches_reference(q, r)


def test_codes_are_the_two_neighbours():
    x = make_values(4096, torch.float32, "normal", 64)
    q_near = qcoll.quantize(x, group_size=64)
    v = x / q_near.scales.repeat_interleave(64)
    lo = torch.floor(v)
    for seed in range(20):
        c = ref.unpack(stochastic(x, seed, group_size=64).data, x.numel(), 8, True).float()
        assert ((c == lo) | (c == lo + 1) | ((c == 127) & (v > 126))).all()


# ---- reproducibility ---------------------------------------------------------------------------
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("bits", [4, 8])
def test_same_seed_same_bits_different_seed_differs(bits, symmetric):
    x = make_values(2000, torch.float32, "normal", 64)
    a = stochastic(x, 5, bits=bits, group_size=64, symmetric=symmetric)
    b = stochastic(x.clone(), 5, bits=bits, group_size=64, symmetric=symmetric)
    c = stochastic(x, 6, bits=bits, group_size=64, symmetric=symmetric)
    assert torch.equal(a.data, b.data) and torch.equal(a.scales, b.scales)
    assert not torch.equal(a.data, c.data)
    assert torch.equal(a.scales, c.scales), "the scales do not depend on the seed"
    ref.assert_same_bits(qcoll.dequantize(a), qcoll.dequantize(b))


def test_draws_depend_on_global_index_only():
    # A prefix of whole groups codes identically alone or as part of the tensor.
    x = make_values(5000, torch.float32, "normal", 128)
    full = stochastic(x, 11, bits=4, group_size=128)
    part = stochastic(x[:1024], 11, bits=4, group_size=128)
    assert torch.equal(full.data[:512], part.data)


def test_nearest_ignores_seed():
    x = make_values(1000, torch.float32, "normal", 64)
    a = qcoll.quantize(x, group_size=64, seed=1)
    b = qcoll.quantize(x, group_size=64, seed=2)
    c = qcoll.quantize(x, group_size=64)
    assert torch.equal(a.data, b.data) and torch.equal(a.data, c.data)


def test_seed_none_uses_torch_generator():
    x = make_values(2000, torch.float32, "normal", 64)
    torch.manual_seed(1234)
    a = qcoll.quantize(x, group_size=64, rounding="stochastic")
    b = qcoll.quantize(x, group_size=64, rounding="stochastic")
    torch.manual_seed(1234)
    a2 = qcoll.quantize(x, group_size=64, rounding="stochastic")
    b2 = qcoll.quantize(x, group_size=64, rounding="stochastic")
    assert torch.equal(a.data, a2.data) and torch.equal(b.data, b2.data)
    assert not torch.equal(a.data, b.data), "each call draws a fresh seed"
    torch.manual_seed(4321)
    assert not torch.equal(a.data, qcoll.quantize(x, group_size=64, rounding="stochastic").data)


def test_seed_none_advances_torch_generator():
    torch.manual_seed(0)
    before = torch.get_rng_state()
    qcoll.quantize(torch.ones(8), rounding="stochastic")
    assert not torch.equal(before, torch.get_rng_state())
    # ... while nearest rounding leaves it alone.
    before = torch.get_rng_state()
    qcoll.quantize(torch.ones(8))
    assert torch.equal(before, torch.get_rng_state())


# ---- unbiasedness ----------------------------------------------------------------------------
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_unbiased(dtype, bits, symmetric):
    """mean over N seeds of dequantize(quantize(x)) -> x.

    Element i dequantizes to base_i + scale_i * B_i with B_i ~ Bernoulli(f_i), f_i the
    fractional part of x_i / scale_i, so the mean of N draws has standard deviation
    scale_i * sqrt(f_i (1 - f_i) / N). Besides 5 sigma per element we allow the generator's
    resolution and the fp32 rounding of v + u (both well below 2**-15 of a step), and the
    fp32 rounding of the dequantized value. The sum over all elements (a much more
    sensitive test of a systematic bias) must be within 5 sigma too.
    """
    N, gs = 3000, 128
    x = make_values(512, dtype, "normal", gs)
    q0 = qcoll.quantize(x, bits=bits, group_size=gs, symmetric=symmetric)
    s = q0.scales.double().repeat_interleave(gs)
    o = q0.offsets.double().repeat_interleave(gs) if not symmetric else torch.zeros_like(s)
    xd = x.double()
    # Bernoulli parameter per element, computed from the fp32 quotient the kernel uses.
    v = ((x.float() - o.float()) / s.float()).double()
    f = v - torch.floor(v)
    total = torch.zeros_like(xd)
    for seed in range(N):
        total += qcoll.dequantize(stochastic(x, seed, bits=bits, group_size=gs,
                                             symmetric=symmetric), dtype=torch.float32).double()
    mean = total / N
    sigma = s * torch.sqrt(f * (1 - f) / N)
    slack = s * 2.0**-15 + xd.abs() * 2.0**-22
    dev = (mean - xd).abs()
    worst = int(torch.argmax(dev - 5 * sigma - slack))
    assert (dev <= 5 * sigma + slack).all(), (
        f"element {worst}: x={xd[worst].item()} mean={mean[worst].item()} "
        f"sigma={sigma[worst].item()} f={f[worst].item()}")
    # Aggregate bias: sum of (mean - x) over elements, in units of its standard deviation.
    z = ((mean - xd).sum() / torch.sqrt((sigma**2).sum())).item()
    assert abs(z) < 5, f"systematic bias: z = {z:.2f}"
    # And the spread is really there: on average the draws are neither all floor nor ceil.
    assert (sigma > 0).float().mean() > 0.9


@pytest.mark.parametrize("bits,symmetric", [(8, True), (4, False)], ids=str)
def test_unbiased_high_power(bits, symmetric):
    """Aggregate bias over 8M draws: K copies of one group, each copy drawing at its own
    indices. The sum over the group's elements of (mean - x) has standard deviation
    sqrt(sum_i scale^2 f_i (1 - f_i) / K), about 0.6 scale here, so this detects a
    systematic bias of about 1e-3 of a step."""
    gs, K = 4096, 2048
    base = torch.linspace(-1.0, 1.0, gs) + 1e-3 * torch.randn(gs, generator=torch.Generator().manual_seed(0))
    q = stochastic(base.repeat(K), 7, bits=bits, group_size=gs, symmetric=symmetric)
    assert torch.unique(q.scales).numel() == 1
    mean = qcoll.dequantize(q).view(K, gs).double().mean(dim=0)
    s = q.scales[0].double()
    o = 0.0 if symmetric else q.offsets[0].item()
    v = ((base - o) / q.scales[0]).double()
    f = v - torch.floor(v)
    sigma_sum = torch.sqrt((s**2 * f * (1 - f) / K).sum())
    z = ((mean - base.double()).sum() / sigma_sum).item()
    assert abs(z) < 5, f"systematic bias: z = {z:.2f}"


def test_unbiased_is_a_real_check():
    # The same statistic rejects nearest rounding for values a quarter step off the grid.
    x = torch.tensor([127.0] + [k + 0.25 for k in range(100)])
    N = 200
    mean = sum(qcoll.dequantize(qcoll.quantize(x, group_size=128)).double() for _ in range(N)) / N
    sigma = math.sqrt(0.25 * 0.75 / N)
    assert ((mean[1:] - x[1:].double()).abs() > 5 * sigma).all()
    mean_s = sum(qcoll.dequantize(stochastic(x, seed, group_size=128)).double()
                 for seed in range(N)) / N
    assert ((mean_s[1:] - x[1:].double()).abs() <= 5 * sigma).all()

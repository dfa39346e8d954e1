"""What quantization promises numerically: the per-element error bound, round-half-even
ties, all-zero and constant groups, and NaN/Inf confined to their own group."""

import math

import pytest
import torch

import qcoll
from tests.support import reference as ref
from tests.support.values import make_values

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
FLT_MAX = torch.finfo(torch.float32).max


def check_bound(x, q, out_dtype=None, mask=None):
    """dequantize(q) in `out_dtype` is within the error bound of x (where `mask`)."""
    y = qcoll.dequantize(q, dtype=out_dtype or x.dtype)
    ref.assert_within_bound(x, y, q, mask)


def finite_range_values(n, dtype, kind, group_size, bits, symmetric):
    x = make_values(n, dtype, kind, group_size, bits, symmetric)
    if dtype == torch.float32 and kind == "wide":
        # Keep |x| <= 2**127 so that asymmetric ranges mostly stay finite and dequantized
        # values fit every output dtype's check below (groups at FLT_MAX:
        # test_groups_at_float32_max_decode_finite).
        x = torch.where(x.abs() > 2.0**127, x * 0.25, x)
    return x


@pytest.mark.parametrize("kind", ["normal", "wide", "grid"])
@pytest.mark.parametrize("group_size", [8, 256, 4096])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_error_bound(dtype, bits, symmetric, group_size, kind):
    x = finite_range_values(5000, dtype, kind, group_size, bits, symmetric)
    q = qcoll.quantize(x, bits=bits, group_size=group_size, symmetric=symmetric)
    nan_groups = torch.isnan(q.scales)
    g = torch.arange(x.numel()) // group_size
    if symmetric or kind != "wide":
        assert not nan_groups.any(), "finite groups must get finite scales"
    else:
        # Asymmetric: exactly the groups whose fp32 range hi - lo overflows are uncodable.
        xf = x.float()
        hi = torch.zeros(len(q.scales)).scatter_reduce(0, g, xf, "amax", include_self=False)
        lo = torch.zeros(len(q.scales)).scatter_reduce(0, g, xf, "amin", include_self=False)
        assert torch.equal(nan_groups, torch.isinf(hi - lo))
        assert torch.isnan(qcoll.dequantize(q)[nan_groups[g]]).all()
    finite_scales = torch.nan_to_num(q.scales, nan=0.0)
    reach = x.float().abs().max().item() + finite_scales.max().item()
    for out_dtype in DTYPES:
        if reach < torch.finfo(out_dtype).max:  # else the output dtype overflows, as it must
            check_bound(x, q, out_dtype, mask=~nan_groups[g])


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("bits", [4, 8])
def test_error_bound_subnormal_groups(bits, symmetric):
    # Groups of fp32 subnormals and tiny normals: scales underflow or are subnormal.
    gen = torch.Generator().manual_seed(5)
    mant = torch.randint(-(2**23), 2**23, (64 * 40,), generator=gen, dtype=torch.int32)
    e = torch.randint(-150, -117, (40,), generator=gen).repeat_interleave(64)
    x = mant.double().mul(torch.exp2(e.double() - 23)).float()  # |x| < 2**e
    q = qcoll.quantize(x, bits=bits, group_size=64, symmetric=symmetric)
    ref.assert_matches_reference(q, ref.quantize(x, bits=bits, group_size=64, symmetric=symmetric))
    assert (q.scales == 0).any() and (q.scales > 0).any()
    check_bound(x, q)


@pytest.mark.parametrize("bits", [4, 8])
def test_bound_is_tight(bits):
    # The bound is not loose: half-step values are dequantized exactly scale/2 away.
    m = ref.qmax(bits)
    x = torch.tensor([float(m)] + [k + 0.5 for k in range(m - 1)])
    q = qcoll.quantize(x, bits=bits, group_size=256)
    assert q.scales.item() == 1.0
    err = (x - qcoll.dequantize(q)).abs()
    assert torch.equal(err[1:], torch.full((m - 1,), 0.5))


# Groups that reach FLT_MAX. The plain quotient's largest code can decode to inf: symmetric
# int8 at FLT_MAX (127 * fl(FLT_MAX / 127)), asymmetric from FLT_MAX down to some lo (2^111
# here: levels * scale + lo; 1.62e38, bits 0x7ef3c447, takes two steps in int8 and int4);
# there the scale steps down to the largest float at which it decodes finite. Symmetric int4
# and fp8 (7 and 448) never overflow: their scales stay the plain quotient.
TWO_STEPS_LO = torch.tensor([0x7EF3C447], dtype=torch.int32).view(torch.float32).item()
EDGE_GROUPS = {True: [[FLT_MAX, 1.0, -FLT_MAX, 0.0, 2.0, -3.0, 0.5, 4.0],
                      [-FLT_MAX, 3.0, 2.0, 1.0, 0.0, -1.0, 2.0**100, -(2.0**126)],
                      [FLT_MAX * (1 - 2.0**-22), -5.0, 0.0, 1.0, 2.0**127, 7.0, 8.0, 9.0]],
               False: [[FLT_MAX, 2.0**111, 2.0**120, 2.0**127, 2.0**112, 2.0**125, 2.0**126, 1.5 * 2.0**111],
                       [FLT_MAX, 1.0, 0.0, 2.0, 3.0, 4.0, 2.0**127, 6.0], [FLT_MAX] + [TWO_STEPS_LO] * 7]}
EDGE_MOVES = {(8, True): True, (4, True): False, ("fp8_e4m3", True): False, (8, False): True, (4, False): True}


@pytest.mark.parametrize("bits, symmetric", list(EDGE_MOVES), ids=[f"{b}-{'sym' if s else 'asym'}" for b, s in EDGE_MOVES])
def test_groups_at_float32_max_decode_finite(bits, symmetric):
    x = torch.tensor([v for group in EDGE_GROUPS[symmetric] for v in group] + [0.5, -0.25, 1.0, 3.0] * 2)
    q = qcoll.quantize(x, bits=bits, group_size=8, symmetric=symmetric)
    r = ref.quantize(x, bits=bits, group_size=8, symmetric=symmetric)
    ref.assert_matches_reference(q, r)
    y = qcoll.dequantize(q)
    assert torch.isfinite(y).all(), f"non-finite values decoded: {y}"
    ref.assert_same_bits(y, ref.dequantize(r), "dequantize")
    check_bound(x, q)
    # Exactly the groups whose plain quotient decodes its largest code to inf move, each to the
    # largest float below it that decodes finite.
    groups = x.view(-1, 8)
    top = ref.FP8_MAX if bits == "fp8_e4m3" else ref.qmax(bits) if symmetric else ref.levels(bits)
    reach = groups.abs().amax(1) if symmetric else groups.amax(1) - groups.amin(1)
    plain = reach / torch.full_like(reach, top)  # tensor / tensor: the IEEE quotient
    largest = torch.full_like(plain, top) * plain
    offset = 0.0 if symmetric else groups.amin(1)
    moved = torch.isinf(largest + offset)
    assert bool(moved.any()) == EDGE_MOVES[bits, symmetric]
    assert torch.equal(q.scales != plain, moved)

    def decodes_finite(scale):
        return torch.isfinite(torch.full_like(scale, top) * scale + offset)

    above = torch.nextafter(q.scales, torch.full_like(q.scales, math.inf))
    assert (q.scales <= plain).all() and decodes_finite(q.scales).all()
    assert not decodes_finite(above)[moved].any(), "a moved scale must be the largest that decodes finite"


# ---- ties: round half to even -------------------------------------------------------------
TIES = {
    # (bits, symmetric): (values at scale 1, expected codes)
    (8, True): ([127, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, 125.5, -126.5, 3.5, -3.5, 64.5],
                [127, 0, 2, 2, 0, -2, -2, 126, 126, -126, 4, -4, 64]),
    (4, True): ([7, 0.5, 1.5, 2.5, -3.5, 6.5, 5.5, -0.5, -7],
                [7, 0, 2, 2, -4, 6, 6, 0, -7]),
    # offset -100 (8 bit) / -3 (4 bit), range 255 / 15: scale 1
    (8, False): ([-100, 155, -99.5, -98.5, -97.5, 154.5, 153.5, 27.5, 28.5],
                 [0, 255, 0, 2, 2, 254, 254, 128, 128]),
    (4, False): ([-3, 12, -2.5, -1.5, 10.5, 11.5, 0.5, 1.5],
                 [0, 15, 0, 2, 14, 14, 4, 4]),
}


TIE_CASES = [(b, s, d) for (b, s) in TIES for d in DTYPES
             if (b, s, d) != (8, False, torch.bfloat16)]  # bf16 cannot hold -99.5 etc.


@pytest.mark.parametrize("step", [1.0, 2.0**-3, 2.0**5])
@pytest.mark.parametrize("bits,symmetric,dtype", TIE_CASES, ids=str)
def test_ties_round_to_even(bits, symmetric, dtype, step):
    vals, expected = TIES[(bits, symmetric)]
    x = torch.tensor(vals, dtype=torch.float64) * step
    assert torch.equal(x.to(dtype).double(), x), "the test values must be exact in the dtype"
    q = qcoll.quantize(x.to(dtype), bits=bits, group_size=16, symmetric=symmetric)
    assert q.scales.tolist() == [step]
    if not symmetric:
        assert q.offsets.tolist() == [vals[0] * step]
    codes = ref.unpack(q.data, len(vals), bits, symmetric)
    assert codes.tolist() == expected


# ---- zeros, constants, NaN / Inf ------------------------------------------------------------
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_zero_groups(dtype, bits, symmetric):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 16, generator=gen)
    x[1] = 0.0
    x[3] = -0.0
    x[4, :9] = 0.0  # mixed with a non-zero tail
    x = x.reshape(-1)[:-3].to(dtype)
    q = qcoll.quantize(x, bits=bits, group_size=16, symmetric=symmetric)
    ref.assert_matches_reference(q, ref.quantize(x, bits=bits, group_size=16, symmetric=symmetric))
    assert q.scales[1].item() == 0.0 and q.scales[3].item() == 0.0
    if not symmetric:
        assert q.offsets[1].item() == 0.0 and q.offsets[3].item() == 0.0
    per_group = 16 * bits // 8
    for g in (1, 3):
        assert not q.data[g * per_group:(g + 1) * per_group].any()
    y = qcoll.dequantize(q)
    assert torch.isfinite(y).all()
    assert not y[16:32].any() and not y[48:64].any()
    check_bound(x, q)


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("bits", [4, 8])
def test_scale_underflow_codes_zero(bits, symmetric):
    tiny = torch.tensor([2.0**-149, -(2.0**-148), 2.0**-149 * 3, 0.0] * 4)  # absmax 3 * 2**-149
    q = qcoll.quantize(tiny, bits=bits, group_size=16, symmetric=symmetric)
    assert q.scales.item() == 0.0, "the scale underflows to zero"
    assert not q.data.any()
    y = qcoll.dequantize(q)
    assert torch.isfinite(y).all()
    expected = 0.0 if symmetric else -(2.0**-148)  # symmetric: 0; asymmetric: the offset
    assert torch.equal(y, torch.full_like(y, expected))


@pytest.mark.parametrize("n", [16, 13])
@pytest.mark.parametrize("value", [3.7, -1234.5, 2.0**-140, 65504.0])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_constant_group_asymmetric_is_exact(dtype, bits, value, n):
    c = torch.tensor(value).to(dtype)
    x = torch.cat([torch.linspace(-1, 1, 16), torch.full((n,), c.item())]).to(dtype)
    q = qcoll.quantize(x, bits=bits, group_size=16, symmetric=False)
    assert q.scales[1].item() == 0.0 and q.offsets[1].item() == c.item()
    for out_dtype in DTYPES:
        y = qcoll.dequantize(q, dtype=out_dtype)
        assert torch.equal(y[16:], x[16:].to(out_dtype)), out_dtype


@pytest.mark.parametrize("position", ["first", "middle", "last"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=str)
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_finite_confined_to_group(dtype, bits, symmetric, bad, position):
    gs, groups = 24, 5
    gen = torch.Generator().manual_seed(7)
    clean = (torch.randn(gs * groups - 5, generator=gen) * 10).to(dtype)  # short last group
    for g in (1, groups - 1):  # a full group and the short tail group
        begin, end = g * gs, min((g + 1) * gs, clean.numel())
        i = {"first": begin, "middle": (begin + end) // 2, "last": end - 1}[position]
        x = clean.clone()
        x[i] = bad
        q = qcoll.quantize(x, bits=bits, group_size=gs, symmetric=symmetric)
        ref.assert_matches_reference(q, ref.quantize(x, bits=bits, group_size=gs, symmetric=symmetric))
        assert math.isnan(q.scales[g].item())
        if not symmetric:
            assert math.isnan(q.offsets[g].item())
        first, last = begin * bits // 8, -(-end * bits // 8)
        assert not q.data[first:last].any(), "codes of a non-finite group are 0"
        y = qcoll.dequantize(q)
        assert torch.isnan(y[begin:end]).all(), "every element of the group dequantizes to NaN"
        # Other groups: finite, and exactly what they are without the bad value.
        q_clean = qcoll.quantize(clean, bits=bits, group_size=gs, symmetric=symmetric)
        y_clean = qcoll.dequantize(q_clean)
        others = torch.ones(x.numel(), dtype=torch.bool)
        others[begin:end] = False
        assert torch.isfinite(y[others]).all()
        assert torch.equal(y[others], y_clean[others])
        keep = torch.ones(groups, dtype=torch.bool)
        keep[g] = False
        assert torch.equal(q.scales[keep], q_clean.scales[keep])


@pytest.mark.parametrize("bits", [4, 8])
def test_asymmetric_range_overflow_is_non_finite(bits):
    x = torch.tensor([-3e38, 3e38, 1.0, 2.0] * 2 + [0.5, 1.5, 2.5, 3.5] * 2)
    q = qcoll.quantize(x, bits=bits, group_size=8, symmetric=False)
    assert math.isnan(q.scales[0].item()) and math.isnan(q.offsets[0].item())
    assert not math.isnan(q.scales[1].item())
    y = qcoll.dequantize(q)
    assert torch.isnan(y[:8]).all() and torch.isfinite(y[8:]).all()
    # The same values are codable symmetrically (absmax 3e38 is finite).
    q_sym = qcoll.quantize(x, bits=bits, group_size=8, symmetric=True)
    assert torch.isfinite(q_sym.scales).all()
    check_bound(x, q_sym)

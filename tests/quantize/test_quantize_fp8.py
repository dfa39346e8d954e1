"""The fp8_e4m3 code format against torch's own float8_e4m3fn conversion (tests/support/reference.py):
codes bit for bit (every E4M3 value, every rounding tie, subnormals, saturation), the
documented error bound, stochastic rounding, non-finite groups and the format's spellings."""

from __future__ import annotations

import pytest
import torch

import qcoll
from tests.support import reference as ref
from tests.support.values import make_values
from qcoll import _C

FP8 = ref.FP8
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _all_e4m3_values() -> torch.Tensor:
    """Every finite E4M3FN value (254 of them: the NaN bytes 0x7f and 0xff excluded), fp32."""
    b = torch.arange(256, dtype=torch.int32)
    b = b[(b & 0x7F) != 0x7F].to(torch.uint8)
    return b.view(torch.float8_e4m3fn).to(torch.float32)


def _quantize_unit_scale(v: torch.Tensor):
    """qcoll codes of v in one group pinned to absmax 448, so scale = 1 and code = E4M3(v)."""
    x = torch.cat([torch.tensor([448.0]), v])
    q = qcoll.quantize(x, bits=FP8, group_size=-(-x.numel() // 8) * 8)
    assert q.scales.tolist() == [1.0]
    return q.data[1:]


def test_every_value_and_every_tie_rounds_like_torch():
    vals = _all_e4m3_values().unique()  # sorted, +-0 merged
    mids = (vals[1:] + vals[:-1]) / 2  # exact in fp32: the ties
    below = torch.nextafter(mids, torch.full_like(mids, -1e9))
    above = torch.nextafter(mids, torch.full_like(mids, 1e9))
    v = torch.cat([vals, mids, below, above, torch.tensor([-0.0, 2.0**-12, -(2.0**-11)])])
    got = _quantize_unit_scale(v)
    want = v.to(torch.float8_e4m3fn).view(torch.uint8)
    ref.assert_same_bytes(got, want, "E4M3 bytes")
    # The values decode exactly, and ties went to the even neighbour (torch's rule).
    assert torch.equal(got[: vals.numel()].view(torch.float8_e4m3fn).to(torch.float32), vals)
    tie_codes = got[vals.numel() : vals.numel() + mids.numel()].to(torch.int32)
    assert bool(((tie_codes & 1) == 0).all())


def test_saturates_where_the_scale_division_overshoots_448():
    # absmax / fl(absmax / 448) can exceed 448 by an ulp: the code saturates to 448 (0x7e),
    # never to the NaN byte that a plain (non-saturating) conversion would give above 464.
    a = torch.rand(20000, generator=torch.Generator().manual_seed(0)) * 100 + 1
    over = a[(a / (a / 448.0)) > 448.0]
    assert over.numel() > 10
    for absmax in over[:10].tolist():
        x = torch.tensor([absmax, -absmax, absmax / 3, 0.0] * 2)
        q = qcoll.quantize(x, bits=FP8, group_size=8)
        assert q.data[:2].tolist() == [0x7E, 0xFE]
        ref.assert_matches_reference(q, ref.quantize(x, bits=FP8, group_size=8))


@pytest.mark.parametrize("kind", ["normal", "grid", "wide", "tiny"])
@pytest.mark.parametrize("group_size", [8, 24, 256, 4096])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_codes_scales_and_values_match_torch_reference(dtype, group_size, kind):
    x = make_values(10007, dtype, kind, group_size, FP8, True)
    q = qcoll.quantize(x, bits=FP8, group_size=group_size)
    r = ref.quantize(x, bits=FP8, group_size=group_size)
    ref.assert_matches_reference(q, r)
    for out in DTYPES:
        ref.assert_same_bits(qcoll.dequantize(q, dtype=out), ref.dequantize(r, out), str(out))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_error_bound_holds_and_is_tight(dtype):
    """|x - dq(q(x))| <= |x| / 16 + scale / 1024 (+ fp32 and output rounding), and the
    largest error seen reaches most of it (the bound is the real one)."""
    x = make_values(200003, dtype, "normal", 256, FP8, True)
    q = qcoll.quantize(x, bits=FP8)
    y = qcoll.dequantize(q)
    ref.assert_within_bound(x, y, q)
    if dtype == torch.float32:
        s = q.scales.repeat_interleave(256)[: x.numel()].double()
        ratio = (x.double() - y.double()).abs() / (x.double().abs() / 16 + s / 1024)
        assert ratio.max() > 0.9


def test_worse_than_int8_near_absmax_better_for_small_values():
    """What the format trades: relative precision everywhere (3 mantissa bits) instead of a
    uniform step of absmax / 127; the error is bounded by half a step of each grid."""
    x = torch.tensor([448.0, 300.0, 1.0, 0.01, -0.003, 100.0, 2.5, -400.0])
    e8 = (qcoll.dequantize(qcoll.quantize(x, bits=8, group_size=8)) - x).abs()
    ef = (qcoll.dequantize(qcoll.quantize(x, bits=FP8, group_size=8)) - x).abs()
    assert ef[1] > e8[1]  # 300: E4M3 step 32 vs int8 step 3.5
    assert (ef[2:5] < e8[2:5]).all()  # small values keep ~3 significant bits


@pytest.mark.parametrize("seed", [0, 2**64 - 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_stochastic_matches_reference_and_brackets(dtype, seed):
    x = make_values(5003, dtype, "wide", 64, FP8, True)
    kw = dict(bits=FP8, group_size=64, rounding="stochastic", seed=seed)
    q = qcoll.quantize(x, **kw)
    ref.assert_matches_reference(q, ref.quantize(x, **kw))
    # Each code is one of the two E4M3 neighbours of x / scale (below or at, and above).
    s = q.scales.repeat_interleave(64)[: x.numel()]
    ok = s > 0
    v = x.float()[ok] / s[ok]
    got = q.data[ok].view(torch.float8_e4m3fn).float()
    grid = _all_e4m3_values().unique()
    lo = torch.searchsorted(grid, v, right=True) - 1
    hi = torch.clamp(lo + 1, max=grid.numel() - 1)
    assert bool(((got == grid[lo]) | (got == grid[hi])).all())
    assert bool((got != grid[lo]).any() and (got != grid[hi]).any())


def test_stochastic_is_unbiased():
    x = torch.tensor([448.0, 1.3, -1.3, 0.0123, 300.0, -17.7, 2.0**-8 * 1.7, 9.5])
    draws = torch.stack([qcoll.dequantize(qcoll.quantize(x, bits=FP8, group_size=8,
                                                         rounding="stochastic", seed=s))
                         for s in range(3000)])
    mean = draws.double().mean(0)
    spread = draws.double().std(0) / 3000**0.5
    assert bool(((mean - x.double()).abs() <= 5 * spread + 1e-12).all())
    nearest = qcoll.dequantize(qcoll.quantize(x, bits=FP8, group_size=8))
    assert (nearest - x).abs().max() > (mean - x.double()).abs().max()  # rounding bias is real


def test_non_finite_groups_get_nan_scale_and_zero_codes():
    """As for the integer formats: a NaN or Inf makes its whole group NaN (scale NaN, codes
    0), so overflow checks downstream still fire; other groups are untouched."""
    x = torch.randn(40)
    x[3], x[17], x[33] = float("nan"), float("inf"), float("-inf")
    q = qcoll.quantize(x, bits=FP8, group_size=8)
    bad_groups = [0, 2, 4]
    assert torch.isnan(q.scales[bad_groups]).all() and torch.isfinite(q.scales[[1, 3]]).all()
    assert (q.data.view(5, 8)[bad_groups] == 0).all()
    y = qcoll.dequantize(q).view(5, 8)
    assert torch.isnan(y[bad_groups]).all() and torch.isfinite(y[[1, 3]]).all()
    ref.assert_matches_reference(q, ref.quantize(x, bits=FP8, group_size=8))


def test_nan_bytes_decode_to_nan():
    codes = torch.tensor([0x7F, 0xFF, 0x7E, 0xFE, 0x00, 0x80, 0x01, 0x08], dtype=torch.uint8)
    q = qcoll.QuantizedTensor(codes, torch.tensor([2.0]), None, (8,), torch.float32, FP8, 8)
    y = qcoll.dequantize(q)
    assert torch.isnan(y[:2]).all()
    assert y[2:].tolist() == [896.0, -896.0, 0.0, -0.0, 2.0**-8, 2.0**-5]


def test_spellings_and_the_format_table():
    x = torch.randn(1000)
    for a, b in [(8, "int8"), (4, "int4")]:
        qa, qb = qcoll.quantize(x, bits=a), qcoll.quantize(x, bits=b)
        assert qa.format == qb.format == b and qa.bits == qb.bits == a
        assert torch.equal(qa.data, qb.data)
    q = qcoll.quantize(x, bits=FP8)
    assert (q.format, q.bits, q.data.numel(), q.nbytes) == (FP8, 8, 1000, 1000 + 4 * 4)
    # The core's table (include/qcoll/quant_spec.h) is what Python reads.
    table = {k: (v["bits"], v["float"], v["qmax"], v["asymmetric"]) for k, v in _C.FORMATS.items()}
    assert table == {"int8": (8, False, 127.0, True), "int4": (4, False, 7.0, True),
                     FP8: (8, True, 448.0, False)}
    assert sorted(v["code"] for v in _C.FORMATS.values()) + [_C.RAW_FORMAT] == [0, 1, 2, 3]
    assert qcoll._runtime.args.OPS == _C.OPS == {"sum": 0, "avg": 1}
    from qcoll._dtypes import BYTES_CODE, DTYPE_CODES
    assert {str(k)[6:]: v for k, v in DTYPE_CODES.items()} == {
        k: v for k, v in _C.DTYPES.items() if k != "bytes"}
    assert BYTES_CODE == _C.DTYPES["bytes"]


@pytest.mark.parametrize("bad", ["fp8", "e4m3", "FP8_E4M3", "int16", 16, 8.0, True, None])
def test_bad_spellings_are_rejected(bad):
    with pytest.raises(ValueError, match=r"bits must be 8 / 'int8', 4 / 'int4' or 'fp8_e4m3'"):
        qcoll.quantize(torch.ones(8), bits=bad)


def test_asymmetric_fp8_is_rejected():
    with pytest.raises(ValueError, match=r"fp8_e4m3 codes are symmetric only"):
        qcoll.quantize(torch.ones(8), bits=FP8, symmetric=False)

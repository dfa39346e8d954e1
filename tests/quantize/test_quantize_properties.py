"""Property tests (hypothesis): for arbitrary shapes, dtypes, widths, modes, group sizes and
finite values of any magnitude (subnormals and signed zeros included), qcoll agrees with the
reference bit for bit and stays within the error bound."""

import os

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import qcoll
from tests.support import reference as ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
WIDTH = {torch.float32: 32, torch.float16: 16, torch.bfloat16: 32}
# QCOLL_HYP_EXAMPLES=2000 for a deeper (slower) search than the default quick run.
SETTINGS = dict(max_examples=int(os.environ.get("QCOLL_HYP_EXAMPLES", 80)), deadline=None,
                suppress_health_check=[HealthCheck.too_slow])

shapes = st.lists(st.integers(0, 9), min_size=0, max_size=4).filter(
    lambda s: torch.Size(s).numel() <= 600)
group_sizes = st.sampled_from([8, 16, 24, 32, 64, 256, 4096])


@st.composite
def tensors(draw, dtype=None, max_magnitude=None):
    """A tensor whose values mix a few magnitudes: runs of one 'special' value (0, -0, a
    subnormal, the dtype's max) and arbitrary finite floats, so groups vary widely."""
    dtype = dtype or draw(st.sampled_from(DTYPES))
    shape = draw(shapes)
    n = torch.Size(shape).numel()
    kw = dict(allow_nan=False, allow_infinity=False, width=WIDTH[dtype])
    if max_magnitude is not None:
        kw.update(min_value=-max_magnitude, max_value=max_magnitude)
    if dtype == torch.float16:
        special = [0.0, -0.0, 2.0**-24, -(2.0**-14), 65504.0, 1.0]
    else:
        special = [0.0, -0.0, 2.0**-149, -(2.0**-126), 1.0, 3.0e38]
    special = [v for v in special if max_magnitude is None or abs(v) <= max_magnitude]
    exponents = draw(st.lists(st.integers(-30, 30), min_size=1, max_size=4))
    elements = st.one_of(
        st.floats(**kw),
        st.sampled_from(special),
        st.builds(lambda m, e: m * 2.0**e, st.floats(-1, 1, width=32), st.sampled_from(exponents)),
    )
    vals = draw(st.lists(elements, min_size=n, max_size=n))
    x = torch.tensor(vals, dtype=torch.float64).reshape(shape).to(dtype)
    # bf16 (drawn as fp32 values) may round up to inf near the fp32 maximum.
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


@settings(**SETTINGS)
@given(x=tensors(), bits=st.sampled_from([4, 8]), symmetric=st.booleans(),
       group_size=group_sizes, out_dtype=st.sampled_from([None] + DTYPES))
def test_nearest_equals_reference(x, bits, symmetric, group_size, out_dtype):
    q = qcoll.quantize(x, bits=bits, group_size=group_size, symmetric=symmetric)
    r = ref.quantize(x, bits=bits, group_size=group_size, symmetric=symmetric)
    ref.assert_matches_reference(q, r)
    y = qcoll.dequantize(q, dtype=out_dtype)
    assert y.shape == x.shape
    ref.assert_same_bits(y, ref.dequantize(r, out_dtype), "dequantize")


@settings(**SETTINGS)
@given(x=tensors(), bits=st.sampled_from([4, 8]), symmetric=st.booleans(),
       group_size=group_sizes, seed=st.integers(0, 2**64 - 1))
def test_stochastic_equals_reference(x, bits, symmetric, group_size, seed):
    q = qcoll.quantize(x, bits=bits, group_size=group_size, symmetric=symmetric,
                       rounding="stochastic", seed=seed)
    r = ref.quantize(x, bits=bits, group_size=group_size, symmetric=symmetric,
                     rounding="stochastic", seed=seed)
    ref.assert_matches_reference(q, r)
    ref.assert_same_bits(qcoll.dequantize(q), ref.dequantize(r), "dequantize")


@settings(**SETTINGS)
@given(data=st.data(), dtype=st.sampled_from(DTYPES), bits=st.sampled_from([4, 8]),
       symmetric=st.booleans(), group_size=group_sizes)
def test_error_bound(data, dtype, bits, symmetric, group_size):
    # Magnitudes up to 2**126 (1e38): symmetric code * scale cannot overflow, nor can an
    # asymmetric range hi - lo. (FLT_MAX itself: see test_groups_at_float32_max_decode_finite.)
    x = data.draw(tensors(dtype, max_magnitude=2.0**126 if dtype != torch.float16 else None))
    q = qcoll.quantize(x, bits=bits, group_size=group_size, symmetric=symmetric)
    assert torch.isfinite(q.scales).all()
    ref.assert_within_bound(x, qcoll.dequantize(q), q)
    ref.assert_within_bound(x, qcoll.dequantize(q, dtype=torch.float32), q)


@settings(**SETTINGS)
@given(x=tensors(torch.float32, max_magnitude=2.0**100), bits=st.sampled_from([4, 8]),
       symmetric=st.booleans(), group_size=group_sizes)
def test_requantize_is_stable(x, bits, symmetric, group_size):
    """Quantizing a dequantized tensor again reproduces the same values (a fixed point) up
    to one step: the grid barely moves, so codes differ by at most 1 and the values by at
    most one scale (plus fp32 rounding)."""
    q1 = qcoll.quantize(x, bits=bits, group_size=group_size, symmetric=symmetric)
    y1 = qcoll.dequantize(q1)
    q2 = qcoll.quantize(y1, bits=bits, group_size=group_size, symmetric=symmetric)
    y2 = qcoll.dequantize(q2)
    n = x.numel()
    s = q1.scales.double().repeat_interleave(group_size)[:n]
    diff = (y1.reshape(-1).double() - y2.reshape(-1).double()).abs()
    assert (diff <= s * (1 + 1e-5) + 2.0**-20 * y1.reshape(-1).double().abs() + 2.0**-140).all()

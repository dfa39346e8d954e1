"""The Python API around the kernels: argument checking and its messages, build_info,
arbitrary strides, dequantize's dtype= and out=, and hand-built QuantizedTensors."""

import dataclasses
import re
import types

import pytest
import torch

import qcoll
from tests.support import reference as ref
from qcoll import _C
from qcoll.quantization import MAX_GROUP_SIZE
from tests.support.values import make_values


@pytest.fixture
def x():
    return make_values(100, torch.float32, "normal", 16).reshape(4, 25)


# ---- bad arguments ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.int64, torch.uint8,
                                   torch.bool, torch.float64, torch.complex64], ids=str)
def test_bad_input_dtype(dtype):
    with pytest.raises(TypeError, match=r"x must have dtype float32, float16 or bfloat16, got "
                       + re.escape(str(dtype))):
        qcoll.quantize(torch.zeros(8, dtype=dtype))


@pytest.mark.parametrize("bad", [[1.0, 2.0], 3.0, None, "tensor"])
def test_input_not_a_tensor(bad):
    with pytest.raises(TypeError, match=r"x must be a torch.Tensor"):
        qcoll.quantize(bad)


@pytest.mark.parametrize("bits", [0, 1, 2, 3, 5, 6, 7, 16, 32, -8, True, "8", None, 4.5])
def test_bad_bits(x, bits):
    with pytest.raises(ValueError, match=r"bits must be 8 / 'int8', 4 / 'int4' or 'fp8_e4m3', "
                       r"got " + re.escape(repr(bits))):
        qcoll.quantize(x, bits=bits)


@pytest.mark.parametrize("group_size", [0, -8, 4, 12, 100, 7, 1, MAX_GROUP_SIZE + 8,
                                        2 * MAX_GROUP_SIZE, 8.0, "8", True])
def test_bad_group_size(x, group_size):
    msg = (rf"group_size must be a positive multiple of 8 up to {MAX_GROUP_SIZE} \(or None "
           rf"for the default 256\), got {re.escape(repr(group_size))}")
    with pytest.raises(ValueError, match=msg):
        qcoll.quantize(x, group_size=group_size)


@pytest.mark.parametrize("group_size", [8, 16, 24, 1 << 20, MAX_GROUP_SIZE])
def test_good_group_sizes(x, group_size):
    assert qcoll.quantize(x, group_size=group_size).group_size == group_size


@pytest.mark.parametrize("rounding", ["up", "Nearest", "", "stochastic ", None, 0, 1])
def test_bad_rounding(x, rounding):
    with pytest.raises(ValueError, match=r"rounding must be one of \['nearest', 'stochastic'\], "
                       r"got " + re.escape(repr(rounding))):
        qcoll.quantize(x, rounding=rounding)


@pytest.mark.parametrize("rounding", [["nearest"], {"nearest": 0}])
def test_unhashable_rounding(x, rounding):
    with pytest.raises((ValueError, TypeError), match=r"rounding must be one of "
                       r"\['nearest', 'stochastic'\]"):
        qcoll.quantize(x, rounding=rounding)


@pytest.mark.parametrize("symmetric", [1, 0, "yes", None])
def test_bad_symmetric(x, symmetric):
    with pytest.raises(TypeError, match=r"symmetric must be a bool, got " + re.escape(repr(symmetric))):
        qcoll.quantize(x, symmetric=symmetric)


@pytest.mark.parametrize("seed", [-1, 2**64, 1.0, "1", True])
def test_bad_seed(x, seed):
    with pytest.raises(ValueError, match=r"seed must be None or an int in \[0, 2\*\*64\), got "
                       + re.escape(repr(seed))):
        qcoll.quantize(x, rounding="stochastic", seed=seed)


def test_seed_extremes_accepted(x):
    for seed in (0, 2**64 - 1):
        qcoll.quantize(x, rounding="stochastic", seed=seed)


def test_arguments_are_keyword_only(x):
    with pytest.raises(TypeError):
        qcoll.quantize(x, 8)
    with pytest.raises(TypeError):
        qcoll.dequantize(qcoll.quantize(x), torch.float16)


def test_unsupported_device():
    # meta tensors have a device but no memory: rejected by name before any kernel runs.
    with pytest.raises(ValueError, match=r"x must be on a cpu or cuda device, got meta"):
        qcoll.quantize(torch.empty(16, device="meta"))


@pytest.mark.skipif(qcoll.build_info()["cuda"], reason="this build has CUDA kernels")
def test_cuda_tensor_without_cuda_build():
    from qcoll._device import device_args

    fake = types.SimpleNamespace(device=torch.device("cuda", 0))
    with pytest.raises(ValueError, match=r"x is a CUDA tensor but qcoll was built without CUDA"):
        device_args(fake, "x")
    if torch.cuda.is_available():  # a real CUDA tensor through the public API
        with pytest.raises(ValueError, match=r"x is a CUDA tensor but qcoll was built without"):
            qcoll.quantize(torch.ones(8, device="cuda"))


@pytest.mark.skipif(qcoll.build_info()["cuda"], reason="this build has CUDA kernels")
def test_core_rejects_cuda_pointer_without_cuda_build():
    # The C++ core checks too (device kind 1 = CUDA), whatever the Python layer does.
    with pytest.raises(ValueError, match=r"built without CUDA kernels"):
        _C.quantize(0, 0, 8, 0, 8, True, 0, 0, 0, 0, 0, 0, 1, 0, 0)


@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        (dict(format=5), r"format must be int8 \(0\), int4 \(1\) or fp8_e4m3 \(2\), got code 5"),
        (dict(format=_C.RAW_FORMAT), r"format must be int8"),
        (dict(format=_C.FORMATS["fp8_e4m3"]["code"], symmetric=False),
         r"fp8_e4m3 codes are symmetric only"),
        (dict(group_size=12), r"group_size must be a positive multiple of 8 up to 16777216, got 12"),
        (dict(group_size=MAX_GROUP_SIZE + 8), r"group_size must be a positive multiple of 8"),
        (dict(rounding=2), r"rounding must be nearest \(0\) or stochastic \(1\), got 2"),
        (dict(dtype=3), r"input dtype must be float32, float16 or bfloat16"),
        (dict(n=-1), r"numel must be >= 0, got -1"),
    ],
)
def test_core_validates_arguments(kwargs, pattern):
    args = dict(input=0, dtype=0, n=0, format=0, group_size=256, symmetric=True, rounding=0,
                seed=0, index_base=0, codes=0, scales=0, offsets=0, device_kind=0,
                device_index=0, stream=0)
    args.update(kwargs)
    with pytest.raises(ValueError, match=pattern):
        _C.quantize(**args)


# ---- build_info --------------------------------------------------------------------------------
def test_build_info():
    info = qcoll.build_info()
    assert {"version", "cuda", "cuda_archs", "openmp", "cuda_available"} <= info.keys()
    assert info["version"] == qcoll.__version__
    assert isinstance(info["cuda"], bool) and isinstance(info["openmp"], bool)
    assert isinstance(info["cuda_available"], bool)
    assert isinstance(info["cuda_archs"], list)
    assert all(isinstance(a, int) and a >= 50 for a in info["cuda_archs"])
    if not info["cuda"]:
        assert info["cuda_archs"] == [] and info["cuda_available"] is False
    else:
        assert info["cuda_archs"], "a CUDA build lists the SM versions it was compiled for"
    info["version"] = "changed"
    assert qcoll.build_info()["version"] == qcoll.__version__, "callers get a copy"


# ---- strides and views -------------------------------------------------------------------------
def _strided_views():
    base = make_values(3 * 40 * 24, torch.float32, "normal", 8).reshape(3, 40, 24)
    return {
        "transpose": base.transpose(0, 2),
        "step_slice": base[:, ::3, 1::2],
        "offset_1": base.reshape(-1)[1:],
        "offset_3_odd_len": base.reshape(-1)[3:3 + 999],
        "expand": base[0, 0, :9].reshape(9, 1).expand(9, 13),
        "channels_last": base.reshape(1, 3, 40, 24).contiguous(memory_format=torch.channels_last),
        "permute_select": base.permute(2, 0, 1)[5],
        "scalar": base[1, 2, 3],
    }


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("view", list(_strided_views()))
def test_strided_inputs(view, dtype, bits, symmetric, rounding):
    """Groups are runs of x.reshape(-1), whatever x's strides and storage offset."""
    v = _strided_views()[view].to(dtype) if dtype != torch.float32 else _strided_views()[view]
    kw = dict(bits=bits, group_size=16, symmetric=symmetric, rounding=rounding, seed=3)
    q = qcoll.quantize(v, **kw)
    assert q.shape == v.shape
    ref.assert_matches_reference(q, ref.quantize(v, **kw))
    q_contig = qcoll.quantize(v.contiguous(), **kw)
    assert torch.equal(q.data, q_contig.data) and torch.equal(q.scales, q_contig.scales)
    y = qcoll.dequantize(q)
    assert y.shape == v.shape and y.is_contiguous()
    ref.assert_same_bits(y, ref.dequantize(q))


def test_input_is_not_modified(x):
    x_t = x.t()
    before, stride = x_t.clone(), x_t.stride()
    qcoll.quantize(x_t, bits=4, symmetric=False)
    assert torch.equal(x_t, before) and x_t.stride() == stride


def test_zero_size_and_scalar():
    for shape in [(0,), (2, 0, 3), ()]:
        x = torch.ones(shape) * 3
        for bits in (4, 8):
            q = qcoll.quantize(x, bits=bits, symmetric=False)
            assert q.data.numel() == (x.numel() * bits + 7) // 8
            assert q.scales.numel() == q.offsets.numel() == (1 if shape == () else 0)
            y = qcoll.dequantize(q)
            assert y.shape == x.shape and torch.equal(y, x)


def test_quantized_tensor_fields(x):
    q = qcoll.quantize(x, bits=4, group_size=16, symmetric=False)
    assert isinstance(q, qcoll.QuantizedTensor)
    assert q.data.dtype == torch.uint8 and q.data.numel() == 50
    assert q.scales.dtype == torch.float32 and q.scales.numel() == 7
    assert q.offsets.dtype == torch.float32 and q.offsets.numel() == 7
    assert (q.shape, q.dtype, q.bits, q.group_size) == (x.shape, x.dtype, 4, 16)
    assert q.numel == 100 and not q.symmetric and q.device == torch.device("cpu")
    assert q.nbytes == 50 + 7 * 4 * 2
    q8 = qcoll.quantize(x, group_size=16)
    assert q8.offsets is None and q8.symmetric and q8.nbytes == 100 + 7 * 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.bits = 8


# ---- dequantize: dtype= and out= ------------------------------------------------------------------
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_dequantize_dtype(in_dtype, out_dtype):
    x = make_values(200, in_dtype, "normal", 16)
    q = qcoll.quantize(x, group_size=16, symmetric=False)
    assert qcoll.dequantize(q).dtype == in_dtype
    y = qcoll.dequantize(q, dtype=out_dtype)
    assert y.dtype == out_dtype and y.shape == x.shape
    ref.assert_same_bits(y, ref.dequantize(q, out_dtype))


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_dequantize_out(x, out_dtype):
    q = qcoll.quantize(x, bits=4, group_size=16)
    out = torch.full((100,), float("nan"), dtype=out_dtype)  # flat: any shape with numel ok
    res = qcoll.dequantize(q, out=out)
    assert res is out
    ref.assert_same_bits(out, ref.dequantize(q, out_dtype).reshape(-1))
    out2 = torch.empty(x.shape, dtype=out_dtype)
    assert qcoll.dequantize(q, dtype=out_dtype, out=out2) is out2
    assert torch.equal(out2, out.reshape(x.shape))


def test_dequantize_out_into_a_view(x):
    q = qcoll.quantize(x, group_size=16)
    buf = torch.zeros(300)
    res = qcoll.dequantize(q, out=buf[100:200])
    assert torch.equal(buf[100:200], qcoll.dequantize(q).reshape(-1))
    assert not buf[:100].any() and not buf[200:].any(), "writes stay inside out"
    assert res.data_ptr() == buf[100:].data_ptr()


@pytest.mark.parametrize(
    "make_out,kwargs,exc,pattern",
    [
        (lambda: torch.empty(100, dtype=torch.float16), dict(dtype=torch.float32), ValueError,
         r"out has dtype torch.float16 but dtype=torch.float32 was requested"),
        (lambda: torch.empty(99), {}, ValueError,
         r"out must be a contiguous tensor of 100 elements on cpu, got 99 elements"),
        (lambda: torch.empty(101), {}, ValueError, r"out must be a contiguous tensor of 100"),
        (lambda: torch.empty(25, 4).t(), {}, ValueError, r"\(contiguous=False\)"),
        (lambda: torch.empty(200)[::2], {}, ValueError, r"\(contiguous=False\)"),
        (lambda: torch.empty(100, device="meta"), {}, ValueError, r"100 elements on meta"),
        (lambda: torch.empty(100, dtype=torch.float64), {}, TypeError,
         r"dtype must have dtype float32, float16 or bfloat16, got torch.float64"),
        (lambda: torch.empty(100, dtype=torch.int32), {}, TypeError, r"dtype must have dtype"),
        (lambda: [0.0] * 100, dict(dtype=torch.float32), TypeError, r"out must be a torch.Tensor"),
        (lambda: [0.0] * 100, {}, TypeError, r"out must be a torch.Tensor"),
        (lambda: None, dict(dtype=torch.int8), TypeError, r"dtype must have dtype float32"),
    ],
)
def test_dequantize_bad_out_or_dtype(x, make_out, kwargs, exc, pattern):
    q = qcoll.quantize(x, group_size=16)
    out = make_out()
    with pytest.raises(exc, match=pattern):
        qcoll.dequantize(q, out=out, **kwargs)


# ---- hand-built QuantizedTensors -------------------------------------------------------------------
def _replace(q, **kw):
    return dataclasses.replace(q, **kw)


@pytest.mark.parametrize(
    "field,make,pattern",
    [
        ("data", lambda q: q.data[:-1], r"q.data must be a contiguous torch.uint8 tensor of 50 "
         r"elements for shape \(4, 25\), got torch.uint8 with 49 elements"),
        ("data", lambda q: torch.cat([q.data, q.data[:1]]), r"q.data .* got torch.uint8 with 51"),
        ("data", lambda q: q.data.view(torch.int8), r"q.data must be a contiguous torch.uint8"),
        ("data", lambda q: torch.stack([q.data, q.data], 1)[:, 0], r"q.data must be a contiguous"),
        ("scales", lambda q: q.scales[:-1], r"q.scales must be a contiguous torch.float32 tensor "
         r"of 7 elements .* got torch.float32 with 6 elements"),
        ("scales", lambda q: q.scales.double(), r"q.scales .* got torch.float64 with 7"),
        ("scales", lambda q: torch.empty(0), r"q.scales .* with 0 elements"),
        ("offsets", lambda q: q.offsets[:3], r"q.offsets must be a contiguous torch.float32 "
         r"tensor of 7 elements"),
        ("offsets", lambda q: q.offsets.half(), r"q.offsets .* got torch.float16"),
        ("shape", lambda q: torch.Size([4, 26]), r"q.data must be a contiguous torch.uint8 tensor "
         r"of 52 elements for shape \(4, 26\)"),
        ("shape", lambda q: torch.Size([2, 25]), r"q.data .* of 25 elements"),
        ("group_size", lambda q: 8, r"q.scales .* of 13 elements"),
        ("group_size", lambda q: 12, r"q.group_size must be a positive multiple of 8"),
        ("format", lambda q: 8, r"q.data .* of 100 elements"),
        ("format", lambda q: 3, r"q.format must be 8 / 'int8', 4 / 'int4' or 'fp8_e4m3', got 3"),
        ("format", lambda q: "fp8_e4m3", r"q.offsets must be None: fp8_e4m3 codes are symmetric"),
        ("scales", lambda q: q.scales.to("meta"), r"q.scales is on meta but q.data is on cpu"),
    ],
)
def test_hand_built_quantized_tensor_rejected(x, field, make, pattern):
    q = qcoll.quantize(x, bits=4, group_size=16, symmetric=False)
    bad = _replace(q, **{field: make(q)})
    with pytest.raises(ValueError, match=pattern):
        qcoll.dequantize(bad)


def test_hand_built_quantized_tensor_accepted(x):
    q = qcoll.quantize(x, bits=4, group_size=16, symmetric=False)
    # Equal-sized buffers from elsewhere (e.g. received over the wire) are fine.
    rebuilt = qcoll.QuantizedTensor(q.data.clone(), q.scales.clone(), q.offsets.clone(),
                                    torch.Size([100]), torch.float32, 4, 16)
    assert torch.equal(qcoll.dequantize(rebuilt), qcoll.dequantize(q).reshape(-1))
    # A plain tuple (or list) as the shape works too.
    for shape in [(10, 10), [100]]:
        t = qcoll.QuantizedTensor(q.data, q.scales, q.offsets, shape, torch.float32, 4, 16)
        assert isinstance(t.shape, torch.Size) and t.numel == 100
        assert qcoll.dequantize(t).shape == torch.Size(shape)
    # Dropping the offsets turns it into a symmetric tensor: codes are read as signed.
    sym = _replace(q, offsets=None)
    ref.assert_same_bits(qcoll.dequantize(sym), ref.dequantize(sym))


def test_dequantize_rejects_non_quantized():
    with pytest.raises(TypeError, match=r"q must be a qcoll.QuantizedTensor, got Tensor"):
        qcoll.dequantize(torch.zeros(4))


# ---- quantize(out=...) reuses buffers -------------------------------------------------


def test_quantize_out_reuses_buffers_and_matches_fresh():
    x = torch.randn(1000, 3)
    y = torch.randn(1000, 3) * 5
    q = qcoll.quantize(x, bits=4, group_size=64)
    ptr = q.data.data_ptr()
    r = qcoll.quantize(y, bits=4, group_size=64, out=q)
    fresh = qcoll.quantize(y, bits=4, group_size=64)
    assert r.data.data_ptr() == ptr
    assert torch.equal(r.data, fresh.data) and torch.equal(r.scales, fresh.scales)
    assert r.shape == y.shape and r.dtype == y.dtype


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(bits=8), "out must match"),
        (dict(bits=4, group_size=128), "out must match"),
        (dict(bits=4, symmetric=False), "out must match"),
    ],
)
def test_quantize_out_mismatch_is_rejected(kwargs, match):
    q = qcoll.quantize(torch.randn(1000), bits=4, group_size=64)
    kwargs.setdefault("group_size", 64)
    with pytest.raises(ValueError, match=match):
        qcoll.quantize(torch.randn(1000), out=q, **kwargs)
    with pytest.raises(ValueError, match="out must match"):
        qcoll.quantize(torch.randn(999), bits=4, group_size=64, out=q)
    with pytest.raises(TypeError, match="out must be a qcoll.QuantizedTensor"):
        qcoll.quantize(torch.randn(1000), bits=4, group_size=64, out=torch.zeros(3))

"""Nearest rounding on the CPU reproduces the reference bit for bit: codes byte for byte,
scales and offsets bitwise, and the dequantized output bitwise (in every output dtype)."""

import pytest
import torch

import qcoll
from tests.support import reference as ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
GROUP_SIZES = [8, 16, 24, 256, 4096, 65536]
LENGTHS = [1, 7, 8, 9, 255, 4103]


def check_exact(x, *, bits, group_size, symmetric, out_dtypes=(None,)):
    q = qcoll.quantize(x, bits=bits, group_size=group_size, symmetric=symmetric)
    r = ref.quantize(x, bits=bits, group_size=group_size, symmetric=symmetric)
    ref.assert_matches_reference(q, r)
    for dtype in out_dtypes:
        y = qcoll.dequantize(q, dtype=dtype)
        assert y.shape == x.shape and y.dtype == (dtype or x.dtype)
        ref.assert_same_bits(y, ref.dequantize(r, dtype), f"dequantize(dtype={dtype})")
    return q, r


@pytest.mark.parametrize("kind", ["normal", "grid", "wide"])
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("group_size", GROUP_SIZES)
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nearest_matches_reference(values, dtype, bits, symmetric, group_size, n, kind):
    x = values(n, dtype, kind, group_size, bits, symmetric)
    q, _ = check_exact(x, bits=bits, group_size=group_size, symmetric=symmetric)
    assert q.data.numel() == (n * bits + 7) // 8
    assert q.scales.numel() == -(-n // group_size)


@pytest.mark.parametrize(
    "dtype,bits,symmetric,group_size,kind",
    [
        (torch.float32, 8, True, 65536, "normal"),
        (torch.float32, 4, False, 4096, "wide"),
        (torch.bfloat16, 4, False, 65536, "grid"),
        (torch.float16, 8, True, 24, "normal"),
    ],
    ids=str,
)
def test_nearest_matches_reference_large(values, dtype, bits, symmetric, group_size, kind):
    # Large enough for the multi-threaded path, with a short final group.
    n = 1000003
    x = values(n, dtype, kind, group_size, bits, symmetric)
    check_exact(x, bits=bits, group_size=group_size, symmetric=symmetric)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dequantize_to_every_dtype(values, dtype, bits, symmetric, out_dtype):
    x = values(1000, dtype, "normal", 16, bits, symmetric)
    check_exact(x, bits=bits, group_size=16, symmetric=symmetric, out_dtypes=(out_dtype,))


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_subnormal_inputs(values, dtype, bits, symmetric, out_dtype):
    # Subnormal inputs, subnormal scales and scales that underflow to 0.
    x = values(4000, dtype, "tiny", 8, bits, symmetric)
    check_exact(x, bits=bits, group_size=8, symmetric=symmetric, out_dtypes=(out_dtype,))


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("bits", [4, 8])
def test_subnormal_outputs(bits, symmetric, out_dtype):
    # fp32 values whose dequantized values fall in the output dtype's subnormal range,
    # where the fp32 -> fp16/bf16 rounding is easiest to get wrong.
    e = {torch.float16: -18.0, torch.bfloat16: -127.0}[out_dtype]
    x = torch.randn(4000, generator=torch.Generator().manual_seed(bits)) * 2**e
    check_exact(x, bits=bits, group_size=8, symmetric=symmetric, out_dtypes=(out_dtype,))


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("bits", [4, 8])
def test_default_group_size_is_256(values, bits, symmetric):
    x = values(700, torch.float32, "normal", 256)
    q = qcoll.quantize(x, bits=bits, symmetric=symmetric)
    assert q.group_size == qcoll.DEFAULT_GROUP_SIZE == 256
    ref.assert_matches_reference(q, ref.quantize(x, bits=bits, group_size=256, symmetric=symmetric))


def test_max_group_size_is_one_group(values):
    x = values(1000, torch.float32, "normal", 1000)
    check_exact(x, bits=8, group_size=qcoll.quantization.MAX_GROUP_SIZE, symmetric=False)


@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 5), (1,), (2, 3, 5), (4, 1, 33)])
@pytest.mark.parametrize("bits", [4, 8])
def test_shapes(values, shape, bits):
    n = torch.Size(shape).numel()
    x = values(n, torch.float32, "normal", 8).reshape(shape)
    q, _ = check_exact(x, bits=bits, group_size=8, symmetric=True)
    assert q.shape == torch.Size(shape)
    assert qcoll.dequantize(q).shape == torch.Size(shape)


def test_int4_layout_by_hand():
    # absmax 7 -> scale 1: codes are the values; element 2k low nibble, 2k+1 high nibble,
    # two's complement; the odd tail leaves the high nibble 0.
    x = torch.tensor([1.0, -1.0, 7.0, -7.0, 0.0, 3.0, -2.0, 5.0, 6.0])
    q = qcoll.quantize(x, bits=4, group_size=16)
    assert q.scales.tolist() == [1.0]
    assert q.data.tolist() == [0xF1, 0x97, 0x30, 0x5E, 0x06]


def test_int8_asymmetric_layout_by_hand():
    x = torch.tensor([-10.0, 245.0, 0.0, 100.0, -9.0])  # lo -10, hi 245: scale 1, offset -10
    q = qcoll.quantize(x, bits=8, group_size=8, symmetric=False)
    assert q.scales.tolist() == [1.0] and q.offsets.tolist() == [-10.0]
    assert q.data.tolist() == [0, 255, 10, 110, 1]
    assert torch.equal(qcoll.dequantize(q), x)

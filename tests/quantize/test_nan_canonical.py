"""NaN bytes on the wire and in outputs: every value the kernels compute is stored with CUDA's
canonical NaN (0x7fffffff in fp32, 0x7fff in fp16/bf16), which GPU arithmetic produces and
x86 does not (it keeps the operand's payload and sign), so CPU and GPU ranks put the same
bytes on the wire and write the same outputs. Raw copies of the input keep their payload.
The emulator tests (test_cuda_emu.py) then hold the CUDA kernels to the same bytes."""

from __future__ import annotations

import pytest
import torch

import qcoll
from tests.quantize.test_wire import DTYPES, make_sources, out_spec, run_encode, run_reduce

CANONICAL = {torch.float32: 0x7FFFFFFF, torch.float16: 0x7FFF, torch.bfloat16: 0x7FFF}
INT = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def _bits(values: torch.Tensor) -> torch.Tensor:
    return values.view(INT[values.dtype]).to(torch.int64) & (0xFFFFFFFF if values.element_size() == 4 else 0xFFFF)


def _assert_nans_canonical(values: torch.Tensor, what: str):
    nan = torch.isnan(values)
    assert nan.any(), f"{what}: the case has no NaN"
    got = set(_bits(values[nan]).tolist())
    assert got == {CANONICAL[values.dtype]}, f"{what}: NaN bits {sorted(map(hex, got))}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("in_bits", [0, 8])
def test_reduce_raw_output_stores_the_canonical_nan(dtype, in_bits):
    n, gs, sources, outputs = 100, 24, 3, 1
    buf, ss, os_ = make_sources(outputs, sources, n, in_bits, gs, dtype, False, 0, "nan-bits",
                                nan_at=(0, 2, 30))
    out, _ = out_spec("wire0", dtype, n, gs, outputs, dtype)
    got = run_reduce(buf, in_bits, gs, dtype, n, sources, ss, outputs, os_, 3.0, out)
    _assert_nans_canonical(got[: n * dtype.itemsize].view(dtype), f"reduce in {in_bits} -> raw")
    for values_dtype in DTYPES:
        out, _ = out_spec("values", dtype, n, gs, outputs, values_dtype)
        got = run_reduce(buf, in_bits, gs, dtype, n, sources, ss, outputs, os_, 3.0, out)
        _assert_nans_canonical(got[:n], f"reduce in {in_bits} -> {values_dtype}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dequantize_of_a_nan_group_stores_the_canonical_nan(dtype):
    x = torch.randn(64).to(dtype)
    x[5] = -float("nan")  # negative NaN: x86 keeps the sign through arithmetic
    q = qcoll.quantize(x, bits=8, group_size=16)
    for out_dtype in DTYPES:
        _assert_nans_canonical(qcoll.dequantize(q, dtype=out_dtype), f"dequantize {out_dtype}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_raw_encode_copies_nan_payloads(dtype):
    x = torch.randn(40).to(dtype)
    payload = {torch.float32: 0x7FC01234, torch.float16: 0x7E05, torch.bfloat16: 0x7FC5}[dtype]
    x.view(INT[dtype])[7] = payload - (1 << 32 if payload >= 1 << 31 else 0)
    chunk, _ = run_encode(x, 40, 0, 40, 1, 0, 1, 0, 8)
    assert int(_bits(chunk[: 40 * dtype.itemsize].view(dtype))[7]) == payload

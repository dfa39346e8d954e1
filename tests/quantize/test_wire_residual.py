"""Error feedback inside the fused dequantize-reduce-quantize (ReduceArgs::residual, wire.h):
the CPU kernel against an independent reference. The value coded is the sum (Hadamard-
transformed where the reduce transforms) plus the old residual; the new residual is that
value minus what a receiver decodes, and 0 in a group whose codes are all zero (here: a
non-finite group). tests/support/cuda_cases.py compares the CUDA kernels with this CPU kernel.
"""

from __future__ import annotations

import pytest
import torch

from tests.support import reference as ref
from tests.support.values import generator
from tests.quantize.test_wire import (CPU, GARBAGE, _C, chunk_bytes, decode_chunk, make_sources, ref_chunk,
                       reference_sum, wire_code, CODE)

# (in bits, in hadamard, out bits, out hadamard, n, group size, hadamard size): every code
# format out; the domains of wire.h (none, forward, transformed sums); packet, group and
# Hadamard-block tails; groups past the CPU's stack block and a team (split path on the GPU).
RESIDUAL_CASES = [
    (8, 0, 4, 0, 1000, 24, 0),
    (8, 0, 4, 0, 13, 8, 0),
    (4, 0, 8, 0, 1000, 256, 0),
    (8, 0, ref.FP8, 0, 1000, 24, 0),
    (0, 0, 4, 0, 1001, 8, 0),
    (ref.FP8, 0, ref.FP8, 0, 13, 8, 0),
    (8, 0, 4, 1, 1000, 64, 64),   # forward transform before the re-encode
    (8, 1, 4, 1, 1003, 256, 32),  # transformed sums, partial last block
    (0, 0, 8, 1, 9001, 4096, 256),
    (8, 0, 4, 0, 9001, 4096, 0),
    (4, 1, ref.FP8, 1, 9001, 4096, 128),
    (8, 0, 4, 0, 20011, 16384, 0),        # groups past a GPU team: the split path
    (0, 0, 8, 1, 20000, 16384, 256),
]
IDS = [f"{ib}h{ih}-{ob}h{oh}-{n}-{gs}-{h}" for ib, ih, ob, oh, n, gs, h in RESIDUAL_CASES]

# (sources, outputs, divisor, dtype, source-major, slack bytes, residual stride slack)
LAYOUTS = [(2, 3, 1.0, torch.bfloat16, True, 16, 5), (4, 1, 4.0, torch.float32, False, 0, 0)]


def make_case(in_bits, n, gs, layout, seed, nan=True):
    """Source chunks (one NaN in output 0 when nan), and an old residual of the chunks'
    scale: (buf, source_stride, output_stride, residual, residual_stride)."""
    sources, outputs, _, dtype, source_major, slack, res_slack = layout
    buf, ss, os_ = make_sources(outputs, sources, n, in_bits, gs, dtype, source_major, slack,
                                seed, nan_at=(0, sources - 1, n // 2) if nan else None)
    stride = n + res_slack
    residual = torch.randn(outputs * stride, generator=generator("res", seed)) * 0.05
    return buf, ss, os_, residual, stride


def run_reduce_residual(buf, in_bits, gs, dtype, n, sources, ss, outputs, os_, divisor, out_bits,
                        residual, residual_stride, in_h=0, out_h=0, device=CPU, lib=_C,
                        out_wire=None):
    """Runs the reduce into quantized chunks with error feedback; residual is updated in
    place. Returns (chunks, chunk stride)."""
    stride = chunk_bytes(out_bits, gs, dtype, n) + (16 if outputs > 1 else 0)
    if out_wire is None:
        out_wire = torch.full((outputs * stride,), GARBAGE, dtype=torch.uint8, device=buf.device)
    lib.reduce_chunks(buf.data_ptr(), wire_code(in_bits), gs, CODE[dtype], n, sources, ss, outputs,
                      os_, divisor, out_wire.data_ptr(), wire_code(out_bits), stride, 0, 0, 0,
                      *device, in_hadamard=in_h, out_hadamard=out_h, residual=residual.data_ptr(),
                      residual_stride=residual_stride)
    return out_wire, stride


def expected(sums, residual, residual_stride, out_bits, gs, n, transform):
    """(chunks, new residual) of the contract, from the fp32 sums."""
    chunks, new = [], residual.clone()
    for o, s in enumerate(sums):
        old = residual[o * residual_stride: o * residual_stride + n]
        v = (ref.hadamard(s, transform) if transform else s) + old
        c = ref_chunk(v, out_bits, gs)
        r = v - decode_chunk(c, out_bits, gs, torch.float32, n)
        groups = v.reshape(-1)
        for g in range(0, n, gs):  # all-zero codes (non-finite or +-0 groups) keep nothing
            if not torch.isfinite(groups[g:g + gs]).all() or (groups[g:g + gs] == 0).all():
                r[g:g + gs] = 0.0
        new[o * residual_stride: o * residual_stride + n] = r
        chunks.append(c)
    return chunks, new


@pytest.mark.parametrize("layout", range(len(LAYOUTS)))
@pytest.mark.parametrize("in_bits,in_h,out_bits,out_h,n,gs,h", RESIDUAL_CASES, ids=IDS)
def test_reduce_residual_matches_reference(in_bits, in_h, out_bits, out_h, n, gs, h, layout):
    sources, outputs, divisor, dtype, *_ = LAYOUTS[layout]
    buf, ss, os_, residual, rstride = make_case(in_bits, n, gs, LAYOUTS[layout],
                                                ("res", in_bits, out_bits, n, gs, h, layout))
    old = residual.clone()
    got, stride = run_reduce_residual(buf, in_bits, gs, dtype, n, sources, ss, outputs, os_, divisor,
                                      out_bits, residual, rstride, in_h=h if in_h else 0,
                                      out_h=h if out_h else 0)
    sums = reference_sum(buf, outputs, sources, ss, os_, n, in_bits, gs, dtype, divisor)
    transform = h if bool(in_h) != bool(out_h) else 0  # equal domains are summed as they are
    chunks, want = expected(sums, old, rstride, out_bits, gs, n, transform)
    for o, c in enumerate(chunks):
        ref.assert_same_bytes(got[o * stride: o * stride + c.numel()], c, f"chunk {o}")
    ref.assert_same_bits(residual, want, "residual")
    # The padding between rows is never touched.
    for o in range(outputs):
        tail = slice(o * rstride + n, (o + 1) * rstride)
        ref.assert_same_bits(residual[tail], old[tail], "residual padding")


def test_residual_needs_a_quantized_out_wire():
    n, gs = 64, 8
    buf, ss, os_ = make_sources(1, 2, n, 8, gs, torch.float32, False, 0, ("res-bad",))
    residual = torch.zeros(n)
    raw = torch.zeros(chunk_bytes(0, gs, torch.float32, n), dtype=torch.uint8)
    values = torch.zeros(n)
    with pytest.raises(ValueError, match="residual.*quantized out_wire"):
        _C.reduce_chunks(buf.data_ptr(), wire_code(8), gs, CODE[torch.float32], n, 2, ss, 1, os_,
                         1.0, raw.data_ptr(), wire_code(0), raw.numel(), 0, 0, 0, *CPU,
                         residual=residual.data_ptr())
    with pytest.raises(ValueError, match="residual.*quantized out_wire"):
        _C.reduce_chunks(buf.data_ptr(), wire_code(8), gs, CODE[torch.float32], n, 2, ss, 1, os_,
                         1.0, 0, 0, 0, values.data_ptr(), CODE[torch.float32], n, *CPU,
                         residual=residual.data_ptr())
    out = torch.zeros(2 * chunk_bytes(4, gs, torch.float32, n), dtype=torch.uint8)
    with pytest.raises(ValueError, match="residual_stride"):
        _C.reduce_chunks(buf.data_ptr(), wire_code(8), gs, CODE[torch.float32], n, 1, ss, 2, os_,
                         1.0, out.data_ptr(), wire_code(4), out.numel() // 2, 0, 0, 0, *CPU,
                         residual=residual.data_ptr(), residual_stride=n - 1)

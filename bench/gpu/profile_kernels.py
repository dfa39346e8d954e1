"""The CUDA kernels that miss their targets most, each launched once at 256 MB, for Nsight
Compute (ncu) to profile: run.sh's `ncu_kernels` step runs

    ncu --clock-control none --set full -k regex:'team_kernel|elementwise_kernel' \
        python3 bench/gpu/profile_kernels.py

Each case runs once untimed first (module load, allocations), then once with its name printed
between markers, so the report's kernels can be matched to the cases in order: per case, the
second of its two launches is the one to read (ncu's --launch-skip cannot tell them apart).
The calls are those of the `kernels` suite (bench/suites/kernels.py), on fresh random data.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: its suites and timing

import qcoll  # noqa: E402
from qcoll import _C  # noqa: E402
from qcoll._dtypes import DTYPE_CODES as CODES  # noqa: E402
from qcoll._formats import format_code  # noqa: E402
from suites.kernels import _dev_args, _wire_sources  # noqa: E402

NBYTES = 256 << 20
DEV = torch.device("cuda")


def quantize(dtype, bits):
    x = torch.randn(NBYTES // dtype.itemsize, device=DEV).to(dtype)
    q = qcoll.quantize(x, bits=bits)
    return lambda: qcoll.quantize(x, bits=bits, out=q)


def dequantize(dtype, bits):
    x = torch.randn(NBYTES // dtype.itemsize, device=DEV).to(dtype)
    q = qcoll.quantize(x, bits=bits)
    out = torch.empty_like(x)
    return lambda: qcoll.dequantize(q, out=out)


def reduce_requant(sources, in_bits=8, out_bits=4):
    n, gs = NBYTES // 4, qcoll.DEFAULT_GROUP_SIZE
    (buf,), chunk = _wire_sources(n, sources, in_bits, DEV, 1)
    out_chunk = _C.wire_chunk_bytes(format_code(out_bits), gs, 0, n)
    out = torch.empty(out_chunk, dtype=torch.uint8, device=DEV)
    return lambda: _C.reduce_chunks(buf.data_ptr(), format_code(in_bits), gs, 0, n, sources, chunk, 1, 0, 1.0,
                                    out.data_ptr(), format_code(out_bits), out_chunk, 0, 0, 0, *_dev_args(DEV))


def reduce_values(dtype, sources=2, in_bits=4):
    n, gs = NBYTES // dtype.itemsize, qcoll.DEFAULT_GROUP_SIZE
    (buf,), chunk = _wire_sources(n, sources, in_bits, DEV, 1)
    out = torch.empty(n, dtype=dtype, device=DEV)
    return lambda: _C.reduce_chunks(buf.data_ptr(), format_code(in_bits), gs, CODES[dtype], n, sources, chunk,
                                    1, 0, float(sources), 0, 0, 0, out.data_ptr(), CODES[dtype], n,
                                    *_dev_args(DEV))


CASES = {
    "quantize int8 fp32": lambda: quantize(torch.float32, 8),
    "quantize int8 bf16": lambda: quantize(torch.bfloat16, 8),
    "dequantize int8 bf16": lambda: dequantize(torch.bfloat16, 8),
    "dq-reduce-q int8x2->int4": lambda: reduce_requant(2),
    "dq-reduce int4x2 -> bf16": lambda: reduce_values(torch.bfloat16),
}


def main() -> None:
    only = sys.argv[1:]
    for name, make in CASES.items():
        if only and name not in only:
            continue
        call = make()
        call()
        torch.cuda.synchronize()
        print(f"=== case: {name}", flush=True)
        call()
        torch.cuda.synchronize()
        del call
        torch.cuda.empty_cache()
    print("=== done", flush=True)


if __name__ == "__main__":
    main()

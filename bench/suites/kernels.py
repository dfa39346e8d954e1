"""`kernels` suite: GB/s of each qcoll kernel next to the copy bandwidth of the same
device, measured in the same run (bytes read + bytes written over time)."""

from __future__ import annotations

import torch

import qcoll
from timing import copies_for, human_bytes, median_seconds, size_ladder

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _devices() -> list:
    devs = [torch.device("cpu")]
    if torch.cuda.is_available() and qcoll.build_info()["cuda_available"]:
        devs.append(torch.device("cuda"))
    return devs


def _copy_gbps(nbytes: int, device: torch.device) -> float:
    n = nbytes // 4
    rot = copies_for(nbytes)
    srcs = [torch.randn(n, device=device) for _ in range(rot)]
    dst = torch.empty(n, device=device)
    t = median_seconds(lambda i: dst.copy_(srcs[i]), device, rotate=rot)
    return 2 * n * 4 / t / 1e9


def _kernel_rows(nbytes: int, device: torch.device, dtype_name: str, bits: int):
    dtype = DTYPES[dtype_name]
    n = nbytes // torch.empty((), dtype=dtype).element_size()
    rot = copies_for(nbytes)
    xs = [torch.randn(n, device=device).to(dtype) for _ in range(rot)]
    qs = [qcoll.quantize(x, bits=bits) for x in xs]
    out = torch.empty(n, dtype=dtype, device=device)
    q_bytes = qs[0].nbytes
    # Reused output buffers: time the kernel, not the allocator's fresh pages.
    t_q = median_seconds(lambda i: qcoll.quantize(xs[i], bits=bits, out=qs[i]), device, rotate=rot)
    t_dq = median_seconds(lambda i: qcoll.dequantize(qs[i], out=out), device, rotate=rot)
    moved = nbytes + q_bytes  # read input + write codes/scales (and the reverse)
    yield f"quantize int{bits}", moved / t_q / 1e9
    yield f"dequantize int{bits}", moved / t_dq / 1e9


def run(quick: bool, progress) -> dict:
    rows = []
    sizes = size_ladder(64 << 10, 256 << 20, quick)
    devices = _devices()
    total = len(devices) * len(sizes)
    task = progress.add_task("kernels", total=total)
    for device in devices:
        for nbytes in sizes:
            copy = _copy_gbps(nbytes, device)
            rows.append(dict(device=device.type, kernel="copy", dtype="fp32", bytes=nbytes,
                             gbps=copy, frac_of_copy=1.0))
            for dtype_name in DTYPES:
                for bits in (8, 4):
                    for kernel, gbps in _kernel_rows(nbytes, device, dtype_name, bits):
                        rows.append(dict(device=device.type, kernel=kernel, dtype=dtype_name,
                                         bytes=nbytes, gbps=gbps, frac_of_copy=gbps / copy))
            progress.advance(task)
    return {"rows": rows, "group_size": qcoll.DEFAULT_GROUP_SIZE}


def table(result: dict) -> list:
    lines = [f"{'device':6} {'kernel':16} {'dtype':5} {'size':>9} {'GB/s':>8} {'of copy':>8}"]
    for r in result["rows"]:
        lines.append(f"{r['device']:6} {r['kernel']:16} {r['dtype']:5} {human_bytes(r['bytes']):>9} "
                     f"{r['gbps']:8.2f} {r['frac_of_copy']:8.0%}")
    return lines

"""Where a CUDA kernel call's fixed cost goes: run.sh's `trace_calls` step.

At 256 MB and 1 GB the `kernels` suite's fp32 encode/decode times fit a straight line with
about 32 us per call that does not grow with size. The suite times one call between two CUDA
events, so that fixed part can be the host's own work before the launch (the GPU idles while
Python validates and plans), a second kernel or memset per call, or the kernel's own tail. Per
case and size this prints and records (JSON to argv[1]):

  host_us     the call's own wall time on the host, the GPU kept busy (no sync): launch cost
  event_us    the suite's measure: events around one call on an idle GPU
  queued_us   events around 20 calls queued back to back, per call: host cost hidden
  kernels     the CUDA activities of one call (torch.profiler): name, count, device us
  copy        the same for torch's copy of the same bytes (the suite's ceiling)
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

import qcoll

DEV = torch.device("cuda")
SIZES = {"1M": 1 << 20, "256M": 256 << 20, "1G": 1 << 30}


def cases(nbytes: int) -> dict:
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(nbytes // dtype.itemsize, device=DEV).to(dtype)
        q = qcoll.quantize(x, bits=8)
        y = torch.empty_like(x)
        name = str(dtype).replace("torch.", "")
        out[f"quantize int8 {name}"] = (lambda x=x, q=q: qcoll.quantize(x, bits=8, out=q))
        out[f"dequantize int8 {name}"] = (lambda q=q, y=y: qcoll.dequantize(q, out=y))
    src = torch.randn(nbytes // 4, device=DEV)
    dst = torch.empty_like(src)
    out["copy fp32"] = lambda: dst.copy_(src)
    return out


def event_us(fn, n: int = 15) -> float:
    times = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def queued_us(fn, calls: int = 20) -> float:
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        for _ in range(calls):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(times)


def host_us(fn, calls: int = 20) -> float:
    """The call's host time with the GPU busy: a long sleep kernel queued first keeps the
    launch queue from draining, so no call waits on the device."""
    times = []
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e8))  # ~0.1 s of GPU cycles ahead of the calls
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def kernels(fn) -> list:
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        dev_us = getattr(e, "device_time_total", None)
        if dev_us is None:
            dev_us = getattr(e, "cuda_time_total", 0)
        if dev_us and e.count:
            rows.append({"name": e.key[:90], "count_per_call": e.count / 3,
                         "device_us_per_call": dev_us / 3,
                         "cpu_us_per_call": e.cpu_time_total / 3})
    return sorted(rows, key=lambda r: -r["device_us_per_call"])[:8]


def main() -> None:
    results = []
    for size, nbytes in SIZES.items():
        for name, fn in cases(nbytes).items():
            for _ in range(3):
                fn()
            row = {"case": name, "size": size, "host_us": host_us(fn), "event_us": event_us(fn),
                   "queued_us": queued_us(fn)}
            try:
                row["kernels"] = kernels(fn)
            except Exception as e:  # the profiler is a diagnosis, not the measurement
                row["kernels"] = f"profiler failed: {e!r}"
            results.append(row)
            print(f"{size:>5} {name:<24} host {row['host_us']:8.1f} us  event {row['event_us']:9.1f} us"
                  f"  queued {row['queued_us']:9.1f} us", flush=True)
            if isinstance(row["kernels"], list):
                for k in row["kernels"]:
                    print(f"        {k['count_per_call']:4.1f}x {k['device_us_per_call']:9.1f} us dev"
                          f" {k['cpu_us_per_call']:8.1f} us cpu  {k['name']}", flush=True)
        torch.cuda.empty_cache()
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()

"""Timing helpers shared by every benchmark suite: warm-up, median of repeats, device
events on CUDA, and buffer rotation so that caches do not flatter the numbers."""

from __future__ import annotations

import os
import statistics
import time
from typing import Callable, Sequence

import torch

# Rotate through this many bytes of inputs per timed call: larger than any LLC/L2 here.
ROTATE_BYTES = 256 << 20


def copies_for(nbytes: int) -> int:
    """How many distinct input buffers to rotate through for a kernel reading nbytes."""
    return max(1, min(16, ROTATE_BYTES // max(nbytes, 1)))


def median_seconds(fn: Callable[[int], None], device: torch.device, *, warmup: int = 3,
                   repeats: int = 15, rotate: int = 1) -> float:
    """Median wall time of fn(i) (i picks the rotated buffer) over `repeats` calls."""
    for i in range(warmup):
        fn(i % rotate)
    times = []
    if device.type == "cuda":
        for i in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(i % rotate)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for i in range(repeats):
            t0 = time.perf_counter()
            fn(i % rotate)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _clock(fn, i: int, device: torch.device) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(i)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn(i)
    return time.perf_counter() - t0


def paired_median_seconds(fn: Callable[[int], None], ref: Callable[[int], None], device: torch.device, *,
                          warmup: int = 3, min_repeats: int = 15, max_repeats: int = 200,
                          min_seconds: float = 0.1, rotate: int = 1) -> tuple:
    """Median times of fn(i) and ref(i), called alternately (fn, ref, fn, ref, ...), so that
    a machine whose load drifts (other jobs on a shared host) slows both alike and their
    ratio stays meaningful. Repeats until min_seconds of fn have run (at least min_repeats,
    at most max_repeats)."""
    for i in range(warmup):
        fn(i % rotate)
        ref(i % rotate)
    a, b = [], []
    i = 0
    while i < max_repeats and (i < min_repeats or sum(a) < min_seconds):
        a.append(_clock(fn, i % rotate, device))
        b.append(_clock(ref, i % rotate, device))
        i += 1
    return statistics.median(a), statistics.median(b)


def balanced_sequence(n: int) -> list:
    """The order of turns of n calls, as a cycle to repeat: every call follows every other
    call exactly once per cycle (n x (n - 1) turns, each call n - 1 of them; never itself),
    also across the cycle's end: an Eulerian circuit of the complete directed graph
    (Hierholzer's algorithm). Timing in rounds (a, b, c, a, b, c) leaves what one call
    leaves behind (warm or spinning threads, socket state) always on the same next call;
    with the sizes suite's four (qcoll's and torch's call at 2 and 1 threads), torch's
    2-thread 256 KB all-reduce, whose OpenMP threads spin on the oversubscribed host, always
    came just before a qcoll block, and its first call took 11-13 ms against 4.5
    (bench/results/probe-suite-order-cpu.txt)."""
    if n == 1:
        return [0]
    # Each call's successors in turn from the next one on (v+1, v+2, ...): the walk then
    # spreads every call over the cycle (for 4: 0 1 2 3 0 2 0 3 1 3 2 1) instead of taking
    # one call's turns first.
    successors = [[(v + k) % n for k in range(1, n)] for v in range(n)]
    stack, circuit = [0], []
    while stack:
        v = stack[-1]
        if successors[v]:
            stack.append(successors[v].pop(0))
        else:
            circuit.append(stack.pop())
    return circuit[::-1][:-1]  # closed at 0: the last step back to the start is the cycle's end


def human_bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    return str(n)


def size_ladder(lo: int, hi: int, quick: bool) -> Sequence[int]:
    """Byte sizes from lo to hi, x4 apart (x16 with --quick)."""
    step = 16 if quick else 4
    sizes, s = [], lo
    while s <= hi:
        sizes.append(s)
        s *= step
    return sizes


def parse_sizes(text: str) -> list:
    """'64K,4M,1G' or '65536' -> byte counts (K/M/G are powers of 1024)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    sizes = []
    for part in text.split(","):
        part = part.strip().upper().removesuffix("B")
        scale = units.get(part[-1:], 1)
        value = part[:-1] if part[-1:] in units else part
        try:
            sizes.append(int(float(value) * scale))
        except ValueError:
            raise ValueError(f"bad size {part!r}: use bytes, or a number with K, M or G") from None
    if not sizes or min(sizes) <= 0:
        raise ValueError("sizes must be positive")
    return sizes


def _busy_seconds() -> float:
    """CPU seconds the whole machine spent busy (user, nice, system, irq, softirq, steal)."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return 0.0
    return (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    t = os.times()
    return t.user + t.system


class OtherLoad:
    """Cores' worth of CPU that other processes (and the hypervisor: steal) used while the
    block ran: ~0 on a quiet machine. `with OtherLoad() as load: ...; load.cores`."""

    def __enter__(self):
        self.t0, self.busy0, self.own0 = time.perf_counter(), _busy_seconds(), _own_seconds()
        return self

    def __exit__(self, *exc):
        wall = max(time.perf_counter() - self.t0, 1e-9)
        others = (_busy_seconds() - self.busy0) - (_own_seconds() - self.own0)
        self.cores = max(0.0, others / wall)
        return False


def wait_for_quiet(max_cores: float = 0.25, timeout: float = 60.0, sample: float = 0.5) -> float:
    """Sleep until other processes use less than max_cores (sampled over `sample` s), at
    most `timeout` s; returns the last sample."""
    deadline = time.monotonic() + timeout
    while True:
        with OtherLoad() as load:
            time.sleep(sample)
        if load.cores < max_cores or time.monotonic() > deadline:
            return load.cores


def cpuinfo_field(name: str) -> str:
    """The first value of `name` in /proc/cpuinfo ("" where absent or unreadable)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(name):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""

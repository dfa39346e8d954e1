"""What a stalled call's time went to, as far as this machine can tell (the sizes suite).

Three causes outside the collective's code were found to stall single calls on the 2-core
VM (bench/results/probe-stalls-cpu.txt), and each leaves a trace read here:
- steal: the hypervisor ran something else on this VM's cores (/proc/stat's steal column);
- a full (generation 2) collection of Python's garbage collector in one rank: 60-150 ms with
  torch imported, during which its peers wait (gc.callbacks);
- TCP's delayed ACK: the first exchange after a pause waits ~40-50 ms for an ACK the peer's
  kernel holds back (TcpExt DelayedACKs in /proc/net/netstat; on loopback the route attribute
  `quickack 1` removes these stalls, torch's calls included).
"""

from __future__ import annotations

import gc
import os
import time

_TICK = os.sysconf("SC_CLK_TCK")


def steal_seconds() -> float:
    """CPU seconds the hypervisor took from this VM's cores since boot (0 where unknown)."""
    try:
        with open("/proc/stat") as f:
            return int(f.readline().split()[8]) / _TICK
    except (OSError, ValueError, IndexError):
        return 0.0


def delayed_acks() -> int:
    """ACKs this network namespace's TCP sent only when its delayed-ACK timer fired."""
    try:
        with open("/proc/net/netstat") as f:
            lines = f.read().split("\n")
    except OSError:
        return 0
    for names, values in zip(lines[::2], lines[1::2]):
        if names.startswith("TcpExt:"):
            table = dict(zip(names.split()[1:], values.split()[1:]))
            return int(table.get("DelayedACKs", 0))
    return 0


class FullCollections:
    """Records when this process's garbage collector ran a full collection (perf_counter
    seconds), to tell which timed calls one overlapped. Use as a context manager."""

    def __init__(self):
        self.spans: list = []
        self._start = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.spans.append((self._start, time.perf_counter()))

    def __enter__(self):
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self._callback)
        return False

    def overlapping(self, starts: list, ends: list) -> list:
        """1.0 for each call [start, end) a full collection overlapped, else 0.0."""
        return [1.0 if any(s < e and b > a for a, b in self.spans) else 0.0
                for s, e in zip(starts, ends)]

"""The bounded probe that measures a group's CostModel (see qcoll.cost).

Every rank runs each measure at the same time (the links are measured while every rank
sends, as in a call), and every time is reduced to the slowest rank's before it becomes a
rate: the ranks end with identical numbers."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from . import cost as cm
from ._runtime import call
from ._formats import FORMATS
from .quantization import dequantize, quantize


def agreed_max(group, values: list, device: torch.device) -> list:
    """The element-wise maximum of `values` over the group's ranks."""
    if group.size == 1:
        return list(values)
    call.drain(group)
    t = torch.tensor(values, dtype=torch.float64, device=device if device.type == "cuda" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group.pg)
    return t.tolist()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_time(fn, device: torch.device) -> float:
    """The fastest of a few timed calls after a warm-up: on a machine shared with other
    jobs the fastest is the call's own cost, the others carry their interference."""
    fn()  # warm-up (first-use allocations, connections)
    times = []
    for _ in range(cm._REPEATS):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return min(times)


def _link(group, tier, device: torch.device, deadline: float) -> cm.Link:
    """The tier's Link from raw all-gathers over `tier` (the node's or the column's group),
    which every rank of `group` runs at once: a tiny one (latency), then growing ones."""
    from .all_gather import quantized_allgather

    def gather_time(nbytes: int) -> float:
        src = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        dst = torch.empty(nbytes * tier.size, dtype=torch.uint8, device=device)
        t = _best_time(lambda: quantized_allgather(dst, src, tier, bits=None), device)
        return agreed_max(group, [t], device)[0]

    latency = gather_time(cm._LATENCY_BYTES)
    nbytes = cm._START_BYTES
    while True:
        t = gather_time(nbytes)
        # The deadline is compared on the agreed time, so every rank stops at the same size.
        over = agreed_max(group, [float(time.monotonic() > deadline)], device)[0]
        if t >= cm._TARGET_S or nbytes >= cm._MAX_BYTES or over:
            break
        nbytes *= 4
    sent = (tier.size - 1) * nbytes
    return cm.Link(bandwidth=sent / max(t - latency, t / 10), latency=latency)


def _kernel_times(fmt: str, n: int, device: torch.device) -> tuple:
    x = torch.randn(n, device=device)
    if fmt == cm.RAW:
        buf, acc = torch.empty_like(x), torch.zeros_like(x)
        return (_best_time(lambda: buf.copy_(x), device), _best_time(lambda: acc.add_(x), device))
    q = quantize(x, bits=fmt)
    out = torch.empty_like(x)
    return (_best_time(lambda: quantize(x, bits=fmt, out=q), device),
            _best_time(lambda: dequantize(q, out=out), device))


def _kernels(group, device: torch.device, deadline: float) -> dict:
    n = cm._KERNEL_START
    while True:
        times = []
        for fmt in cm._PROBE_FORMATS:
            times += _kernel_times(fmt, n, device)
        times = agreed_max(group, times, device)
        over = agreed_max(group, [float(time.monotonic() > deadline)], device)[0]
        if min(times) * 20 >= cm._TARGET_S or n >= cm._KERNEL_MAX or over:
            break
        n *= 4
    return {fmt: cm.KernelRate(encode=n / times[2 * i], decode=n / times[2 * i + 1])
            for i, fmt in enumerate(cm._PROBE_FORMATS)}


def probe(group, device: torch.device, budget_s: float) -> cm.CostModel:
    """Measure `group`'s CostModel on `device` (collective: every rank calls it)."""
    assert set(cm._PROBE_FORMATS) == set(FORMATS) | {cm.RAW}
    start = time.monotonic()
    tiers = [("intra", group.node_size > 1), ("inter", group.num_nodes > 1)]
    share = budget_s / (sum(need for _, need in tiers) + 1)  # links and kernels share the budget
    links = {}
    for tier, needed in tiers:
        if needed:
            sub = group.intra if tier == "intra" else group.inter
            links[tier] = _link(group, sub, device, start + share * (len(links) + 1))
    kernels = _kernels(group, device, start + budget_s)
    return cm.CostModel(world=group.size, node_size=group.node_size, device=device.type,
                        intra=links.get("intra"), inter=links.get("inter"), kernels=kernels,
                        source="probe")

"""`sizes` suite: qcoll's unquantized collectives (bits=None) against torch's same call on
gloo, per size, collective and dtype: the ratio of their times, min / median / max of single
calls, and the stalled calls (issue 26 item 3).

Layouts 2 nodes x 2 and 3 nodes x 2 (local processes, qcoll.new_group(node_size=2)); sizes
1 KB to 64 MB, every power of 4 (bytes of the full tensor: the all-reduce's tensor, the
all-gather's output, the reduce-scatter's input); fp32 and bf16. Two launches, each timing
torch.set_num_threads(2) and (1) in blocks taking turns (timing.balanced_sequence: each
kind of block after each other kind equally often):
  2 threads / 1 thread     OMP_NUM_THREADS=2 (a plain launch on 2 cores)
  torchrun 2 / torchrun    OMP_NUM_THREADS=1, as torchrun sets it when it starts several
                           ranks per node (torchrun: set_num_threads left at 1)
Calls run back to back in blocks, qcoll's and torch's blocks taking turns (a barrier before
each block only); ratio = qcoll's block totals / torch's. With more processes than cores a
single small call is bimodal, torch's included; block totals are not. Control cells (fp32,
64 KB and 1 MB, each collective) time torch's call against itself the same way: their spread
is the harness's noise, printed beside the targets and shaded on the chart.

Targets (item 3): ratio <= 1.25 from 64 KB up, <= 1.5 below; no stalled call (above both
3x its cell's median and the median + 20 ms); at 1 thread and under torchrun, qcoll's time
per call at most 1.3x its 2-thread time. Each stalled call, qcoll's and torch's, is put down
to the cause the machine recorded (stall_causes: a full garbage collection, steal, a TCP
delayed ACK, or unexplained).

`ratios(cells)`: a few (collective, bytes) ratios on 2 x 2 in a few seconds, for a gate."""

from __future__ import annotations

import statistics

from timing import human_bytes, size_ladder

from . import _ranks

WORKER = _ranks.WORKER.replace("_worker.py", "_sizes_worker.py")
COLLECTIVES = ("reduce_scatter", "allgather", "all_reduce")
LAYOUTS = [(4, 2), (6, 2)]  # (world, node_size)
LAUNCHES = {  # OMP_NUM_THREADS -> the modes it times: name -> torch.set_num_threads
    "2": {"2 threads": 2, "1 thread": 1},
    "1": {"torchrun 2": 2, "torchrun": 1},
}
BASE = {"1 thread": "2 threads", "torchrun": "torchrun 2"}  # a mode's 2-thread time
STALL_FACTOR, STALL_MARGIN_S = 3.0, 0.020
SMALL_BYTES = 64 << 10
# Control cells: torch's call timed against itself, exactly as a qcoll cell is timed. Their
# ratios are the harness's own noise (4 or 6 processes on 2 cores), the yardstick for a
# qcoll cell near its limit; they are left out of the targets.
CONTROL = "control:"
CONTROL_SIZES = (64 << 10, 1 << 20)
# A full run's cell: 24 blocks in about 4.8 s of calls. With 6 blocks in 1.2 s, torch against
# itself ranged 0.76-1.31 over 24 cells (sd of the log ratio 0.118): as wide as the 1.25
# limit. 24 blocks in 4.8 s: 0.91-1.12 (sd 0.050). bench/results/sizes-noise-cpu.txt.
FULL_BLOCKS, FULL_BUDGET_S = 24, 4.8


def limit(nbytes: int) -> float:
    return 1.25 if nbytes >= SMALL_BYTES else 1.5


def stalled(times: list) -> list:
    """Indices of the stalled calls: above both 3x the median and the median + 20 ms."""
    med = statistics.median(times)
    return [i for i, t in enumerate(times) if t > STALL_FACTOR * med and t > med + STALL_MARGIN_S]


def stalls(times: list) -> int:
    return len(stalled(times))


# A stall's cause, by the evidence the worker kept (bench/stall_evidence.py), in this order:
# a full garbage collection during the call on some rank; at least one clock tick (10 ms) of
# steal during its block; TCP sent delayed ACKs during the call (the first of its block) or
# during its block's later calls (a later call: back-to-back calls leave the delayed-ACK
# timer nothing to wait for unless a sender's window is stuck, as bbr's 4-packet floor does:
# bench/results/probe-stalls-1mb-bbr-cpu.txt); else unexplained (qcoll's or torch's own).
STALL_CAUSES = ("full_gc", "steal", "delayed_ack", "unexplained")
STEAL_EVIDENCE_S = 0.01


def stall_causes(d: dict) -> dict:
    """{cause: count} over one side's stalled calls (a worker's per-name record); {} for a
    record without evidence (results from before the worker kept it)."""
    if "full_gc" not in d:
        return {}
    k = d["calls_per_block"]
    counts = dict.fromkeys(STALL_CAUSES, 0)
    for i in stalled(d["calls_s"]):
        block = i // k
        # The delayed ACKs of the call's part of its block (None: a record from before the
        # later calls' were kept).
        acks = d["first_call_delayed_acks"] if i % k == 0 else d.get("later_calls_delayed_acks")
        if d["full_gc"][i]:
            cause = "full_gc"
        elif d["block_steal_s"][block] >= STEAL_EVIDENCE_S:
            cause = "steal"
        elif acks is not None and acks[block] > 0:
            cause = "delayed_ack"
        else:
            cause = "unexplained"
        counts[cause] += 1
    return counts


def _launch(world: int, node_size: int, omp: str, cells: list, blocks: int, budget_s: float,
            progress=None, task=None, modes=None) -> list:
    modes = modes or LAUNCHES[omp]
    cfg = dict(world=world, node_size=node_size, threads=list(modes.values()), cells=cells,
               blocks=blocks, budget_s=budget_s)
    out = _ranks.launch(cfg, env=lambda r: {"OMP_NUM_THREADS": omp}, progress=progress, task=task,
                        timeout=1800, worker=WORKER)
    rows = []
    for c in out["cells"]:
        for mode, threads in modes.items():
            q, t = c[f"qcoll@{threads}"], c[f"torch@{threads}"]
            control = c["collective"].startswith(CONTROL)
            row = dict(world=world, node_size=node_size, mode=mode, dtype=c["dtype"], bytes=c["bytes"],
                       collective=c["collective"][len(CONTROL):] if control else c["collective"],
                       control=control, calls=len(q["calls_s"]),
                       ratio=sum(q["blocks_s"]) / sum(t["blocks_s"]),
                       qcoll_per_call_s=sum(q["blocks_s"]) / len(q["calls_s"]),
                       torch_per_call_s=sum(t["blocks_s"]) / len(t["calls_s"]),
                       other_cores=q.get("other_cores", 0.0))
            for name, d in (("qcoll", q), ("torch", t)):
                row[f"{name}_min_s"] = min(d["calls_s"])
                row[f"{name}_median_s"] = statistics.median(d["calls_s"])
                row[f"{name}_max_s"] = max(d["calls_s"])
                row[f"{name}_stalls"] = stalls(d["calls_s"])
                row[f"{name}_stall_causes"] = stall_causes(d)
            rows.append(row)
    return rows


def ratios(cells=(("reduce_scatter", 256 << 10), ("allgather", 4 << 10), ("all_reduce", 1 << 20)),
           dtype: str = "fp32", omp: str = "1", threads: int = 1, blocks: int = 4,
           budget_s: float = 0.15) -> dict:
    """{(collective, bytes): qcoll / torch time} on 2 nodes x 2 gloo ranks, in a few seconds
    (for a gate: compare with a committed ceiling); by default as under torchrun
    (OMP_NUM_THREADS=1). Also returns each cell's stall count under key
    (collective, bytes, "stalls")."""
    rows = _launch(4, 2, omp, [[dtype, b, c] for c, b in cells], blocks, budget_s,
                   modes={"gate": threads})
    out = {}
    for r in rows:
        if r["control"]:  # a control cell's name is its collective's: never the gate's ratio
            continue
        out[(r["collective"], r["bytes"])] = r["ratio"]
        out[(r["collective"], r["bytes"], "stalls")] = r["qcoll_stalls"]
    return out


def run(quick: bool, progress, sizes=None) -> dict:
    sizes = sizes or size_ladder(1 << 10, 64 << 20, quick)
    dtypes = ["fp32"] if quick else ["fp32", "bf16"]
    layouts = LAYOUTS[:1] if quick else LAYOUTS
    cells = [[d, s, c] for d in dtypes for s in sizes for c in COLLECTIVES]
    cells += [["fp32", s, CONTROL + c] for s in CONTROL_SIZES for c in COLLECTIVES]
    rows = []
    for world, ns in layouts:
        for omp in LAUNCHES:
            task = progress.add_task(f"sizes {world // ns}x{ns}, OMP_NUM_THREADS={omp}", total=len(cells))
            rows += _launch(world, ns, omp, cells, blocks=4 if quick else FULL_BLOCKS,
                            budget_s=0.5 if quick else FULL_BUDGET_S, progress=progress, task=task)
    return {"rows": rows, "targets": targets(rows), "control": control(rows)}


def control(rows: list) -> dict:
    """The control cells' ratios (torch against itself): how far apart two identical calls
    measure in this harness; a qcoll cell's ratio is only resolved beyond this band."""
    ratios = sorted(r["ratio"] for r in rows if r.get("control"))
    if not ratios:
        return {}
    return {"cells": len(ratios), "min": round(ratios[0], 3), "max": round(ratios[-1], 3),
            "median": round(statistics.median(ratios), 3)}


def targets(rows: list) -> dict:
    """Item 3, met or missed: the worst ratio against its limit, the stalled calls, and the
    1-thread / torchrun slowdown of qcoll against its own 2-thread time (control cells
    left out)."""
    rows = [r for r in rows if not r.get("control")]
    over = [r for r in rows if r["ratio"] > limit(r["bytes"])]
    worst = max(rows, key=lambda r: r["ratio"] / limit(r["bytes"]))
    stalled_rows = [r for r in rows if r["qcoll_stalls"]]
    base = {(r["mode"], r["world"], r["dtype"], r["bytes"], r["collective"]): r["qcoll_per_call_s"]
            for r in rows if r["mode"] in BASE.values()}
    slow = []
    for r in rows:
        two = base.get((BASE.get(r["mode"]), r["world"], r["dtype"], r["bytes"], r["collective"]))
        if two:
            r["vs_2_threads"] = r["qcoll_per_call_s"] / two
            slow.append(r)
    worst_thread = max(slow, key=lambda r: r["vs_2_threads"]) if slow else None
    cell = lambda r: (f"{r['collective']} {human_bytes(r['bytes'])} {r['dtype']} "
                      f"{r['world'] // r['node_size']}x{r['node_size']} {r['mode']}")
    return {
        "ratio": {"met": not over, "worst": round(worst["ratio"], 3), "worst_cell": cell(worst),
                  "over_limit": [f"{cell(r)}: {r['ratio']:.2f}" for r in over]},
        "stalls": {"met": not stalled_rows, "calls": sum(r["qcoll_stalls"] for r in rows),
                   "torch_calls": sum(r["torch_stalls"] for r in rows),
                   "causes": _cause_totals(rows, "qcoll"), "torch_causes": _cause_totals(rows, "torch"),
                   "cells": [f"{cell(r)}: {r['qcoll_stalls']}" for r in stalled_rows]},
        "threads": {"met": all(r["vs_2_threads"] <= 1.3 for r in slow),
                    "worst": round(worst_thread["vs_2_threads"], 3) if worst_thread else None,
                    "worst_cell": cell(worst_thread) if worst_thread else None,
                    "over_limit": [f"{cell(r)}: {r['vs_2_threads']:.2f}" for r in slow
                                   if r["vs_2_threads"] > 1.3]},
    }


def _cause_totals(rows: list, side: str) -> dict:
    totals = dict.fromkeys(STALL_CAUSES, 0)
    for r in rows:
        for cause, n in r.get(f"{side}_stall_causes", {}).items():
            totals[cause] += n
    return totals


def table(result: dict) -> list:
    lines = [f"{'layout':7}{'mode':12}{'dtype':6}{'collective':15}{'size':>9}{'ratio':>7}"
             f"{'qcoll min/med/max ms':>24}{'torch min/med/max ms':>24}{'stalls q/t':>11}{'others':>7}"]
    for r in result["rows"]:
        q = "/".join(f"{r[f'qcoll_{k}_s'] * 1e3:.1f}" for k in ("min", "median", "max"))
        t = "/".join(f"{r[f'torch_{k}_s'] * 1e3:.1f}" for k in ("min", "median", "max"))
        mark = " control" if r.get("control") else " *" if r["ratio"] > limit(r["bytes"]) else ""
        lines.append(f"{r['world'] // r['node_size']}x{r['node_size']:<5}{r['mode']:12}{r['dtype']:6}"
                     f"{r['collective']:15}{human_bytes(r['bytes']):>9}{r['ratio']:7.2f}{q:>24}{t:>24}"
                     f"{r['qcoll_stalls']:>6}/{r['torch_stalls']:<4}{r.get('other_cores', 0):5.2f}{mark}")
    for name, t in result["targets"].items():
        lines.append(f"target {name}: {'met' if t['met'] else 'MISSED'} {t}")
    if result.get("control"):
        lines.append(f"control (torch against itself, the harness's noise): {result['control']}")
    return lines


def plot(result: dict, path: str) -> None:
    from plotting import _plt, _size_axis, _subtitle

    plt = _plt()
    rows = [r for r in result["rows"] if not r.get("control")]
    noise = result.get("control")
    fig, axes = plt.subplots(1, len(COLLECTIVES), figsize=(6 * len(COLLECTIVES), 4.8), squeeze=False)
    sizes = sorted({r["bytes"] for r in rows})
    for ax, coll in zip(axes[0], COLLECTIVES):
        series = sorted({(r["world"], r["node_size"], r["mode"], r["dtype"]) for r in rows})
        for world, ns, mode, dtype in series:
            pts = sorted((r["bytes"], r["ratio"]) for r in rows if r["collective"] == coll
                         and (r["world"], r["node_size"], r["mode"], r["dtype"]) == (world, ns, mode, dtype))
            ax.plot([s for s, _ in pts], [v for _, v in pts], marker="o", ms=3, lw=1,
                    label=f"{world // ns}x{ns} {mode} {dtype}")
        ax.plot(sizes, [limit(s) for s in sizes], "k--", lw=1.5, label="target")
        ax.axhline(1.0, color="gray", lw=0.8)
        if noise:
            ax.axhspan(noise["min"], noise["max"], color="gray", alpha=0.15,
                       label="torch vs itself (noise)")
        _size_axis(ax, sizes)
        ax.set_title(f"{coll}, bits=None: qcoll / torch time")
        ax.set_xlabel("tensor bytes")
        ax.set_ylabel("ratio (lower is better)")
        ax.set_ylim(0, max(2.0, max(r["ratio"] for r in rows) * 1.05))
    axes[0][0].legend(fontsize=6, ncol=2)
    fig.suptitle(_subtitle(result), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

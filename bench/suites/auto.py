"""`auto` suite: policy="auto" (qcoll.auto) and the cost model behind it on the emulated
cluster (_netns.py: one network namespace per node, tc tbf throttling each node's link).

Per topology (2 nodes x 2 ranks, 3 x 2) and link (unthrottled, 10 Gbit/s, 1 Gbit/s): the
ranks probe their group's cost model (qcoll.cost_model, bounded), then per collective
(all-gather, reduce-scatter, all-reduce) and size (1, 4, 16, 64 MB of bf16: the gathered or
reduced tensor) time the uncompressed call, the quantized call with the collective's
default policy and the same with policy="auto", taking turns (_worker.Bench: median of the
slowest rank; calls under 20 ms in turns of CALLS_PER_TURN back to back; at least
CELL_SECONDS of timed calls a cell), next to the model's prediction for each, and the
quantized call once more as a control: its time over the first one's is how far apart
two identical calls measure in the cell, the yardstick
for an auto cell near its limit. Targets (issue 24): each fixed call's prediction within
20% of its measured time, auto within 1.1x of the faster fixed call in every cell. Then per link, on 2 x 2, the zero suite's ZeRO-3 step (fp32; the quick
run's small GPT, the full run's 9.7M one) for ZeRO-3, ZeRO++ and ZeRO++ with
ZeroConfig(policy="auto"): auto within 1.05x of the faster of the other two.

--quick: 2 x 2 only, links 1 Gbit/s and unthrottled, 1 and 16 MB, fewer repeats, the
quick zero model: proves the suite runs; its numbers are not the targets' evidence.
Needs root and iproute2. The namespaces use their own prefix (qcoll-auto-), so a cluster
suite running beside this one is left alone."""

from __future__ import annotations

import os
import statistics

from qcoll.cost import BUDGET_S
from timing import human_bytes

from . import _netns, _ranks, zero

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_auto_worker.py")
PREFIX = "qcoll-auto-"
TOPOLOGIES = [(2, 2), (3, 2)]  # (nodes, ranks per node)
LINKS = [None, 10, 1]  # Gbit/s per node, None: unthrottled
SIZES = [1 << 20, 4 << 20, 16 << 20, 64 << 20]
PREDICTION_TOLERANCE = 0.20
AUTO_TARGET = 1.10  # auto / faster fixed call, every cell
# Timed one at a time, 1 MB calls (5-10 ms) spread 3-18 ms on the 2-core VM and auto's
# median landed 1.18-1.33x the same choice's fixed median in five cells; four back-to-back
# calls a turn average that out.
CALLS_PER_TURN = 4
# Each cell's timed calls take at least this long (more turns, up to 8x the repeats): with
# 7 repeats a cell whose slowest call passed 20 ms gave its 10 ms calls 8 turns, and auto
# running the very call it was compared with measured up to 1.23x of it (the 4 MB
# reduce-scatter at 1 Gbit/s, 12-04); the turns' spread is independent from turn to turn
# (the control against the quantized call: correlation 0.03 over 173 cells of three runs),
# so more of them narrow a cell's median.
CELL_SECONDS = 4.0
STEP_TARGET = 1.05  # ZeRO step with auto / faster of ZeRO-3 and ZeRO++
STEP_CONFIGS = [("ZeRO-3", dict(qwz=False, hpz=False, qgz=False)),
                ("ZeRO++", dict(qwz=True, hpz=True, qgz=True)),
                ("ZeRO++ auto", dict(qwz=True, hpz=True, qgz=True, policy="auto"))]


def _link_name(gbit) -> str:
    return "unthrottled" if gbit is None else f"{gbit} Gbit/s"


def run(quick: bool, progress, sizes=None) -> dict:
    why = _netns.available()
    if why:
        raise SystemExit(f"auto suite: {why}")
    topologies = TOPOLOGIES[:1] if quick else TOPOLOGIES
    links = [1, None] if quick else LINKS
    sizes = sizes or ([1 << 20, 16 << 20] if quick else SIZES)
    rows, models, probes, steps = [], {}, {}, []
    task = progress.add_task("auto", total=len(topologies) * len(links) + len(links))
    done = 0
    for nodes, node_size in topologies:
        topology = f"{nodes}x{node_size}"
        with _netns.EmulatedCluster(nodes, prefix=PREFIX) as cluster:
            for gbit in links:
                cluster.set_link(gbit, delay_us=50)
                name = _link_name(gbit)
                probes[f"{topology} {name}"] = dict(cluster.probe(), delay_us=cluster.delay_us)
                cfg = dict(world=nodes * node_size, node_size=node_size, sizes=sizes, dtype="bf16", device="cpu",
                           warmup=1 if quick else 2, repeats=3 if quick else 7, iface=_netns.IFACE,
                           probe_budget_s=BUDGET_S, calls_per_turn=CALLS_PER_TURN, min_seconds=CELL_SECONDS)  # the probe's default budget
                out = _ranks.launch(cfg, prefix=lambda r: cluster.exec_prefix(r // node_size),
                                    env=lambda r: {"GLOO_SOCKET_IFNAME": _netns.IFACE,
                                                   "QCOLL_HOST_ID": f"node{r // node_size}"},
                                    timeout=3600, worker=WORKER)
                models[f"{topology} {name}"] = dict(out["model"], probe_s=out["probe_s"],
                                                    gather_trials=out["gather_trials"])
                for r in out["rows"]:
                    rows.append(dict(r, topology=topology, link=name, link_gbit=gbit))
                done += 1
                progress.update(task, completed=done)
            if (nodes, node_size) == (zero.NODES, zero.NODE_SIZE):
                for gbit in links:
                    cluster.set_link(gbit, delay_us=50)
                    steps.append(_step(cluster, gbit, quick))
                    done += 1
                    progress.update(task, completed=done)
    for r in rows:
        fastest = min(r["uncompressed_s"], r["quantized_s"])
        r["auto_vs_best_fixed"] = r["auto_s"] / fastest
        for impl in ("uncompressed", "quantized", "auto"):
            r[f"{impl}_prediction_error"] = r[f"{impl}_predicted_s"] / r[f"{impl}_s"] - 1
        if "control_s" in r:
            r["control_ratio"] = r["control_s"] / r["quantized_s"]
    result = {"topologies": [f"{n}x{s}" for n, s in topologies], "dtype": "bf16", "backend": "gloo",
              "links": probes, "models": models, "rows": rows, "steps": steps}
    result["targets"] = targets(result)
    result["control"] = control(rows)
    return result


def control(rows: list) -> dict:
    """The control's ratios (the same quantized call timed twice in each cell): how far
    apart two identical calls measure here; an auto cell is only resolved beyond this band."""
    ratios = sorted(r["control_ratio"] for r in rows if "control_ratio" in r)
    if not ratios:
        return {}
    return {"cells": len(ratios), "min": round(ratios[0], 3), "max": round(ratios[-1], 3),
            "median": round(statistics.median(ratios), 3)}


def _step(cluster, gbit, quick: bool) -> dict:
    cfg = zero.config(quick, link=True, dtype="fp32")
    cfg.update(configs=STEP_CONFIGS, iface=_netns.IFACE, interleave=True)  # steps in turns: a drift falls on all
    out = _ranks.launch(cfg, prefix=lambda r: cluster.exec_prefix(r // zero.NODE_SIZE),
                        env=lambda r: {"GLOO_SOCKET_IFNAME": _netns.IFACE, "QCOLL_HOST_ID": f"node{r // zero.NODE_SIZE}"},
                        timeout=3600, worker=zero.WORKER)
    times = {r["config"]: r["step_time_s"] for r in out["rows"]}
    return {"link": _link_name(gbit), "link_gbit": gbit, "model": dict(cfg["model"], params=out["params"]),
            "step_time_s": times,
            "auto_vs_best": times["ZeRO++ auto"] / min(times["ZeRO-3"], times["ZeRO++"]),
            "rows": out["rows"]}


def targets(result: dict) -> dict:
    rows = result["rows"]
    fixed_errors = [abs(r[f"{impl}_prediction_error"]) for r in rows for impl in ("uncompressed", "quantized")]
    within = sum(e <= PREDICTION_TOLERANCE for e in fixed_errors)
    worst_auto = max((r["auto_vs_best_fixed"] for r in rows), default=None)
    out = {
        "prediction_within_20pct": {"target": f"every fixed call's prediction within {PREDICTION_TOLERANCE:.0%}",
                                    "cells": len(fixed_errors), "within": within,
                                    "worst_error": round(max(fixed_errors, default=0), 3),
                                    "met": within == len(fixed_errors)},
        "auto_within_1.1x": {"target": AUTO_TARGET, "worst": round(worst_auto, 3) if worst_auto else None,
                             "cells_over": sum(r["auto_vs_best_fixed"] > AUTO_TARGET for r in rows),
                             "over": [f"{_cell(r)}: {r['auto_vs_best_fixed']:.2f}"
                                      + (f" (control {r['control_ratio']:.2f})" if "control_ratio" in r else "")
                                      for r in rows if r["auto_vs_best_fixed"] > AUTO_TARGET],
                             "met": worst_auto is not None and worst_auto <= AUTO_TARGET},
    }

    for s in result["steps"]:
        out[f"zero_step_auto_{s['link']}"] = {"target": STEP_TARGET, "measured": round(s["auto_vs_best"], 3),
                                              "met": s["auto_vs_best"] <= STEP_TARGET}
    return out


def _cell(r: dict) -> str:
    return f"{r['collective']} {human_bytes(r['bytes'])} {r['topology']} {r['link']}"


def table(result: dict) -> list:
    lines = []
    for name, p in result["links"].items():
        m = result["models"][name]
        inter = m["inter"] or {}
        lines.append(f"{name}: link probed {p['gbit_s']:.2f} Gbit/s one stream; model (probe {m['probe_s']:.1f} s): "
                     f"intra {m['intra']['bandwidth'] * 8e-9:.2f} Gbit/s/rank {m['intra']['latency'] * 1e3:.2f} ms, "
                     f"inter {inter.get('bandwidth', 0) * 8e-9:.2f} Gbit/s/rank {inter.get('latency', 0) * 1e3:.2f} ms")
        # The transport's trials per band: "gather_trials"; in runs before the model held the
        # chosen paths, "gather_paths"; absent from runs before the measured gather.
        paths = m["gather_trials"] if "gather_trials" in m else m.get("gather_paths", {})
        if paths:
            lines.append("  all-gathers by " + ", ".join(
                f"{human_bytes(int(band.split('-')[0]))}-{human_bytes(int(band.split('-')[1]))}: {d['path']} "
                + ("(the cost model's)" if d["measured_s"] is None else
                   f"({d['measured_s']['ring'] * 1e3:.1f} / {d['measured_s']['all_to_all'] * 1e3:.1f} ms)")
                for band, d in paths.items()))
    lines.append(f"{'topo':5}{'link':>12} {'collective':15}{'size':>8} | {'uncompr. ms (pred)':>19} "
                 f"{'quantized ms (pred)':>20} {'auto ms':>9} {'auto/best':>9}  choice")
    for r in result["rows"]:
        lines.append(
            f"{r['topology']:5}{r['link']:>12} {r['collective']:15}{human_bytes(r['bytes']):>8} | "
            f"{r['uncompressed_s'] * 1e3:8.1f} ({r['uncompressed_predicted_s'] * 1e3:7.1f}) "
            f"{r['quantized_s'] * 1e3:8.1f} ({r['quantized_predicted_s'] * 1e3:7.1f}) "
            f"{r['auto_s'] * 1e3:9.1f} {r['auto_vs_best_fixed']:8.2f}x  {r['auto_choice']}")
    for s in result["steps"]:
        t = s["step_time_s"]
        lines.append(f"ZeRO step, {s['link']}: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in t.items())
                     + f"; auto / best {s['auto_vs_best']:.2f}x")
    for key, t in result["targets"].items():
        lines.append(f"target {key}: {'met' if t['met'] else 'MISSED'} "
                     f"({', '.join(f'{k} {v}' for k, v in t.items() if k != 'met')})")
    if result.get("control"):
        lines.append(f"control (the quantized call against itself, the harness's noise): {result['control']}")
    return lines


def plot(result: dict, path: str) -> None:
    from plotting import _plt, _subtitle

    plt = _plt()
    rows = result["rows"]
    series = sorted({(r["topology"], r["link"]) for r in rows})
    fig, axes = plt.subplots(2, 3, figsize=(14, 8))
    for col, collective in enumerate(("allgather", "reduce_scatter", "all_reduce")):
        ax_t, ax_p = axes[0][col], axes[1][col]
        for topo, link in series:
            pts = sorted((r["bytes"], r) for r in rows if (r["topology"], r["link"], r["collective"]) == (topo, link, collective))
            if not pts:
                continue
            x = [p[0] / 2**20 for p in pts]
            line, = ax_t.plot(x, [p[1]["auto_vs_best_fixed"] for p in pts], marker="o", label=f"{topo} {link}")
            for impl, style in (("uncompressed", "--"), ("quantized", ":")):
                ax_p.plot(x, [p[1][f"{impl}_predicted_s"] / p[1][f"{impl}_s"] for p in pts], style,
                          marker=".", color=line.get_color())
        ax_t.axhline(AUTO_TARGET, color="red", lw=0.8, ls="--")
        ax_t.axhline(1.0, color="grey", lw=0.5)
        ax_t.set_title(f"{collective}: auto / faster fixed call", fontsize=10)
        ax_p.axhspan(1 - PREDICTION_TOLERANCE, 1 + PREDICTION_TOLERANCE, color="green", alpha=0.1)
        ax_p.set_title(f"{collective}: predicted / measured", fontsize=10)
        for ax in (ax_t, ax_p):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("MB")
            ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(_subtitle(result) + ("  [QUICK RUN]" if result.get("quick") else "")
                 + "\nlower row: dashed uncompressed, dotted quantized; green: within 20%", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

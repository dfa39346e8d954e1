"""PNG charts of the suites' results (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from timing import human_bytes


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _subtitle(result: dict) -> str:
    m = result.get("machine", {})
    what = m.get("gpu") or f"{m.get('cpu', '?')}, {m.get('cpus', '?')} cores"
    return f"{what}; {result.get('date', '')[:10]}; {result.get('command', '')}"


def _size_axis(ax, sizes) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes)
    ax.set_xticklabels([human_bytes(s) for s in sizes], rotation=45, ha="right", fontsize=7)
    ax.grid(True, which="major", alpha=0.3)


def kernels_chart(result: dict, path: str) -> None:
    """GB/s vs size per kernel, the copy ceiling dashed; one panel per (device, dtype)."""
    plt = _plt()
    rows = result["rows"]
    panels = sorted({(r["device"], r["dtype"]) for r in rows if r["kernel"] != "copy"})
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.8), squeeze=False)
    for ax, (device, dtype) in zip(axes[0], panels):
        copy = sorted((r["bytes"], r["gbps"]) for r in rows if r["device"] == device and r["kernel"] == "copy")
        sizes = [s for s, _ in copy]
        ax.plot(sizes, [g for _, g in copy], "k--", lw=2, label="copy (ceiling)")
        ax.plot(sizes, [g * 0.5 for _, g in copy], "k:", lw=1, label="50% of copy")
        kernels = sorted({r["kernel"] for r in rows if r["device"] == device and r["dtype"] == dtype
                          and r["kernel"] != "copy"})
        for k in kernels:
            pts = sorted((r["bytes"], r["gbps"]) for r in rows
                         if r["device"] == device and r["dtype"] == dtype and r["kernel"] == k)
            ax.plot([s for s, _ in pts], [g for _, g in pts], marker="o", ms=3, label=k)
        _size_axis(ax, sizes)
        ax.set_title(f"{device}, {dtype} values")
        ax.set_ylabel("GB/s (bytes read + written / time)")
        ax.legend(fontsize=7)
    fig.suptitle("qcoll kernels vs copy bandwidth\n" + _subtitle(result), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def speedup_chart(result: dict, path: str, series_key=None, targets=None, breakdown=None) -> None:
    """qcoll's speedup over torch's collective vs size: one line per collective (and per
    series_key value, e.g. the link bandwidth). targets: {collective: speedup} drawn dotted.
    breakdown: a series_key value whose qcoll calls get a third panel, taken apart."""
    plt = _plt()
    rows = [r for r in result["rows"] if r["impl"] == "qcoll" and r.get("speedup") is not None]
    panels = 3 if breakdown is not None else 2
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.8))
    ax, ax2 = axes[0], axes[1]
    keys = sorted({(r["collective"], r.get(series_key) if series_key else None) for r in rows},
                  key=lambda k: (k[0], str(k[1])))
    sizes = sorted({r["bytes"] for r in rows})
    colors = {"reduce_scatter": "tab:red", "allgather": "tab:blue", "all_reduce": "tab:green"}
    styles = ["-", "--", "-.", ":"]
    series_values = sorted({k[1] for k in keys}, key=str)
    for coll, sv in keys:
        pts = sorted((r["bytes"], r["speedup"], r["time_s"]) for r in rows
                     if r["collective"] == coll and (not series_key or r.get(series_key) == sv))
        label = coll + (f", {sv}" if series_key else "")
        style = styles[series_values.index(sv) % len(styles)]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=colors.get(coll), marker="o",
                ms=3, label=label)
        ax2.plot([p[0] for p in pts], [p[2] * 1e3 for p in pts], style, color=colors.get(coll),
                 marker="o", ms=3, label="qcoll " + label)
        base = sorted((r["bytes"], r["time_s"]) for r in result["rows"]
                      if r["impl"] == "torch" and r["collective"] == coll
                      and (not series_key or r.get(series_key) == sv))
        ax2.plot([p[0] for p in base], [p[1] * 1e3 for p in base], style, color=colors.get(coll),
                 marker="x", ms=4, alpha=0.35, label="torch " + label)
    for coll, target in (targets or {}).items():
        ax.axhline(target, color=colors.get(coll), ls=":", lw=1, label=f"target {coll} {target}x")
    ax.axhline(1.0, color="k", lw=0.8)
    for a in (ax, ax2):
        _size_axis(a, sizes)
        a.set_xlabel("tensor size (all-gather output / reduce-scatter input)")
    ax.set_ylabel("speedup over torch.distributed (x)")
    ax.set_title("qcoll vs torch, same ranks and sizes")
    ax2.set_yscale("log")
    ax2.set_ylabel("time per call (ms, slowest rank)")
    ax2.set_title("time per call")
    ax.legend(fontsize=7)
    ax2.legend(fontsize=6)
    if breakdown is not None:
        _breakdown_panel(axes[2], [r for r in rows if not series_key or r.get(series_key) == breakdown],
                         breakdown)
    fig.suptitle(_subtitle(result), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


PARTS = {  # phase -> (label, colour)
    "kernels": ("kernels", "tab:orange"),
    "intra_hop": ("intra-node hop", "tab:green"),
    "inter_hop": ("inter-node hop", "tab:purple"),
    "hop": ("all-gather hop", "tab:blue"),
    "workspace": ("fresh workspace pages", "tab:gray"),
}


def _breakdown_panel(ax, rows: list, label) -> None:
    """Stacked bars: each part of qcoll's call run alone, next to the call's time, in ms per
    MB of tensor (so that every size shares one linear scale)."""
    rows = sorted((r for r in rows if "phases_s" in r), key=lambda r: (r["collective"], r["bytes"]))
    names, seen = [], set()
    for i, r in enumerate(rows):
        per_mb = 1e3 / (r["bytes"] / 2**20)
        bottom = 0.0
        for part, secs in r["phases_s"].items():
            name, color = PARTS.get(part, (part, None))
            ax.bar(i, secs * per_mb, bottom=bottom, color=color, width=0.6,
                   label=name if name not in seen else None)
            seen.add(name)
            bottom += secs * per_mb
        ax.plot([i - 0.35, i + 0.35], [r["time_s"] * per_mb] * 2, "k-", lw=2.5,
                label="the whole call" if "call" not in seen else None)
        seen.add("call")
        if "link_bound_s" in r:
            ax.plot([i - 0.35, i + 0.35], [r["link_bound_s"] * per_mb] * 2, "r:", lw=2.5,
                    label="link alone (wire bytes / rate)" if "link" not in seen else None)
            seen.add("link")
        short = {"reduce_scatter": "RS", "allgather": "AG", "all_reduce": "AR"}.get(r["collective"], r["collective"])
        names.append(f"{short} {human_bytes(r['bytes'])}")
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(names, rotation=45, ha="right", fontsize=7)
    ax.set_ylabel("ms per MB of tensor (each part alone, slowest rank)")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.45)  # room for the legend
    ax.set_title(f"where qcoll's time goes ({label})")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")


def group_size_chart(result: dict, path: str) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4.5))
    def fmt_of(r):  # results before the fp8 format carry only "bits"
        return r.get("format", f"int{r['bits']}")

    for fmt in dict.fromkeys(fmt_of(r) for r in result["rows"]):
        for inp, style in (("gaussian", "-"), ("outliers", "--")):
            pts = sorted((r["group_size"], r["rel_rms_error"]) for r in result["rows"]
                         if fmt_of(r) == fmt and r["input"] == inp)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", ms=3,
                    label=f"{fmt}, {inp}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("group size")
    ax.set_ylabel("relative RMS error of a round trip")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.suptitle(_subtitle(result), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

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


def speedup_chart(result: dict, path: str, series_key=None, targets=None) -> None:
    """qcoll's speedup over torch's collective vs size: one line per collective (and per
    series_key value, e.g. the link bandwidth). targets: {collective: speedup} drawn dotted."""
    plt = _plt()
    rows = [r for r in result["rows"] if r["impl"] == "qcoll" and r.get("speedup") is not None]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    keys = sorted({(r["collective"], r.get(series_key) if series_key else None) for r in rows},
                  key=lambda k: (k[0], str(k[1])))
    sizes = sorted({r["bytes"] for r in rows})
    colors = {"reduce_scatter": "tab:red", "allgather": "tab:blue"}
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
    fig.suptitle(_subtitle(result), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def group_size_chart(result: dict, path: str) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for bits in (8, 4):
        for inp, style in (("gaussian", "-"), ("outliers", "--")):
            pts = sorted((r["group_size"], r["rel_rms_error"]) for r in result["rows"]
                         if r["bits"] == bits and r["input"] == inp)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", ms=3,
                    label=f"int{bits}, {inp}")
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

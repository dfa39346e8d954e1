"""`cluster` suite: the collectives suite on an emulated low-bandwidth cluster (ZeRO++'s
"low-bandwidth cluster" experiment in miniature), on this one machine.

2 nodes x 2 ranks. Each node is a network namespace with one veth to a bridge in the root
namespace (see _netns.py for the picture); tc tbf throttles each node's link, both ways, to
1 Gbit/s and 10 Gbit/s (and leaves it unthrottled in the full run). The node's ranks run
in its namespace with gloo bound to its veth (GLOO_SOCKET_IFNAME): ranks of one node talk
over the namespace's loopback (their shared address is local), so only cross-node traffic
is throttled. Every namespace and link is removed afterwards, even on failure or a signal.

Per link rate, the link is first probed (one TCP stream's throughput, round-trip time);
then for each size torch's collective, the same through qcoll, and qcoll's quantized one
are timed as in the collectives suite, plus the bytes that actually left each node's veth
per call (wire MB/node: the busiest node's uplink, TCP/IP headers included), from which
`link_bound_ms` = wire bytes / probed throughput: the time the link alone needs.

Needs root and iproute2 (ip, tc)."""

from __future__ import annotations

from timing import human_bytes

from . import _netns, _ranks, collectives

NODES, NODE_SIZE = 2, 2
TARGETS = {"reduce_scatter": 3.5, "allgather": 1.8, "all_reduce": 3.0}  # speedup over torch at 1 Gbit/s
TARGET_SIZES = {"all_reduce": 32 << 20}  # else the largest size measured
TARGET_GBIT = 1


def run(quick: bool, progress, sizes=None, pipeline_only=False, overlap_only=False,
        all_reduce_only=False) -> dict:
    why = _netns.available()
    if why:
        raise SystemExit(f"cluster suite: {why}")
    links = [1, 10] if quick else [1, 10, None]
    sizes = sizes or ([4 << 20, 32 << 20] if quick else [1 << 20, 4 << 20, 16 << 20, 64 << 20])
    world = NODES * NODE_SIZE
    rows, probes, qdiscs = [], {}, {}
    task = progress.add_task("cluster", total=len(links) * len(sizes))
    with _netns.EmulatedCluster(NODES) as cluster:
        for i, gbit in enumerate(links):
            name = "unthrottled" if gbit is None else f"{gbit} Gbit/s"
            cluster.set_link(gbit, delay_us=50)
            probes[name] = dict(cluster.probe(), delay_us=cluster.delay_us)
            qdiscs[name] = cluster.qdiscs()
            sub = progress.add_task(f"  link {name}", total=len(sizes))
            cfg = collectives.config(sizes, quick, pipeline_only=pipeline_only, overlap_only=overlap_only,
                                     all_reduce_only=all_reduce_only, iface=_netns.IFACE)
            out = _ranks.launch(
                cfg, prefix=lambda r: cluster.exec_prefix(r // NODE_SIZE),
                env=lambda r: {"GLOO_SOCKET_IFNAME": _netns.IFACE, "QCOLL_HOST_ID": f"node{r // NODE_SIZE}"},
                progress=progress, task=sub, timeout=1200)
            progress.update(task, completed=(i + 1) * len(sizes))
            for r in out["rows"]:
                r["link"] = name
                r["link_gbit"] = gbit
                if "wire_bytes_per_node" in r:
                    r["link_bound_s"] = r["wire_bytes_per_node"] * 8 / (probes[name]["gbit_s"] * 1e9)
                rows.append(r)
    rows = collectives.finish(rows, keys=("bytes", "link"))
    return {"world": world, "node_size": NODE_SIZE, "dtype": collectives.DTYPE, "backend": "gloo",
            "links": probes, "qdiscs": qdiscs, "rows": rows, "targets": targets(rows)}


def targets(rows: list) -> dict:
    """qcoll vs torch at 1 Gbit/s, 2 nodes x 2 ranks, at the target's size (TARGET_SIZES)
    or else the largest size measured (and every size), with the shortfall where missed."""
    out = {}
    for coll, target in TARGETS.items():
        pts = sorted((r["bytes"], r["speedup"]) for r in rows
                     if r["collective"] == coll and r["impl"] == "qcoll" and r["link_gbit"] == TARGET_GBIT)
        if not pts:
            continue
        at = [p for p in pts if p[0] == TARGET_SIZES.get(coll)]
        size, speedup = (at or pts)[-1]
        out[f"{coll}_speedup_at_{TARGET_GBIT}gbit"] = {
            "target": target, "size": size, "measured": round(speedup, 3), "met": speedup >= target,
            "short_by": None if speedup >= target else round(target - speedup, 3),
            "short_by_frac": None if speedup >= target else round(1 - speedup / target, 3),
            "by_size": {str(s): round(v, 3) for s, v in pts},
        }
    return out


def table(result: dict) -> list:
    lines = []
    for name, p in result["links"].items():
        lines.append(f"link {name}: probed {p['gbit_s']:.2f} Gbit/s one stream, RTT {p['rtt_us']:.0f} us"
                     f", added delay {p['delay_us']} us")
    lines += collectives.table(result, extra=(("link", "link", 13),))
    lines.append(f"{'':15}{'link bound (ms), busiest uplink':>40}")
    for r in result["rows"]:
        if r["impl"] != "torch-via-qcoll" and "link_bound_s" in r:
            lines.append(f"  {r['collective']:15}{r['link']:>12}{human_bytes(r['bytes']):>9} {r['impl']:8}"
                         f" time {r['time_s'] * 1e3:8.1f} ms, link alone {r['link_bound_s'] * 1e3:8.1f} ms "
                         f"({r['link_bound_s'] / r['time_s']:.0%} of it)")
    for key, t in result["targets"].items():
        verdict = "met" if t["met"] else f"MISSED by {t['short_by']:.2f}x ({t['short_by_frac']:.0%})"
        sizes = ", ".join(f"{human_bytes(int(k))} {v:.2f}x" for k, v in t["by_size"].items())
        lines.append(f"target {key} >= {t['target']}x at {human_bytes(t['size'])}: "
                     f"{t['measured']:.2f}x, {verdict} (by size: {sizes})")
    return lines


def plot(result: dict, path: str) -> None:
    from plotting import speedup_chart

    speedup_chart(result, path, series_key="link", targets=TARGETS, breakdown=f"{TARGET_GBIT} Gbit/s")

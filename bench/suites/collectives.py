"""`collectives` suite: qcoll.quantized_all_reduce / quantized_allgather /
quantized_reduce_scatter next to torch.distributed's all_reduce / all_gather_into_tensor /
reduce_scatter_tensor in the input dtype, on the same ranks, sizes and inputs, in the same
run (--all-reduce-only: the all-reduce rows alone).

4 local ranks (separate processes) form 2 nodes x 2 ranks (qcoll.new_group(node_size=2));
gloo on CPU, or NCCL ranks sharing GPU 0 with --device cuda (correctness only: the ranks
time-slice one GPU). Per size (the bytes of the all-gather's output = the bytes of the
reduce-scatter's input, bf16) and collective, three implementations:
  torch            torch.distributed's call (all_gather_single / reduce_scatter_single, the
                   names torch >= 2.9 gives all_gather_into_tensor / reduce_scatter_tensor;
                   gloo has no AVG: SUM then divide)
  torch-via-qcoll  the same collective through qcoll (bits=None, hierarchical=False), which
                   counts its bytes by qcoll's rule (the all-reduce: from 4 ranks qcoll's raw
                   exchange, not the transport's call)
  qcoll            qwZ int8 all-gather; 2-hop qgZ reduce-scatter (int8 in the node, int4
                   across, fp32 reduce); all-reduce = that reduce-scatter, then an int4
                   all-gather of the reduced shards (quantized_all_reduce(bits=8,
                   inter_bits=4), the DDP hook's defaults)
For the all-reduce, size is the tensor's bytes (every rank's input and output).
The three take turns call by call (torch, via-qcoll, qcoll, torch, ...) so that load from
other jobs on a shared machine falls on all alike; a size measured while other processes
used over half a core is measured again (full runs: up to 3 attempts; `other_cores` and
`attempts` in each row).
Reported: median over repeats of the slowest rank's time, speedup over torch, bytes handed
to peers inside / across nodes per call (summed over ranks; torch's row repeats the
torch-via-qcoll count), and the relative L2 error against the exact result (fp64).

Pipeline rows (collective "pipeline", fp32 input of the given size): the default 2-hop
reduce-scatter with pipeline_stages 1, 2 and 4, "forced" (every requested stage run) and
"auto" (what qcoll runs: stages whose slice would be below MIN_PIPELINE_STAGE_BYTES are
dropped, include/qcoll/plan.h); "speedup" there is over pipeline_stages=1. They are what
that threshold was chosen from.

Overlap rows (collective "overlap", bf16): a 64 MB qwZ all-gather issued with async_op=True
beside a CPU matmul in the caller, against the two one after the other (and the matmul
alone); "speedup" there is over the sequential pair; bit_identical_to_sync says the async
result equals a synchronous call's."""

from __future__ import annotations

from timing import human_bytes, size_ladder

from . import _ranks

WORLD, NODE_SIZE = 4, 2
DTYPE = "bf16"
GPU_ENV = {  # several NCCL ranks on one GPU: docs/emulators.md
    "CUDA_VISIBLE_DEVICES": "0", "NCCL_NET": "Socket", "NCCL_SOCKET_IFNAME": "lo",
    "NCCL_MNNVL_ENABLE": "0", "NCCL_PAT_ENABLE": "0",
}


PIPELINE_SIZES = [1 << 20, 4 << 20, 16 << 20, 64 << 20]


def config(sizes, quick: bool, device: str = "cpu", pipeline_only: bool = False,
           overlap_only: bool = False, all_reduce_only: bool = False, **extra) -> dict:
    pipeline = [] if overlap_only or all_reduce_only else [1 << 20, 16 << 20] if quick else PIPELINE_SIZES
    overlap = [] if pipeline_only or all_reduce_only else [16 << 20] if quick else [64 << 20]
    only = pipeline_only or overlap_only
    extra.update(all_reduce=not only, all_reduce_only=bool(all_reduce_only))
    return dict(world=WORLD, node_size=NODE_SIZE, sizes=[] if only else list(sizes),
                dtype=DTYPE, device=device, warmup=2 if quick else 3, repeats=5 if quick else 11,
                pipeline_stages=None, phases=True, attempts=1 if quick else 3,
                pipeline_sizes=pipeline if device == "cpu" else [],
                overlap_sizes=overlap if device == "cpu" else [], **extra)


def finish(rows: list, keys=("bytes",)) -> list:
    """Speedups over torch's direct call (and over the same baseline through qcoll); torch's
    row gets the byte counts of the baseline through qcoll (same collective, same rule)."""
    index = {(r["collective"], r["impl"], *[r.get(k) for k in keys]): r for r in rows}
    for r in rows:
        if r["collective"] in ("pipeline", "overlap"):
            r["speedup"] = r.get("vs_one_stage", r.get("vs_sequential"))
            continue
        key = (r["collective"], *[r.get(k) for k in keys])
        torch_row = index.get((key[0], "torch", *key[1:]))
        via = index.get((key[0], "torch-via-qcoll", *key[1:]))
        if torch_row:
            r["speedup"] = torch_row["time_s"] / r["time_s"]
        if via:
            r["speedup_vs_via_qcoll"] = via["time_s"] / r["time_s"]
            if r["impl"] == "torch":
                r["intra_bytes"], r["inter_bytes"] = via["intra_bytes"], via["inter_bytes"]
    return rows


def run(quick: bool, progress, sizes=None, device=None, pipeline_only=False, overlap_only=False,
        all_reduce_only=False) -> dict:
    device = device or "cpu"
    if device == "auto":
        device = "cpu"
    sizes = sizes or ([256 << 10, 4 << 20, 32 << 20] if quick else size_ladder(64 << 10, 64 << 20, False))
    task = progress.add_task(f"collectives ({device})", total=len(sizes))
    env = (lambda r: dict(GPU_ENV, NCCL_HOSTID=f"qhost{r}")) if device == "cuda" else None
    out = _ranks.launch(config(sizes, quick, device, pipeline_only, overlap_only, all_reduce_only), env=env,
                        progress=progress,
                        task=task, timeout=900)
    return {"world": WORLD, "node_size": NODE_SIZE, "dtype": DTYPE, "device": device,
            "backend": out["backend"], "torch_calls": out["torch_calls"], "rows": finish(out["rows"])}


def table(result: dict, extra=()) -> list:
    """extra: (header, key, width) columns put before the size."""
    head = "".join(f"{h:>{w}}" for h, _, w in extra)
    lines = [f"{result['world']} ranks as {result['world'] // result['node_size']} nodes x "
             f"{result['node_size']}, {result['dtype']}, backend {result['backend']}; bytes per call "
             f"summed over ranks",
             f"{'collective':15}{head}{'size':>9} {'impl':16}{'ms':>9}{'speedup':>8}{'intra MB':>9}"
             f"{'inter MB':>9}{'wire MB/node':>13}{'rel.err':>9}{'others':>7}"]
    for r in result["rows"]:
        cols = "".join(f"{str(r.get(k)):>{w}}" for h, k, w in extra)
        wire = r.get("wire_bytes_per_node")
        lines.append(
            f"{r['collective']:15}{cols}{human_bytes(r['bytes']):>9} {r['impl']:16}{r['time_s'] * 1e3:9.2f}"
            f"{r.get('speedup', float('nan')):8.2f}{r.get('intra_bytes', 0) / 1e6:9.2f}"
            f"{r.get('inter_bytes', 0) / 1e6:9.2f}{'' if wire is None else format(wire / 1e6, '.2f'):>13}"
            f"{r['rel_error']:9.1e}{r.get('other_cores', float('nan')):7.2f}")
    lines.insert(1, "others: cores of CPU other processes used while this size was timed (0 = quiet)")
    lines += phase_lines(result["rows"], extra)
    return lines


def phase_lines(rows: list, extra=()) -> list:
    """Where qcoll's time goes: each part of the call run alone (see _worker.rs_phases)."""
    lines = []
    for r in rows:
        if "phases_s" not in r:
            continue
        if not lines:
            lines.append("qcoll's call taken apart (each part alone, all ranks at once; ms):")
        parts = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in r["phases_s"].items())
        where = "".join(f"{str(r.get(k)):>{w}}" for _, k, w in extra)
        lines.append(f"  {r['collective']:15}{where}{human_bytes(r['bytes']):>9}: {parts}; sum "
                     f"{sum(r['phases_s'].values()) * 1e3:.2f} vs the call {r['time_s'] * 1e3:.2f}; "
                     f"{r.get('page_faults_per_call', 0):.0f} page faults/call (rank 0)")
    return lines


def plot(result: dict, path: str) -> None:
    from plotting import speedup_chart

    speedup_chart(result, path)

"""`project` suite: qcoll's cost model (qcoll.cost.CostModel, the equations policy="auto"
decides with) projected to 16 .. 1,024 GPUs, 8 per node, next to the papers' figures.

Nothing is measured here: the model is given GPU-cluster rates (every one an assumption,
listed in the result's "assumptions" and the README) and predicts, per GPU count and
inter-node bandwidth (100, 200, 400 Gbit/s per node; 800 Gbit/s per GPU inside the node):
- the collectives (all-gather, reduce-scatter, all-reduce of a 256 MB bf16 tensor):
  uncompressed, quantized (qcoll's default policies), and what policy="auto" would pick;
- one ZeRO-3 training step of a GPT (18B parameters, 1K tokens per GPU: ZeRO++'s Table 2
  setting) with ZeRO-3 (bf16 all-gathers forward and backward, bf16 reduce-scatter), ZeRO++
  (int8 forward all-gather, hpZ's backward all-gather inside the node, int8/int4 2-hop
  reduce-scatter) and auto (each call the faster of its two);
- the same at the papers' own settings (ZeRO++: 384 V100s, 16 per node, 100 Gbit/s;
  AGoQ: an 8-rank all-reduce of 32 MB at 200 and 10 Gbit/s; SDP4Bit: 128 GPUs at 100 Gbit/s),
  next to the figures they report.
Kernel rates come from a GPU run's kernels suite (bench/results/gpu-results-*.json,
"kernels_cuda") when one exists, else from HBM_FRACTION of the GPU's HBM bandwidth."""

from __future__ import annotations

import glob
import json
import os

import torch

from qcoll import AllGatherPolicy, AllReducePolicy, ReduceScatterPolicy
from qcoll._formats import FORMATS
from qcoll.cost import RAW, CostModel, KernelRate, Link

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")
GPUS = [16, 32, 64, 128, 256, 512, 1024]
GPUS_PER_NODE = 8
INTER_GBIT = [100, 200, 400]  # per node, shared by its GPUs
INTRA_GBIT = 800  # per GPU (NVLink class)
INTRA_LATENCY_S, INTER_LATENCY_S = 10e-6, 30e-6  # one exchange (NCCL-class launch + wire)
HBM_BYTES_S = 3.35e12  # H100 SXM HBM3
HBM_FRACTION = 0.5  # of HBM bandwidth a quantize / dequantize kernel sustains (assumed)
PEAK_FLOPS = 989e12  # H100 SXM dense bf16
MFU = 0.45  # of peak the compute sustains (assumed)
COLLECTIVE_BYTES = 256 << 20
# The step: ZeRO++ Table 2's 18B model at 1K tokens per GPU; 6 * params * tokens FLOPs
# (forward + backward, no recomputation); one all-gather / reduce-scatter per layer.
STEP = dict(params=18e9, tokens_per_gpu=1024, layers=40)
BF16 = torch.bfloat16

PAPERS = {
    "zeropp_2.16x": dict(what="ZeRO++ vs ZeRO-3 step throughput, 18B, 1K tokens/GPU, 384 V100 "
                         "(24 DGX-2 nodes of 16), 1 IB link = 100 Gbit/s per node", paper=2.16,
                         gpus=384, per_node=16, inter_gbit=100, intra_gbit=1200,  # NVSwitch: 150 GB/s per GPU each way
                         peak=120e12, hbm=0.9e12, mfu=0.45),
    "zeropp_4x_bytes": dict(what="ZeRO++: cross-node bytes per step, ZeRO-3 / ZeRO++", paper=4.0),
    "sdp4bit_4.08x": dict(what="SDP4Bit vs non-quantized sharded DP, up to 4.08x end to end on 128 GPUs "
                          "(100 Gbit/s environment, GPT up to 6.7B)", paper=4.08, gpus=128, per_node=8,
                          inter_gbit=100, params=6.7e9, tokens_per_gpu=2048, layers=32),
    "agoq_allreduce_200g": dict(what="AGoQ 8-bit all-reduce vs all-reduce, 32 MB, DP=8 (one rank per node, "
                                "TP=8 beside it), 200 Gbit/s", paper=131.23 / 39.17, inter_gbit=200),
    "agoq_allreduce_10g": dict(what="the same at 10 Gbit/s", paper=1603.78 / 432.36, inter_gbit=10),
}


def _gpu_kernel_rates():
    """(rates, source): from the newest GPU result's kernels rows, else None."""
    results = []
    for path in glob.glob(os.path.join(RESULTS, "gpu-results-*.json")):
        with open(path) as f:
            results.append((json.load(f), path))
    # Newest first, by the kernels run's own date (file names carry no order).
    results.sort(key=lambda r: (r[0].get("kernels_cuda") or {}).get("date", ""), reverse=True)
    for result, path in results:
        rows = (result.get("kernels_cuda") or {}).get("rows", [])
        rows = [r for r in rows if r.get("device") == "cuda"]
        best = {}
        for r in rows:  # the largest size of each kernel, bf16 input where measured
            key = r["kernel"]
            if key not in best or (r["dtype"] == "bf16", r["bytes"]) > (best[key]["dtype"] == "bf16", best[key]["bytes"]):
                best[key] = r
        try:
            # Each kernel's measured bandwidth, charged with the bytes the model counts.
            rates = _rates(lambda kind, fmt: best["copy" if kind == "copy" else f"{kind} {fmt}"]["gbps"] * 1e9)
            return rates, f"measured: {os.path.relpath(path, RESULTS)}"
        except KeyError:
            continue
    return None


def _rates(bandwidth) -> dict:
    """Elements/s of each format's kernels from the bytes/s each moves, bandwidth(kind, format)
    with kind quantize / dequantize / copy: encode reads bf16 (2 B) and writes the code;
    decode reads the code and reads + writes an fp32 accumulator (8 B); raw: a 2-byte copy
    (4 B), and an add reading bf16 and the fp32 accumulator and writing it (10 B)."""
    rates = {}
    for name, info in FORMATS.items():
        code = info["bits"] / 8
        rates[name] = KernelRate(bandwidth("quantize", name) / (2 + code),
                                 bandwidth("dequantize", name) / (code + 8))
    rates[RAW] = KernelRate(bandwidth("copy", RAW) / 4, bandwidth("copy", RAW) / 10)
    return rates


def hbm_kernel_rates(hbm: float = HBM_BYTES_S) -> dict:
    """Every kernel at HBM_FRACTION of HBM bandwidth (no GPU measurement)."""
    return _rates(lambda kind, fmt: HBM_FRACTION * hbm)


def gpu_model(gpus: int, per_node: int, inter_gbit: float, intra_gbit: float = INTRA_GBIT,
              kernels: dict = None) -> CostModel:
    return CostModel(world=gpus, node_size=per_node, device="cuda",
                     intra=Link(intra_gbit * 1e9 / 8, INTRA_LATENCY_S),
                     inter=Link(inter_gbit * 1e9 / 8 / per_node, INTER_LATENCY_S) if gpus > per_node else None,
                     kernels=kernels, source="projection")


def _best(model, collective, numel, policies) -> tuple:
    preds = [model.predict(collective, numel, BF16, p) for p in policies]
    return min(preds, key=lambda p: p.seconds)


def step(model: CostModel, params: float, tokens: int, layers: int, peak: float, mfu: float) -> dict:
    """One ZeRO-3 step per configuration: compute + the step's collectives (no overlap;
    see the README for why this bounds the speedup from above)."""
    gpus, per_node = model.world, model.node_size
    n = int(params / layers / gpus)  # elements per rank of one layer's shard
    compute = 6 * params * tokens / (peak * mfu)
    hpz = gpu_model(per_node, per_node, 1.0, model.intra.bandwidth * 8 / 1e9, model.kernels)
    raw_ag, q_ag = AllGatherPolicy(bits=None), AllGatherPolicy()
    raw_rs, q_rs = ReduceScatterPolicy.transport(), ReduceScatterPolicy()
    hpz_n = n * gpus // per_node
    parts = {
        "ZeRO-3": [model.predict("allgather", n, BF16, raw_ag)] * 2 + [model.predict("reduce_scatter", n, BF16, raw_rs)],
        "ZeRO++": [model.predict("allgather", n, BF16, q_ag), hpz.predict("allgather", hpz_n, BF16, raw_ag),
                   model.predict("reduce_scatter", n, BF16, q_rs)],
    }
    parts["auto"] = [_best(model, "allgather", n, [raw_ag, q_ag]), hpz.predict("allgather", hpz_n, BF16, raw_ag),
                     _best(model, "reduce_scatter", n, [raw_rs, q_rs, ReduceScatterPolicy(hierarchical=False)])]
    out = {"compute_s": compute}
    for name, ps in parts.items():
        comm = layers * sum(p.seconds for p in ps)
        out[name] = {"step_s": compute + comm, "comm_s": comm,
                     "inter_bytes_per_gpu": layers * sum(p.inter_bytes for p in ps)}
    out["zeropp_speedup"] = out["ZeRO-3"]["step_s"] / out["ZeRO++"]["step_s"]
    out["auto_speedup"] = out["ZeRO-3"]["step_s"] / out["auto"]["step_s"]
    out["inter_bytes_ratio"] = out["ZeRO-3"]["inter_bytes_per_gpu"] / out["ZeRO++"]["inter_bytes_per_gpu"]
    return out


def collectives(model: CostModel) -> dict:
    out = {}
    for collective, raw, q in (("allgather", AllGatherPolicy(bits=None), AllGatherPolicy()),
                               ("reduce_scatter", ReduceScatterPolicy.transport(), ReduceScatterPolicy()),
                               ("all_reduce", AllReducePolicy(bits=None), AllReducePolicy())):
        numel = COLLECTIVE_BYTES // 2 if collective == "all_reduce" else COLLECTIVE_BYTES // 2 // model.world
        u, k = (model.predict(collective, numel, BF16, p).seconds for p in (raw, q))
        out[collective] = {"uncompressed_s": u, "quantized_s": k, "auto_s": min(u, k), "speedup": u / k}
    return out


def papers(kernels: dict) -> dict:
    out = {}
    z = PAPERS["zeropp_2.16x"]
    zm = gpu_model(z["gpus"], z["per_node"], z["inter_gbit"], z["intra_gbit"], hbm_kernel_rates(z["hbm"]))
    zs = step(zm, STEP["params"], STEP["tokens_per_gpu"], STEP["layers"], z["peak"], z["mfu"])
    out["zeropp_2.16x"] = dict(what=z["what"], paper=z["paper"], projected=zs["zeropp_speedup"])
    out["zeropp_4x_bytes"] = dict(what=PAPERS["zeropp_4x_bytes"]["what"], paper=4.0, projected=zs["inter_bytes_ratio"])
    s = PAPERS["sdp4bit_4.08x"]
    sm = gpu_model(s["gpus"], s["per_node"], s["inter_gbit"], kernels=kernels)
    ss = step(sm, s["params"], s["tokens_per_gpu"], s["layers"], PEAK_FLOPS, MFU)
    out["sdp4bit_4.08x"] = dict(what=s["what"] + "; projected: qcoll's ZeRO++ configuration (not qWD) on "
                                "the measured GPU kernel rates", paper=s["paper"], projected=ss["zeropp_speedup"])
    for key in ("agoq_allreduce_200g", "agoq_allreduce_10g"):
        a = PAPERS[key]
        # DP=8 across 8 nodes, one rank per node, beside 7 other TP ranks sharing the NIC.
        am = gpu_model(8, 1, a["inter_gbit"] / 8 * 1, kernels=kernels)
        numel = (32 << 20) // 2
        u, q = (am.predict("all_reduce", numel, BF16, p).seconds for p in (AllReducePolicy(bits=None), AllReducePolicy()))
        # Megatron's gradients (AGoQ's baseline) are fp32: the same 32 MB, 4 bytes an element.
        u32, q32 = (am.predict("all_reduce", numel // 2, torch.float32, p).seconds
                    for p in (AllReducePolicy(bits=None), AllReducePolicy()))
        out[key] = dict(what=a["what"], paper=a["paper"], projected=u / q, uncompressed_s=u, quantized_s=q,
                        projected_fp32_gradients=u32 / q32)
    return out


def run(quick: bool, progress) -> dict:
    measured = _gpu_kernel_rates()
    kernels, kernel_source = measured if measured else (
        hbm_kernel_rates(), f"{HBM_FRACTION:.0%} of {HBM_BYTES_S / 1e12:.2f} TB/s HBM (no GPU result in bench/results)")
    rows = []
    for gpus in GPUS:
        for gbit in INTER_GBIT:
            m = gpu_model(gpus, GPUS_PER_NODE, gbit, kernels=kernels)
            rows.append({"gpus": gpus, "inter_gbit_per_node": gbit,
                         "step": step(m, STEP["params"], STEP["tokens_per_gpu"], STEP["layers"], PEAK_FLOPS, MFU),
                         "collectives": collectives(m)})
    assumptions = {
        "gpus_per_node": GPUS_PER_NODE, "intra_gbit_per_gpu": INTRA_GBIT,
        "inter_gbit_per_node": INTER_GBIT, "inter_link_per_gpu": "the node's bandwidth / 8 (every GPU sends at once)",
        "latency_s": {"intra": INTRA_LATENCY_S, "inter": INTER_LATENCY_S, "rule": "one per exchange, any world size"},
        "kernel_rates": kernel_source,
        "kernel_elements_per_s": {k: {"encode": v.encode, "decode": v.decode} for k, v in kernels.items()},
        "compute": f"6 x params x tokens FLOPs at {MFU:.0%} of {PEAK_FLOPS / 1e12:.0f} TFLOP/s (H100 SXM bf16 dense)",
        "overlap": "none: step = compute + every collective's predicted time",
        "step_model": STEP, "collective_bytes": COLLECTIVE_BYTES,
        "policies": "qcoll defaults: all-gather int8; reduce-scatter int8 in node / int4 across, 2-hop, 2 stages; "
                    "all-reduce int8, 2-hop, 2 stages; hpZ: the backward all-gather inside the node, bf16",
    }
    return {"assumptions": assumptions, "rows": rows, "papers": papers(kernels)}


def table(result: dict) -> list:
    lines = [f"kernel rates: {result['assumptions']['kernel_rates']}",
             f"{'GPUs':>5} {'Gbit/s':>7} | {'ZeRO-3 s':>9} {'ZeRO++ s':>9} {'auto s':>8} {'ZeRO++ x':>9} "
             f"{'x-node B':>9} | {'AG x':>6} {'RS x':>6} {'AR x':>6}  (256 MB collectives: uncompressed / quantized)"]
    for r in result["rows"]:
        s, c = r["step"], r["collectives"]
        lines.append(f"{r['gpus']:5d} {r['inter_gbit_per_node']:7d} | {s['ZeRO-3']['step_s']:9.3f} "
                     f"{s['ZeRO++']['step_s']:9.3f} {s['auto']['step_s']:8.3f} {s['zeropp_speedup']:8.2f}x "
                     f"{s['inter_bytes_ratio']:8.2f}x | {c['allgather']['speedup']:5.2f}x "
                     f"{c['reduce_scatter']['speedup']:5.2f}x {c['all_reduce']['speedup']:5.2f}x")
    for key, p in result["papers"].items():
        fp32 = f" (fp32 gradients: {p['projected_fp32_gradients']:.2f}x)" if "projected_fp32_gradients" in p else ""
        lines.append(f"{key}: paper {p['paper']:.2f}x, projected {p['projected']:.2f}x{fp32}  ({p['what']})")
    return lines


def plot(result: dict, path: str) -> None:
    from plotting import _plt, _subtitle

    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    for gbit in INTER_GBIT:
        rows = [r for r in result["rows"] if r["inter_gbit_per_node"] == gbit]
        x = [r["gpus"] for r in rows]
        ax1.plot(x, [r["step"]["zeropp_speedup"] for r in rows], marker="o", label=f"{gbit} Gbit/s/node")
        ax2.plot(x, [r["collectives"]["reduce_scatter"]["speedup"] for r in rows], marker="o", label=f"RS {gbit}")
        ax2.plot(x, [r["collectives"]["all_reduce"]["speedup"] for r in rows], ls="--", marker=".", label=f"AR {gbit}")
    ax1.set_title("projected ZeRO++ / ZeRO-3 step speedup (18B, 1K tokens/GPU)")
    ax2.set_title("projected 256 MB collective speedup, quantized / uncompressed")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs (8 per node)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(_subtitle(result), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

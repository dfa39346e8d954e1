"""`error_feedback` suite: what error feedback buys int4 gradients, on the convergence test.

The GPT of tests/zero/test_zero_convergence.py (vocab 16, d_model 64, one layer, 32 tokens,
8 sequences per rank, AdamW lr 5e-3) under DistributedDataParallel on 4 gloo ranks as 2
nodes x 2, 200 steps (quick: 60), one run per configuration, same seed and batches:
DDP's default all-reduce; qcoll.ddp's hook at int8 in the node / int4 across (its
defaults) and int4 everywhere, each with and without qcoll.ErrorFeedback; and int4 with
groups of 4096 (a larger quantization error), with and without. Reported: the mean loss of
the last 20 steps against the default's, cross-node bytes per rank and step, the error
feedback's memory per rank."""

from __future__ import annotations

import os

from . import _ranks

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_ef_worker.py")
CONFIGS = [
    ("DDP default", dict(default=True)),
    ("int8/int4 + EF", dict(bits=8, inter_bits=4, error_feedback=True)),
    ("int8/int4", dict(bits=8, inter_bits=4, error_feedback=False)),
    ("int4 + EF", dict(bits=4, inter_bits=4, error_feedback=True)),
    ("int4", dict(bits=4, inter_bits=4, error_feedback=False)),
    ("int4 g4096 + EF", dict(bits=4, inter_bits=4, error_feedback=True, group_size=4096)),
    ("int4 g4096", dict(bits=4, inter_bits=4, error_feedback=False, group_size=4096)),
]
TAIL = 20


def run(quick: bool, progress) -> dict:
    cfg = {"world": 4, "node_size": 2, "seed": 0, "lr": 5e-3, "batch": 8, "seq": 32,
           "steps": 60 if quick else 200, "configs": CONFIGS,
           "model": dict(vocab=16, d_model=64, layers=1, heads=4)}
    task = progress.add_task("error_feedback", total=len(CONFIGS))
    out = _ranks.launch(cfg, progress=progress, task=task, timeout=3600, worker=WORKER)
    rows = out["rows"]
    base = sum(rows[0]["losses"][-TAIL:]) / TAIL
    for r in rows:
        r["final_loss"] = sum(r["losses"][-TAIL:]) / TAIL
        r["vs_default"] = r["final_loss"] / base - 1
    return {"world": 4, "node_size": 2, "backend": "gloo", "steps": cfg["steps"], "model": cfg["model"],
            "rows": rows}


def table(result: dict) -> list:
    lines = [f"DDP, {result['world']} ranks as 2 nodes x 2, {result['steps']} steps; final loss = mean of the "
             f"last {TAIL} steps",
             f"{'config':18}{'final loss':>11}{'vs default':>11}{'x-node B/rank/step':>20}{'EF bytes/rank':>15}"]
    for r in result["rows"]:
        lines.append(f"{r['config']:18}{r['final_loss']:11.4f}{r['vs_default'] * 100:+10.2f}%"
                     f"{r['inter_bytes_per_rank_step']:20.0f}{r['error_feedback_bytes']:15d}")
    return lines


def plot(result: dict, path: str) -> None:
    from plotting import _plt, _subtitle

    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in result["rows"]:
        ax.plot(r["losses"], label=r["config"], lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (mean over ranks)")
    ax.set_title("int4 gradients with and without error feedback (DDP, 2 nodes x 2)")
    ax.legend(fontsize=7)
    fig.suptitle(_subtitle(result), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

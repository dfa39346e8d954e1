"""One rank of the `zero` suite (started by _ranks.launch, never by hand).

    python bench/suites/_zero_worker.py CONFIG.json RANK

For every ZeRO configuration in the config: builds examples/gpt.py's GPT from the same seed,
wraps it in qcoll.zero.ZeroEngine (bf16 compute, AdamW) on a qcoll group of node_size ranks
per node, and trains `steps` steps on the same synthetic Markov data. Per step: the slowest
rank's time of forward + backward + step (after `warmup` steps), the bytes the engine sent
to other nodes and within the node (engine.stats() deltas, mean per rank), and the loss.
Per step and rank, engine.timings() splits the step's host time into waiting on
all-gathers (issue + wait), reduce-scatters, the optimizer step, and compute (the rest); the
row keeps the median over timed steps of the mean over ranks. Rank 0 prints `PROGRESS done
total` lines and writes the rows as JSON to the config's "out" path."""

from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import gpt  # noqa: E402

import qcoll  # noqa: E402
from qcoll.zero import ZeroConfig, ZeroEngine  # noqa: E402

CATEGORIES = ("forward_allgather", "backward_allgather", "reduce_scatter")
PHASES = ("compute", "gather", "reduce_scatter", "optimizer")


def _tx_bytes(iface) -> int:
    if not iface:
        return 0
    with open(f"/sys/class/net/{iface}/statistics/tx_bytes") as f:
        return int(f.read())


def train(cfg: dict, rank: int, group, language, model_cfg, name: str, techniques: dict) -> dict:
    world, node_size = cfg["world"], cfg["node_size"]
    iface = cfg.get("iface") if rank % node_size == 0 else None
    torch.manual_seed(cfg["seed"])
    model = gpt.GPT(model_cfg)
    config = ZeroConfig(**techniques, compute_dtype=torch.bfloat16, max_grad_norm=1.0)
    engine = ZeroEngine(model, lambda ps: torch.optim.AdamW(ps, lr=cfg["lr"], weight_decay=0.01), group,
                        config=config)
    times, inter, intra, wire, losses, phases = [], [], [], [], [], []
    for step in range(cfg["steps"]):
        x, y = language.batch(step, cfg["batch"] * world, cfg["seq"], seed=cfg["seed"])
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        before, t_before = engine.stats(), engine.timings()
        dist.barrier()
        tx0 = _tx_bytes(iface)
        t0 = time.perf_counter()
        engine.zero_grad()
        loss = gpt.lm_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        dt = time.perf_counter() - t0
        dist.barrier()  # every rank done sending: the step's bytes left the veth
        tx = _tx_bytes(iface) - tx0
        after, t_after = engine.stats(), engine.timings()
        spent = {k: t_after[k] - t_before[k] for k in ("gather", "reduce_scatter", "optimizer")}
        spent["compute"] = dt - sum(spent.values())
        p = torch.tensor([spent[k] for k in PHASES], dtype=torch.float64)
        dist.all_reduce(p)
        phases.append((p / world).tolist())
        d_inter = sum(after[c]["inter_bytes"] - before[c]["inter_bytes"] for c in CATEGORIES)
        d_intra = sum(after[c]["intra_bytes"] - before[c]["intra_bytes"] for c in CATEGORIES)
        t = torch.tensor([dt, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64)
        dist.all_reduce(t[:1], op=dist.ReduceOp.MAX)  # the slowest rank's step
        s = torch.tensor([float(d_inter), float(d_intra), float(loss.item()), float(tx)], dtype=torch.float64)
        dist.all_reduce(s)
        times.append(float(t[0]))
        inter.append(float(s[0]) / world)
        intra.append(float(s[1]) / world)
        losses.append(float(s[2]) / world)
        wire.append(float(s[3]) / (world // node_size))  # per node
    w = cfg["warmup"]
    timed = times[w:] or times
    tail = min(5, len(losses))
    row = {"config": name, **techniques, "steps": cfg["steps"], "warmup": w,
           "step_time_s": statistics.median(timed), "step_times_s": timed,
           "phase_s": {k: statistics.median(ph[i] for ph in (phases[w:] or phases)) for i, k in enumerate(PHASES)},
           "inter_bytes_per_rank": statistics.mean(inter[1:] or inter),
           "intra_bytes_per_rank": statistics.mean(intra[1:] or intra),
           "loss_first": losses[0], "loss_final": losses[-1],
           "loss_final_mean5": sum(losses[-tail:]) / tail, "losses": losses}
    if cfg.get("iface"):
        row["wire_bytes_per_node"] = statistics.mean(wire[1:] or wire)
    return row


def main() -> None:
    cfg = json.load(open(sys.argv[1]))
    rank = int(sys.argv[2])
    world = cfg["world"]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{cfg['store']}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=cfg.get("timeout_s", 300)))
    group = qcoll.new_group(node_size=cfg["node_size"], backend="torch")
    m = cfg["model"]
    model_cfg = gpt.GPTConfig(vocab_size=m["vocab"], block_size=cfg["seq"], n_layer=m["layers"],
                              n_head=m["heads"], d_model=m["d_model"], tie_weights=True)
    language = gpt.MarkovLanguage(m["vocab"], seed=cfg["seed"])
    rows = []
    for i, (name, techniques) in enumerate(cfg["configs"]):
        rows.append(train(cfg, rank, group, language, model_cfg, name, techniques))
        if rank == 0:
            print(f"PROGRESS {i + 1} {len(cfg['configs'])}", flush=True)
    if rank == 0:
        n_params = sum(p.numel() for p in gpt.GPT(model_cfg).parameters())
        with open(cfg["out"], "w") as f:
            json.dump({"rows": rows, "params": n_params, "entropy": language.entropy}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

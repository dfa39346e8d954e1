"""One rank of the `error_feedback` suite (started by _ranks.launch, never by hand).

    python bench/suites/_ef_worker.py CONFIG.json RANK

For every configuration: the GPT of tests/zero/test_zero_convergence.py (tests/support/gpt.py, vocab
16, d_model 64, one layer) under DistributedDataParallel, AdamW, the same seed and the same
synthetic Markov batches, with DDP's default all-reduce or qcoll.ddp's hook at the
configuration's code formats, with or without error feedback. Rank 0 writes the mean loss
over ranks per step, the cross-node bytes per step and the error-feedback memory."""

from __future__ import annotations

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)  # tests/support: the GPT the tests and examples train too

from tests.support import gpt  # noqa: E402

import qcoll  # noqa: E402
import qcoll.ddp  # noqa: E402


def train(cfg: dict, rank: int, group, hook: dict) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    world = cfg["world"]
    torch.manual_seed(cfg["seed"])
    m = cfg["model"]
    model_cfg = gpt.GPTConfig(vocab_size=m["vocab"], block_size=cfg["seq"], n_layer=m["layers"],
                              n_head=m["heads"], d_model=m["d_model"], tie_weights=True)
    model = DDP(gpt.GPT(model_cfg))
    state = qcoll.ddp.QuantizedHookState(group, **{k: v for k, v in hook.items() if k != "default"})
    model.register_comm_hook(state, qcoll.ddp.counted_allreduce_hook if hook.get("default")
                             else qcoll.ddp.quantized_allreduce_hook)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.01)
    language = gpt.MarkovLanguage(m["vocab"], seed=cfg["seed"])
    losses, inter = [], 0.0
    for step in range(cfg["steps"]):
        x, y = language.batch(step, cfg["batch"] * world, cfg["seq"], seed=cfg["seed"])
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        qcoll.reset_stats()
        opt.zero_grad()
        loss = gpt.lm_loss(model(x), y)
        loss.backward()
        opt.step()
        t = torch.tensor([loss.item()], dtype=torch.float64)
        dist.all_reduce(t)
        losses.append(float(t) / world)
        inter = qcoll.stats()["all_reduce"]["inter_bytes"]
    return {"losses": losses, "inter_bytes_per_rank_step": inter,
            "error_feedback_bytes": state.error_feedback_bytes,
            "params": sum(p.numel() for p in model.parameters())}


def main() -> None:
    cfg = json.load(open(sys.argv[1]))
    rank = int(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{cfg['store']}", rank=rank,
                            world_size=cfg["world"], timeout=datetime.timedelta(seconds=cfg.get("timeout_s", 300)))
    group = qcoll.new_group(node_size=cfg["node_size"], backend="torch")
    rows = []
    for i, (name, hook) in enumerate(cfg["configs"]):
        rows.append(dict(config=name, hook=hook, **train(cfg, rank, group, hook)))
        if rank == 0:
            print(f"PROGRESS {i + 1} {len(cfg['configs'])}", flush=True)
    if rank == 0:
        with open(cfg["out"], "w") as f:
            json.dump({"rows": rows}, f)
    dist.barrier()
    qcoll.destroy()  # qcoll's groups first, while the interpreter lives (as the README's teardown)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

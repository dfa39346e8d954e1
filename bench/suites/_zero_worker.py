"""One rank of the `zero` suite (started by _ranks.launch, never by hand).

    python bench/suites/_zero_worker.py CONFIG.json RANK

For every configuration in the config: builds tests/support/gpt.py's GPT from the same seed,
wraps it in qcoll.zero.ZeroEngine (the config's compute dtype, AdamW) on a qcoll group of node_size ranks
per node, or shards it with PyTorch FSDP2 (a "fsdp2" entry: "default" or "qcoll"; see
FSDP2Run), or replicates it with DDP (a "ddp" entry; see DDPRun), or trains it in one
process on the whole global batch in fp32 (a "reference" entry, the fidelity suite's
yardstick; see ReferenceRun), and trains `steps` steps on the same synthetic Markov data (one configuration after another,
or with "interleave" in the config all built first and stepped in turns). Per step: the slowest
rank's time of forward + backward + step (after `warmup` steps), the bytes the engine sent
to other nodes and within the node (engine.stats() deltas, mean per rank), and the loss.
Per step and rank, engine.timings() splits the step's host time into waiting on
all-gathers (issue + wait), reduce-scatters, the optimizer step, and compute (the rest); the
row keeps the median over timed steps of the mean over ranks. Rank 0 prints `PROGRESS done
total` lines and writes the rows as JSON to the config's "out" path."""

from __future__ import annotations

import datetime
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)  # tests/support: the GPT the tests and examples train too

from tests.support import gpt  # noqa: E402

import qcoll  # noqa: E402
from qcoll.zero import ZeroConfig, ZeroEngine  # noqa: E402

CATEGORIES = ("forward_allgather", "backward_allgather", "reduce_scatter")
PHASES = ("compute", "gather", "reduce_scatter", "optimizer")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _tx_bytes(iface) -> int:
    if not iface:
        return 0
    with open(f"/sys/class/net/{iface}/statistics/tx_bytes") as f:
        return int(f.read())


class EngineRun:
    """qcoll.zero.ZeroEngine with the configuration's ZeRO++ techniques."""

    def __init__(self, cfg: dict, group, model, techniques: dict):
        config = ZeroConfig(**techniques, compute_dtype=DTYPES[cfg["dtype"]],
                            max_grad_norm=cfg.get("max_grad_norm", 1.0))
        self.engine = ZeroEngine(model, lambda ps: _adamw(cfg, ps), group, config=config)

    def step(self, x, y):
        self.engine.zero_grad()
        loss = gpt.lm_loss(self.engine(x), y)
        self.engine.backward(loss)
        self.engine.step()
        return loss

    def settle(self) -> None:
        """Wait for what the last step left in flight (stage 2 with overlap_publish)."""
        self.engine.wait_weights()

    def traffic(self) -> tuple:
        s = self.engine.stats()
        return (sum(s[c]["inter_bytes"] for c in CATEGORIES), sum(s[c]["intra_bytes"] for c in CATEGORIES))

    def timings(self) -> dict:
        return self.engine.timings()


def _adamw(cfg: dict, params):
    return torch.optim.AdamW(params, lr=cfg["lr"], weight_decay=cfg.get("weight_decay", 0.01))


class ReferenceRun:
    """The same model in fp32 in this process alone, on the whole global batch (every rank
    computes the same): what the engine rows are compared with. No communication."""

    def __init__(self, cfg: dict, group, model, techniques: dict):
        self.model, self.cfg = model, cfg
        self.optimizer = _adamw(cfg, model.parameters())

    def step(self, x, y):
        x, y = self.global_batch
        self.optimizer.zero_grad(set_to_none=True)
        loss = gpt.lm_loss(self.model(x), y)
        loss.backward()
        if self.cfg.get("max_grad_norm", 1.0) is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.get("max_grad_norm", 1.0))
        self.optimizer.step()
        return loss

    def traffic(self) -> tuple:
        return (0, 0)

    def timings(self) -> dict:
        return {}


class FSDP2Run:
    """PyTorch FSDP2 (fully_shard per block, compute-dtype params, fp32 reduce): its default
    collectives counted under qcoll's rule ("default"), or qcoll.fsdp.use_qcoll with hpZ as
    reshard_after_forward=<node size> ("qcoll"). FSDP2 does not time its collectives: the
    step splits into the optimizer and the rest ("compute": compute and communication)."""

    def __init__(self, cfg: dict, group, model, techniques: dict):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy

        from tests.support import fsdp_training

        mode = techniques["fsdp2"]
        policy = MixedPrecisionPolicy(param_dtype=DTYPES[cfg["dtype"]], reduce_dtype=torch.float32)
        mesh = init_device_mesh("cpu", (cfg["world"],))
        reshard = cfg["node_size"] if mode == "qcoll" else True
        self.model = fsdp_training.shard_blocks(model, mesh, reshard_after_forward=reshard, mp_policy=policy)
        fsdp_training.configure(self.model, mode, cfg["node_size"])
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg["lr"], weight_decay=0.01)
        self.optimizer_s = 0.0

    def step(self, x, y):
        self.optimizer.zero_grad(set_to_none=True)
        loss = gpt.lm_loss(self.model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        t0 = time.perf_counter()
        self.optimizer.step()
        self.optimizer_s += time.perf_counter() - t0
        return loss

    def traffic(self) -> tuple:
        s = qcoll.stats()
        return (sum(s[c]["inter_bytes"] for c in ("allgather", "reduce_scatter")),
                sum(s[c]["intra_bytes"] for c in ("allgather", "reduce_scatter")))

    def timings(self) -> dict:
        return {"optimizer": self.optimizer_s}


class DDPRun:
    """DistributedDataParallel in the config's dtype (parameters and gradients), AdamW: DDP's
    default all-reduce counted under qcoll's rule (qcoll.ddp.counted_allreduce_hook, torch's
    own allreduce_hook: "default"), or qcoll.ddp.quantized_allreduce_hook (int8 in the node,
    int4 across, error feedback: "qcoll"). DDP overlaps its bucket all-reduces with the
    backward, so the step splits into the optimizer and the rest ("compute")."""

    def __init__(self, cfg: dict, group, model, techniques: dict):
        import qcoll.ddp
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.model = DDP(model.to(DTYPES[cfg["dtype"]]))
        state = qcoll.ddp.QuantizedHookState(group, bits=8, inter_bits=4, error_feedback=True)
        hook = (qcoll.ddp.quantized_allreduce_hook if techniques["ddp"] == "qcoll"
                else qcoll.ddp.counted_allreduce_hook)
        self.model.register_comm_hook(state, hook)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg["lr"], weight_decay=0.01)
        self.optimizer_s = 0.0

    step = FSDP2Run.step

    def traffic(self) -> tuple:
        s = qcoll.stats()["all_reduce"]
        return s["inter_bytes"], s["intra_bytes"]

    def timings(self) -> dict:
        return {"optimizer": self.optimizer_s}


def _median_or_none(values: list):
    return None if any(math.isnan(v) for v in values) else statistics.median(values)


class Training:
    """One configuration's run, stepped from outside (train() steps one or several in
    turns), and its row."""

    def __init__(self, cfg: dict, rank: int, group, language, model_cfg, name: str, techniques: dict):
        self.cfg, self.rank, self.language, self.name, self.techniques = cfg, rank, language, name, techniques
        self.iface = cfg.get("iface") if rank % cfg["node_size"] == 0 else None
        torch.manual_seed(cfg["seed"])
        kind = (FSDP2Run if "fsdp2" in techniques else DDPRun if "ddp" in techniques
                else ReferenceRun if "reference" in techniques else EngineRun)
        self.run = kind(cfg, group, gpt.GPT(model_cfg), techniques)
        self.times, self.inter, self.intra, self.wire, self.losses, self.phases = [], [], [], [], [], []
        self.loop = None

    def step(self, step: int) -> None:
        cfg, run, world, rank = self.cfg, self.run, self.cfg["world"], self.rank
        x, y = self.language.batch(step, cfg["batch"] * world, cfg["seq"], seed=cfg["seed"])
        run.global_batch = (x, y)
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        before, t_before = run.traffic(), run.timings()
        dist.barrier()
        tx0 = _tx_bytes(self.iface)
        t0 = time.perf_counter()
        loss = run.step(x, y)
        dt = time.perf_counter() - t0
        dist.barrier()  # every rank done sending: the step's bytes left the veth
        tx = _tx_bytes(self.iface) - tx0
        after, t_after = run.traffic(), run.timings()
        # A phase the run cannot time (FSDP2's collectives) is NaN; compute is the rest.
        spent = {k: t_after[k] - t_before[k] if k in t_after else math.nan
                 for k in ("gather", "reduce_scatter", "optimizer")}
        spent["compute"] = dt - sum(v for v in spent.values() if not math.isnan(v))
        p = torch.tensor([spent[k] for k in PHASES], dtype=torch.float64)
        dist.all_reduce(p)
        self.phases.append((p / world).tolist())
        d_inter, d_intra = after[0] - before[0], after[1] - before[1]
        t = torch.tensor([dt, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64)
        dist.all_reduce(t[:1], op=dist.ReduceOp.MAX)  # the slowest rank's step
        s = torch.tensor([float(d_inter), float(d_intra), float(loss.item()), float(tx)], dtype=torch.float64)
        dist.all_reduce(s)
        self.times.append(float(t[0]))
        self.inter.append(float(s[0]) / world)
        self.intra.append(float(s[1]) / world)
        self.losses.append(float(s[2]) / world)
        self.wire.append(float(s[3]) / (world // cfg["node_size"]))  # per node

    def loop_steps(self) -> None:
        """Steps back to back, no bookkeeping between them, timed as one: work a step leaves
        in flight (stage 2's overlap_publish) is inside the window, not in an untimed gap."""
        cfg, run, world, rank = self.cfg, self.run, self.cfg["world"], self.rank
        dist.barrier()
        t0 = time.perf_counter()
        for step in range(cfg["steps"], cfg["steps"] + cfg["loop_steps"]):
            x, y = self.language.batch(step, cfg["batch"] * world, cfg["seq"], seed=cfg["seed"])
            run.global_batch = (x, y)
            run.step(x.chunk(world)[rank], y.chunk(world)[rank])
        getattr(run, "settle", lambda: None)()
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        self.loop = float(t[0]) / cfg["loop_steps"]

    def row(self) -> dict:
        cfg, losses, w = self.cfg, self.losses, self.cfg["warmup"]
        timed = self.times[w:] or self.times
        tail, long_tail = min(5, len(losses)), min(cfg.get("loss_tail", 5), len(losses))
        row = {"config": self.name, **self.techniques, "steps": cfg["steps"], "warmup": w,
               "step_time_s": statistics.median(timed), "step_times_s": timed,
               "phase_s": {k: _median_or_none([ph[i] for ph in (self.phases[w:] or self.phases)])
                           for i, k in enumerate(PHASES)},
               "inter_bytes_per_rank": statistics.mean(self.inter[1:] or self.inter),
               "intra_bytes_per_rank": statistics.mean(self.intra[1:] or self.intra),
               "loss_first": losses[0], "loss_final": losses[-1],
               "loss_final_mean5": sum(losses[-tail:]) / tail, "loss_tail": long_tail,
               "loss_tail_mean": sum(losses[-long_tail:]) / long_tail, "losses": losses}
        if cfg.get("iface"):
            row["wire_bytes_per_node"] = statistics.mean(self.wire[1:] or self.wire)
        if self.loop is not None:
            row["loop_steps"], row["loop_step_time_s"] = cfg["loop_steps"], self.loop
        return row


def train(cfg: dict, rank: int, group, language, model_cfg, configs: list, progress) -> list:
    """The rows of `configs` ((name, techniques) pairs), every one built first, then stepped
    in turns (A, B, C, A, B, C, ...; one configuration: alone); progress() after each round.
    In turns, load from other jobs that comes and goes on a shared host falls on all of them
    alike, where one configuration after another lets a drift land on one (the auto suite's
    ZeRO++ auto steps ran 0.30 s in their first half and 0.36 s in their second, the config
    before it 0.32 s throughout)."""
    trainings = [Training(cfg, rank, group, language, model_cfg, name, techniques) for name, techniques in configs]
    for step in range(cfg["steps"]):
        for training in trainings:
            training.step(step)
        progress()
    if cfg.get("loop_steps"):
        for training in trainings:
            training.loop_steps()
    return [training.row() for training in trainings]


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
    if cfg.get("interleave"):  # only runs that keep their own counters: FSDP2 and DDP read qcoll.stats()
        if any("fsdp2" in techniques or "ddp" in techniques for _, techniques in cfg["configs"]):
            raise ValueError("interleave: FSDP2 and DDP runs share qcoll.stats() and must run one after another")
        batches = [cfg["configs"]]
    else:
        batches = [[config] for config in cfg["configs"]]
    done, total = 0, len(batches) * cfg["steps"]

    def progress():
        nonlocal done
        done += 1
        if rank == 0:
            print(f"PROGRESS {done} {total}", flush=True)
    rows = [row for configs in batches for row in train(cfg, rank, group, language, model_cfg, configs, progress)]
    if rank == 0:
        n_params = sum(p.numel() for p in gpt.GPT(model_cfg).parameters())
        with open(cfg["out"], "w") as f:
            json.dump({"rows": rows, "params": n_params, "entropy": language.entropy}, f)
    dist.barrier()
    qcoll.destroy()  # qcoll's groups first, while the interpreter lives (as the README's teardown)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

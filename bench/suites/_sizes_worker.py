"""One rank of the sizes suite (started by _ranks.launch, never by hand).

    python bench/suites/_sizes_worker.py CONFIG.json RANK

Per dtype, size and collective: qcoll's unquantized call (bits=None) and torch's same call
at each of the config's thread counts (torch.set_num_threads before each block), in blocks
of back-to-back calls taking turns (timing.balanced_sequence: each block follows each
other kind of block equally often; a barrier before each block only), so that a thread
count's time is compared with the other's measured alike.
Every call's time is kept (the slowest rank's), and each block's total, with the evidence
of what a stalled call waited for (stall_evidence.py): whether a full garbage collection ran
during it on any rank, the steal during its block, and the TCP delayed ACKs sent during the
first call of its block and during its later calls (read outside the timed calls). Rank 0
writes the cells as JSON to the config's "out" path."""

from __future__ import annotations

import datetime
import json
import sys
import time

import os

import torch
import torch.distributed as dist

import qcoll

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from suites.sizes import CONTROL  # noqa: E402  (the cell names' one definition)
from stall_evidence import FullCollections, delayed_acks, steal_seconds  # noqa: E402
from timing import _busy_seconds, _own_seconds, balanced_sequence  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TORCH_AG = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
TORCH_RS = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def calls(collective: str, size: int, dtype, world: int, group, rank: int) -> dict:
    """{"qcoll": fn, "torch": fn} for one cell; size: bytes of the full tensor (all-reduce:
    the tensor; all-gather: its output; reduce-scatter: its input). "control:COLLECTIVE":
    torch's call in both places, timed the same way (the harness's own noise)."""
    if collective.startswith(CONTROL):
        torch_fn = calls(collective[len(CONTROL):], size, dtype, world, group, rank)["torch"]
        return {"qcoll": torch_fn, "torch": torch_fn}
    g = torch.Generator().manual_seed(rank)
    if collective == "all_reduce":
        x = torch.randn(max(1, size // dtype.itemsize), generator=g).to(dtype)

        def torch_ar():
            dist.all_reduce(x)
            x.div_(world)  # gloo has no AVG
        return {"qcoll": lambda: qcoll.quantized_all_reduce(x, group, bits=None), "torch": torch_ar}
    n = max(1, size // (world * dtype.itemsize))
    if collective == "allgather":
        shard, full = torch.randn(n, generator=g).to(dtype), torch.empty(world * n, dtype=dtype)
        return {"qcoll": lambda: qcoll.quantized_allgather(full, shard, group, bits=None),
                "torch": lambda: TORCH_AG(full, shard)}
    inp, out = torch.randn(world * n, generator=g).to(dtype), torch.empty(n, dtype=dtype)

    def torch_rs():
        TORCH_RS(out, inp)
        out.div_(world)
    return {"qcoll": lambda: qcoll.quantized_reduce_scatter(out, inp, group, intra_bits=None,
                                                            inter_bits=None),
            "torch": torch_rs}


# Barriers and the reductions of times run on a group of their own: a barrier on torch's
# group (the baseline's) would leave its threads and sockets warm for the block after it.
SYNC = None


def slowest(values: list) -> list:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=SYNC)
    return t.tolist()


def measure(fns: dict, blocks: int, budget_s: float) -> dict:
    """fns: name -> (fn, threads). Per name: every call's time and every block's total
    (slowest rank's)."""
    for fn, threads in fns.values():  # warm-up; also sizes the blocks
        torch.set_num_threads(threads)
        fn()
    t0 = time.perf_counter()
    for fn, threads in fns.values():
        torch.set_num_threads(threads)
        fn()
    per_call = slowest([time.perf_counter() - t0])[0] / len(fns)
    # At least 4 calls a block below 0.1 s a call: with 2, one disturbed call (this VM's
    # occasional +100 ms) moved a 16 MB cell's 12-call total by a quarter.
    floor = 4 if per_call < 0.1 else 2
    k = int(max(floor, min(20, budget_s / max(per_call, 1e-6) / (blocks * len(fns)))))
    k = int(slowest([k])[0])
    times = {name: [] for name in fns}
    totals = {name: [] for name in fns}
    full_gc = {name: [] for name in fns}
    steal = {name: [] for name in fns}
    first_acks = {name: [] for name in fns}
    later_acks = {name: [] for name in fns}
    names = list(fns)
    cycle = balanced_sequence(len(names))
    turns = -(-blocks * len(names) // len(cycle)) * len(cycle)  # whole cycles: `blocks` or more a call
    wall0, busy0, own0 = time.perf_counter(), _busy_seconds(), _own_seconds()
    with FullCollections() as collections:
        for turn in range(turns):
            name = names[cycle[turn % len(cycle)]]
            fn, threads = fns[name]
            torch.set_num_threads(threads)
            steal0 = steal_seconds()
            dist.barrier(group=SYNC)
            starts, ends = [], []
            acks = delayed_acks()
            start = time.perf_counter()
            for i in range(k):
                c0 = time.perf_counter()
                fn()
                c1 = time.perf_counter()
                starts.append(c0)
                ends.append(c1)
                if i == 0:  # the first call's delayed ACKs, its reading left out of the block
                    after_first = delayed_acks()
                    acks = after_first - acks
                    start += time.perf_counter() - c1
            totals[name].append(time.perf_counter() - start)
            later = delayed_acks() - after_first
            times[name] += [e - s for s, e in zip(starts, ends)]
            full_gc[name] += collections.overlapping(starts, ends)
            steal[name].append(steal_seconds() - steal0)
            first_acks[name].append(float(acks))
            later_acks[name].append(float(later))
    # CPU that processes other than the ranks used meanwhile, in cores (machine-wide).
    wall, busy = time.perf_counter() - wall0, _busy_seconds() - busy0
    own = torch.tensor([_own_seconds() - own0], dtype=torch.float64)
    dist.all_reduce(own, group=SYNC)
    others = max(0.0, busy - own.item()) / wall
    return {name: {"calls_s": slowest(times[name]), "blocks_s": slowest(totals[name]),
                   "calls_per_block": k, "other_cores": slowest([others])[0],
                   "full_gc": slowest(full_gc[name]), "block_steal_s": slowest(steal[name]),
                   "first_call_delayed_acks": slowest(first_acks[name]),
                   "later_calls_delayed_acks": slowest(later_acks[name])} for name in fns}


def main() -> None:
    cfg = json.load(open(sys.argv[1]))
    rank, world = int(sys.argv[2]), cfg["world"]
    dist.init_process_group("gloo", init_method=f"file://{cfg['store']}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=cfg.get("timeout_s", 300)))
    group = qcoll.new_group(node_size=cfg["node_size"], backend="torch")
    global SYNC
    SYNC = dist.new_group(backend="gloo")
    cells, done = [], 0
    for dtype_name, size, collective in cfg["cells"]:
        fns = calls(collective, size, DTYPES[dtype_name], world, group, rank)
        timed = measure({f"{name}@{t}": (fn, t) for t in cfg["threads"] for name, fn in fns.items()},
                        cfg["blocks"], cfg["budget_s"])
        cells.append({"dtype": dtype_name, "bytes": size, "collective": collective, **timed})
        done += 1
        if rank == 0:
            print(f"PROGRESS {done} {len(cfg['cells'])}", flush=True)
    if rank == 0:
        with open(cfg["out"], "w") as f:
            json.dump({"cells": cells}, f)
    dist.barrier()
    qcoll.destroy()  # qcoll's groups first, while the interpreter lives (as the README's teardown)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""One rank of the `auto` suite (started by _ranks.launch, never by hand).

    python bench/suites/_auto_worker.py CONFIG.json RANK

Probes the group's cost model (qcoll.cost_model, bounded by the config's probe budget),
then per size and collective times four calls taking turns (_worker.Bench, the config's
calls_per_turn back to back for calls under 20 ms, at least the config's min_seconds of
timed calls a cell, each round starting one call later: in
a fixed order auto sat third and at 1 MB measured 1.02-1.05x the very fixed call it ran, on
average over 22 runs, the control in fourth place 0.99-1.00x): the uncompressed one, the
quantized one with the collective's default policy, the same configuration with
policy="auto", and the quantized one again ("control": how far two identical calls measure
apart in this cell); next to each, the model's prediction for it. Rank 0 prints `PROGRESS
done total` lines and writes the rows as JSON to the config's "out" path."""

from __future__ import annotations

import datetime
import json
import sys
import time

import torch
import torch.distributed as dist

import qcoll
from qcoll import AllGatherPolicy, AllReducePolicy, ReduceScatterPolicy
from _worker import DTYPES, Bench, _values

# Per collective: the uncompressed call's policy and the configured quantized one.
FIXED = {
    "allgather": {"uncompressed": AllGatherPolicy(bits=None), "quantized": AllGatherPolicy()},
    "reduce_scatter": {"uncompressed": ReduceScatterPolicy.transport(), "quantized": ReduceScatterPolicy()},
    "all_reduce": {"uncompressed": AllReducePolicy(bits=None), "quantized": AllReducePolicy()},
}


def _calls(collective, group, size, dtype, rank, world) -> tuple:
    """{impl: fn} for the four calls, and the numel the model's predict takes."""
    if collective == "allgather":
        n = max(1, size // (world * dtype.itemsize))
        shard, full = _values((rank, size, "ag"), n, dtype, "cpu"), torch.empty(world * n, dtype=dtype)

        def call(policy):
            return lambda: qcoll.quantized_allgather(full, shard, group, **policy)
        numel = n
    elif collective == "reduce_scatter":
        n = max(1, size // (world * dtype.itemsize))
        inp = torch.cat([_values((rank, p, size, "rs"), n, dtype, "cpu") for p in range(world)])
        out = torch.empty(n, dtype=dtype)

        def call(policy):
            return lambda: qcoll.quantized_reduce_scatter(out, inp, group, **policy)
        numel = n
    else:
        numel = max(1, size // dtype.itemsize)
        x, buf = _values((rank, size, "ar"), numel, dtype, "cpu"), torch.empty(numel, dtype=dtype)

        def call(policy):
            def run():
                buf.copy_(x)  # in place: every impl starts from the same values (and pays the copy)
                qcoll.quantized_all_reduce(buf, group, **policy)
            return run
    fixed = FIXED[collective]
    fns = {"uncompressed": call(fixed["uncompressed"].kwargs()), "quantized": call(fixed["quantized"].kwargs()),
           "auto": call(dict(fixed["quantized"].kwargs(), policy="auto")),
           "control": call(fixed["quantized"].kwargs())}
    return fns, numel


def main() -> None:
    cfg = json.load(open(sys.argv[1]))
    rank = int(sys.argv[2])
    world, node_size = cfg["world"], cfg["node_size"]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{cfg['store']}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=cfg.get("timeout_s", 300)))
    group = qcoll.new_group(node_size=node_size, backend="torch")
    t0 = time.perf_counter()
    model = qcoll.cost_model(group, budget_s=cfg["probe_budget_s"])
    probe_s = time.perf_counter() - t0
    b = Bench(cfg, rank)
    dtype = DTYPES[cfg["dtype"]]
    rows, done = [], 0
    total = len(cfg["sizes"]) * len(FIXED)
    for size in cfg["sizes"]:
        for collective in FIXED:
            fns, numel = _calls(collective, group, size, dtype, rank, world)
            timed = b.time_interleaved(fns, calls_per_turn=cfg.get("calls_per_turn", 1), rotate=True,
                                       min_seconds=cfg.get("min_seconds", 0.0))
            decision = [d for k, d in qcoll.auto.decisions(group).items() if k[0] == collective and k[1] == numel]
            row = {"collective": collective, "bytes": size, "numel": numel, "dtype": cfg["dtype"],
                   "auto_choice": decision[0]["choice"], "candidates_predicted_s": decision[0]["predicted_s"],
                   "other_cores": timed["auto"]["other_cores"]}
            for impl in fns:
                row[f"{impl}_s"] = timed[impl]["time_s"]
                row[f"{impl}_times_s"] = timed[impl]["times_s"]
                if "wire_bytes_per_node" in timed[impl]:
                    row[f"{impl}_wire_bytes_per_node"] = timed[impl]["wire_bytes_per_node"]
            for impl, policy in FIXED[collective].items():
                row[f"{impl}_predicted_s"] = model.predict(collective, numel, dtype, policy).seconds
            row["auto_predicted_s"] = decision[0]["predicted_s"][decision[0]["choice"]]
            rows.append(row)
            done += 1
            if rank == 0:
                print(f"PROGRESS {done} {total}", flush=True)
    if rank == 0:
        with open(cfg["out"], "w") as f:
            # The transport's trials of the all-gather paths per size band (Group.gather_paths;
            # the model holds the chosen paths of the bands the probe met).
            trials = {f"{lo}-{hi}": d for (lo, hi), d in group.gather_paths.items()}
            json.dump({"rows": rows, "model": model.to_dict(), "probe_s": probe_s, "gather_trials": trials}, f)
    dist.barrier()
    qcoll.destroy()  # qcoll's groups first, while the interpreter lives (as the README's teardown)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

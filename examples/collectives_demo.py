"""qcoll's collectives on an emulated cluster: N local gloo ranks seen as nodes of
--node-size ranks. For a gradient reduce-scatter and a weight all-gather it prints, next to
torch.distributed's own collective: the error against the exact result, the bytes this
rank sent inside its node and across nodes, and the time.

    python examples/collectives_demo.py [--ranks 4] [--node-size 2] [--numel 4000000]

Under a launcher (torchrun sets RANK, WORLD_SIZE and LOCAL_WORLD_SIZE) each process is one
rank and the node layout is the launcher's: on each of two machines,

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d \
             --rdzv-endpoint HOST0:29400 examples/collectives_demo.py
"""

import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import qcoll


def timed(fn, repeats=3):
    fn()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    dist.barrier()
    return (time.perf_counter() - t0) / repeats


def measure(name, fn, exact, out, stats_key):
    qcoll.reset_stats()
    fn()
    s = qcoll.stats()[stats_key]
    err = ((out.float() - exact).norm() / exact.norm()).item()
    return name, err, s["intra_bytes"], s["inter_bytes"], timed(fn)


def launched() -> bool:
    """True when a launcher (torchrun) started this process as one rank."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def worker(rank, world, node_size, numel, store):
    torch.set_num_threads(1)
    if store is None:  # torchrun: rendezvous and node layout (LOCAL_WORLD_SIZE) from the launcher
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    group = qcoll.new_group(node_size=node_size, backend="torch")
    torch.manual_seed(rank)
    n = numel // world
    grads = torch.randn(world * n, dtype=torch.bfloat16)
    everyone = [torch.empty_like(grads) for _ in range(world)]
    dist.all_gather(everyone, grads)
    exact_rs = torch.stack(everyone).float().mean(0)[rank * n:(rank + 1) * n]
    out = torch.empty(n, dtype=torch.bfloat16)
    rows = [
        measure("reduce-scatter  torch (bf16)",
                lambda: qcoll.quantized_reduce_scatter(out, grads, group, intra_bits=None, inter_bits=None,
                                                       hierarchical=False), exact_rs, out, "reduce_scatter"),
        measure("reduce-scatter  qcoll qgZ int8/int4",
                lambda: qcoll.quantized_reduce_scatter(out, grads, group, pipeline_stages=2),
                exact_rs, out, "reduce_scatter"),
    ]
    shard = grads[:n].contiguous()
    full = torch.empty(world * n, dtype=torch.bfloat16)
    exact_ag = torch.cat([e[:n] for e in everyone]).float()
    rows += [
        measure("all-gather      torch (bf16)",
                lambda: qcoll.quantized_allgather(full, shard, group, bits=None), exact_ag, full, "allgather"),
        measure("all-gather      qcoll qwZ int8",
                lambda: qcoll.quantized_allgather(full, shard, group, bits=8), exact_ag, full, "allgather"),
    ]
    if rank == 0:
        print(f"{world} ranks as {group.num_nodes} nodes x {group.node_size}; {n} elements per rank "
              f"(bf16); bytes sent by rank 0 per call\n")
        print(f"{'collective':38}{'rel. error':>11}{'intra MB':>10}{'inter MB':>10}{'ms':>9}")
        for name, err, intra, inter, secs in rows:
            print(f"{name:38}{err:11.2e}{intra / 1e6:10.2f}{inter / 1e6:10.2f}{secs * 1e3:9.1f}")
        base, q = rows[0][3], rows[1][3]
        print(f"\ncross-node bytes of the gradient reduce-scatter: {q / base:.3f}x of torch's")
    qcoll.destroy()  # qcoll's groups first, while the interpreter lives (as the README's teardown)
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=None, help="local ranks to spawn (default 4)")
    parser.add_argument("--node-size", type=int, default=None, help="ranks per emulated node (default 2)")
    parser.add_argument("--numel", type=int, default=4_000_000)
    args = parser.parse_args()
    if launched():
        if args.ranks is not None or args.node_size is not None:
            parser.error("under torchrun the launcher sets the ranks and the node layout: "
                         "drop --ranks/--node-size")
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), None, args.numel, None)
        return
    args.ranks = 4 if args.ranks is None else args.ranks
    args.node_size = 2 if args.node_size is None else args.node_size
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(args.ranks, args.node_size, args.numel, os.path.join(tmp, "store")),
                 nprocs=args.ranks)


if __name__ == "__main__":
    main()

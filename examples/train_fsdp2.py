"""Train a small GPT (tests/support/gpt.py) with PyTorch FSDP2 (fully_shard per block) and compare
FSDP2's default collectives with FSDP2 + qcoll (ZeRO++: int8 weight all-gather, in-node
backward all-gather, int8/int4 2-hop gradient reduce-scatter).

    python examples/train_fsdp2.py                       # spawns 4 ranks as 2 nodes x 2
    torchrun --nproc-per-node 4 examples/train_fsdp2.py --node-size 2
    torchrun --nnodes 2 --nproc-per-node 8 ... examples/train_fsdp2.py   # real nodes: no --node-size
    python examples/train_fsdp2.py --ranks 6 --node-size 2 --steps 50

Both runs train the same model from the same seed on the same data, one after the other in
the same processes. "FSDP2 default" is fully_shard as shipped (reshard_after_forward=True),
its bytes counted under qcoll's rule by qcoll.fsdp.count_default_collectives; "FSDP2 +
qcoll" is qcoll.fsdp.use_qcoll with reshard_after_forward=<ranks per node> (hpZ). Each
--log-every steps rank 0 prints the loss, step time and the bytes one rank sent to other
nodes; a table puts the two side by side at the end.

CPU: gloo ranks, one thread each; GPUs: NCCL, one process per GPU (several processes share
a single GPU as in train_zero3.py, which proves correctness, not speed).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import torch.distributed as dist

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]  # launch.py beside this file; tests/support from the root

import launch  # noqa: E402
from tests.support import gpt  # noqa: E402  (the GPT the tests and benchmarks use too)
# shard_blocks: fully_shard per block, then the root; configure: qcoll.fsdp.use_qcoll, or FSDP2's
# own collectives with their bytes counted (qcoll.fsdp.count_default_collectives).
from tests.support.fsdp_training import configure, shard_blocks, train_step  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
PHASES = ("forward_allgather", "backward_allgather", "reduce_scatter")


# ---- one rank ---------------------------------------------------------------------------
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ranks", type=int, default=None,
                   help="processes to spawn (default: 4 on CPU, the GPU count on GPUs); ignored under torchrun")
    p.add_argument("--node-size", type=int, default=None,
                   help="ranks per (emulated) node; default: 2 when spawning, the launcher's "
                        "LOCAL_WORLD_SIZE under torchrun")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--runs", choices=("both", "default", "qcoll"), default="both")
    formats = ("8", "4", "int8", "int4", "fp8_e4m3")  # the spellings of a code format

    def code_format(s):
        return int(s) if s.isdigit() else s

    p.add_argument("--weight-bits", type=code_format, choices=[code_format(f) for f in formats], default=8)
    p.add_argument("--grad-bits", type=code_format, nargs=2, choices=[code_format(f) for f in formats],
                   default=(8, 4), metavar=("INTRA", "INTER"))
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="param (compute) dtype; fp32 reduce")
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--vocab", type=int, default=16)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.torchrun = launch.launched()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.backend == "auto":
        args.backend = "nccl" if gpus else "gloo"
    if args.backend == "nccl" and not gpus:
        p.error("--backend nccl needs a GPU")
    if args.torchrun:
        args.ranks = int(os.environ["WORLD_SIZE"])
    elif args.ranks is None:
        args.ranks = gpus if args.backend == "nccl" and gpus > 1 else 4
    if args.node_size is None and not args.torchrun:
        args.node_size = 2 if args.ranks % 2 == 0 else 1
    ns = args.node_size or int(os.environ.get("LOCAL_WORLD_SIZE", args.ranks))
    if args.ranks < 1 or ns < 1 or args.ranks % ns:
        p.error(f"the node size {ns} must divide the {args.ranks} ranks")
    args.nodes = args.ranks // ns
    args.ranks_per_node = ns
    return args


def train(rank, args, device, language, cfg, mode, progress=None):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    world = args.ranks
    torch.manual_seed(args.seed)
    model = gpt.GPT(cfg).to(device)
    mesh = init_device_mesh(device.type, (world,))
    policy = MixedPrecisionPolicy(param_dtype=DTYPES[args.dtype], reduce_dtype=torch.float32)
    reshard = True if mode == "default" else args.ranks_per_node  # hpZ: secondary shard in the node
    shard_blocks(model, mesh, reshard_after_forward=reshard, mp_policy=policy)
    configure(model, mode, args.node_size, weight_bits=args.weight_bits, grad_bits=args.grad_bits)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    name = "FSDP2 default" if mode == "default" else "FSDP2 + qcoll"

    def step(x, y):
        return train_step(model, optimizer, x, y, gpt.lm_loss, max_grad_norm=1.0)

    return launch.train_loop(name, args, rank, device, language, step, progress, width=14)


def worker(rank, args, store=None):
    device = launch.setup(rank, args.ranks, args.backend, store)
    rank = dist.get_rank()
    language = gpt.MarkovLanguage(args.vocab, seed=args.seed)
    cfg = gpt.GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                        d_model=args.d_model, tie_weights=True)
    n_params = sum(p.numel() for p in gpt.GPT(cfg).parameters())
    header = [f"GPT {args.layers} layers, d_model {args.d_model}, vocab {args.vocab}, "
              f"{n_params / 1e3:.1f}K parameters, fully_shard per block; {args.ranks} ranks as "
              f"{args.nodes} node(s) x {args.ranks_per_node} on {device.type} ({args.backend}); "
              f"{args.dtype} params, fp32 reduce; batch {args.batch} x {args.seq} tokens per rank",
              f"loss: ln(vocab) = {math.log(args.vocab):.3f} at the start, "
              f"the language's entropy rate {language.entropy:.3f} at best"]
    modes = {"both": ("default", "qcoll"), "default": ("default",), "qcoll": ("qcoll",)}[args.runs]
    launch.run_all(rank, header,
                   [lambda progress, mode=mode: train(rank, args, device, language, cfg, mode, progress)
                    for mode in modes],
                   lambda console, results: report(console, results, args), width=14)


# ---- report -----------------------------------------------------------------------------
def report(console, results, args):
    console.print(launch.comparison_table(
        f"{args.steps} steps, {args.ranks} ranks ({args.nodes} nodes x {args.ranks_per_node}), {args.dtype} "
        "params; bytes: mean per rank per step sent to other nodes", results, launch.summary_rows(results, PHASES)))
    if args.backend == "gloo":
        console.print(launch.LOOPBACK_NOTE)


def main(argv=None):
    launch.run(worker, parse_args(argv))


if __name__ == "__main__":
    main()

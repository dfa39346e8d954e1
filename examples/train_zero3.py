"""Train a small GPT (tests/support/gpt.py) with qcoll's ZeRO-3 engine on N local processes seen
as nodes of --node-size ranks, and compare plain ZeRO-3 with ZeRO++ (qwZ + hpZ + qgZ).

    python examples/train_zero3.py                      # ZeRO-3 vs ZeRO++, 4 ranks as 2x2
    python examples/train_zero3.py --no-qgz --steps 50  # one run: qwZ + hpZ only
    python examples/train_zero3.py --ranks 6 --node-size 3 --dtype fp16

Each step prints (on rank 0) the loss, the step time and the bytes this rank sent to other
nodes (qcoll's accounting: payload, scales and padding). With --compare (the default when
no technique flag is given) both configurations train the same model from the same seed
on the same data, one after the other in the same processes, and a table puts them side
by side.

CPU: gloo ranks, one thread each. GPUs: NCCL, one process per GPU; with a single GPU,
several processes share it (each gets its own NCCL host id and NCCL talks over loopback
sockets, see docs/emulators.md), which proves correctness, not speed. --backend
gloo forces CPU; --qcoll-backend torch sends qcoll's traffic through the torch
ProcessGroup instead of qcoll's own NCCL communicators.

The data is a fixed random second-order Markov language (tests/support/gpt.py): the loss falls
from ln(vocab) towards the chain's entropy rate, printed at the start.

Under a launcher (torchrun sets RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE) each
process is one rank and the node layout is the launcher's (no --ranks / --node-size): on
each of two machines,

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d \
             --rdzv-endpoint HOST0:29400 examples/train_zero3.py --steps 50
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]  # launch.py beside this file; tests/support from the root

import launch  # noqa: E402
from tests.support import gpt  # noqa: E402  (the GPT the tests and benchmarks use too)

import qcoll  # noqa: E402
from qcoll.zero import ZeroConfig, ZeroEngine  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CATEGORIES = ("forward_allgather", "backward_allgather", "reduce_scatter")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ranks", type=int, default=None, help="processes (default: 4 on CPU, the GPU count on GPUs)")
    p.add_argument("--node-size", type=int, default=None, help="ranks per emulated node (default 2)")
    p.add_argument("--steps", type=int, default=200)
    for name, what in (("qwz", "int8 forward weight all-gather"), ("hpz", "in-node backward all-gather"),
                       ("qgz", "int8/int4 2-hop gradient reduce-scatter")):
        p.add_argument(f"--{name}", action=argparse.BooleanOptionalAction, default=None,
                       help=f"{what} (with any of these flags: one run, techniques not named stay on)")
    p.add_argument("--compare", action="store_true",
                   help="run ZeRO-3 (all off) and ZeRO++ (all on) and compare; the default without technique flags")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="compute dtype (fp32 master weights)")
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                   help="torch.distributed backend (auto: nccl when a GPU is present)")
    p.add_argument("--qcoll-backend", choices=("auto", "nccl", "torch"), default="auto",
                   help="qcoll's transport: its own NCCL communicators, or the torch ProcessGroup "
                        "(auto: NCCL for CUDA tensors)")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--vocab", type=int, default=16)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--log-every", type=int, default=25, help="print a line every N steps")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.backend == "auto":
        args.backend = "nccl" if gpus else "gloo"
    if args.backend == "nccl" and not gpus:
        p.error("--backend nccl needs a GPU")
    if args.qcoll_backend == "nccl" and args.backend != "nccl":
        p.error("--qcoll-backend nccl needs GPUs (--backend nccl)")
    args.launched = launch.launched()
    if args.launched:
        if args.ranks is not None or args.node_size is not None:
            p.error("under torchrun the launcher sets the ranks and the node layout: drop --ranks/--node-size")
        args.ranks = int(os.environ["WORLD_SIZE"])
        args.node_size = int(os.environ.get("LOCAL_WORLD_SIZE", args.ranks))
    if args.node_size is None:
        args.node_size = 2
    if args.ranks is None:
        args.ranks = gpus if args.backend == "nccl" and gpus > 1 else 4
    if args.ranks < 1 or args.node_size < 1 or args.ranks % args.node_size:
        p.error(f"--node-size {args.node_size} must divide --ranks {args.ranks}")
    flags = {k: getattr(args, k) for k in ("qwz", "hpz", "qgz")}
    if args.compare or all(v is None for v in flags.values()):
        args.runs = [("ZeRO-3", dict(qwz=False, hpz=False, qgz=False)), ("ZeRO++", dict(qwz=True, hpz=True, qgz=True))]
    else:
        on = {k: v is not False for k, v in flags.items()}  # unnamed techniques stay on
        names = {"qwz": "qwZ", "hpz": "hpZ", "qgz": "qgZ"}
        name = ("ZeRO++" if all(on.values()) else "+".join(names[k] for k, v in on.items() if v) or "ZeRO-3")
        args.runs = [(name, on)]
    return args


# ---- one rank ----------------------------------------------------------------------------
def train(rank, args, device, group, language, cfg, name, techniques, progress=None):
    torch.manual_seed(args.seed)
    model = gpt.GPT(cfg).to(device)
    config = ZeroConfig(**techniques, compute_dtype=DTYPES[args.dtype], max_grad_norm=args.max_grad_norm)
    engine = ZeroEngine(model, lambda ps: torch.optim.AdamW(ps, lr=args.lr, weight_decay=0.01), group,
                        config=config)
    skipped = 0

    def step(x, y):
        nonlocal skipped
        before = engine.stats()
        engine.zero_grad()
        loss = gpt.lm_loss(engine(x), y)
        engine.backward(loss)
        skipped += not engine.step()
        after = engine.stats()
        return loss, [after[c]["inter_bytes"] - before[c]["inter_bytes"] for c in CATEGORIES]

    result = launch.train_loop(name, args, rank, device, language, step, progress)
    return dict(result, skipped=skipped, stats=engine.stats())


def worker(rank, args, store):
    device = launch.setup(rank, args.ranks, args.backend, store)
    group = qcoll.new_group(node_size=None if args.launched else args.node_size,  # launcher: LOCAL_WORLD_SIZE
                            backend=None if args.qcoll_backend == "auto" else args.qcoll_backend)
    language = gpt.MarkovLanguage(args.vocab, seed=args.seed)
    cfg = gpt.GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                        d_model=args.d_model, tie_weights=True)
    n_params = sum(p.numel() for p in gpt.GPT(cfg).parameters())
    header = [f"GPT {args.layers} layers, d_model {args.d_model}, vocab {args.vocab}, "
              f"{n_params / 1e3:.1f}K parameters; {args.ranks} ranks as {args.ranks // args.node_size} "
              f"node(s) x {args.node_size} on {device.type} ({args.backend}); {args.dtype} compute; "
              f"batch {args.batch} x {args.seq} tokens per rank",
              f"loss: ln(vocab) = {math.log(args.vocab):.3f} at the start, "
              f"the language's entropy rate {language.entropy:.3f} at best"]
    launch.run_all(rank, header,
                   [lambda progress, n=name, t=techniques: train(rank, args, device, group, language, cfg, n, t,
                                                                 progress)
                    for name, techniques in args.runs],
                   lambda console, results: report(console, results, args))


# ---- report ------------------------------------------------------------------------------
def report(console, results, args):
    rows = launch.summary_rows(results, CATEGORIES)
    if any(r["skipped"] for r in results):
        rows.append(("skipped steps (fp16 overflow)", [r["skipped"] for r in results], str))
    console.print(launch.comparison_table(
        f"{args.steps} steps, {args.ranks} ranks ({args.ranks // args.node_size} nodes x {args.node_size}), "
        f"{args.dtype}; bytes: mean per rank per step sent to other nodes", results, rows))
    if args.backend == "gloo":
        console.print(launch.LOOPBACK_NOTE)


def main(argv=None):
    launch.run(worker, parse_args(argv))


if __name__ == "__main__":
    main()

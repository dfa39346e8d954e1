"""qcoll under Hugging Face Accelerate: Accelerate's FSDP2 plug-in shards the model, then
qcoll.fsdp.use_qcoll puts qcoll's collectives into the FSDP2 groups Accelerate made
(int8 weight all-gather, int8/int4 2-hop gradient reduce-scatter). See docs/accelerate.md.

    torchrun --nproc-per-node 8 examples/accelerate_fsdp2.py              # FSDP2 + qcoll
    torchrun --nproc-per-node 8 examples/accelerate_fsdp2.py --no-qcoll  # FSDP2 alone
    accelerate launch --num-processes 8 examples/accelerate_fsdp2.py
    torchrun --nnodes 2 --nproc-per-node 8 ... examples/accelerate_fsdp2.py  # nodes from LOCAL_WORLD_SIZE

It trains a tiny transformers GPT-2 (from a config, no download) on the synthetic Markov
language of gpt.py, prints the loss and writes the losses as JSON with --json. Accelerate
applies FSDP on two or more GPUs only: elsewhere (one GPU, CPUs) it reports another
distributed type and leaves the model whole, and this script stops saying so.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpt  # noqa: E402

import qcoll  # noqa: E402
import qcoll.fsdp  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--per-rank", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--no-qcoll", action="store_true", help="FSDP2's own collectives (the baseline)")
    p.add_argument("--node-size", type=int, default=None,
                   help="ranks per node (default: LOCAL_WORLD_SIZE, i.e. real nodes)")
    p.add_argument("--json", default=None, help="write the run's losses and facts here (main process)")
    args = p.parse_args()

    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.utils import DistributedType
    from transformers import GPT2Config, GPT2LMHeadModel

    # 1. Accelerate's FSDP2: one FSDP group per transformer block (the model's
    #    _no_split_modules), the embedding / final norm / head groups, the root; bf16 policy.
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            reshard_after_forward=True)
    accelerator = Accelerator(fsdp_plugin=plugin, mixed_precision="bf16")
    if accelerator.distributed_type != DistributedType.FSDP:
        sys.exit(f"Accelerate chose {accelerator.distributed_type.value}, not FSDP: it shards with FSDP on two "
                 "or more GPUs only (run under torchrun / accelerate launch with --nproc-per-node >= 2)")

    torch.manual_seed(0)
    vocab, seq = 64, 32
    model = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=128, n_layer=4, n_head=4,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)

    # 2. qcoll's collectives on every FSDP2 group Accelerate made (after prepare: it shards).
    if not args.no_qcoll:
        qcoll.fsdp.use_qcoll(model, weight_bits=8, grad_intra_bits=8, grad_inter_bits=4, node_size=args.node_size)
    qcoll.reset_stats()

    rank, world = accelerator.process_index, accelerator.num_processes
    language = gpt.MarkovLanguage(vocab)
    losses = []
    for step in range(args.steps):
        x, y = language.batch(step, args.per_rank * world, seq)
        x, y = x.chunk(world)[rank].to(accelerator.device), y.chunk(world)[rank].to(accelerator.device)
        loss = gpt.lm_loss(model(input_ids=x).logits, y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), reduction="mean").item())
        if step % 10 == 0 or step == args.steps - 1:
            accelerator.print(f"step {step:4d}  loss {losses[-1]:.4f}")

    stats = qcoll.stats()
    if accelerator.is_main_process:
        mode = "FSDP2 alone" if args.no_qcoll else "FSDP2 + qcoll"
        print(f"{mode}: final loss {sum(losses[-10:]) / min(10, len(losses)):.4f} (entropy of the language "
              f"{language.entropy():.4f}); qcoll all-gathers {stats['allgather']['calls']}, reduce-scatters "
              f"{stats['reduce_scatter']['calls']}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"distributed_type": accelerator.distributed_type.value, "losses": losses,
                           "qcoll_allgather_calls": stats["allgather"]["calls"],
                           "qcoll_reduce_scatter_calls": stats["reduce_scatter"]["calls"]}, f)
    accelerator.end_training()


if __name__ == "__main__":
    main()

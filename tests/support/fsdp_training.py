"""FSDP2 set-up and one training step, shared by examples/train_fsdp2.py, the FSDP2 tests
(tests/plugins/test_fsdp.py, test_hsdp.py, test_ddp.py) and the zero benchmark
(bench/suites/_zero_worker.py): fully_shard per block, then FSDP2's default collectives
(counted) or qcoll's."""

from __future__ import annotations

import torch
import torch.nn as nn

import qcoll
import qcoll.fsdp


def shard_blocks(model: nn.Module, mesh, *, reshard_after_forward=True, mp_policy=None) -> nn.Module:
    """fully_shard every block (each child of a ModuleList / Sequential holding parameters),
    then the root for the rest: the usual FSDP2 wrapping of a transformer."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs = dict(mesh=mesh, reshard_after_forward=reshard_after_forward,
                  mp_policy=mp_policy or MixedPrecisionPolicy())
    blocks = [child for m in model.modules() if isinstance(m, (nn.ModuleList, nn.Sequential))
              for child in m.children() if any(True for _ in child.parameters())]
    for block in blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def configure(model: nn.Module, mode: str, node_size=None, *, weight_bits=8, grad_bits=(8, 4),
              stages: int = 2) -> nn.Module:
    """mode "default": FSDP2's own collectives, counted in qcoll.stats(); "qcoll": use_qcoll."""
    if mode == "default":
        return qcoll.fsdp.count_default_collectives(model, node_size=node_size)
    return qcoll.fsdp.use_qcoll(model, weight_bits=weight_bits, grad_intra_bits=grad_bits[0],
                                grad_inter_bits=grad_bits[1], grad_pipeline_stages=stages,
                                node_size=node_size)


def _inter_bytes() -> tuple:
    s = qcoll.stats()
    return s["allgather"]["inter_bytes"], s["reduce_scatter"]["inter_bytes"]


def train_step(model, optimizer, x, y, loss_fn, max_grad_norm=None):
    """One step; returns (local loss, cross-node bytes this rank sent per phase)."""
    ag0, rs0 = _inter_bytes()
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), y)
    ag1, _ = _inter_bytes()
    loss.backward()
    if max_grad_norm:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    ag2, rs2 = _inter_bytes()
    return loss.detach(), (ag1 - ag0, ag2 - ag1, rs2 - rs0)

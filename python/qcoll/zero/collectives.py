"""The engine's three collectives, all through qcoll so every byte is counted alike:
forward all-gather (qwZ or baseline), backward all-gather (hpZ's in-node gather, or the
forward one again) and the gradient reduce-scatter (qgZ or baseline)."""

from __future__ import annotations

import torch

from .. import collectives as qc
from ..group import Group
from .config import ZeroConfig
from .flat_unit import FlatUnit

CATEGORIES = ("forward_allgather", "backward_allgather", "reduce_scatter")


class EngineCollectives:
    def __init__(self, config: ZeroConfig, group: Group, hpz_group: Group):
        self.config = config
        self.group = group
        self.hpz_group = hpz_group
        self.counters = {c: {"calls": 0, "intra_bytes": 0, "inter_bytes": 0} for c in CATEGORIES}
        self._uncounted = []  # (category, Work) of calls whose bytes are not in counters yet

    def _counted(self, category: str, call, async_op: bool = True):
        """Issue a qcoll call (it runs on the group's thread) and charge its own bytes,
        from its Work, to `category` once it has completed."""
        work = call(True)
        self._uncounted.append((category, work))
        self._count(wait=False)
        if async_op:
            return work
        work.wait()
        return None

    def _count(self, wait: bool) -> None:
        while self._uncounted and (wait or self._uncounted[0][1].is_completed()):
            category, work = self._uncounted.pop(0)
            work.wait()
            for key, value in self.counters[category].items():
                self.counters[category][key] = value + work.traffic[key]

    def gather_forward(self, unit: FlatUnit, async_op: bool):
        unit.allocate()
        bits = self.config.weight_bits if self.config.qwz else None
        return self._counted("forward_allgather", lambda a: qc.quantized_allgather(
            unit.full, unit.compute_shard, self.group, bits=bits, group_size=self.config.group_size,
            async_op=a), async_op)

    def keep_secondary(self, unit: FlatUnit) -> None:
        """hpZ: keep this rank's part of the gathered weights for the backward gather."""
        n = self.hpz_group.size
        part = unit.padded_numel // n
        r = self.hpz_group.rank
        unit.secondary = unit.full[r * part:(r + 1) * part].clone()

    def gather_backward(self, unit: FlatUnit, async_op: bool):
        if not self.config.hpz:
            category_call = lambda a: qc.quantized_allgather(  # noqa: E731 - the forward gather again
                unit.full, unit.compute_shard, self.group,
                bits=self.config.weight_bits if self.config.qwz else None,
                group_size=self.config.group_size, async_op=a)
        else:
            # The secondary shard holds exactly the weights forward used; no re-quantization.
            category_call = lambda a: qc.quantized_allgather(  # noqa: E731
                unit.full, unit.secondary, self.hpz_group, bits=None, async_op=a)
        unit.allocate()
        return self._counted("backward_allgather", category_call, async_op)

    def reduce_grads(self, unit: FlatUnit) -> None:
        grad = unit.flat_grad()
        shard = torch.empty(unit.shard_numel, dtype=grad.dtype, device=grad.device)
        cfg = self.config
        if cfg.qgz:
            call = lambda a: qc.quantized_reduce_scatter(  # noqa: E731
                shard, grad, self.group, op="avg", intra_bits=cfg.grad_intra_bits,
                inter_bits=cfg.grad_inter_bits, group_size=cfg.group_size,
                pipeline_stages=cfg.grad_pipeline_stages, async_op=a)
        else:
            call = lambda a: qc.quantized_reduce_scatter(  # noqa: E731
                shard, grad, self.group, op="avg", intra_bits=None, inter_bits=None,
                hierarchical=False, async_op=a)
        self._counted("reduce_scatter", call, async_op=False)
        unit.accumulate_grad_shard(shard)

    def stats(self) -> dict:
        self._count(wait=True)
        return {c: dict(v) for c, v in self.counters.items()}

"""The engine's three collectives, all through qcoll: forward all-gather (qwZ or baseline),
backward all-gather (hpZ's in-node gather from the secondary shard, or the forward one
again) and the gradient reduce-scatter (qgZ or baseline). Stage 2 has no gathers in forward
or backward: its weight all-gather after each step (qWD's delta_allgather, qwZ's quantized
all-gather or the baseline) is what feeds forward, and is counted as "forward_allgather".

Bytes are charged per call from the call's own Work.traffic (the C++ core counts them by
qcoll.stats' rule), so the counts stay right when calls run asynchronously and interleave.
Host time spent issuing and waiting on each kind of call is kept too (the zero suite's
breakdown).
"""

from __future__ import annotations

import time
from typing import List, Optional

import torch

from ..all_gather import quantized_allgather
from ..delta import delta_allgather
from ..reduce_scatter import quantized_reduce_scatter
from ..group import Group
from .config import ZeroConfig
from .flat_param import FlatParam

CATEGORIES = ("forward_allgather", "backward_allgather", "reduce_scatter")
_FIELDS = ("calls", "intra_bytes", "inter_bytes")
MAX_REDUCES_IN_FLIGHT = 2


def _completed(work) -> bool:
    return work is None or work.is_completed()


class EngineComms:
    def __init__(self, config: ZeroConfig, group: Group, hpz_group: Group):
        self.config = config
        self.group = group
        self.hpz_group = hpz_group
        self.counters = {c: dict.fromkeys(_FIELDS, 0) for c in CATEGORIES}
        self.seconds = {"gather": 0.0, "reduce_scatter": 0.0}
        self._uncharged: List[tuple] = []  # (category, Work) whose bytes are not counted yet
        self._pending_reduce: List[tuple] = []  # (flat, shard, work) of reduce-scatters in flight

    # ---- accounting ----------------------------------------------------------------------
    def _issued(self, category: str, work):
        """Charge a call's bytes to `category` (once it completes; see _settle)."""
        self._uncharged.append((category, work))
        self._settle(wait=False)
        return work

    def _settle(self, wait: bool) -> None:
        while self._uncharged and (wait or _completed(self._uncharged[0][1])):
            category, work = self._uncharged.pop(0)
            work.wait()
            for field in _FIELDS:
                self.counters[category][field] += work.traffic[field]

    def timed(self, kind: str, fn):
        start = time.perf_counter()
        try:
            return fn()
        finally:
            self.seconds[kind] += time.perf_counter() - start

    # ---- all-gathers -------------------------------------------------------------------
    def _gather_weights(self, flat: FlatParam):
        return quantized_allgather(flat.full, flat.compute_shard, self.group, async_op=True,
                                      **self.config.weight_policy.kwargs())

    def gather_forward(self, flat: FlatParam):
        return self._issued("forward_allgather", self.timed("gather", lambda: self._gather_weights(flat)))

    def keep_secondary(self, flat: FlatParam) -> None:
        """hpZ: keep this rank's part of the gathered weights for the backward gather."""
        part = flat.padded_numel // self.hpz_group.size
        r = self.hpz_group.rank
        flat.secondary = flat.full[r * part:(r + 1) * part].clone()

    def gather_backward(self, flat: FlatParam):
        # The forward gather again: without hpZ, or where no secondary shard is kept (an
        # earlier backward of the same forward weights used and dropped it: forward, forward,
        # backward, backward); the weights are the ones forward used either way.
        if not self.config.hpz or flat.secondary is None:
            return self._issued("backward_allgather", self.timed("gather", lambda: self._gather_weights(flat)))
        # The secondary shard holds exactly the weights forward used; no re-quantization.
        return self._issued("backward_allgather", self.timed("gather", lambda: quantized_allgather(
            flat.full, flat.secondary, self.hpz_group, bits=None, async_op=True)))

    def publish_weights(self, flat: FlatParam, source: Optional[torch.Tensor] = None):
        """Stage 2, after the optimizer step: the updated shard into every rank's full buffer.
        source: gather this partition exactly instead (the transport's all-gather in the
        compute dtype; at start and after a load). Returns the call's Work."""
        if source is not None:
            issue = lambda: quantized_allgather(flat.full, source, self.group, bits=None, async_op=True)
        elif self.config.qwd:
            issue = lambda: delta_allgather(flat.full, flat.compute_shard, self.group, async_op=True,
                                            **self.config.weight_policy.kwargs())
        else:
            issue = lambda: self._gather_weights(flat)
        return self._issued("forward_allgather", self.timed("gather", issue))

    # ---- gradients -----------------------------------------------------------------------
    def reduce_grads(self, flat: FlatParam) -> None:
        """Start the reduce-scatter of this rank's gradient; finish_reduces() adds the result
        to the fp32 gradient shard."""
        grad = flat.flat_grad()
        shard = torch.empty(flat.shard_numel, dtype=grad.dtype, device=grad.device)
        kwargs = self.config.grad_policy.kwargs()
        work = self._issued("reduce_scatter", self.timed("reduce_scatter", lambda: quantized_reduce_scatter(
            shard, grad, self.group, op="avg", async_op=True, **kwargs)))
        self._pending_reduce.append((flat, shard, grad, work))
        # Accumulate what has completed; keep at most MAX_REDUCES_IN_FLIGHT gradient buffers.
        while self._pending_reduce and (len(self._pending_reduce) > MAX_REDUCES_IN_FLIGHT
                                        or _completed(self._pending_reduce[0][3])):
            self._finish_one()

    def _finish_one(self) -> None:
        flat, shard, _grad, work = self._pending_reduce.pop(0)  # _grad stays alive until done
        if work is not None:
            self.timed("reduce_scatter", work.wait)
        flat.accumulate_grad_shard(shard)

    def finish_reduces(self) -> None:
        """Wait for every reduce-scatter in flight, in issue order, and accumulate."""
        while self._pending_reduce:
            self._finish_one()

    def stats(self) -> dict:
        self._settle(wait=True)
        return {c: dict(v) for c, v in self.counters.items()}

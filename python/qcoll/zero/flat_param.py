"""One flat buffer of a ZeRO-3 unit: parameters of one kind (all trainable, or all frozen)
flattened into one buffer and partitioned over the group.

Each rank keeps the fp32 master shard (what the optimizer updates), its compute-dtype copy
(what the all-gathers send) and the fp32 gradient shard. The full compute-dtype buffer
exists only while the unit is gathered: its storage is resized to 0 when freed and back when
gathered, so views of it (tensors autograd saved) stay valid across gathers. While freed,
each parameter holds an empty placeholder (as in DeepSpeed's ZeRO-3), so code that reads it
outside forward sees an empty tensor, not memory that is no longer there; gathering points
it back at its view (a parameter autograd saved is the same object, so backward finds its
weights once the unit is gathered again).
Which state the buffer is in is the unit's business (unit.py); this class only holds memory.
Stage 2 (`resident`): the full buffer is never freed; the engine keeps it current on every
rank after each step.
"""

from __future__ import annotations

import math
from typing import List, Optional

import torch
import torch.nn as nn


class FlatParam:
    def __init__(self, index: int, params: List[nn.Parameter], names: List[str], world: int, rank: int,
                 compute_dtype: torch.dtype, resident: bool = False):
        for name, p in zip(names, params):
            if not p.is_floating_point():
                raise TypeError(f"parameter {name} has dtype {p.dtype}; ZeRO-3 shards floating-point "
                                "parameters only")
        self.index = index
        self.params = params
        self.names = names
        self.shapes = [p.shape for p in params]
        self.numels = [p.numel() for p in params]
        self.offsets = [0]
        for n in self.numels[:-1]:
            self.offsets.append(self.offsets[-1] + n)
        self.numel = sum(self.numels)
        self.shard_numel = max(1, math.ceil(self.numel / world))  # padded: world * shard_numel
        self.padded_numel = world * self.shard_numel
        self.rank = rank
        self.compute_dtype = compute_dtype
        self.requires_grad = params[0].requires_grad
        self.resident = resident
        device = params[0].device

        flat = torch.zeros(self.padded_numel, dtype=torch.float32, device=device)
        with torch.no_grad():
            for p, off, n in zip(params, self.offsets, self.numels):
                flat[off:off + n].copy_(p.detach().reshape(-1))
        self.master = nn.Parameter(self.shard_of(flat).clone(), requires_grad=self.requires_grad)
        self.compute_shard = self.master.detach().to(compute_dtype)
        self.full = torch.empty(self.padded_numel, dtype=compute_dtype, device=device)
        self.secondary: Optional[torch.Tensor] = None  # hpZ's copy of part of `full`
        self._views = [self.full[off:off + n].view(shape)
                       for off, n, shape in zip(self.offsets, self.numels, self.shapes)]
        self._placeholder = torch.empty(0, dtype=compute_dtype, device=device)
        self._point_params_at(self._views)
        self.free()

    def shard_of(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's partition of a padded flat buffer."""
        begin = self.rank * self.shard_numel
        return flat[begin:begin + self.shard_numel]

    # ---- full buffer lifetime ----------------------------------------------------------
    def allocate(self) -> None:
        storage = self.full.untyped_storage()
        nbytes = self.padded_numel * self.full.element_size()
        if storage.size() != nbytes:
            storage.resize_(nbytes)
            self._point_params_at(self._views)

    def free(self) -> None:
        if self.resident:
            return
        self.full.untyped_storage().resize_(0)
        self._point_params_at([self._placeholder] * len(self.params))

    def _point_params_at(self, tensors: List[torch.Tensor]) -> None:
        for p, t in zip(self.params, tensors):
            p.data = t

    # ---- gradients ---------------------------------------------------------------------
    def flat_grad(self) -> torch.Tensor:
        """This rank's gradient of the whole buffer, in the compute dtype, padded."""
        grad = torch.zeros(self.padded_numel, dtype=self.compute_dtype, device=self.full.device)
        for p, off, n in zip(self.params, self.offsets, self.numels):
            if p.grad is not None:
                grad[off:off + n].copy_(p.grad.reshape(-1))
                p.grad = None
        return grad

    def accumulate_grad_shard(self, shard: torch.Tensor) -> None:
        shard = shard.float()
        # The padding past the last parameter gets no gradient (a Hadamard-smoothed
        # reduce-scatter would leave noise there): masters and optimizer state stay zero in it,
        # so a checkpoint need not hold it and resumes exactly on any world size.
        shard[max(0, self.numel - self.rank * self.shard_numel):].zero_()
        if self.master.grad is None:
            self.master.grad = shard
        else:
            self.master.grad.add_(shard)

    # ---- weights -------------------------------------------------------------------------
    def refresh_compute_shard(self) -> None:
        self.compute_shard.copy_(self.master.detach())

    def flatten(self, tensors: List[torch.Tensor]) -> torch.Tensor:
        """The padded fp32 flat buffer of full parameter values, in this buffer's order."""
        flat = torch.zeros(self.padded_numel, dtype=torch.float32, device=self.master.device)
        for t, off, n in zip(tensors, self.offsets, self.numels):
            flat[off:off + n].copy_(t.reshape(-1))
        return flat

    def unflatten(self, flat: torch.Tensor) -> dict:
        return {name: flat[off:off + n].view(shape).clone()
                for name, off, n, shape in zip(self.names, self.offsets, self.numels, self.shapes)}

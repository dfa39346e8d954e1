"""ZeroEngine: ZeRO-3 for any nn.Module on qcoll's collectives (qwZ, hpZ, qgZ).

Each module that owns parameters directly is a unit (flat_unit.py). A unit is gathered
right before a module that uses it runs forward (and again before its backward), freed
after, and its gradient is reduce-scattered into the fp32 gradient shards as soon as
autograd has accumulated all of it. The optimizer only ever sees the fp32 master shards.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ..collectives import quantized_allgather
from ..group import Group, _partition_groups, _subgroup, new_group, resolve_group
from .collectives import EngineCollectives
from .config import ZeroConfig
from .flat_unit import FlatUnit
from .loss_scaler import LossScaler


def _hpz_group(group: Group, size: Optional[int]) -> Group:
    """hpZ's group: `size` consecutive ranks inside a node (default: the whole node)."""
    size = group.node_size if size is None else size
    if group.node_size % size:
        raise ValueError(f"hpz_group_size={size} must divide the node size {group.node_size}")
    if size == group.node_size:
        return group.intra
    blocks = [group.global_ranks[s:s + size] for s in range(0, group.size, size)]
    mine = _partition_groups(blocks, group.global_ranks)[group.rank // size]
    if mine is None:  # one rank: its secondary shard is the whole gathered weight
        return _subgroup(None, blocks[group.rank // size], node_size=1, backend=group.backend)
    return new_group(mine, node_size=size, backend=group.backend)


def _cast_inputs(value, dtype: torch.dtype):
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        return type(value)(_cast_inputs(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast_inputs(v, dtype) for k, v in value.items()}
    return value


class ZeroEngine:
    def __init__(self, model: nn.Module, optimizer_factory: Callable, group=None, *,
                 config: ZeroConfig = ZeroConfig()):
        if not isinstance(config, ZeroConfig):
            raise TypeError(f"config must be a qcoll.zero.ZeroConfig, got {type(config).__name__}")
        self.module = model
        self.config = config
        self.group = resolve_group(group)
        self.comm = EngineCollectives(config, self.group, _hpz_group(self.group, config.hpz_group_size)
                                      if config.hpz else self.group)
        self.units: List[FlatUnit] = []
        self._aliases: Dict[str, tuple] = {}  # parameter name -> (unit, name in the unit)
        self._build_units()
        self.optimizer = optimizer_factory([u.master for u in self.units])
        self.scaler = LossScaler(config.compute_dtype == torch.float16, config.loss_scale,
                                 config.initial_loss_scale, config.loss_scale_window)
        self._forward_order: List[int] = []  # units in order of first use
        self._backward_order: List[int] = []  # _forward_order reversed (backward prefetch)
        self._backward_position: Dict[int, int] = {}  # unit -> index in _backward_order
        self._forward_calls: List[List[int]] = []  # units of each module call (forward prefetch)
        self._forward_call = 0  # this forward's position in _forward_calls
        self._order_known = False
        self._in_backward = False
        self._register_hooks()

    # ---- setup -------------------------------------------------------------------------
    def _build_units(self) -> None:
        owner = {}  # id(param) -> unit index
        self._module_units: Dict[nn.Module, List[int]] = {}
        for mod_name, module in self.module.named_modules():
            params, names = [], []
            for p_name, p in module.named_parameters(recurse=False):
                full_name = f"{mod_name}.{p_name}" if mod_name else p_name
                if id(p) in owner:  # tied: owned by an earlier module
                    unit = self.units[owner[id(p)]]
                    self._aliases[full_name] = (unit, unit.names[unit.params.index(p)])
                    continue
                params.append(p)
                names.append(full_name)
            # Trainable and frozen parameters go to separate units: a frozen parameter must
            # not share a master shard with trainable ones, or weight decay (and momentum
            # from its zero gradient) would move it.
            for trainable in (True, False):
                chosen = [(p, n) for p, n in zip(params, names) if p.requires_grad == trainable]
                if not chosen:
                    continue
                unit = FlatUnit(len(self.units), module, [p for p, _ in chosen], [n for _, n in chosen],
                                self.group.size, self.group.rank, self.config.compute_dtype)
                unit.master.requires_grad_(trainable)
                for p, name in chosen:
                    owner[id(p)] = unit.index
                    self._aliases[name] = (unit, name)
                self.units.append(unit)
        for module in self.module.modules():
            needed = sorted({owner[id(p)] for p in module.parameters(recurse=False)})
            if needed:
                self._module_units[module] = needed

    def _register_hooks(self) -> None:
        for module, unit_ids in self._module_units.items():
            module.register_forward_pre_hook(self._make_pre_forward(unit_ids))
            module.register_forward_hook(self._make_post_forward(unit_ids))
        for unit in self.units:
            for p in unit.params:
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(self._make_grad_ready(unit))

    # ---- gathering -----------------------------------------------------------------------
    def _wait(self, unit: FlatUnit) -> None:
        if unit.pending is not None:
            unit.pending.wait()
            unit.pending = None
            if not self._in_backward and self.config.hpz:
                self.comm.keep_secondary(unit)

    def _gather(self, unit: FlatUnit, backward: bool, async_op: bool = False) -> None:
        if unit.gathered:
            return
        unit.gathered = True
        if backward:
            unit.pending = self.comm.gather_backward(unit, async_op=True)
        else:
            unit.pending = self.comm.gather_forward(unit, async_op=True)
        if not async_op:
            self._wait(unit)

    def _prefetch_after(self, unit_ids: List[int], backward: bool) -> None:
        if not (self.config.prefetch and self._order_known):
            return
        if not backward:
            # The next module call of the recorded forward, not the unit after this one's
            # first use: a unit used again late (a tied head, a reused module) would
            # otherwise prefetch an early unit that no module of this forward uses again.
            if self._forward_call < len(self._forward_calls):
                for u in self._forward_calls[self._forward_call]:
                    self._gather(self.units[u], backward, async_op=True)
            return
        # Backward runs the recorded forward order in reverse: gather the unit that follows
        # the latest of this module's units in that order.
        positions = [self._backward_position[u] for u in unit_ids if u in self._backward_position]
        if positions and max(positions) + 1 < len(self._backward_order):
            self._gather(self.units[self._backward_order[max(positions) + 1]], backward, async_op=True)

    def _make_pre_forward(self, unit_ids: List[int]):
        def hook(module, args):
            for u in unit_ids:
                unit = self.units[u]
                self._gather(unit, backward=False)
                self._wait(unit)
                unit.users += 1
                if not self._order_known and u not in self._forward_order:
                    self._forward_order.append(u)
            if not self._order_known:
                self._forward_calls.append(unit_ids)
            self._forward_call += 1
            self._prefetch_after(unit_ids, backward=False)
            return None
        return hook

    def _make_post_forward(self, unit_ids: List[int]):
        def hook(module, args, output):
            for u in unit_ids:
                unit = self.units[u]
                unit.users -= 1
                if unit.users == 0:
                    unit.free()
            self._register_pre_backward(output, unit_ids)
            return None
        return hook

    def _register_pre_backward(self, output, unit_ids: List[int]) -> None:
        """Gather the module's units again when autograd reaches its outputs' gradients."""
        tensors = [t for t in _flatten(output) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not tensors or not torch.is_grad_enabled():
            return
        fired = [False]

        def pre_backward(grad):
            if not fired[0]:
                fired[0] = True
                self._in_backward = True
                for u in unit_ids:
                    unit = self.units[u]
                    self._gather(unit, backward=True)
                    self._wait(unit)
                self._prefetch_after(unit_ids, backward=True)
            return grad

        for t in tensors:
            t.register_hook(pre_backward)

    def _make_grad_ready(self, unit: FlatUnit):
        expected = sum(p.requires_grad for p in unit.params)

        def hook(param):
            unit.grads_ready += 1
            if unit.grads_ready == expected:
                self._reduce(unit)
        return hook

    def _reduce(self, unit: FlatUnit) -> None:
        if unit.reduced:
            return
        self._wait(unit)
        self.comm.reduce_grads(unit)
        unit.reduced = True
        if unit.users == 0:
            unit.free()

    # ---- the training-loop API -----------------------------------------------------------
    def __call__(self, *args, **kwargs):
        self._in_backward = False
        self._forward_call = 0
        if not self._order_known:  # record the last forward before the first backward
            self._forward_calls = []
        return self.module(*_cast_inputs(args, self.config.compute_dtype),
                           **_cast_inputs(kwargs, self.config.compute_dtype))

    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward() (scaled for fp16), then every unit's gradient reduce-scattered
        into the fp32 gradient shards; gradients accumulate until zero_grad()."""
        self._in_backward = True
        (loss * self.scaler.scale if self.scaler.enabled else loss).backward()
        # Units autograd did not reach in full (unused parameters) reduce now, in unit order,
        # so every rank runs the same reduce-scatters.
        for unit in self.units:
            if unit.requires_grad and not unit.reduced:
                self._reduce(unit)
        for unit in self.units:
            self._wait(unit)
            unit.free()
            unit.grads_ready = 0
            unit.reduced = False
            unit.users = 0
        self._in_backward = False
        if not self._order_known:
            self._order_known = True
            self._backward_order = self._forward_order[::-1]
            self._backward_position = {u: i for i, u in enumerate(self._backward_order)}

    @torch.no_grad()
    def step(self) -> bool:
        """Unscale, skip on overflow (fp16), clip, update the shards, refresh the compute
        copies. Returns False when the step was skipped."""
        grads = [u.master.grad for u in self.units if u.master.grad is not None]
        if self.scaler.enabled:
            for g in grads:
                g.div_(self.scaler.scale)
            overflow = torch.tensor([0.0 if all(torch.isfinite(g).all() for g in grads) else 1.0],
                                    device=self._flag_device())
            dist.all_reduce(overflow, op=dist.ReduceOp.MAX, group=self.group.pg)
            self.scaler.update(bool(overflow.item()))
            if overflow.item():
                self.zero_grad()
                return False
        if self.config.max_grad_norm is not None:
            self.clip_grad_norm(self.config.max_grad_norm)
        self.optimizer.step()
        for unit in self.units:
            unit.refresh_compute_shard()
        return True

    def clip_grad_norm(self, max_norm: float) -> float:
        """Scale the gradient shards so the global norm is at most max_norm; returns the norm."""
        sq = torch.zeros(1, dtype=torch.float64, device=self._flag_device())
        for u in self.units:
            if u.master.grad is not None:
                sq += u.master.grad.double().pow(2).sum().to(sq.device)
        dist.all_reduce(sq, group=self.group.pg)
        norm = float(sq.sqrt())
        if norm > max_norm:
            for u in self.units:
                if u.master.grad is not None:
                    u.master.grad.mul_(max_norm / (norm + 1e-6))
        return norm

    def zero_grad(self) -> None:
        for unit in self.units:
            unit.master.grad = None

    def _flag_device(self) -> torch.device:
        """Where the small all-reduced tensors live: the GPU for an NCCL group, else the CPU."""
        if self.group.pg is not None and dist.get_backend(self.group.pg) == "nccl" and self.units:
            return self.units[0].master.device
        return torch.device("cpu")

    # ---- inspection ------------------------------------------------------------------
    @torch.no_grad()
    def full_state_dict(self) -> Dict[str, torch.Tensor]:
        """Every parameter (tied names included) in full fp32, identical on all ranks."""
        full = {}
        for unit in self.units:
            gathered = torch.empty(unit.padded_numel, dtype=torch.float32, device=unit.master.device)
            quantized_allgather(gathered, unit.master.detach(), self.group, bits=None)
            full.update(unit.unflatten(gathered))
        return {name: full[inner] for name, (unit, inner) in self._aliases.items()}

    def stats(self) -> dict:
        """Bytes of the engine's own collectives since it was built (qcoll.stats() rule)."""
        return self.comm.stats()

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale


def _flatten(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _flatten(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _flatten(v)

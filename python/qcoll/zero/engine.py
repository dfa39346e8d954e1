"""ZeroEngine: ZeRO-3 for any nn.Module on qcoll's collectives (qwZ, hpZ, qgZ), and stage 2
(SDP4Bit's setting: qWD, TLq-HS).

Units are subtrees (unit_modules.py): a unit is gathered right before its module's forward (and
again before its backward), freed after its last use, and its gradient is reduce-scattered
into the fp32 gradient shards once autograd has accumulated all that this backward's graph
reaches of it, in an order every rank shares (_issue_reduces). Each unit's
lifecycle lives in unit.py; this file drives it from module hooks. The optimizer only ever
sees the fp32 master shards. Checkpoints: checkpoint.py.

Stage 2 is the same engine with resident full buffers: a unit's "gather" moves it through
the same states without communicating, and step() all-gathers the updated shards into
every rank's full buffers (EngineComms.publish_weights).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ..all_gather import quantized_allgather
from ..group import Group, _partition_groups, _subgroup, resolve_group
from . import checkpoint
from .comms import EngineComms
from .config import ZeroConfig
from .flat_param import FlatParam
from .loss_scaler import LossScaler
from .unit import BACKWARD, FORWARD, Unit, UnitState
from .unit_modules import assign_parameters, select_unit_modules


def _hpz_group(group: Group, size: Optional[int]) -> Group:
    """hpZ's group: `size` consecutive ranks inside a node (default: the whole node)."""
    size = group.node_size if size is None else size
    if group.node_size % size:
        raise ValueError(f"hpz_group_size={size} must divide the node size {group.node_size}")
    if size == group.node_size:
        return group.intra
    blocks = [group.global_ranks[s:s + size] for s in range(0, group.size, size)]
    mine = _partition_groups(blocks, group.timeout)[group.rank // size]
    # A Group of its own that owns `mine` (close() destroys it); one rank: a singleton,
    # its secondary shard is the whole gathered weight.
    return _subgroup(mine, blocks[group.rank // size], node_size=size, backend=group.backend,
                     timeout=group.timeout)


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
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not callable(optimizer_factory):
            raise TypeError("optimizer_factory must be a callable taking the parameters (e.g. lambda p: "
                            f"torch.optim.AdamW(p)), got {type(optimizer_factory).__name__}")
        self.module = model
        self.config = config
        self.group = resolve_group(group)
        self.comm = EngineComms(config, self.group, _hpz_group(self.group, config.hpz_group_size)
                                      if config.hpz else self.group)
        self.resident = config.stage == 2  # full weights stay on every rank
        self.units: List[Unit] = []
        self.flat_params: List[FlatParam] = []
        self._aliases: Dict[str, tuple] = {}  # parameter name -> (flat param, its name there)
        self._build_units()
        self.optimizer = optimizer_factory([f.master for f in self.flat_params])
        self.scaler = LossScaler(config.compute_dtype == torch.float16, config.loss_scale,
                                 config.initial_loss_scale, config.loss_scale_window)
        self.steps = 0  # optimizer steps applied (skipped fp16 overflow steps not counted)
        self.optimizer_seconds = 0.0
        # The order, recorded by the forward and backward of the first step (prefetch, and
        # freeing a unit reused in one forward only after its last use).
        self._order_known = False
        self._forward_calls: List[int] = []  # the unit of each module call, in forward order
        self._forward_uses: Dict[int, int] = {}  # unit -> calls of its module per forward
        self._backward_order: List[int] = []  # units in the order their backward started
        self._backward_next: Dict[int, int] = {}  # unit -> the unit whose backward comes next
        self._call = 0  # this forward's position in _forward_calls
        # Reduce-scatters are issued in one order that every rank shares (as DDP issues its
        # buckets), whatever order autograd completes units in: ranks whose losses reach
        # different parameters (an auxiliary loss on some ranks) then still pair each unit's
        # reduce-scatter with the same unit's. The first backward: the reverse of the order
        # rank 0's forward first used units in; later ones: the order rank 0's first
        # backward completed them in (_agree_orders).
        self._reduce_order: List[int] = [u.index for u in reversed(self.units) if u.requires_grad]
        self._reduces_issued = 0  # this backward's position in _reduce_order
        self._completed_order: List[int] = []  # units in the order autograd completed them
        # Stage 2's weight all-gathers: flat indices in the order the forward first uses
        # them, agreed by every rank like _reduce_order (a rank may skip a unit).
        self._publish_order: List[int] = [f.index for f in self.flat_params]
        self._in_forward = False  # the root module's forward is running (or raised)
        self._in_backward = False  # backward() is running autograd
        self._backward_failed = False  # the last backward() raised
        self._publishing: Dict[int, object] = {}  # flat index -> its weights' all-gather Work
        self._register_hooks()
        if self.resident:
            self._publish_weights(self.flat_params, [f.compute_shard for f in self.flat_params])

    # ---- setup -------------------------------------------------------------------------
    def _build_units(self) -> None:
        modules = select_unit_modules(self.module, self.config.unit_modules)
        names = {id(m): n for n, m in self.module.named_modules(remove_duplicate=False)}
        owned, aliases = assign_parameters(self.module, modules)
        canonical = {}
        for i, module in enumerate(modules):
            flats = []
            # Trainable and frozen parameters in separate buffers: a frozen parameter must
            # not share a master shard with trainable ones (weight decay would move it).
            for trainable in (True, False):
                chosen = [(n, p) for n, p in owned[i] if p.requires_grad == trainable]
                if chosen:
                    flat = FlatParam(len(self.flat_params), [p for _, p in chosen], [n for n, _ in chosen],
                                     self.group.size, self.group.rank, self.config.compute_dtype,
                                     resident=self.resident)
                    self.flat_params.append(flat)
                    flats.append(flat)
                    canonical.update({n: flat for n, _ in chosen})
            if flats:
                self.units.append(Unit(len(self.units), names[id(module)], module, flats))
        self._aliases = {name: (canonical[canon], canon) for name, canon in aliases.items()}
        self._unit_of = {f.index: u.index for u in self.units for f in u.flats}  # flat -> unit

    def _register_hooks(self) -> None:
        self.module.register_forward_pre_hook(self._forward_begin, prepend=True)
        for unit in self.units:
            unit.module.register_forward_pre_hook(self._make_pre_forward(unit))
            unit.module.register_forward_hook(self._make_post_forward(unit))
            for flat in unit.trainable:
                for p in flat.params:
                    p.register_post_accumulate_grad_hook(self._make_grad_ready(unit))
        self.module.register_forward_hook(self._forward_end)
        if not self.resident:  # stage 3: outside forward the parameters are placeholders
            for module in self.module.modules():
                if next(module.parameters(), None) is not None:
                    module.register_state_dict_pre_hook(self._refuse_module_state_dict)
                    module.register_load_state_dict_pre_hook(self._refuse_module_load)
        self._reading_module = False  # _module_entries() is reading the module's state dict

    def _refuse_module_state_dict(self, module, prefix, keep_vars):
        if not self._reading_module:
            raise RuntimeError(
                "qcoll.zero: state_dict() of a module whose weights ZeroEngine shards (stage 3) would "
                "hold none: outside forward each parameter is an empty placeholder. "
                "Call engine.full_state_dict() on every rank for a plain state dict of the full "
                "weights, or save engine.state_dict() with torch.distributed.checkpoint")

    def _refuse_module_load(self, module, state_dict, prefix, *args):
        raise RuntimeError(
            "qcoll.zero: load_state_dict() of a module whose weights ZeroEngine shards (stage 3) "
            "cannot reach them. Call engine.load_full_state_dict(state) on every rank with a "
            "plain state dict, or engine.load_state_dict() with one torch.distributed.checkpoint filled")

    def _module_entries(self) -> Dict[str, torch.Tensor]:
        """The module's own state_dict(keep_vars=True) (its names, and its buffers), which
        its state-dict hooks refuse to users in stage 3."""
        self._reading_module = True
        try:
            return self.module.state_dict(keep_vars=True)
        finally:
            self._reading_module = False

    # ---- gathering -----------------------------------------------------------------------
    def _gather(self, unit: Unit, phase: str) -> None:
        if unit.gathered:
            return
        if self.resident:  # stage 2: the weights are already there
            unit.gather(phase, lambda flat: None)
            return
        unit.gather(phase, self.comm.gather_forward if phase == FORWARD else self.comm.gather_backward)

    def _publish_weights(self, flats: List[FlatParam], sources: Optional[list] = None,
                         wait: bool = True) -> None:
        """Stage 2: every rank's full buffers from the shards; sources: each flat's partition
        to gather exactly instead (at start and after a load, when the full buffers may not
        agree across ranks yet). wait=False: leave the calls in flight (overlap_publish);
        _wait_published waits for them. Callers have waited for the last step's calls."""
        sources = sources or [None] * len(flats)
        for flat, source in zip(flats, sources):
            self._publishing[flat.index] = self.comm.publish_weights(flat, source)
        if wait:
            self.wait_weights()

    def _forward_ordered(self, flats: List[FlatParam]) -> List[FlatParam]:
        """flats in the order the recorded forward first uses their units (the calls
        complete in issue order, so the first unit's weights arrive first), as every rank
        agreed it (_agree_orders)."""
        position = {index: k for k, index in enumerate(self._publish_order)}
        return sorted(flats, key=lambda f: position[f.index])

    def _wait_published(self, flats: List[FlatParam]) -> None:
        for flat in flats:
            work = self._publishing.pop(flat.index, None)
            if work is not None:
                self.comm.timed("gather", work.wait)

    def wait_weights(self) -> None:
        """Stage 2 with overlap_publish: wait until the weights of the last step() are in
        every parameter (the next forward waits per unit by itself). A no-op otherwise."""
        self._wait_published(self.flat_params)

    def _wait(self, unit: Unit) -> Optional[str]:
        self._wait_published(unit.flats)  # stage 2: this unit's weights of the last step
        return unit.wait(lambda fn: self.comm.timed("gather", fn))

    def _use_for_forward(self, unit: Unit) -> None:
        self._gather(unit, FORWARD)
        if self._wait(unit) == FORWARD and self.config.hpz and torch.is_grad_enabled():
            # hpZ: keep this rank's part of exactly the weights forward uses, for backward.
            for flat in unit.flats:
                self.comm.keep_secondary(flat)

    # ---- forward -------------------------------------------------------------------------
    def _forward_begin(self, module, args):
        if self._in_forward or self._backward_failed:  # the last forward or backward raised
            self._recover_from_abandoned_pass()
        self._in_forward = True
        self._call = 0
        for unit in self.units:
            unit.new_forward()
        if not self._order_known:  # record the last forward before the first backward
            self._forward_calls, self._forward_uses = [], {}

    def _forward_end(self, module, args, output):
        self._in_forward = False
        # What forward gathered and did not free (prefetched for a call that did not come,
        # or used fewer times than recorded): free it now.
        for unit in self.units:
            self._wait(unit)
            if unit.state is UnitState.GATHERED:
                unit.release()

    def _make_pre_forward(self, unit: Unit):
        def hook(module, args):
            self._use_for_forward(unit)
            unit.enter()
            if not self._order_known:
                self._forward_calls.append(unit.index)
                self._forward_uses[unit.index] = self._forward_uses.get(unit.index, 0) + 1
            self._call += 1
            if self.config.prefetch and self._order_known and self._call < len(self._forward_calls):
                # The next module call of the recorded forward (a unit used again later, a tied
                # head or a reused module, is still gathered then: nothing to do).
                self._gather(self.units[self._forward_calls[self._call]], FORWARD)
            return None
        return hook

    def _make_post_forward(self, unit: Unit):
        def hook(module, args, output):
            unit.exit()
            # Free after the last use: while recording, after every use (the first step
            # gathers a reused unit again rather than hold every unit to the end).
            if unit.users == 0 and (not self._order_known
                                    or unit.forward_calls >= self._forward_uses.get(unit.index, 0)):
                unit.release()
            self._register_pre_backward(output, unit)
            return None
        return hook

    def _recover_from_abandoned_pass(self) -> None:
        """The last forward or backward raised (a caught out-of-memory error, a failing
        hook) and left units gathered, in use or waiting for gradients: finish its calls in
        flight (every rank that raised at the same point issued the same ones) and start
        again from the shards. Its reduced gradients stay accumulated until zero_grad()."""
        self.comm.finish_reduces()
        for unit in self.units:
            self._wait_published(unit.flats)
            unit.abandon(lambda fn: self.comm.timed("gather", fn))
        self._reduces_issued = 0
        self._backward_failed = False
        if not self._order_known:  # record the next step's orders from scratch
            self._backward_order, self._completed_order = [], []

    # ---- backward ------------------------------------------------------------------------
    def _register_pre_backward(self, output, unit: Unit) -> None:
        """Gather the unit again when autograd reaches its module's outputs' gradients."""
        tensors = [t for t in _flatten(output) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not tensors or not torch.is_grad_enabled():
            return
        fired = [False]

        def pre_backward(grad):
            if not fired[0]:
                fired[0] = True
                self._start_backward(unit)
            return grad

        for t in tensors:
            t.register_hook(pre_backward)

    def _outside_backward(self, unit: Unit) -> RuntimeError:
        return RuntimeError(
            f"qcoll.zero: autograd reached unit {unit.index} ({unit.name}) outside engine.backward(loss) "
            "(loss.backward() or torch.autograd.grad on the engine's outputs): the engine gathers its "
            "weights and reduces its gradients only inside engine.backward(loss)")

    def _start_backward(self, unit: Unit) -> None:
        if not self._in_backward:
            if self.resident:  # stage 2 gathers nothing: torch.autograd.grad (input gradients) may run
                return
            raise self._outside_backward(unit)
        if unit.state in (UnitState.GRADS_PENDING, UnitState.REDUCED):
            return  # another call of a reused module: still gathered
        if not self._order_known:
            self._backward_order.append(unit.index)
        self._gather(unit, BACKWARD)
        self._wait(unit)
        unit.start_backward()
        nxt = self._backward_next.get(unit.index) if self.config.prefetch else None
        # Only a unit this step's forward ran (a unit skipped on every rank this step, by a
        # branch or layer drop, has no backward, nor with hpZ a secondary shard to gather).
        if nxt is not None and self.units[nxt].forward_calls > 0 and self.units[nxt].state in (
                UnitState.SHARDED, UnitState.SECONDARY_KEPT):
            self._gather(self.units[nxt], BACKWARD)

    def _make_grad_ready(self, unit: Unit):
        def hook(param):
            if not self._in_backward:
                raise self._outside_backward(unit)
            if unit.grad_arrived(param):
                if not self._order_known:
                    self._completed_order.append(unit.index)
                self._issue_reduces(until_incomplete=True)
        return hook

    def _issue_reduces(self, until_incomplete: bool) -> None:
        """Issue the reduce-scatters due in the shared order: those of units autograd has
        completed, stopping at the first that it has not (until_incomplete), or all the rest
        (the end of backward: a unit with unused parameters reduces what it has)."""
        order = self._reduce_order
        while self._reduces_issued < len(order):
            unit = self.units[order[self._reduces_issued]]
            if until_incomplete and not unit.grads_complete:
                return
            self._reduces_issued += 1
            self._reduce(unit)

    def _reduce(self, unit: Unit) -> None:
        self._wait(unit)
        for flat in unit.trainable:
            self.comm.reduce_grads(flat)
        # A unit whose trainable parameters this graph does not reach may still be on the
        # gradient's way (its frozen weights pass it on to earlier units): its buffers and
        # state stay for its backward, and the end of backward frees them.
        if unit.reachable_grads:
            unit.reduced()

    # ---- the training-loop API -----------------------------------------------------------
    def __call__(self, *args, **kwargs):
        return self.module(*_cast_inputs(args, self.config.compute_dtype),
                           **_cast_inputs(kwargs, self.config.compute_dtype))

    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward() (scaled for fp16), then every unit's gradient reduce-scattered
        into the fp32 gradient shards; gradients accumulate until zero_grad()."""
        if self._backward_failed:  # the last backward raised, and no forward has recovered since
            self._recover_from_abandoned_pass()
        reachable = _reachable_leaves(loss)
        for unit in self.units:
            unit.expect_gradients(reachable)
        if not self._order_known:
            self._agree_first_reduce_order()
        self._in_backward = True
        try:
            self._issue_reduces(until_incomplete=True)  # units this graph does not reach
            (loss * self.scaler.scale if self.scaler.enabled else loss).backward()
            # Units autograd did not complete (a parameter it reached got no gradient) reduce
            # now, in the shared order, so every rank runs the same reduce-scatters.
            self._issue_reduces(until_incomplete=False)
            self._reduces_issued = 0
            self.comm.finish_reduces()
            for unit in self.units:
                self._wait(unit)
                unit.reset()
        except BaseException:
            self._backward_failed = True  # the next forward (or backward) starts from the shards
            raise
        finally:
            self._in_backward = False
        if not self._order_known:
            self._order_known = True
            order = self._backward_order
            self._backward_next = {u: v for u, v in zip(order, order[1:])}
            self._agree_orders()

    def _agree_first_reduce_order(self) -> None:
        """The first backward's reduce order: the reverse of the order the forward first
        used units in (rank 0's), then the units it did not run."""
        trainable = [u.index for u in self.units if u.requires_grad]
        order = [u for u in reversed(self._first_use_order()) if u in trainable]
        order += [u for u in reversed(trainable) if u not in order]
        self.wait_weights()  # nothing of the engine's in flight on the group while it agrees
        self._reduce_order = self._rank0s(order)

    def _first_use_order(self) -> List[int]:
        """The units the recorded forward ran, in the order of their first call."""
        return list(dict.fromkeys(self._forward_calls))

    def _rank0s(self, values: List[int]) -> List[int]:
        """Rank 0's `values` on every rank (every rank passes as many)."""
        if self.group.size == 1:  # a one-rank Group's pg is None: the whole world
            return values
        shared = torch.tensor(values, dtype=torch.int64, device=self._flag_device())
        dist.broadcast(shared, src=self.group.global_ranks[0], group=self.group.pg)
        return shared.tolist()

    def _agree_orders(self) -> None:
        """The orders the collectives of later steps are issued in, as rank 0 recorded them
        in the first step, so that they pair up on every rank even where ranks' graphs
        differ: the reduce-scatters in the order autograd completed units (then those it
        left incomplete, in the order used so far), so that no unit waits for another to be
        issued; stage 2's weight all-gathers in the order the forward first used units."""
        completed = list(dict.fromkeys(self._completed_order))
        reduce_order = completed + [u for u in self._reduce_order if u not in completed]
        first_use = {u: k for k, u in enumerate(self._first_use_order())}
        flats = sorted(self.flat_params, key=lambda f: first_use.get(self._unit_of[f.index], len(first_use)))
        self._completed_order = []
        orders = self._rank0s(reduce_order + [f.index for f in flats])
        self._reduce_order = orders[:len(reduce_order)]
        self._publish_order = orders[len(reduce_order):]

    @torch.no_grad()
    def step(self) -> bool:
        """Unscale, skip on overflow (fp16), clip, update the shards, refresh the compute
        copies. Returns False when the step was skipped."""
        start, waited = time.perf_counter(), sum(self.comm.seconds.values())
        try:
            return self._step()
        finally:  # the collectives it waits for are counted as theirs (timings()), not twice
            waited = sum(self.comm.seconds.values()) - waited
            self.optimizer_seconds += time.perf_counter() - start - waited

    def _step(self) -> bool:
        self.wait_weights()  # the last step's all-gathers read the compute shards refreshed below
        self.comm.finish_reduces()
        grads = [f.master.grad for f in self.flat_params if f.master.grad is not None]
        if self.scaler.enabled:
            for g in grads:
                g.div_(self.scaler.scale)
            overflow = torch.tensor([0.0 if all(torch.isfinite(g).all() for g in grads) else 1.0],
                                    device=self._flag_device())
            if self.group.size > 1:  # a one-rank Group's pg is None: the whole world
                dist.all_reduce(overflow, op=dist.ReduceOp.MAX, group=self.group.pg)
            self.scaler.update(bool(overflow.item()))
            if overflow.item():
                self.zero_grad()
                return False
        if self.config.max_grad_norm is not None:
            self.clip_grad_norm(self.config.max_grad_norm)
        self.optimizer.step()
        for flat in self.flat_params:
            flat.refresh_compute_shard()
        if self.resident:
            self._publish_weights(self._forward_ordered([f for f in self.flat_params if f.requires_grad]),
                                  wait=not self.config.overlap_publish)
        self.steps += 1
        return True

    def clip_grad_norm(self, max_norm: float) -> float:
        """Scale the gradient shards so the global norm is at most max_norm; returns the norm."""
        sq = torch.zeros(1, dtype=torch.float64, device=self._flag_device())
        for f in self.flat_params:
            if f.master.grad is not None:
                sq += f.master.grad.double().pow(2).sum().to(sq.device)
        if self.group.size > 1:  # a one-rank Group's pg is None: the whole world
            dist.all_reduce(sq, group=self.group.pg)
        norm = float(sq.sqrt())
        if norm > max_norm:
            for f in self.flat_params:
                if f.master.grad is not None:
                    f.master.grad.mul_(max_norm / (norm + 1e-6))
        return norm

    def zero_grad(self) -> None:
        # Reduce-scatters still in flight (a backward that raised) land first, then go too.
        self.comm.finish_reduces()
        for flat in self.flat_params:
            flat.master.grad = None

    def _flag_device(self) -> torch.device:
        """Where the small all-reduced tensors live: the GPU for an NCCL group, else the CPU."""
        if self.group.pg is not None and dist.get_backend(self.group.pg) == "nccl" and self.flat_params:
            return self.flat_params[0].master.device
        return torch.device("cpu")

    # ---- checkpoints (checkpoint.py) -----------------------------------------------------
    def state_dict(self) -> dict:
        """A torch.distributed.checkpoint state dict of the whole run (fp32 masters, optimizer
        state, resident weights in stage 2, loss scaler, step count), sharded over the group:
        ``dcp.save(engine.state_dict(), checkpoint_id=...)``. Copies, not views."""
        self.wait_weights()
        return checkpoint.engine_state_dict(self)

    def load_state_dict(self, state: dict) -> None:
        """Resume, on any world size and node size, from ``sd = engine.state_dict();
        dcp.load(sd, checkpoint_id=...)``; same model, unit layout, ZeroConfig and optimizer
        kind, else ValueError before anything changes."""
        self.wait_weights()
        replica = checkpoint.load_engine_state_dict(self, state)
        if self.resident:  # the weights as they were (with qWD they are not the masters' copy)
            self._publish_weights(self.flat_params, replica)

    def load_full_state_dict(self, state: Dict[str, torch.Tensor]) -> None:
        """Load a plain model state dict (full_state_dict(), or a single-process model's
        state_dict()) at any world size; the optimizer state is left as it is."""
        self.wait_weights()
        checkpoint.load_full_state_dict(self, state)
        if self.resident:
            self._publish_weights(self.flat_params, [f.compute_shard for f in self.flat_params])

    # ---- inspection ------------------------------------------------------------------
    @torch.no_grad()
    def full_state_dict(self) -> Dict[str, torch.Tensor]:
        """Every parameter (tied names included) in full fp32, identical on all ranks, and
        every persistent buffer as this rank holds it (the engine does not synchronize
        buffers: BatchNorm's running statistics differ between ranks), in state_dict() order."""
        full = {}
        for flat in self.flat_params:
            gathered = torch.empty(flat.padded_numel, dtype=torch.float32, device=flat.master.device)
            quantized_allgather(gathered, flat.master.detach(), self.group, bits=None)
            full.update(flat.unflatten(gathered))
        out = {}
        for name, value in self._module_entries().items():
            out[name] = full[self._aliases[name][1]] if name in self._aliases else value.detach().clone()
        return out

    def stats(self) -> dict:
        """Bytes of the engine's own collectives since it was built (qcoll.stats() rule)."""
        return self.comm.stats()

    def timings(self) -> dict:
        """Host seconds since the engine was built: issuing and waiting on all-gathers,
        reduce-scatters, and step()'s own work (unscale, clip, optimizer, compute-copy refresh;
        the collectives it waits for are counted as theirs)."""
        return dict(self.comm.seconds, optimizer=self.optimizer_seconds)

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale


def _reachable_leaves(loss: torch.Tensor) -> Optional[set]:
    """ids of the leaf tensors whose gradient a backward from `loss` accumulates (its
    graph's AccumulateGrad nodes), as DDP's find_unused_parameters finds them; None where
    the graph hides some (reentrant activation checkpointing runs a backward of its own
    inside a node): then every parameter is expected."""
    seen, stack, leaves = set(), [loss.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        kind = type(node).__name__
        if kind == "AccumulateGrad":
            leaves.add(id(node.variable))
        elif kind == "CheckpointFunctionBackward":
            return None
        stack.extend(nxt for nxt, _ in node.next_functions)
    return leaves


def _flatten(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield from _flatten(getattr(value, field.name, None))  # a field(init=False) may be unset
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _flatten(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _flatten(v)

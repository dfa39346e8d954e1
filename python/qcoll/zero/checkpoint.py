"""ZeroEngine checkpoints through torch.distributed.checkpoint (DCP), on any world size.

state_dict() is a DCP state dict:

    model    {flat key: DTensor}   fp32 masters
    optim    state {flat key: {name: DTensor or value}}, param_groups (hyperparameters)
    replica  {flat key: DTensor}   stage 2: the resident weights (under qWD they carry the
                                   last steps' quantization and are not the masters' copy)
    engine   format, config, layout, loss scaler, step count, whether the optimizer has state

A flat key names a unit's buffer ("<unit>.trainable" / "<unit>.frozen"). Each flat buffer is
saved as the 1-D tensor of its parameters' elements (no padding), Shard(0) over the engine's
group: the engine's partition is torch.chunk's (ceil(numel / world) per rank, the last ranks
short or empty), which is DTensor's, so DCP reshards it onto any world size. The padding past
the last parameter is zero by construction (FlatParam.accumulate_grad_shard), so nothing is
lost by leaving it out.

The values are copies: dcp.load fills them, and load_state_dict() checks the engine part
before anything in the engine changes, so a rejected checkpoint leaves the engine as it was.
The same dict saved per rank with torch.save also loads back at the same world size.
load_full_state_dict(): a plain model state dict onto any world size.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List

import torch

FORMAT = "qcoll.zero.ZeroEngine/2"
_ROOT = "<root>"


def _config_summary(config) -> dict:
    """The config's fields as plain values (unit_modules shows in the layout instead)."""
    return {f.name: str(getattr(config, f.name)) for f in dataclasses.fields(config) if f.name != "unit_modules"}


def _layout(engine) -> List[tuple]:
    """(unit name, trainable, parameter names, shapes) of every flat buffer, in order."""
    return [(unit.name, flat.requires_grad, tuple(flat.names), tuple(tuple(s) for s in flat.shapes))
            for unit in engine.units for flat in unit.flats]


def _flat_keys(engine) -> List[str]:
    return [f"{unit.name or _ROOT}.{'trainable' if flat.requires_grad else 'frozen'}"
            for unit in engine.units for flat in unit.flats]


# ---- the engine's partition as DTensors -----------------------------------------------------
class _Sharding:
    """Turns a flat buffer's per-rank partition (shard_numel elements, the tail padding) into
    the DTensor of its parameters' elements and back."""

    def __init__(self, engine):
        self.group = engine.group
        self.mesh = None
        if self.group.size > 1:
            from torch.distributed.device_mesh import DeviceMesh

            device = engine.flat_params[0].master.device if engine.flat_params else torch.device("cpu")
            self.mesh = DeviceMesh.from_group(self.group.pg, device.type)

    def valid(self, flat) -> int:
        """Elements of this rank's partition that are parameters (the rest is padding)."""
        return max(0, min(flat.shard_numel, flat.numel - self.group.rank * flat.shard_numel))

    def wrap(self, flat, partition: torch.Tensor):
        local = partition[:self.valid(flat)].detach().clone()
        if self.mesh is None:  # one rank: the whole buffer, a plain tensor
            return local
        from torch.distributed.tensor import DTensor, Shard
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape = torch.Size([flat.numel])
        size, offset = compute_local_shape_and_global_offset(shape, self.mesh, [Shard(0)])
        if size[0] != local.numel() or (local.numel() and offset[0] != self.group.rank * flat.shard_numel):
            raise RuntimeError(f"qcoll.zero: DTensor's Shard(0) of {flat.numel} elements over {self.group.size} "
                               f"ranks ({list(size)} at {list(offset)}) is not the engine's partition")
        return DTensor.from_local(local, self.mesh, [Shard(0)], run_check=False, shape=shape, stride=(1,))

    def is_partition(self, flat, value) -> bool:
        """Whether a loaded value is a flat buffer's elements (what wrap() made)."""
        if self.mesh is None:
            return torch.is_tensor(value) and tuple(value.shape) == (flat.numel,)
        from torch.distributed.tensor import DTensor

        return isinstance(value, DTensor)

    def unwrap(self, flat, value, like: torch.Tensor) -> torch.Tensor:
        """The loaded elements as this rank's partition, padding zero, dtype and device of `like`."""
        local = value.to_local() if hasattr(value, "to_local") else value
        out = torch.zeros(flat.shard_numel, dtype=like.dtype, device=like.device)
        out[:local.numel()].copy_(local)
        return out


def _sharded_state(opt_state: dict, flat, sharding: _Sharding) -> dict:
    """One master's optimizer state: master-shaped tensors sharded, the rest (Adam's step)
    as it is (every rank holds the same)."""
    return {k: sharding.wrap(flat, v) if torch.is_tensor(v) and v.shape == flat.master.shape
            else (v.detach().clone() if torch.is_tensor(v) else v) for k, v in opt_state.items()}


@torch.no_grad()
def _optimizer_state_shapes(optimizer) -> dict:
    """The state an optimizer will hold, for one that has none yet (dcp.load fills the state
    dict it is given, so the entries must exist): one step at lr 0 on zero gradients, then
    parameters, their gradients (a state_dict() between backward() and the first step must
    not lose them), learning rates and state put back as they were."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    saved = [p.detach().clone() for p in params]
    grads = [p.grad for p in params]  # gradients accumulated before the first step: kept
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = torch.zeros_like(g["lr"]) if torch.is_tensor(g["lr"]) else 0.0
    for p in params:  # frozen masters get no gradient, hence no state, as in training
        p.grad = torch.zeros_like(p) if p.requires_grad else None
    try:
        optimizer.step()
        return {id(p): dict(optimizer.state[p]) for p in params if p in optimizer.state}
    finally:
        for g, lr in zip(optimizer.param_groups, lrs):
            g["lr"] = lr
        for p, s, grad in zip(params, saved, grads):
            p.copy_(s)
            p.grad = grad
        optimizer.state.clear()


def engine_state_dict(engine) -> dict:
    sharding = _Sharding(engine)
    keys = _flat_keys(engine)
    optimizer = engine.optimizer
    has_state = len(optimizer.state) > 0
    state_of = ({id(p): s for p, s in optimizer.state.items()} if has_state
                else _optimizer_state_shapes(optimizer))
    key_of = {id(f.master): k for f, k in zip(engine.flat_params, keys)}
    groups = [dict({k: v for k, v in g.items() if k != "params"}, params=[key_of[id(p)] for p in g["params"]])
              for g in optimizer.param_groups]
    out = {
        "model": {k: sharding.wrap(f, f.master) for f, k in zip(engine.flat_params, keys)},
        "optim": {"state": {k: _sharded_state(state_of[id(f.master)], f, sharding)
                            for f, k in zip(engine.flat_params, keys) if id(f.master) in state_of},
                  "param_groups": groups},
        "engine": {"format": FORMAT, "config": _config_summary(engine.config), "layout": _layout(engine),
                   "scaler": engine.scaler.state_dict(), "steps": engine.steps,
                   "optimizer_has_state": has_state},
    }
    if engine.resident:
        out["replica"] = {k: sharding.wrap(f, f.shard_of(f.full)) for f, k in zip(engine.flat_params, keys)}
    return out


# ---- loading --------------------------------------------------------------------------------
def _check_engine_state(engine, state) -> None:
    meta = state.get("engine") if isinstance(state, dict) else None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        older = isinstance(state, dict) and str(state.get("format", "")).startswith("qcoll.zero.ZeroEngine/")
        raise ValueError(
            "load_state_dict: not a ZeroEngine.state_dict() filled by torch.distributed.checkpoint.load"
            + (" (this is a per-rank torch.save checkpoint of an earlier qcoll, a format no longer read: with "
               "that version save engine.full_state_dict() and load it here with load_full_state_dict; the "
               "optimizer state does not carry over)"
               if older else "; for a plain model state dict use load_full_state_dict"))
    theirs, mine = meta["layout"], _layout(engine)
    for i in range(max(len(theirs), len(mine))):
        a = tuple(theirs[i]) if i < len(theirs) else None
        b = mine[i] if i < len(mine) else None
        if a != b:
            raise ValueError(f"load_state_dict: the checkpoint is of another model or unit layout: "
                             f"{_layout_difference(i, a, b)}")
    differ = {k: (v, meta["config"].get(k)) for k, v in _config_summary(engine.config).items()
              if meta["config"].get(k) != v}
    if differ:
        fields = ", ".join(f"{k}={theirs} in the checkpoint, {mine} here" for k, (mine, theirs) in differ.items())
        raise ValueError(f"load_state_dict: the checkpoint's ZeroConfig differs: {fields}")
    groups_theirs, groups_mine = state["optim"]["param_groups"], engine.optimizer.param_groups
    keys = _flat_keys(engine)
    key_of = {id(f.master): k for f, k in zip(engine.flat_params, keys)}
    if [g["params"] for g in groups_theirs] != [[key_of[id(p)] for p in g["params"]] for g in groups_mine]:
        raise ValueError("load_state_dict: the checkpoint's optimizer has other parameter groups")
    settings_theirs, settings_mine = sorted(groups_theirs[0]) if groups_theirs else [], \
        sorted(groups_mine[0]) if groups_mine else []
    if settings_theirs != settings_mine:
        raise ValueError(f"load_state_dict: the checkpoint's optimizer is of another kind (its settings "
                         f"{settings_theirs}, here {settings_mine})")
    if meta["scaler"]["enabled"] != engine.scaler.enabled:
        raise ValueError("load_state_dict: loss scaling is on in one of the checkpoint and this engine only")
    if engine.resident and "replica" not in state:
        raise ValueError("load_state_dict: the checkpoint holds no resident weights (stage 2)")


def _layout_difference(i: int, theirs, mine) -> str:
    """The first parameter that differs (name or shape), else the whole flat buffer."""
    if theirs is not None and mine is not None and tuple(theirs[:2]) == tuple(mine[:2]):
        for (n1, s1), (n2, s2) in zip(zip(theirs[2], theirs[3]), zip(mine[2], mine[3])):
            if (n1, tuple(s1)) != (n2, tuple(s2)):
                return f"unit {mine[0]!r} holds {n1}{list(s1)} there and {n2}{list(s2)} here"
    return f"flat buffer {i} is {_describe(theirs)} there and {_describe(mine)} here"


def _describe(entry) -> str:
    if entry is None:
        return "absent"
    unit, trainable, names, shapes = entry
    return (f"unit {unit!r} ({'trainable' if trainable else 'frozen'}: "
            + ", ".join(f"{n}{list(s)}" for n, s in zip(names, shapes)) + ")")


@torch.no_grad()
def load_engine_state_dict(engine, state: dict) -> list:
    """Restores masters, optimizer, scaler and steps; returns the resident weights' partitions
    (stage 2) for the engine to publish, else None."""
    _check_engine_state(engine, state)
    sharding = _Sharding(engine)
    keys = _flat_keys(engine)
    for flat, key in zip(engine.flat_params, keys):
        flat.master.copy_(sharding.unwrap(flat, state["model"][key], flat.master))
        flat.master.grad = None
        flat.refresh_compute_shard()
    index = {id(p): i for i, p in enumerate(p for g in engine.optimizer.param_groups for p in g["params"])}
    opt_state = {}
    if state["engine"]["optimizer_has_state"]:
        for flat, key in zip(engine.flat_params, keys):
            saved = state["optim"]["state"].get(key)
            if saved is not None:
                opt_state[index[id(flat.master)]] = {
                    k: sharding.unwrap(flat, v, flat.master) if sharding.is_partition(flat, v) else v
                    for k, v in saved.items()}
    groups = [dict(theirs, params=[index[id(p)] for p in mine["params"]])
              for theirs, mine in zip(state["optim"]["param_groups"], engine.optimizer.param_groups)]
    engine.optimizer.load_state_dict({"state": opt_state, "param_groups": groups})
    engine.scaler.load_state_dict(state["engine"]["scaler"])
    engine.steps = int(state["engine"]["steps"])
    if not engine.resident:
        return None
    return [sharding.unwrap(f, state["replica"][k], f.compute_shard) for f, k in zip(engine.flat_params, keys)]


def _full_values(engine, state: Dict[str, torch.Tensor]) -> tuple:
    """Checks a plain model state dict against the engine's model; returns
    ({canonical parameter name: tensor}, {buffer name: tensor})."""
    if not isinstance(state, dict):
        raise TypeError(f"load_full_state_dict: expected a dict of tensors, got {type(state).__name__}")
    names = {}  # canonical name -> names present
    for name, (_, canon) in engine._aliases.items():
        if name in state:
            names.setdefault(canon, []).append(name)
    buffers = {n: b for n, b in engine._module_entries().items() if n not in engine._aliases}
    unexpected = sorted(k for k in state if k not in engine._aliases and k not in buffers)
    missing = sorted({canon for _, canon in engine._aliases.values()} - set(names))
    missing += sorted(k for k in buffers if k not in state)
    if unexpected or missing:
        raise ValueError(f"load_full_state_dict: the state dict does not match the model: missing "
                         f"{missing[:8] or 'nothing'}, unexpected {unexpected[:8] or 'nothing'}")
    values = {}
    shapes = {n: s for f in engine.flat_params for n, s in zip(f.names, f.shapes)}
    for canon, present in names.items():
        value = state[present[0]]
        for other in present[1:]:
            if not torch.equal(state[other], value):
                raise ValueError(f"load_full_state_dict: tied parameters {present[0]} and {other} differ")
        if tuple(value.shape) != tuple(shapes[canon]):
            raise ValueError(f"load_full_state_dict: {present[0]} has shape {tuple(value.shape)}, the model's "
                             f"is {tuple(shapes[canon])}")
        values[canon] = value
    for name, buf in buffers.items():
        if tuple(state[name].shape) != tuple(buf.shape):
            raise ValueError(f"load_full_state_dict: buffer {name} has shape {tuple(state[name].shape)}, the "
                             f"model's is {tuple(buf.shape)}")
    return values, {n: (buffers[n], state[n]) for n in buffers}


@torch.no_grad()
def load_full_state_dict(engine, state: Dict[str, torch.Tensor]) -> None:
    values, buffers = _full_values(engine, state)
    for flat in engine.flat_params:
        full = flat.flatten([values[n].to(flat.master.device, torch.float32) for n in flat.names])
        flat.master.copy_(flat.shard_of(full))
        flat.refresh_compute_shard()
    for buf, value in buffers.values():
        buf.copy_(value)

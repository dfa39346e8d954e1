"""ZeroEngine checkpoints.

state_dict() / load_state_dict(): this rank's fp32 master shards, optimizer state, loss
scaler and step count (stage 2: and this rank's partition of the resident weights, which
under qWD carry the last steps' quantization and are not the masters' copy), for resuming the same run bit-identically (same model, world size,
node size and config). load_full_state_dict(): a plain model state dict onto any world size.
Every check runs before anything is changed, so a rejected checkpoint leaves the engine as
it was; the errors name what differs.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List

import torch

FORMAT = "qcoll.zero.ZeroEngine/1"


def _config_summary(config) -> dict:
    """The config's fields as plain values (unit_modules shows in the layout instead)."""
    return {f.name: str(getattr(config, f.name)) for f in dataclasses.fields(config) if f.name != "unit_modules"}


def _layout(engine) -> List[tuple]:
    """(unit name, trainable, parameter names, shapes) of every flat buffer, in order."""
    return [(unit.name, flat.requires_grad, tuple(flat.names), tuple(tuple(s) for s in flat.shapes))
            for unit in engine.units for flat in unit.flats]


def engine_state_dict(engine) -> dict:
    g = engine.group
    return {
        "format": FORMAT,
        "world_size": g.size, "node_size": g.node_size, "rank": g.rank,
        "config": _config_summary(engine.config),
        "layout": _layout(engine),
        "master": [f.master.detach().clone() for f in engine.flat_params],
        "optimizer": engine.optimizer.state_dict(),
        "scaler": engine.scaler.state_dict(),
        "steps": engine.steps,
        "replica": ([f.shard_of(f.full).detach().clone() for f in engine.flat_params]
                    if engine.resident else None),
    }


def _check_engine_state(engine, state) -> None:
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError("load_state_dict: not a ZeroEngine.state_dict() checkpoint (for a plain model "
                         "state dict use load_full_state_dict)")
    g = engine.group
    for key, mine in (("world_size", g.size), ("node_size", g.node_size), ("rank", g.rank)):
        if state[key] != mine:
            raise ValueError(f"load_state_dict: checkpoint {key} {state[key]} != this engine's {mine}"
                             + ("; load_full_state_dict(full_state_dict()) moves weights across world sizes"
                                if key != "rank" else ""))
    theirs, mine = state["layout"], _layout(engine)
    for i in range(max(len(theirs), len(mine))):
        a = tuple(theirs[i]) if i < len(theirs) else None
        b = mine[i] if i < len(mine) else None
        if a != b:
            raise ValueError(f"load_state_dict: the checkpoint is of another model or unit layout: "
                             f"{_layout_difference(i, a, b)}")
    differ = {k: (v, state["config"].get(k)) for k, v in _config_summary(engine.config).items()
              if state["config"].get(k) != v}
    if differ:
        fields = ", ".join(f"{k}={theirs} in the checkpoint, {mine} here" for k, (mine, theirs) in differ.items())
        raise ValueError(f"load_state_dict: the checkpoint's ZeroConfig differs: {fields}")
    for i, (flat, master) in enumerate(zip(engine.flat_params, state["master"])):
        if master.shape != flat.master.shape:
            raise ValueError(f"load_state_dict: master shard {i} has shape {tuple(master.shape)}, "
                             f"expected {tuple(flat.master.shape)}")
    if engine.resident:
        for i, (flat, part) in enumerate(zip(engine.flat_params, state.get("replica") or [])):
            if part.shape != flat.compute_shard.shape or part.dtype != flat.compute_shard.dtype:
                raise ValueError(f"load_state_dict: weight partition {i} is {part.dtype}{list(part.shape)}, "
                                 f"expected {flat.compute_shard.dtype}{list(flat.compute_shard.shape)}")
    opt_theirs, opt_mine = state["optimizer"]["param_groups"], engine.optimizer.state_dict()["param_groups"]
    if [len(pg["params"]) for pg in opt_theirs] != [len(pg["params"]) for pg in opt_mine]:
        raise ValueError("load_state_dict: the checkpoint's optimizer has other parameter groups")
    keys_theirs = [sorted(pg) for pg in opt_theirs]
    if keys_theirs != [sorted(pg) for pg in opt_mine]:
        raise ValueError(f"load_state_dict: the checkpoint's optimizer is of another kind (its settings "
                         f"{keys_theirs[0]}, here {sorted(opt_mine[0])})")
    if state["scaler"]["enabled"] != engine.scaler.enabled:
        raise ValueError("load_state_dict: loss scaling is on in one of the checkpoint and this engine only")


def _layout_difference(i: int, theirs, mine) -> str:
    """The first parameter that differs (name or shape), else the whole flat buffer."""
    if theirs is not None and mine is not None and theirs[:2] == mine[:2]:
        for (n1, s1), (n2, s2) in zip(zip(theirs[2], theirs[3]), zip(mine[2], mine[3])):
            if (n1, s1) != (n2, s2):
                return f"unit {mine[0]!r} holds {n1}{list(s1)} there and {n2}{list(s2)} here"
    return f"flat buffer {i} is {_describe(theirs)} there and {_describe(mine)} here"


def _describe(entry) -> str:
    if entry is None:
        return "absent"
    unit, trainable, names, shapes = entry
    return (f"unit {unit!r} ({'trainable' if trainable else 'frozen'}: "
            + ", ".join(f"{n}{list(s)}" for n, s in zip(names, shapes)) + ")")


@torch.no_grad()
def load_engine_state_dict(engine, state: dict) -> None:
    _check_engine_state(engine, state)
    for flat, master in zip(engine.flat_params, state["master"]):
        flat.master.copy_(master)
        flat.master.grad = None
        flat.refresh_compute_shard()
    engine.optimizer.load_state_dict(state["optimizer"])
    engine.scaler.load_state_dict(state["scaler"])
    engine.steps = int(state["steps"])


def _full_values(engine, state: Dict[str, torch.Tensor]) -> tuple:
    """Checks a plain model state dict against the engine's model; returns
    ({canonical parameter name: tensor}, {buffer name: tensor})."""
    if not isinstance(state, dict):
        raise TypeError(f"load_full_state_dict: expected a dict of tensors, got {type(state).__name__}")
    names = {}  # canonical name -> names present
    for name, (_, canon) in engine._aliases.items():
        if name in state:
            names.setdefault(canon, []).append(name)
    buffers = {n: b for n, b in engine.module.state_dict(keep_vars=True).items() if n not in engine._aliases}
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

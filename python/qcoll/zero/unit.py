"""A ZeRO-3 unit and its lifecycle, in one place.

A unit is a module and the parameters it holds (unit_modules.py), in up to two flat buffers
(flat_param.py): trainable ones and frozen ones (a frozen parameter must not share a master
shard with trainable ones, or weight decay would move it). Each step a unit goes through

    forward:   SHARDED -> GATHERING -> GATHERED <-> IN_USE (its module's forward runs)
               GATHERED -> SECONDARY_KEPT (hpZ) or SHARDED, after its last forward use
    backward:  SECONDARY_KEPT or SHARDED -> GATHERING -> GATHERED -> GRADS_PENDING
               GRADS_PENDING -> REDUCED when its gradients are reduce-scattered: once autograd
               has every gradient this backward's graph reaches of it, in the order all ranks
               share (engine._issue_reduces); one the graph reaches whose backward never
               started reduces at the end of backward from where it is, and one whose
               trainable parameters the graph does not reach keeps its state (its frozen
               weights may still pass the gradient on)
    end:       every unit -> SHARDED; after a forward or backward that raised, abandon()

Only the methods here change `state`, and each checks that the transition is legal, so an
engine bug is an error naming the unit and both states, not silently wrong weights.
"""

from __future__ import annotations

import enum
from typing import List, Optional

import torch.nn as nn

from .flat_param import FlatParam


class UnitState(enum.Enum):
    SHARDED = "sharded"  # only this rank's shard
    GATHERING = "gathering"  # an all-gather into the full buffers is in flight
    GATHERED = "gathered"  # full weights valid, no module running on them
    IN_USE = "in use"  # its module's forward runs on them (users > 0)
    SECONDARY_KEPT = "secondary kept"  # forward done; hpZ kept part of the weights for backward
    GRADS_PENDING = "gradients pending"  # gathered for backward, autograd still computing gradients
    REDUCED = "reduced"  # this backward's gradients reduce-scattered; trainable buffer freed


_ALLOWED = {
    UnitState.SHARDED: {UnitState.GATHERING, UnitState.REDUCED},
    UnitState.SECONDARY_KEPT: {UnitState.GATHERING, UnitState.REDUCED, UnitState.SHARDED},
    UnitState.GATHERING: {UnitState.GATHERED},
    UnitState.GATHERED: {UnitState.IN_USE, UnitState.GRADS_PENDING, UnitState.SECONDARY_KEPT,
                         UnitState.SHARDED, UnitState.REDUCED},
    UnitState.IN_USE: {UnitState.GATHERED},
    UnitState.GRADS_PENDING: {UnitState.REDUCED, UnitState.SHARDED},
    UnitState.REDUCED: {UnitState.SHARDED},
}
FORWARD, BACKWARD = "forward", "backward"


class Unit:
    def __init__(self, index: int, name: str, module: nn.Module, flats: List[FlatParam]):
        self.index = index
        self.name = name or "<root>"
        self.module = module
        self.flats = flats
        self.state = UnitState.SHARDED
        self.users = 0  # calls of its module whose forward is running
        self.forward_calls = 0  # calls of its module in this forward
        self.grads_ready = 0  # trainable parameters whose gradient autograd has accumulated
        self.expected_grads = sum(len(f.params) for f in flats if f.requires_grad)
        self.reachable_grads = self.expected_grads  # of those, the ones this backward reaches
        self._reachable: Optional[set] = None  # their ids (None: every trainable parameter)
        self._works: list = []
        self._gather_phase: Optional[str] = None

    @property
    def requires_grad(self) -> bool:
        return self.expected_grads > 0

    @property
    def trainable(self) -> List[FlatParam]:
        return [f for f in self.flats if f.requires_grad]

    def _move(self, new: UnitState) -> None:
        if new not in _ALLOWED[self.state]:
            raise RuntimeError(f"qcoll.zero: unit {self.index} ({self.name}) cannot go from "
                               f"{self.state.value} to {new.value}")
        self.state = new

    # ---- gathering -----------------------------------------------------------------------
    @property
    def gathered(self) -> bool:
        """Full weights valid or on their way."""
        return self.state in (UnitState.GATHERING, UnitState.GATHERED, UnitState.IN_USE,
                              UnitState.GRADS_PENDING)

    def gather(self, phase: str, issue) -> None:
        """Start the all-gather of every buffer: issue(flat) returns the call's Work."""
        for f in self.flats:
            f.allocate()
        self._works = [issue(f) for f in self.flats]
        self._gather_phase = phase
        self._move(UnitState.GATHERING)

    def wait(self, timed) -> Optional[str]:
        """Wait for an all-gather in flight (timed(fn) runs fn and times it); returns the
        phase it was issued for, or None when nothing was in flight."""
        if self.state is not UnitState.GATHERING:
            return None
        for w in self._works:
            if w is not None:
                timed(w.wait)
        self._works = []
        self._move(UnitState.GATHERED)
        return self._gather_phase

    # ---- forward -------------------------------------------------------------------------
    def new_forward(self) -> None:
        self.forward_calls = 0

    def enter(self) -> None:
        if self.state is not UnitState.IN_USE:
            self._move(UnitState.IN_USE)
        self.users += 1
        self.forward_calls += 1

    def exit(self) -> None:
        self.users -= 1
        if self.users == 0:
            self._move(UnitState.GATHERED)

    def release(self) -> None:
        """Free the full buffers after forward; hpZ's secondary shards, if kept, stay."""
        for f in self.flats:
            f.free()
        kept = any(f.secondary is not None for f in self.flats)
        self._move(UnitState.SECONDARY_KEPT if kept else UnitState.SHARDED)

    # ---- backward ------------------------------------------------------------------------
    def start_backward(self) -> None:
        self._move(UnitState.GRADS_PENDING)

    def expect_gradients(self, reachable: Optional[set]) -> None:
        """A backward starts whose graph reaches the parameters whose ids are in `reachable`
        (a parameter it does not reach gets no gradient from it: an unused head, an expert
        that got no tokens, a layer not run); None: every trainable parameter."""
        ids = [id(p) for f in self.trainable for p in f.params]
        self._reachable = None if reachable is None else {i for i in ids if i in reachable}
        self.reachable_grads = len(ids) if reachable is None else len(self._reachable)

    def grad_arrived(self, param) -> bool:
        """A trainable parameter's gradient is accumulated; True when it was the last one."""
        if self._reachable is not None and id(param) not in self._reachable:
            raise RuntimeError(
                f"qcoll.zero: unit {self.index} ({self.name}) got a gradient for a parameter the "
                "loss's graph did not show (a custom autograd.Function running a backward of its "
                "own?); the unit may already be reduce-scattered")
        self.grads_ready += 1
        return self.grads_ready == self.reachable_grads

    @property
    def grads_complete(self) -> bool:
        """Autograd has accumulated every gradient this backward brings it."""
        return self.grads_ready >= self.reachable_grads

    def reduced(self) -> None:
        """Its gradients are reduce-scattered: the trainable buffers and every secondary
        are no longer needed (frozen weights may still feed input gradients: they stay
        until the backward ends)."""
        for f in self.flats:
            if f.requires_grad:
                f.free()
            f.secondary = None
        self._move(UnitState.REDUCED)

    def abandon(self, timed) -> None:
        """A forward or backward stopped by an exception: wait for its all-gather in flight
        (its buffers must outlive the call), drop the gradients autograd left in the
        parameters (the next backward would add to them) and go back to only the shards,
        from whatever state the pass left it in."""
        self.wait(timed)
        for f in self.flats:
            for p in f.params:
                p.grad = None
        self._clear()
        self.state = UnitState.SHARDED

    def reset(self) -> None:
        """End of backward: only the shards remain."""
        self._clear()
        if self.state is not UnitState.SHARDED:
            self._move(UnitState.SHARDED)

    def _clear(self) -> None:
        for f in self.flats:
            f.free()
            f.secondary = None
        self.users = self.grads_ready = self.forward_calls = 0

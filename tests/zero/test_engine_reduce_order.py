"""Ranks whose losses reach different parameters (an auxiliary loss or a dropped layer on
some ranks only), in stage 2.

A unit whose parameters all get gradients is reduce-scattered during autograd; one with a
parameter that got none is reduce-scattered at the end of backward. When that differs between
ranks, each rank's reduce-scatters must still pair unit with unit: the engine issues them in
one shared order. Before, rank 0 reduced the head during autograd and rank 1 at the end, so
same-sized units' gradients were averaged with each other's (every weight wrong, no error).
Stage 3 gathers each unit again in backward, so there every rank's backward must reach the
same units (as in FSDP); the same-graph run checks the shared order changes nothing there.
The reference: the same model in one process, stepped with each rank's gradients averaged.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from tests.support.distributed import run_ranks

LR = 0.1
STEPS = 3


class _Heads(nn.Module):
    """Two heads of 8 -> 4 (72 elements, the size of a block: a misordered pair mixes
    silently)."""

    def __init__(self):
        super().__init__()
        self.main = nn.Linear(8, 4)
        self.side = nn.Linear(8, 4)

    def forward(self, h):
        return self.main(h), self.side(h)


class _AuxModel(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.Sequential(*[nn.Linear(8, 8) for _ in range(3)])
        self.heads = nn.ModuleList([_Heads()])

    def forward(self, x, aux: bool, drop: bool = False):
        h = x
        for i, block in enumerate(self.blocks):
            if not (drop and i == 1):
                h = block(h)
        main, side = self.heads[0](torch.tanh(h))
        loss = main.pow(2).sum()
        return loss + side.pow(2).sum() if aux else loss


def _batch(rank, step):
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank))


CASES = {  # rank -> (auxiliary loss, drop block 1)
    "aux loss on rank 0": lambda rank: (rank == 0, False),  # the side head: no gradient elsewhere
    "block dropped on rank 1": lambda rank: (True, rank == 1),
    "same graph": lambda rank: (True, False),
}


def _reference(world, case):
    """One process: each step, the average of every rank's gradients, then SGD."""
    model = _AuxModel()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for rank in range(world):
            model.zero_grad()
            model(_batch(rank, step), *CASES[case](rank)).backward()
            for g, p in zip(grads, model.parameters()):
                if p.grad is not None:
                    g += p.grad / world
        for g, p in zip(grads, model.parameters()):
            p.grad = g
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(rank, world, stage, case):
    from qcoll.zero import ZeroConfig, ZeroEngine

    eng = ZeroEngine(_AuxModel(), lambda ps: torch.optim.SGD(ps, lr=LR),
                     config=ZeroConfig(stage=stage, compute_dtype=torch.float32, qwz=False, qgz=False))
    for step in range(STEPS):
        eng.zero_grad()
        eng.backward(eng(_batch(rank, step), *CASES[case](rank)))
        assert eng.step()
    return eng.full_state_dict()


@pytest.mark.parametrize("stage,case", [(2, "aux loss on rank 0"), (2, "block dropped on rank 1"),
                                        (3, "same graph")])
def test_each_unit_is_reduced_with_its_own_gradients(stage, case):
    world = 2
    expected = _reference(world, case)
    for got in run_ranks(world, _train, stage, case, timeout=120):
        for name, value in expected.items():
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)


# ---- the shared order holds nothing back --------------------------------------------------
class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(8, 8)
        self.idle = nn.Linear(8, 8)  # never called

    def forward(self, x):
        return torch.tanh(self.used(x))


class _Blocks(nn.Module):
    """Four blocks; `reverse` calls them in the reverse of their registration order; block
    3 holds a Linear its forward never uses (an expert that got no tokens)."""

    def __init__(self, reverse: bool):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([_Block() for _ in range(4)])
        self.reverse = reverse

    def forward(self, x):
        for block in (reversed(self.blocks) if self.reverse else self.blocks):
            x = block(x)
        return x.pow(2).sum()


def _pending_when_last_block_completes(rank, world, reverse):
    """How many other units still hold gathered weights and gradients (not yet
    reduce-scattered) when autograd accumulates a gradient of the block that runs first,
    each step."""
    from qcoll.zero import ZeroConfig, ZeroEngine
    from qcoll.zero.unit import UnitState

    model = _Blocks(reverse)
    eng = ZeroEngine(model, lambda ps: torch.optim.SGD(ps, lr=LR),
                     config=ZeroConfig(compute_dtype=torch.float32, qwz=False, qgz=False))
    index = 3 if reverse else 0  # the units are the blocks, in registration order
    assert [u.name for u in eng.units] == [f"blocks.{i}" for i in range(4)]
    seen = []
    model.blocks[index].used.bias.register_post_accumulate_grad_hook(lambda p: seen.append(
        sum(u.state is UnitState.GRADS_PENDING for u in eng.units if u.index != index)))
    for step in range(STEPS):
        eng.zero_grad()
        eng.backward(eng(_batch(rank, step)))
        eng.step()
    return seen


@pytest.mark.parametrize("reverse", [False, True])
def test_no_unit_waits_for_one_ahead_of_it(reverse):
    """Every block has an unused Linear, and with `reverse` the forward calls the blocks in the
    reverse of their registration (unit) order. When the block run first gets its last
    gradient, the others have all been reduce-scattered: a unit with an unused parameter is
    complete once autograd has what its graph reaches, and the first step's order is the
    reverse of the forward's. Before, the first unit in the order never completed, so every
    unit behind it kept its weights and gradients to the end of backward."""
    for seen in run_ranks(2, _pending_when_last_block_completes, reverse, timeout=120):
        assert seen == [0] * STEPS, seen

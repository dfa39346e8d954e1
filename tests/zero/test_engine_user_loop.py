"""ZeroEngine under what a user's code does around the training step: reading the model's
parameters and state dict outside forward (stage 3 shards them), an exception in forward
or backward that the loop catches and steps past, and unit modules that return dataclasses.
Each run is checked against the same training in one process."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

from tests.support.distributed import run_ranks

LR = 0.1
STEPS = 3


class _Fail(torch.autograd.Function):
    """Identity whose backward raises while `armed` (an error inside autograd)."""

    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if _Fail.armed:
            raise RuntimeError("injected backward failure")
        return grad


@dataclasses.dataclass
class _Out:
    hidden: torch.Tensor
    extra: int = 0


class _Block(nn.Module):
    def __init__(self, dataclass_output: bool):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.dataclass_output = dataclass_output
        self.fail = False

    def forward(self, x):
        x = x.hidden if isinstance(x, _Out) else x
        h = torch.tanh(self.lin(x))
        if self.fail:  # inside the unit's forward: its weights gathered and in use
            raise RuntimeError("injected forward failure")
        return _Out(h) if self.dataclass_output else h


class _Model(nn.Module):
    """Three blocks in a ModuleList (three units); block 1 can fail in forward (its `fail`) or
    backward (_Fail.armed)."""

    def __init__(self, dataclass_output: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([_Block(dataclass_output) for _ in range(3)])

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i == 1:
                x = _Out(_Fail.apply(x.hidden)) if isinstance(x, _Out) else _Fail.apply(x)
        return (x.hidden if isinstance(x, _Out) else x).pow(2).sum()


def _batch(rank, step):
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank))


def _reference(world, steps, dataclass_output=False):
    """One process: each step in `steps`, the average of every rank's gradients, then SGD."""
    model = _Model(dataclass_output)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in steps:
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for rank in range(world):
            model.zero_grad()
            model(_batch(rank, step)).backward()
            for g, p in zip(grads, model.parameters()):
                g += p.grad / world
        for g, p in zip(grads, model.parameters()):
            p.grad = g
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _engine(model, stage=3):
    from qcoll.zero import ZeroConfig, ZeroEngine

    return ZeroEngine(model, lambda ps: torch.optim.SGD(ps, lr=LR),
                      config=ZeroConfig(stage=stage, compute_dtype=torch.float32, qwz=False, qgz=False))


def _assert_matches(results, expected):
    for got in results:
        for name, value in expected.items():
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)


# ---- parameters and state dicts outside forward ------------------------------------------
def _outside_forward(rank, world, stage):
    model = _Model()
    eng = _engine(model, stage)
    seen_in_forward = []
    model.blocks[0].register_forward_pre_hook(lambda m, a: seen_in_forward.append(tuple(m.lin.weight.shape)))
    eng.zero_grad()
    eng.backward(eng(_batch(rank, 0)))
    eng.step()
    shapes = [tuple(p.shape) for p in model.parameters()]
    norms = [float(p.detach().norm()) for p in model.parameters()]  # read freed memory before
    errors = {}
    for what, call in (("state_dict", model.state_dict),
                       ("block state_dict", model.blocks[2].lin.state_dict),
                       ("load_state_dict", lambda: model.load_state_dict(eng.full_state_dict()))):
        try:
            call()
        except RuntimeError as e:
            errors[what] = str(e)
    eng.zero_grad()  # the engine still trains after the refused calls
    eng.backward(eng(_batch(rank, 1)))
    eng.step()
    return shapes, norms, seen_in_forward, errors, eng.full_state_dict()


def test_stage3_parameters_outside_forward_are_empty_and_state_dicts_point_to_the_engine():
    results = run_ranks(2, _outside_forward, 3, timeout=120)
    for shapes, norms, seen, errors, _ in results:
        assert all(s == (0,) for s in shapes), shapes
        assert norms == [0.0] * len(norms)
        assert seen == [(8, 8), (8, 8)]  # the real weight inside each forward
        assert set(errors) == {"state_dict", "block state_dict", "load_state_dict"}
        assert "engine.full_state_dict()" in errors["state_dict"]
        assert "engine.full_state_dict()" in errors["block state_dict"]
        assert "engine.load_full_state_dict" in errors["load_state_dict"]
    _assert_matches([r[4] for r in results], _reference(2, [0, 1]))


def test_stage2_keeps_the_module_state_dict():
    """Stage 2 holds the full weights on every rank: the module's own state dict works."""
    for shapes, _, _, errors, _ in run_ranks(2, _outside_forward, 2, timeout=120):
        assert errors == {} and (8, 8) in shapes


# ---- an exception in forward or backward -------------------------------------------------
def _fails_once(rank, world, where, dataclass_output):
    model = _Model(dataclass_output)
    eng = _engine(model)
    raised = []
    for step in range(STEPS):
        model.blocks[1].fail = step == 1 and where == "forward"
        _Fail.armed = step == 1 and where == "backward"
        eng.zero_grad()
        try:
            eng.backward(eng(_batch(rank, step)))
        except RuntimeError as e:  # a loop that skips the failed step
            raised.append((step, "injected" in str(e)))
            eng.zero_grad()
            continue
        eng.step()
    _Fail.armed = False
    return raised, eng.full_state_dict()


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_step_that_raises_is_skipped_and_training_goes_on(where):
    """Before, the units the failed pass left gathered or waiting for gradients made every
    later step raise (an illegal state change)."""
    results = run_ranks(2, _fails_once, where, False, timeout=120)
    assert all(raised == [(1, True)] for raised, _ in results), results
    _assert_matches([state for _, state in results], _reference(2, [0, 2]))


def test_dataclass_outputs_get_their_backward_gather():
    """A unit returning a dataclass: its pre-backward hook finds the tensors inside it (before,
    none was registered and backward ran on freed weights)."""
    results = run_ranks(2, _fails_once, None, True, timeout=120)
    assert all(raised == [] for raised, _ in results)
    _assert_matches([state for _, state in results], _reference(2, range(STEPS), dataclass_output=True))


# ---- gradient accumulation, and backward outside the engine ------------------------------
def _two_forwards_two_backwards(rank, world, stage, hpz):
    from qcoll.zero import ZeroConfig, ZeroEngine

    eng = ZeroEngine(_Model(), lambda ps: torch.optim.SGD(ps, lr=LR),
                     config=ZeroConfig(stage=stage, hpz=hpz, compute_dtype=torch.float32, qwz=False, qgz=False))
    for step in range(0, 2 * STEPS, 2):
        eng.zero_grad()
        losses = [eng(_batch(rank, step)), eng(_batch(rank, step + 1))]
        for loss in losses:  # each micro-batch's loss holds half the step's weight
            eng.backward(loss / 2)
        eng.step()
    return eng.full_state_dict()


def _reference_accumulated(world):
    model = _Model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(0, 2 * STEPS, 2):
        model.zero_grad()
        for rank in range(world):
            for micro in (step, step + 1):
                (model(_batch(rank, micro)) / (2 * world)).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("stage,hpz", [(2, None), (3, False), (3, None)])
def test_two_forwards_then_two_backwards(stage, hpz):
    """Before (the shared order's first form), the second backward took every unit as
    complete and reduce-scattered zeros before autograd reached it: stage 2's weights went
    wrong and stage 3 ran backward on freed weights. With hpZ (stage 3's default) the first
    backward drops the secondary shards: the second gathers as forward did (it raised)."""
    _assert_matches(run_ranks(2, _two_forwards_two_backwards, stage, hpz, timeout=120),
                    _reference_accumulated(2))


def _plain_backward(rank, world):
    eng = _engine(_Model())
    try:
        eng(_batch(rank, 0)).backward()
    except RuntimeError as e:
        return str(e)
    return None


def test_loss_backward_outside_the_engine_raises():
    for message in run_ranks(2, _plain_backward, timeout=120):
        assert message is not None and "engine.backward(loss)" in message, message


@dataclasses.dataclass
class _Partial:
    hidden: torch.Tensor
    cache: torch.Tensor = dataclasses.field(init=False)  # never set


class _PartialBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return _Partial(torch.tanh(self.lin(x.hidden if isinstance(x, _Partial) else x)))


def _unset_field(rank, world):
    torch.manual_seed(0)
    model = nn.Sequential(_PartialBlock(), _PartialBlock())
    eng = _engine(model)
    eng.zero_grad()
    eng.backward(eng(_batch(rank, 0)).hidden.sum())
    return eng.step()


def test_a_dataclass_output_with_an_unset_field():
    assert run_ranks(2, _unset_field, timeout=120) == [True, True]


# ---- gradients the engine must not take early or refuse ------------------------------------
class _FrozenPath(nn.Module):
    """A block whose frozen Linear carries the gradient on to the block before, and whose
    trainable adapter this step does not use."""

    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(8, 8).requires_grad_(False)
        self.adapter = nn.Linear(8, 8)
        self.use_adapter = False

    def forward(self, x):
        h = torch.tanh(self.frozen(x))
        return self.adapter(h) if self.use_adapter else h


class _Checkpointed(nn.Module):
    """A block that recomputes its inner MLP in backward (reentrant checkpointing, which
    runs a backward of its own that the loss's graph does not show)."""

    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(8, 8)
        self.mlp = nn.Sequential(nn.Linear(8, 8), nn.Tanh())

    def forward(self, x):
        h = torch.tanh(self.attn(x))
        return torch.utils.checkpoint.checkpoint(self.mlp, h, use_reentrant=True)


def _chain(kind):
    torch.manual_seed(0)
    middle = {"frozen path": _FrozenPath, "checkpointed": _Checkpointed}.get(kind, lambda: nn.Linear(8, 8))()
    return nn.Sequential(nn.Linear(8, 8), middle, nn.Linear(8, 8))


def _train_chain(rank, world, kind, stage):
    eng = _engine(_chain(kind), stage)
    for step in range(STEPS):
        eng.zero_grad()
        x = _batch(rank, step).requires_grad_(kind == "input gradient")
        loss = eng(x).pow(2).sum()
        if kind == "input gradient":  # a gradient penalty's first half, in stage 2
            (grad_x,) = torch.autograd.grad(loss, x, retain_graph=True)
            assert grad_x.shape == x.shape
        eng.backward(loss)
        eng.step()
    return eng.full_state_dict()


def _reference_chain(world, kind):
    model = _chain(kind)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    for step in range(STEPS):
        grads = {n: torch.zeros_like(p) for n, p in model.named_parameters() if p.requires_grad}
        for rank in range(world):
            model.zero_grad()
            model(_batch(rank, step)).pow(2).sum().backward()
            for n, p in model.named_parameters():
                if p.grad is not None:
                    grads[n] += p.grad / world
        for n, p in model.named_parameters():
            if p.requires_grad:
                p.grad = grads[n]
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("kind,stage", [("frozen path", 3), ("frozen path", 2), ("checkpointed", 2),
                                        ("checkpointed", 3), ("input gradient", 2)])
def test_gradients_through_frozen_weights_checkpoints_and_input_gradients(kind, stage):
    """frozen path: the middle unit's trainable parameters get no gradient this step but its
    frozen weights pass the gradient on (it was reduced, freed, before autograd reached it:
    backward read freed memory). checkpointed: reentrant checkpointing hides the MLP's
    parameters from the loss's graph (the unit was reduced before its MLP's gradients came:
    stage 2 added them into the next step, silently). input gradient: stage 2 lets
    torch.autograd.grad reach the units."""
    _assert_matches(run_ranks(2, _train_chain, kind, stage, timeout=120), _reference_chain(2, kind))

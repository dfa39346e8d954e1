"""Which modules are units and which unit holds each parameter (qcoll.zero.unit_modules), and the
unit lifecycle's guard against illegal transitions (qcoll.zero.unit). No ranks needed."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from qcoll.zero import ZeroConfig
from qcoll.zero.flat_param import FlatParam
from qcoll.zero.unit import Unit, UnitState
from qcoll.zero.unit_modules import assign_parameters, select_unit_modules
from tests.support.zero_helpers import gpt


def _units(model, rule):
    modules = select_unit_modules(model, rule)
    owned, aliases = assign_parameters(model, modules)
    names = {id(m): n or "<root>" for n, m in model.named_modules()}
    return {names[id(m)]: sorted(n for n, _ in owned[i]) for i, m in enumerate(modules)}, aliases


def test_auto_rule_picks_blocks_and_the_root_keeps_the_rest():
    model = gpt.GPT(gpt.GPTConfig(n_layer=2, tie_weights=True))
    units, aliases = _units(model, None)
    assert list(units) == ["<root>", "blocks.0", "blocks.1"]
    assert units["<root>"] == ["ln_f.bias", "ln_f.weight", "wpe.weight", "wte.weight"]
    assert units["blocks.1"] == sorted(n for n, _ in model.named_parameters() if n.startswith("blocks.1."))
    assert aliases["head.weight"] == "wte.weight"  # tied: one parameter, two names


def test_every_parameter_in_exactly_one_unit():
    model = gpt.GPT(gpt.GPTConfig(n_layer=3, tie_weights=False))
    for rule in (None, (nn.Linear,), (gpt.Block, nn.LayerNorm), lambda m: isinstance(m, gpt.MLP)):
        units, _ = _units(model, rule)
        held = [n for names in units.values() for n in names]
        assert sorted(held) == sorted(n for n, _ in model.named_parameters()), rule


def test_nested_sequential_and_empty_children():
    model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1)))
    units, _ = _units(model, None)
    # ReLU holds nothing: not a unit; the inner Sequential and both of its Linears are.
    assert list(units) == ["<root>", "0", "2", "2.0", "2.1"]
    assert units["2"] == [] and units["<root>"] == []


def test_tied_across_units_goes_to_their_common_ancestor():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Sequential(nn.Linear(2, 2))
            self.b = nn.Sequential(nn.Linear(2, 2))
            self.b[0].weight = self.a[0].weight

    units, aliases = _units(Tied(), (nn.Sequential,))
    assert units["a"] == ["a.0.bias"] and units["b"] == ["b.0.bias"]
    assert units["<root>"] == ["a.0.weight"] and aliases["b.0.weight"] == "a.0.weight"


def test_a_module_reused_at_two_places_keeps_its_parameters():
    shared = nn.Linear(2, 2)
    model = nn.ModuleDict({"x": nn.Sequential(shared), "y": nn.Sequential(shared)})
    units, aliases = _units(model, (nn.Linear,))
    assert units == {"<root>": [], "x.0": ["x.0.bias", "x.0.weight"]}
    assert aliases["y.0.weight"] == "x.0.weight"


@pytest.mark.parametrize("value", [(), (int,), ("Linear",), nn.Linear, "blocks", 3])
def test_unit_modules_validation(value):
    with pytest.raises(ValueError, match="unit_modules"):
        ZeroConfig(unit_modules=value)


def test_unit_modules_accepts_classes_and_callables():
    assert ZeroConfig(unit_modules=(nn.Linear, gpt.Block)).unit_modules == (nn.Linear, gpt.Block)
    rule = lambda m: isinstance(m, gpt.Block)  # noqa: E731
    assert ZeroConfig(unit_modules=rule).unit_modules is rule


def test_illegal_transition_names_the_unit_and_states():
    lin = nn.Linear(2, 2)
    unit = Unit(0, "lin", lin, [FlatParam(0, list(lin.parameters()), ["weight", "bias"], 1, 0, torch.float32)])
    assert unit.state is UnitState.SHARDED
    with pytest.raises(RuntimeError, match=r"unit 0 \(lin\) cannot go from sharded to in use"):
        unit.enter()
    with pytest.raises(RuntimeError, match="sharded to gradients pending"):
        unit.start_backward()

"""Which modules are ZeRO-3 units, and which unit holds each parameter.

A unit is a module plus every parameter in its subtree not claimed by a smaller unit (as in
FSDP2 and DeepSpeed). The root module is always a unit: it holds whatever no smaller unit
claims. A parameter registered under several modules (tied weights, a module reused at two
places) belongs to the deepest unit whose subtree holds every one of its registrations, so
each module that reads it runs while that unit is gathered.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch.nn as nn


def _holds_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def auto_unit(module: nn.Module, parent: nn.Module) -> bool:
    """The default rule: each child of a ModuleList / Sequential that holds parameters (a
    transformer's blocks) is a unit."""
    return isinstance(parent, (nn.ModuleList, nn.Sequential)) and _holds_parameters(module)


def select_unit_modules(root: nn.Module, rule) -> List[nn.Module]:
    """The unit modules, root first, in module order. `rule`: None (auto_unit), a tuple of
    module classes, or a callable(module) -> bool (ZeroConfig.unit_modules)."""
    chosen = [root]
    seen = {id(root)}

    def visit(parent: nn.Module) -> None:
        for child in parent.children():
            if id(child) not in seen:
                if rule is None:
                    picked = auto_unit(child, parent)
                elif isinstance(rule, tuple):
                    picked = isinstance(child, rule)
                else:
                    picked = bool(rule(child))
                if picked:
                    seen.add(id(child))
                    chosen.append(child)
            visit(child)

    visit(root)
    return chosen


def assign_parameters(root: nn.Module, unit_modules: List[nn.Module]) -> Tuple[Dict[int, list], Dict[str, str]]:
    """unit index -> [(canonical name, parameter)], and every parameter name -> canonical
    name. The canonical name is the first name state_dict() gives the parameter."""
    index = {id(m): i for i, m in enumerate(unit_modules)}
    chains: Dict[int, List[List[int]]] = {}  # id(param) -> unit chain of each registration
    first: Dict[int, Tuple[str, nn.Parameter]] = {}
    aliases: Dict[str, str] = {}

    def visit(module: nn.Module, prefix: str, chain: List[int]) -> None:
        if id(module) in index and (not chain or chain[-1] != index[id(module)]):
            chain = chain + [index[id(module)]]
        for name, p in module._parameters.items():
            if p is None:
                continue
            full = prefix + name
            first.setdefault(id(p), (full, p))
            aliases[full] = first[id(p)][0]
            chains.setdefault(id(p), []).append(chain)
        for name, child in module._modules.items():
            if child is not None:
                visit(child, f"{prefix}{name}.", chain)

    visit(root, "", [])
    owned: Dict[int, List[Tuple[str, nn.Parameter]]] = {i: [] for i in range(len(unit_modules))}
    for pid, (name, p) in first.items():
        registrations = chains[pid]
        # The deepest unit on the first registration's chain that every registration shares.
        owner = next(u for u in reversed(registrations[0]) if all(u in c for c in registrations))
        owned[owner].append((name, p))
    return owned, aliases

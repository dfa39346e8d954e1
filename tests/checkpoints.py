"""Shared pieces of the checkpoint tests (test_zero_checkpoint.py, test_fsdp_checkpoint.py):
exact comparison and copies of nested state, and one scratch folder per test module for the
checkpoints its ranks write and later ranks read."""

from __future__ import annotations

import functools
import tempfile

import torch


def same(a, b) -> bool:
    """Nested dicts / lists / tensors equal bit for bit (tensors by torch.equal)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def copied(value):
    """Nested state with every tensor cloned (a state dict may hand out live tensors)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: copied(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(copied(v) for v in value)
    return value


@functools.lru_cache(maxsize=None)
def scratch(prefix: str) -> str:
    """A folder made once per prefix and test session."""
    return tempfile.mkdtemp(prefix=prefix)

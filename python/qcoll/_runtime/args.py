"""A call's arguments, checked once, on every rank, before any communication: the tensors
(type, contiguity, dtype, device, sizes), the reduction and the group's size. The code
formats and blocks are the policies' to check (qcoll.policy)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import _C
from .._dtypes import BYTES_CODE, DTYPE_CODES, dtype_code
from ..group import Group

OPS = dict(_C.OPS)  # name -> the core's ReduceOp code

_SIZE_RULES = {
    "quantized_allgather": "output.numel() must equal group size * input.numel()",
    "delta_allgather": "full.numel() must equal group size * shard.numel()",
    "quantized_reduce_scatter": "input.numel() must equal group size * output.numel()",
}


def ranks_in(group) -> int:
    """The group's number of ranks without creating a qcoll.Group (arguments are checked
    before any Group is made: making one communicates)."""
    if isinstance(group, Group):
        return group.size
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a qcoll.Group, a torch ProcessGroup or None, got {type(group).__name__}")
    return dist.get_world_size(group)


def _check_written(t, name: str, what: str) -> None:
    """A tensor the call writes in place (as torch's in-place ops and collectives)."""
    if t.requires_grad and t.is_leaf:
        raise RuntimeError(f"{what}: {name} is a leaf tensor that requires grad; a collective "
                           "writes it in place (pass a tensor without requires_grad, or detach it)")


def _check_tensor_arg(t, name: str, what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_contiguous():
        raise ValueError(f"{what}: {name} must be contiguous")


def check_pair(output, input, expected_out: int, expected_in: int, what: str,
               raw_bytes_ok: bool = False, names=("output", "input")) -> int:
    """The dtype code of a valid (output, input) pair; raw_bytes_ok (unquantized
    all-gather): a non-float dtype is moved as raw bytes (BYTES_CODE). names: what the
    caller calls the two."""
    out_name, in_name = names
    # The common case in one test; the helpers then name what is wrong.
    if not (isinstance(output, torch.Tensor) and isinstance(input, torch.Tensor)
            and output.is_contiguous() and input.is_contiguous()):
        for name, t in ((out_name, output), (in_name, input)):
            _check_tensor_arg(t, name, what)
    _check_written(output, out_name, what)
    if raw_bytes_ok and input.dtype not in DTYPE_CODES:
        code = BYTES_CODE
    else:
        code = dtype_code(input.dtype, what, in_name)
    if output.dtype != input.dtype:
        raise ValueError(f"{what}: {out_name} dtype {output.dtype} does not match {in_name} dtype {input.dtype}")
    if output.device != input.device:
        raise ValueError(f"{what}: {out_name} is on {output.device} but {in_name} is on {input.device}")
    if output.numel() != expected_out or input.numel() != expected_in:
        raise ValueError(f"{what}: {_SIZE_RULES[what]}; got {out_name}.numel()={output.numel()}, "
                         f"{in_name}.numel()={input.numel()}")
    return code


def check_in_place(tensor, what: str) -> int:
    """The dtype code of the one tensor an in-place call (the all-reduce) reads and writes."""
    _check_tensor_arg(tensor, "tensor", what)
    _check_written(tensor, "tensor", what)
    return dtype_code(tensor.dtype, what, "tensor")


def check_op(op) -> int:
    """The core's ReduceOp code of `op` ("sum" or "avg")."""
    if not isinstance(op, str) or op not in OPS:
        raise ValueError(f"op must be one of {sorted(OPS)}, got {op!r}")
    return OPS[op]


def check_async_op(async_op) -> None:
    """async_op must be a bool: a truthy string or number would return an unwaited Work."""
    if not isinstance(async_op, bool):
        raise TypeError(f"async_op must be True or False, got {async_op!r}")

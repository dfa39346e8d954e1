"""qcoll.quantized_allgather: the API of the core's all-gather (src/collectives/all_gather.cpp).
Its keywords become an AllGatherPolicy; the call runs in the runtime (qcoll._runtime)."""

from __future__ import annotations

from typing import Optional

import torch

from . import auto
from ._dtypes import BYTES_CODE
from ._formats import RAW_CODE
from ._runtime import args, call
from ._runtime.steps import AllGather
from .group import resolve_group
from .policy import ALL_GATHER, AllGatherPolicy, cached

_WHAT = "quantized_allgather"


def quantized_allgather(output: torch.Tensor, input: torch.Tensor, group=None, *, bits=ALL_GATHER.bits,
                        group_size: Optional[int] = None, async_op: bool = False, policy=None):
    """all_gather_into_tensor semantics: output = concatenation of every rank's input, in
    rank order. bits=8 / "int8", 4 / "int4" or "fp8_e4m3" block-quantizes what travels
    (every rank, this one included, dequantizes the same bytes, so all outputs are
    bit-identical); bits=None is the transport's own all-gather in the input dtype, which
    may then be any dtype (a non-float one travels as raw bytes, exactly). The input may be a view of this rank's
    slot of the output (in place). policy="auto": the group's cost model chooses between this
    call and bits=None per call (qcoll.auto)."""
    args.check_async_op(async_op)
    if policy is not None:
        return auto.all_gather(quantized_allgather, output, input, group, policy, bits=bits,
                               group_size=group_size, async_op=async_op)
    size = args.ranks_in(group)
    n = input.numel() if isinstance(input, torch.Tensor) else 0
    policy = cached(AllGatherPolicy, bits, group_size)
    code = args.check_pair(output, input, size * n, n, _WHAT, raw_bytes_ok=policy.code == RAW_CODE)
    return all_gather_call(_WHAT, output, input, resolve_group(group), policy, code, async_op)


def all_gather_call(what: str, output: torch.Tensor, input: torch.Tensor, g, policy: AllGatherPolicy,
                    code: int, async_op: bool):
    """The all-gather of checked arguments (also delta_allgather's bits=None)."""
    n = input.numel() * (input.element_size() if code == BYTES_CODE else 1)
    wire = policy.code
    if call.debugging():
        call.debug_check(g, (what, n, output.numel(), str(input.dtype), wire, policy.group_size), input.device)
    step = AllGather(g, n, code, wire, policy.group_size, input.device)

    def launch(ctx, workspace):
        step.run(ctx, input, output, workspace)

    return call.run(what, g, input, output, step.plan.workspace_bytes, launch, async_op)


__all__ = ["quantized_allgather"]

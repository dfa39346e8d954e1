"""qcoll.quantized_reduce_scatter: the API of the core's reduce-scatter
(src/collectives/reduce_scatter.cpp), with error feedback on the input's encode. Its
keywords become a ReduceScatterPolicy; the call runs in the runtime (qcoll._runtime)."""

from __future__ import annotations

from typing import Optional

import torch

from . import auto
from ._runtime import args, call
from ._runtime.steps import ReduceScatter, carve
from .error_feedback import check_error_feedback, compensate_first_hop, inter_residual
from .group import resolve_group
from .policy import REDUCE_SCATTER, ReduceScatterPolicy, cached

_WHAT = "quantized_reduce_scatter"


def quantized_reduce_scatter(output: torch.Tensor, input: torch.Tensor, group=None, *, op: str = "avg",
                             intra_bits=REDUCE_SCATTER.intra_bits, inter_bits=REDUCE_SCATTER.inter_bits,
                             group_size: Optional[int] = None, pipeline_stages: Optional[int] = None,
                             hierarchical: Optional[bool] = None, error_feedback=None,
                             hadamard: bool = False, hadamard_size: Optional[int] = None,
                             async_op: bool = False, policy=None):
    """reduce_scatter_tensor semantics: rank r's output = op over ranks of
    input[r*n:(r+1)*n], n = output.numel(). op: "avg" (true mean) or "sum"; reduced in fp32
    (but for the transport's own call, below).

    Several nodes: 2-hop (intra-node all-to-all at intra_bits, fp32 reduce, inter-node
    all-to-all at inter_bits), pipelined over pipeline_stages slices (fewer where a slice
    would be below the measured size where pipelining pays). One node, or
    hierarchical=False: one all-to-all at intra_bits (one node) or inter_bits (several).
    Each bits argument: 8 / "int8", 4 / "int4", "fp8_e4m3", or None, which sends the input
    dtype; an unquantized inter-node hop carries the fp32 partial sums instead, so with both
    None a bf16/fp16 result is rounded once, within half an ulp of the exact sum (or mean)
    up to fp32 summation error (gloo's and NCCL's own bf16 sums round at every step). With
    one hop (one node, or hierarchical=False) and it unquantized this is the transport's
    own reduce-scatter, torch's same call: its own summation, in the input dtype (over
    gloo, gloo's algorithm, an all-reduce of a copy of the input, in a buffer qcoll keeps
    up to 64 MB rather than one allocated per call: the same sums, 0.65-0.78x torch's
    time from 32 MB).

    error_feedback: a qcoll.ErrorFeedback kept for this input: the residual of this rank's
    previous first-hop encode is added to the input before encoding (the input itself is
    left unchanged) and the new residual is kept; on the 2-hop path with inter_bits
    quantized, likewise for the partial sums this rank re-encodes across nodes (see
    qcoll.error_feedback).

    hadamard=True (SDP4Bit's TLq-HS): the quantized hops carry the codes of Hadamard-smoothed
    values (blocks of hadamard_size, as qcoll.quantize), fused into the kernels: the sender
    transforms, the partial sums between the hops stay in the transformed domain, and the
    final decode transforms back. Raw hops (bits=None) carry plain values; with both bits
    None it is an error.

    policy="auto": the group's cost model chooses per call between the transport's own
    reduce-scatter and this configuration on the paths it leaves open (qcoll.auto).
    """
    args.check_async_op(async_op)
    check_error_feedback(error_feedback)
    if policy is not None:
        return auto.reduce_scatter(
            quantized_reduce_scatter, output, input, group, policy, async_op=async_op,
            error_feedback=error_feedback, op=op, intra_bits=intra_bits, inter_bits=inter_bits,
            group_size=group_size, pipeline_stages=pipeline_stages, hierarchical=hierarchical,
            hadamard=hadamard, hadamard_size=hadamard_size)
    size = args.ranks_in(group)
    n = output.numel() if isinstance(output, torch.Tensor) else 0
    code = args.check_pair(output, input, n, size * n, _WHAT)
    op_code = args.check_op(op)
    # pipeline_stages=None (one stage) stays this API's documented default: see qcoll.policy.
    policy = cached(ReduceScatterPolicy, intra_bits, inter_bits, group_size, pipeline_stages,
                    hierarchical, hadamard, hadamard_size)
    group_size, hadamard_size = policy.group_size, policy.hadamard_block
    g = resolve_group(group)
    if call.debugging():
        call.debug_check(g, (_WHAT, n, input.numel(), str(input.dtype), op, policy.intra_code,
                             policy.inter_code, group_size, policy.pipeline_stages, hierarchical,
                             error_feedback is not None, hadamard_size), input.device)
    step = ReduceScatter(g, n, code, op_code, policy.intra_code, policy.inter_code, group_size,
                         policy.pipeline_stages, hierarchical, input.device, hadamard_size)
    plan = step.plan
    ef = residual = None
    if error_feedback is not None and (plan.encodes_input or plan.reencodes_partial_sums):
        ef = error_feedback.bind(_WHAT, input, g.size)
        if plan.encodes_input:
            residual = ef.residual("input", input.numel(), input.device)
    inter = inter_residual(ef, plan, input.device)
    workspace_bytes = plan.workspace_bytes + (0 if residual is None else input.numel() * input.element_size() + 16)

    def launch(ctx, workspace):
        source = input
        if residual is not None:  # the compensated input goes into the workspace, past the plan's
            source, _ = carve(workspace, plan.workspace_bytes, input.numel(), input.dtype)
            source.copy_(input.reshape(-1))
            compensate_first_hop(source, residual, plan, group_size, g.size, n, hadamard_size)
        step.run(ctx, source, output, workspace, residual=inter)

    return call.run(_WHAT, g, input, output, workspace_bytes, launch, async_op, comms=step.comms,
                    keep=tuple(r for r in (residual, inter) if r is not None))


__all__ = ["quantized_reduce_scatter"]

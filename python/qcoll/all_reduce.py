"""qcoll.quantized_all_reduce: AGoQ's 8-bit all-reduce as qcoll's reduce-scatter, then its
all-gather of the reduced shards.

The composition lives here, once: both halves are the core's collectives (the runtime's
ReduceScatter and AllGather steps, the same plans), run one after the other inside ONE call
of the group (one sequence number, one Work, one worker task on CPU, stream order on GPU),
with error feedback between them. The runtime (qcoll._runtime) runs the call.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import _C, auto
from ._device import on_gpu
from ._formats import RAW_CODE
from ._runtime import args, call
from ._runtime.steps import AllGather, ReduceScatter, carve, transport_all_reduce
from .error_feedback import (
    check_error_feedback,
    compensate_first_hop,
    compensate_shard,
    inter_residual,
    keep_shard_residual,
)
from .group import resolve_group
from .policy import ALL_REDUCE, AllReducePolicy, cached, host_all_reduce_tail_apart

_WHAT = "quantized_all_reduce"
# A bits=None bf16/fp16 all-reduce through the transport's all-reduce of fp32 copies goes
# this many elements at a time (a 64 MB fp32 workspace at most).
_UPCAST_CHUNK = 1 << 24
_F32 = _C.DTYPES["float32"]
_AVG = _C.OPS["avg"]


def quantized_all_reduce(tensor: torch.Tensor, group=None, *, op: str = "avg", bits=ALL_REDUCE.bits,
                         inter_bits=ALL_REDUCE.inter_bits, group_size: Optional[int] = None,
                         hierarchical: bool = ALL_REDUCE.hierarchical,
                         pipeline_stages: Optional[int] = ALL_REDUCE.pipeline_stages,
                         error_feedback=None, async_op: bool = False, policy=None):
    """all_reduce semantics, in place: every rank's tensor becomes op ("avg": the mean,
    "sum") over the ranks' tensors, computed in fp32, in the tensor's dtype.

    1. reduce-scatter (qcoll.quantized_reduce_scatter's algorithm) of the tensor, padded to
       a multiple of the group size (host tensors from 4 MB: the last numel % size
       elements apart, unquantized: all-gathered as fp32, summed in rank order on every rank,
       rounded once),
       into this rank's shard: across nodes the 2-hop path
       (bits inside the node, `inter_bits or bits` across; hierarchical=False: one hop);
    2. all-gather of the shards at `inter_bits or bits` when the group spans nodes (bits on
       one node): every rank, the shard's owner too, decodes the same bytes, so the result
       is bit-identical on every rank.
    bits=None (inter_bits None too) is unquantized: on CPU, from 4 ranks, the flat
    reduce-scatter of the raw inputs then the all-gather (hierarchical is ignored), except
    fp32 tensors over 1 MB, which take the transport's own all-reduce (gloo's, torch's same
    call); on 2-3 ranks the transport's all-reduce (of fp32 copies for bf16/fp16), except
    bf16/fp16 from 1 MB, which take the flat exchange (AllReducePolicy.route);
    on GPU the two halves (a flat bf16/fp16 reduce-scatter
    exchanging the raw inputs, a 2-hop one carrying fp32 partial sums across nodes). Every
    way the sum is fp32 and rounded once to the tensor's dtype, so a bf16/fp16 result is
    within half an ulp of the fp32 sum of the inputs (gloo's and NCCL's own bf16 sums round
    at every step).
    error_feedback: a qcoll.ErrorFeedback kept for this tensor (see qcoll.error_feedback):
    the residuals of this rank's input encode, of its partial sums' inter-node re-encode
    (2-hop) and of its shard's all-gather encode.
    policy="auto": the group's cost model chooses per call between bits=None and this
    configuration on the paths it leaves open (qcoll.auto).
    Returns a Work with async_op=True (one for the whole call), else None.
    """
    args.check_async_op(async_op)
    check_error_feedback(error_feedback)
    if policy is not None:
        return auto.all_reduce(quantized_all_reduce, tensor, group, policy, op=op,
                               error_feedback=error_feedback, async_op=async_op, bits=bits,
                               inter_bits=inter_bits, group_size=group_size,
                               pipeline_stages=pipeline_stages, hierarchical=hierarchical)
    size = args.ranks_in(group)
    code = args.check_in_place(tensor, _WHAT)
    op_code = args.check_op(op)
    policy = cached(AllReducePolicy, bits, inter_bits, group_size, pipeline_stages, hierarchical)
    rs = policy.reduce_scatter()
    group_size, stages = policy.group_size, policy.pipeline_stages
    g = resolve_group(group)
    if call.debugging():
        call.debug_check(g, (_WHAT, tensor.numel(), str(tensor.dtype), op, rs.intra_code, rs.inter_code,
                             group_size, stages, hierarchical, error_feedback is not None), tensor.device)

    numel = tensor.numel()
    host = not on_gpu(tensor.device)
    route = policy.route(tensor.element_size(), numel, size, host and call.has_transport_all_reduce(g, tensor.device))
    if route.path == "transport":  # (error feedback has nothing to keep)
        return _transport_all_reduce(g, tensor, code, op_code, async_op)
    # A size that does not split into whole shards: the prefix that does, reduced in place,
    # and the last numel % size elements apart (policy.host_all_reduce_tail_apart), or the
    # tensor copied into a padded buffer and back.
    apart = host and host_all_reduce_tail_apart(numel * tensor.element_size())
    tail = numel % size if apart else 0
    n = -(-(numel - tail) // size)  # shard elements; the tensor less its tail is padded to size * n
    device = tensor.device
    reduce_scatter = ReduceScatter(g, n, code, op_code, rs.intra_code, rs.inter_code, group_size, stages,
                                   route.hierarchical, device, raw_exchange=route.raw_exchange, call_numel=numel)
    rs_plan = reduce_scatter.plan
    # The shards cross nodes (if the group spans several) in the format the plan crosses them with.
    gather_format = rs_plan.second_format
    all_gather = AllGather(g, n, code, gather_format, group_size, device)
    tail_gather = AllGather(g, tail, _F32, RAW_CODE, group_size, device) if tail else None

    ef = residual_in = residual_shard = None
    encodes = rs_plan.encodes_input or rs_plan.reencodes_partial_sums or gather_format != RAW_CODE
    if error_feedback is not None and encodes:  # as the reduce-scatter: an exact call keeps none
        ef = error_feedback.bind(_WHAT, tensor, size)
        if rs_plan.encodes_input:
            residual_in = ef.residual("input", size * n, device)
        if gather_format != RAW_CODE:
            residual_shard = ef.residual("shard", n, device)
    residual_inter = inter_residual(ef, rs_plan, device)

    padded = size * n != numel - tail  # then the reduce-scatter input is a padded copy
    core_bytes = max(rs_plan.workspace_bytes, all_gather.plan.workspace_bytes,
                     tail_gather.plan.workspace_bytes if tail else 0)
    workspace_bytes = core_bytes + 64 + (size * n + n) * tensor.element_size() + 4 * (size + 1) * tail
    flat = tensor.view(-1)

    def launch(ctx, workspace):
        full, offset = flat[:numel - tail], core_bytes
        if padded:
            full, offset = carve(workspace, offset, size * n, tensor.dtype)
            full[:numel].copy_(flat)
            full[numel:].zero_()
        shard, offset = carve(workspace, offset, n, tensor.dtype)
        parts = (_C.Traffic(), _C.Traffic(), _C.Traffic())
        try:
            if residual_in is not None:
                compensate_first_hop(full, residual_in, rs_plan, group_size, size, n)
            reduce_scatter.run(ctx, full, shard, workspace, parts[0], "none", residual_inter)
            if residual_shard is not None:
                wanted = compensate_shard(shard, residual_shard)
            all_gather.run(ctx, shard, full, workspace, parts[1], "none")
            if residual_shard is not None:
                keep_shard_residual(wanted, full[g.rank * n:(g.rank + 1) * n], residual_shard)
            if padded:
                flat.copy_(full[:numel])
            if tail:
                _reduce_tail(ctx, tail_gather, flat[numel - tail:], size, op_code, workspace, offset, parts[2])
        finally:
            _C.add_traffic(ctx.traffic, list(parts), ctx.counter("all_reduce"))

    return call.run(_WHAT, g, tensor, tensor, workspace_bytes, launch, async_op, comms=reduce_scatter.comms,
                    keep=tuple(r for r in (residual_in, residual_inter, residual_shard) if r is not None))


def _reduce_tail(ctx, gather: AllGather, tail: torch.Tensor, size: int, op: int, workspace, offset: int,
                 traffic) -> None:
    """`tail` (this rank's last elements) becomes their sum (or mean) over the ranks: every
    rank's values all-gathered as fp32, then added in rank order, so every rank computes the
    same fp32 sum and rounds it once."""
    mine, offset = carve(workspace, offset, tail.numel(), torch.float32)
    every, _ = carve(workspace, offset, size * tail.numel(), torch.float32)
    mine.copy_(tail)
    gather.run(ctx, mine, every, workspace, traffic, "none")
    rows = every.view(size, -1)
    total = rows[0].clone()
    for row in rows[1:]:
        total.add_(row)
    if op == _AVG:
        total.div_(size)
    tail.copy_(total)


def _transport_all_reduce(g, tensor: torch.Tensor, code: int, op: int, async_op: bool):
    """The transport's all-reduce in one exchange (after the call check): in place for
    fp32; for bf16/fp16 of fp32 copies in the workspace, _UPCAST_CHUNK elements at a time
    (summed in fp32, rounded once)."""
    upcast = code != _F32
    numel = tensor.numel()
    check_bytes = (g.size + 1) * _C.CALL_HEADER_BYTES
    chunk = min(numel, _UPCAST_CHUNK) if upcast else numel
    workspace_bytes = check_bytes + (16 + 4 * chunk if upcast else 0)
    flat = tensor.view(-1)
    wire = _F32 if upcast else code

    def launch(ctx, workspace):
        if not upcast or numel <= chunk:
            parts = [(0, numel, ctx.traffic, "all_reduce")]
        else:  # parts counted as one call (add_traffic below)
            parts = [(b, min(chunk, numel - b), _C.Traffic(), "none") for b in range(0, numel, chunk)]
        try:
            for begin, count, part, collective in parts:
                values = flat[begin:begin + count]
                if upcast:
                    values, _ = carve(workspace, check_bytes, count, torch.float32)
                    values.copy_(flat[begin:begin + count])
                transport_all_reduce(ctx, code, wire, op, values, workspace, part,
                                     numel if begin == 0 else -1, collective)
                if upcast:
                    flat[begin:begin + count].copy_(values)
        finally:
            if len(parts) > 1:
                _C.add_traffic(ctx.traffic, [p[2] for p in parts], ctx.counter("all_reduce"))

    return call.run(_WHAT, g, tensor, tensor, workspace_bytes, launch, async_op)


__all__ = ["quantized_all_reduce"]

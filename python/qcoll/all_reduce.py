"""qcoll.quantized_all_reduce: AGoQ's 8-bit all-reduce as qcoll's reduce-scatter, then its
all-gather of the reduced shards.

The composition lives here, once: both halves are the core's existing collectives
(collectives.py's _reduce_scatter_core / _allgather_core, the same plans), run one after
the other inside ONE call of the group (one _run: one sequence number, one Work, one
worker-thread task on CPU, stream order on GPU), with error feedback between them.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import _C
from ._device import on_gpu
from ._dtypes import dtype_code
from ._formats import format_of
from .collectives import (
    OPS,
    _allgather_core,
    _carve,
    _check_op,
    _debug_check,
    _ranks_in,
    _reduce_scatter_core,
    _run,
)
from .error_feedback import (
    check_error_feedback,
    compensate_first_hop,
    has_first_encode,
    inter_residual,
    compensate_shard,
    keep_shard_residual,
)
from .group import resolve_group
from .policy import ALL_REDUCE, AllReducePolicy

_WHAT = "quantized_all_reduce"
# A bits=None bf16/fp16 all-reduce goes through the transport's fp32 all-reduce, this many
# elements at a time (a 64 MB fp32 workspace at most): twice the bytes of a bf16 ring, but
# one exchange; a reduce-scatter (fp32 partial sums across nodes) then an all-gather moved
# fewer bytes and ran 1.45x torch's bf16 all-reduce (bench/results/sizes-*.json).
_UPCAST_CHUNK = 1 << 24


def _check_tensor(tensor) -> int:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{_WHAT}: tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise ValueError(f"{_WHAT}: tensor must be contiguous")
    if tensor.requires_grad and tensor.is_leaf:
        raise RuntimeError(f"{_WHAT}: tensor is a leaf tensor that requires grad; the all-reduce "
                           "writes it in place (pass a tensor without requires_grad, or detach it)")
    return dtype_code(tensor.dtype, f"{_WHAT}: tensor")


def quantized_all_reduce(tensor: torch.Tensor, group=None, *, op: str = "avg", bits=ALL_REDUCE.bits,
                         inter_bits=ALL_REDUCE.inter_bits, group_size: Optional[int] = None,
                         hierarchical: bool = ALL_REDUCE.hierarchical,
                         pipeline_stages: Optional[int] = ALL_REDUCE.pipeline_stages,
                         error_feedback=None, async_op: bool = False):
    """all_reduce semantics, in place: every rank's tensor becomes op ("avg": the mean,
    "sum") over the ranks' tensors, computed in fp32, in the tensor's dtype.

    1. reduce-scatter (qcoll.quantized_reduce_scatter's algorithm) of the tensor, padded to
       a multiple of the group size, into this rank's shard: across nodes the 2-hop path
       (bits inside the node, `inter_bits or bits` across; hierarchical=False: one hop);
    2. all-gather of the shards at `inter_bits or bits` when the group spans nodes (bits on
       one node): every rank, the shard's owner too, decodes the same bytes, so the result
       is bit-identical on every rank.
    bits=None (inter_bits None too) is unquantized: on CPU the transport's own all-reduce
    (gloo's, torch's same call), of fp32 values for bf16/fp16 tensors; either way the sum
    is fp32 and rounded once to the tensor's dtype, so a bf16/fp16 result is within half an
    ulp of the fp32 sum of the inputs (gloo's and NCCL's own bf16 sums round at every step).
    error_feedback: a qcoll.ErrorFeedback kept for this tensor (see qcoll.error_feedback):
    the residuals of this rank's input encode, of its partial sums' inter-node re-encode
    (2-hop) and of its shard's all-gather encode.
    Returns a Work with async_op=True (one for the whole call), else None.
    """
    size = _ranks_in(group)
    code = _check_tensor(tensor)
    _check_op(op)
    policy = AllReducePolicy(bits, inter_bits, group_size, pipeline_stages, hierarchical)
    rs = policy.reduce_scatter()
    group_size, stages = policy.group_size, policy.pipeline_stages
    check_error_feedback(error_feedback)
    g = resolve_group(group)
    _debug_check(g, (_WHAT, tensor.numel(), str(tensor.dtype), op, rs.intra_code, rs.inter_code,
                     group_size, stages, hierarchical, error_feedback is not None), tensor.device)

    if (bits is None and inter_bits is None and error_feedback is None and not on_gpu(tensor.device)
            and g.size > 1 and g.communicator(tensor.device).has_all_reduce):
        return _transport_all_reduce(g, tensor, code, op, async_op)

    numel = tensor.numel()
    n = -(-numel // size)  # shard elements; the tensor is padded to size * n
    device = tensor.device
    rs_plan, reduce_scatter, extra_comms = _reduce_scatter_core(g, n, code, op, rs.intra_bits, rs.inter_bits,
                                                                group_size, stages, hierarchical, device)
    # The shards cross nodes (if the group spans several) in the format the plan crosses them with.
    gather_bits = format_of(rs_plan.second_format)
    ag_plan, all_gather = _allgather_core(g, n, code, gather_bits, group_size, device)

    ef = residual_in = residual_shard = None
    if error_feedback is not None:
        ef = error_feedback.bind(_WHAT, tensor, size)
        if has_first_encode(rs_plan):
            residual_in = ef.residual("input", size * n, device)
        if gather_bits is not None:
            residual_shard = ef.residual("shard", n, device)
    residual_inter = inter_residual(ef, rs_plan, g.num_nodes, n, device)

    padded = size * n != numel  # then the reduce-scatter input is a padded copy
    core_bytes = max(rs_plan.workspace_bytes, ag_plan.workspace_bytes)
    workspace_bytes = core_bytes + 32 + (size * n + n) * tensor.element_size()
    flat = tensor.view(-1)

    def launch(comm, kind, index, stream, workspace, traffic, sequence, lane_stream):
        full, offset = flat, core_bytes
        if padded:
            full, offset = _carve(workspace, offset, size * n, tensor.dtype)
            full[:numel].copy_(flat)
            full[numel:].zero_()
        shard, _ = _carve(workspace, offset, n, tensor.dtype)
        parts = (_C.Traffic(), _C.Traffic())
        try:
            if residual_in is not None:
                compensate_first_hop(full, residual_in, rs_plan, group_size, size, n)
            g._buffers.set(full, shard, workspace)
            reduce_scatter(comm, kind, index, stream, workspace, parts[0], sequence, full, shard,
                           "none", lane_stream, residual_inter)
            if residual_shard is not None:
                wanted = compensate_shard(shard, residual_shard)
            g._buffers.set(shard, full, workspace)
            all_gather(comm, kind, index, stream, workspace, parts[1], sequence, shard, full, "none")
            if residual_shard is not None:
                keep_shard_residual(wanted, full[g.rank * n:(g.rank + 1) * n], residual_shard)
            if padded:
                flat.copy_(full[:numel])
        finally:
            _C.add_traffic(traffic, list(parts), "all_reduce")

    return _run(_WHAT, g, tensor, tensor, workspace_bytes, launch, async_op, extra_comms=extra_comms)


def _transport_all_reduce(g, tensor: torch.Tensor, code: int, op: str, async_op: bool):
    """The transport's all-reduce in one exchange (after the call check): in place for
    fp32; for bf16/fp16 of fp32 copies in the workspace, _UPCAST_CHUNK elements at a time
    (summed in fp32, rounded once)."""
    upcast = tensor.dtype != torch.float32
    numel = tensor.numel()
    check_bytes = (g.size + 1) * _C.CALL_HEADER_BYTES
    chunk = min(numel, _UPCAST_CHUNK) if upcast else numel
    workspace_bytes = check_bytes + (16 + 4 * chunk if upcast else 0)
    flat = tensor.view(-1)
    wire = _C.DTYPES["float32"] if upcast else code

    def launch(comm, kind, index, stream, workspace, traffic, sequence, lane_stream):
        if not upcast or numel <= chunk:
            parts = [(0, numel, traffic, "all_reduce")]
        else:  # parts counted as one call (add_traffic below)
            parts = [(b, min(chunk, numel - b), _C.Traffic(), "none") for b in range(0, numel, chunk)]
        try:
            for begin, count, part, collective in parts:
                values = flat[begin:begin + count]
                if upcast:
                    values, _ = _carve(workspace, check_bytes, count, torch.float32)
                    values.copy_(flat[begin:begin + count])
                g._buffers.set(values, values, workspace)
                _C.all_reduce_raw(comm, code, wire, OPS[op], count, values.data_ptr(), workspace.data_ptr(),
                                  part, sequence, numel if begin == 0 else -1, collective)
                if upcast:
                    flat[begin:begin + count].copy_(values)
        finally:
            if len(parts) > 1:
                _C.add_traffic(traffic, [p[2] for p in parts], "all_reduce")

    return _run(_WHAT, g, tensor, tensor, workspace_bytes, launch, async_op)


__all__ = ["quantized_all_reduce"]

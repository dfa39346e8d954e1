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
from ._dtypes import dtype_code
from ._formats import format_of
from .collectives import (
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
    bits=None sends the tensor's dtype (exact up to fp32 summation order for fp32).
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


__all__ = ["quantized_all_reduce"]

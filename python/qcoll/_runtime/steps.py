"""The core's collectives as steps of a call. A step is planned when the call is made (the
plan cached per signature: the core's plan is pure arithmetic) and runs inside the call,
with the call's context (communicator, device, stream, sequence number) and, for each core
call, its own CallBuffers. A call runs one step (quantized_allgather) or several in a row
(quantized_all_reduce: a reduce-scatter, then an all-gather of its shards)."""

from __future__ import annotations

import functools

import torch

from .. import _C
from .._device import on_gpu
from .buffers import CallBuffers

# Smallest pipeline stage (input bytes of one partition's slice) worth its exchanges;
# measured, see include/qcoll/plan.h. Tests lower it to exercise many stages on small data.
MIN_STAGE_BYTES = _C.MIN_PIPELINE_STAGE_BYTES


class CallContext:
    """What every step of one call runs with: the group's communicator for the device, the
    core's (kind, index, stream) triple, the lane stream of a CUDA call, the call's number
    (stamped into its wire headers), its Traffic, and whether qcoll.stats() counts it."""

    __slots__ = ("comm", "kind", "index", "stream", "lane_stream", "sequence", "traffic", "counted")

    def __init__(self, comm, kind: int, index: int, stream: int, lane_stream: int, sequence: int, traffic,
                 counted: bool = True):
        self.comm, self.kind, self.index, self.stream = comm, kind, index, stream
        self.lane_stream, self.sequence, self.traffic = lane_stream, sequence, traffic
        self.counted = counted

    def counter(self, collective: str) -> str:
        """The qcoll.stats() counter the call adds its bytes to ("none": not counted)."""
        return collective if self.counted else "none"


@functools.lru_cache(maxsize=1024)
def _all_gather_plan(size, n, code, wire_format, group_size, headers):
    return _C.plan_all_gather(size, n, code, wire_format, group_size, headers)


@functools.lru_cache(maxsize=1024)
def _reduce_scatter_plan(size, node_size, n, code, intra, inter, group_size, stages, hierarchical,
                         headers, min_stage_bytes, hadamard_size, raw_exchange, call_numel):
    return _C.plan_reduce_scatter(size, node_size, n, code, intra, inter, group_size, stages,
                                  hierarchical, headers, min_stage_bytes, hadamard_size, raw_exchange,
                                  call_numel)


class AllGather:
    """The core's all-gather of n elements (dtype code `code`) per rank over group g, at
    wire_format (a format code; RAW: the transport's own). Host calls carry headers and the
    call check."""

    __slots__ = ("plan", "code")

    def __init__(self, g, n: int, code: int, wire_format: int, group_size: int, device: torch.device):
        self.plan = _all_gather_plan(g.size, n, code, wire_format, group_size, not on_gpu(device))
        self.code = code

    def run(self, ctx: CallContext, input, output, workspace, traffic=None, collective="allgather"):
        """collective: the qcoll.stats() counter, "none" for a part of a composite call
        (counted once by the call, with traffic: the part's own)."""
        _C.all_gather(self.plan, ctx.comm, self.code, CallBuffers(input, output, workspace), ctx.kind,
                      ctx.index, ctx.stream, ctx.traffic if traffic is None else traffic, ctx.sequence,
                      ctx.counter(collective))


class ReduceScatter:
    """The core's reduce-scatter with n output elements per rank over g: the plan (flat or
    2-hop, its stages and each hop's format) and, for the 2-hop path, the intra and inter
    communicators (whose recorded failures the call's Work raises too: `comms`).
    raw_exchange: a flat unquantized call exchanges the raw inputs and sums them in fp32
    (rounding once) instead of being the transport's own reduce-scatter. call_numel: the
    elements of the all-reduce this is the first half of (its call check compares them),
    -1 for a reduce-scatter."""

    __slots__ = ("plan", "code", "op", "_intra", "_inter")

    def __init__(self, g, n: int, code: int, op: int, intra_format: int, inter_format: int,
                 group_size: int, stages: int, hierarchical, device: torch.device, hadamard_size: int = 0,
                 raw_exchange: bool = False, call_numel: int = -1):
        hier = -1 if hierarchical is None else int(hierarchical)
        self.plan = _reduce_scatter_plan(g.size, g.node_size, n, code, intra_format, inter_format,
                                         group_size, stages, hier, not on_gpu(device), MIN_STAGE_BYTES,
                                         hadamard_size, raw_exchange, call_numel)
        self.code, self.op = code, op
        two_hop = self.plan.two_hop
        self._intra = g.intra.communicator(device) if two_hop else None
        self._inter = g.inter.communicator(device) if two_hop else None

    @property
    def comms(self) -> tuple:
        return (self._intra, self._inter) if self.plan.two_hop else ()

    def run(self, ctx: CallContext, input, output, workspace, traffic=None, collective="reduce_scatter",
            residual=None):
        """residual: the error-feedback residual of the inter-node re-encode (error_feedback's
        inter_residual), or None."""
        _C.reduce_scatter(self.plan, ctx.comm, self._intra, self._inter, self.code, self.op,
                          CallBuffers(input, output, workspace), ctx.kind, ctx.index, ctx.stream,
                          ctx.traffic if traffic is None else traffic, ctx.sequence, ctx.lane_stream,
                          ctx.counter(collective), 0 if residual is None else residual.data_ptr())


def transport_all_reduce(ctx: CallContext, code: int, wire: int, op: int, values, workspace, traffic,
                         call_numel: int, collective: str) -> None:
    """The transport's own all-reduce of `values` (dtype code `wire`) in place, after the call
    check of a call of call_numel elements of dtype `code` (-1: a later part, not checked)."""
    _C.all_reduce_raw(ctx.comm, code, wire, op, values.numel(), CallBuffers(values, values, workspace),
                      traffic, ctx.sequence, call_numel, ctx.counter(collective))


def carve(workspace: torch.Tensor, offset: int, numel: int, dtype: torch.dtype):
    """A typed view of numel elements at a 16-byte aligned offset of the workspace, and the
    offset after it."""
    offset = -(-offset // 16) * 16
    nbytes = numel * dtype.itemsize
    return workspace[offset:offset + nbytes].view(dtype), offset + nbytes

"""qcoll.quantized_allgather and qcoll.quantized_reduce_scatter.

Every argument is checked here, on every rank, before any communication; the algorithms
themselves run in the C++ core (src/collectives/) over the group's communicator: for CPU
tensors on the group's worker thread (_calls.py), for CUDA tensors on the group's
communication stream (_streams.py)."""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch
import torch.distributed as dist

from . import _C
from ._calls import Work, new_traffic
from ._device import device_args, on_gpu
from ._dtypes import BYTES_CODE, DTYPE_CODES, dtype_code
from ._formats import RAW_CODE, format_code
from .group import Group, resolve_group
from .error_feedback import (check_error_feedback, compensate_first_hop, has_first_encode,
                             has_inter_encode, inter_residual)
from .policy import ALL_GATHER, REDUCE_SCATTER, AllGatherPolicy, ReduceScatterPolicy

OPS = dict(_C.OPS)  # name -> the core's ReduceOp code
# Smallest pipeline stage (input bytes of one partition's slice) worth its exchanges;
# measured, see include/qcoll/plan.h. Tests lower it to exercise many stages on small data.
_MIN_STAGE_BYTES = _C.MIN_PIPELINE_STAGE_BYTES


def _check_bits(bits, name: str) -> int:
    """A hop's code format: 8 / "int8", 4 / "int4" or "fp8_e4m3" quantize, None sends the
    input dtype. Returns the core's format code (RAW_CODE for None)."""
    return format_code(bits, name, allow_none=True)


def _check_pair(output, input, expected_out: int, expected_in: int, what: str,
                raw_bytes_ok: bool = False, names=("output", "input")) -> int:
    """The dtype code of a valid pair; raw_bytes_ok (unquantized all-gather): a non-float
    dtype is moved as raw bytes (BYTES_CODE). names: what the caller calls the two."""
    out_name, in_name = names
    for name, t in ((out_name, output), (in_name, input)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_contiguous():
            raise ValueError(f"{what}: {name} must be contiguous")
    if output.requires_grad and output.is_leaf:  # as torch's in-place ops and collectives
        raise RuntimeError(f"{what}: {out_name} is a leaf tensor that requires grad; a collective "
                           "writes it in place (pass a tensor without requires_grad, or detach it)")
    if raw_bytes_ok and input.dtype not in DTYPE_CODES:
        code = BYTES_CODE
    else:
        code = dtype_code(input.dtype, f"{what}: {in_name}")
    if output.dtype != input.dtype:
        raise ValueError(f"{what}: {out_name} dtype {output.dtype} does not match {in_name} dtype {input.dtype}")
    if output.device != input.device:
        raise ValueError(f"{what}: {out_name} is on {output.device} but {in_name} is on {input.device}")
    if output.numel() != expected_out or input.numel() != expected_in:
        raise ValueError(f"{what}: {_size_rule(what)}; got {out_name}.numel()={output.numel()}, "
                         f"{in_name}.numel()={input.numel()}")
    return code


def _size_rule(what: str) -> str:
    if what == "quantized_allgather":
        return "output.numel() must equal group size * input.numel()"
    if what == "delta_allgather":
        return "full.numel() must equal group size * shard.numel()"
    return "input.numel() must equal group size * output.numel()"


def _ranks_in(group) -> int:
    """The group's number of ranks without creating a qcoll.Group (arguments are checked first)."""
    if isinstance(group, Group):
        return group.size
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a qcoll.Group, a torch ProcessGroup or None, got {type(group).__name__}")
    return dist.get_world_size(group)


def _debug_check(group: Group, meta: tuple, device: torch.device) -> None:
    """QCOLL_DEBUG=1: compare the call's metadata across ranks and raise on a mismatch
    (instead of hanging or corrupting data inside the transport). Skipped while a CUDA
    graph is being captured on `device`: the check synchronizes the host, which a capture
    forbids (the eager warm-up calls before the capture are checked)."""
    if os.environ.get("QCOLL_DEBUG", "0") in ("", "0") or group.size == 1:
        return
    if on_gpu(device) and group._cuda.capturing(device):
        return
    group._calls.drain()  # group.pg may be the worker's own (a sub-group's): never both at once
    metas = [None] * group.size
    dist.all_gather_object(metas, meta, group=group.pg)
    if any(m != metas[0] for m in metas):
        lines = "\n".join(f"  rank {r}: {m}" for r, m in enumerate(metas))
        raise ValueError(f"qcoll: ranks disagree on {meta[0]} arguments:\n{lines}")


class _Describe:
    """A call's name for its errors, formatted only when one is raised (a per-call f-string
    of the group's ranks is a measurable part of a small call)."""

    __slots__ = ("what", "ranks", "sequence")

    def __init__(self, what: str, group: Group, sequence: int):
        self.what, self.ranks, self.sequence = what, group.global_ranks, sequence  # not the group: no cycle

    def __str__(self) -> str:
        return f"qcoll.{self.what} (call {self.sequence} of the group of global ranks {self.ranks})"

    __format__ = lambda self, spec: format(str(self), spec)  # noqa: E731


def _describe(what: str, group: Group, sequence: int) -> _Describe:
    return _Describe(what, group, sequence)


def _run(what: str, group: Group, input: torch.Tensor, output: torch.Tensor, workspace_bytes: int,
         launch, async_op: bool, extra_comms: tuple = ()):
    """Run `launch(comm, kind, index, stream, workspace, traffic, sequence, lane_stream)` for
    one call.

    The output is written in place: its version counter is bumped now, as torch's in-place
    ops do, so autograd sees the write. CPU: the call runs on the group's worker thread,
    after every call issued before it on the group's family; the tensors stay referenced
    until it has run. CUDA: the call runs on the family's communication stream, ordered
    after the caller's current stream (_streams.py); extra_comms: the call's other
    communicators, whose recorded failures its Work raises too."""
    if not output.is_inference():
        torch.autograd.graph.increment_version(output)
    device = input.device
    if on_gpu(device):
        group._calls.drain()  # CPU calls issued earlier on this family go first
    comm = group.communicator(device)
    kind, index, _ = device_args(input, "input")
    sequence = group._next_sequence()
    traffic = new_traffic()
    describe = _describe(what, group, sequence)

    if on_gpu(device):
        def enqueue(stream, lane, workspace):
            group._buffers.set(input, output, workspace)  # read by a torch transport only
            try:
                launch(comm, kind, index, stream.cuda_stream, workspace, traffic, sequence,
                       lane.cuda_stream)
            finally:
                group._buffers.clear()

        call = group._cuda.run(device, enqueue, workspace_bytes, (input, output),
                               (comm, *extra_comms), describe, async_op)
        return None if call is None else Work(traffic=traffic, cuda_call=call)

    def run():
        workspace = _workspace(group, workspace_bytes)
        group._buffers.set(input, output, workspace)
        try:
            launch(comm, kind, index, 0, workspace, traffic, sequence, 0)
        finally:
            group._buffers.clear()

    if not async_op:
        group._calls.call(run, describe)
        return None
    return Work(group._calls.submit(run, describe), traffic=traffic)


def _workspace(group: Group, nbytes: int) -> torch.Tensor:
    """Scratch for one CPU call: one grow-only buffer per group. Fresh large allocations
    come back from the OS as new pages, and faulting them in cost a quarter of a 64 MB
    reduce-scatter (bench/results/cluster-cpu.json). It is taken when the call runs on the
    family's worker thread, which runs one call at a time, so two calls in flight never
    share it. (CUDA calls use their family's cached workspace: _streams.py.)"""
    if group._cpu_workspace is None or group._cpu_workspace.numel() < nbytes:
        group._cpu_workspace = torch.empty(nbytes, dtype=torch.uint8)
    return group._cpu_workspace[:nbytes]


@functools.lru_cache(maxsize=1024)
def _allgather_plan(size, n, code, wire_format, group_size, headers):
    return _C.plan_all_gather(size, n, code, wire_format, group_size, headers)


@functools.lru_cache(maxsize=1024)
def _reduce_scatter_plan(size, node_size, n, code, intra, inter, group_size, stages, hierarchical,
                         headers, min_stage_bytes, hadamard_size):
    return _C.plan_reduce_scatter(size, node_size, n, code, intra, inter, group_size, stages,
                                  hierarchical, headers, min_stage_bytes, hadamard_size)


def _check_op(op) -> str:
    if not isinstance(op, str) or op not in OPS:
        raise ValueError(f"op must be one of {sorted(OPS)}, got {op!r}")
    return op


def _allgather_core(g: Group, n: int, code: int, bits, group_size: int, device: torch.device):
    """The plan of one all-gather of n elements per rank over g, and
    run(comm, kind, index, stream, workspace, traffic, sequence, input, output, collective)
    that executes it in the core (collective: the stats() counter, "none" for a part)."""
    plan = _allgather_plan(g.size, n, code, _check_bits(bits, "bits"), group_size,
                           not on_gpu(device))

    def run(comm, kind, index, stream, workspace, traffic, sequence, input, output,
            collective="allgather", lane_stream=0):
        _C.all_gather(plan, comm, code, input.data_ptr(), output.data_ptr(), workspace.data_ptr(),
                      kind, index, stream, traffic, sequence, collective)

    return plan, run


def _reduce_scatter_core(g: Group, n: int, code: int, op: str, intra_bits, inter_bits,
                         group_size: int, stages: int, hierarchical, device: torch.device,
                         hadamard_size: int = 0):
    """The plan of one reduce-scatter with n output elements per rank over g, its run (as
    _allgather_core's, plus the lane stream of a CUDA call) and the call's other
    communicators (the 2-hop's intra and inter; see _run's extra_comms). g.intra and g.inter
    share g's buffer registry, which the caller fills for the call."""
    hier = -1 if hierarchical is None else int(hierarchical)
    plan = _reduce_scatter_plan(g.size, g.node_size, n, code, _check_bits(intra_bits, "intra_bits"),
                                _check_bits(inter_bits, "inter_bits"), group_size, stages, hier,
                                not on_gpu(device), _MIN_STAGE_BYTES, hadamard_size)
    intra_comm = g.intra.communicator(device) if plan.two_hop else None
    inter_comm = g.inter.communicator(device) if plan.two_hop else None
    op_code = OPS[op]

    def run(comm, kind, index, stream, workspace, traffic, sequence, input, output,
            collective="reduce_scatter", lane_stream=0, residual=None):
        # residual: error_feedback.inter_residual's, or None
        _C.reduce_scatter(plan, comm, intra_comm, inter_comm, code, op_code, input.data_ptr(),
                          output.data_ptr(), workspace.data_ptr(), kind, index, stream, traffic,
                          sequence, lane_stream, collective,
                          0 if residual is None else residual.data_ptr())

    return plan, run, ((intra_comm, inter_comm) if plan.two_hop else ())


def _carve(workspace: torch.Tensor, offset: int, numel: int, dtype: torch.dtype):
    """A typed view of numel elements at a 16-byte aligned offset of the workspace, and the
    offset after it."""
    offset = -(-offset // 16) * 16
    nbytes = numel * dtype.itemsize
    return workspace[offset:offset + nbytes].view(dtype), offset + nbytes


def quantized_allgather(output: torch.Tensor, input: torch.Tensor, group=None, *, bits=ALL_GATHER.bits,
                        group_size: Optional[int] = None, async_op: bool = False):
    """all_gather_into_tensor semantics: output = concatenation of every rank's input, in
    rank order. bits=8 / "int8", 4 / "int4" or "fp8_e4m3" block-quantizes what travels
    (every rank, this one included, dequantizes the same bytes, so all outputs are
    bit-identical); bits=None is the transport's own all-gather in the input dtype, which
    may then be any dtype (a non-float one travels as raw bytes, exactly). The input may be a view of this rank's
    slot of the output (in place)."""
    size = _ranks_in(group)
    n = input.numel() if isinstance(input, torch.Tensor) else 0
    policy = AllGatherPolicy(bits=bits, group_size=group_size)
    wire_format, group_size = policy.code, policy.group_size
    code = _check_pair(output, input, size * n, n, "quantized_allgather",
                       raw_bytes_ok=wire_format == RAW_CODE)
    if code == BYTES_CODE:
        n *= input.element_size()
    g = resolve_group(group)
    _debug_check(g, ("quantized_allgather", n, output.numel(), str(input.dtype), wire_format, group_size),
                 input.device)
    plan, run = _allgather_core(g, n, code, bits, group_size, input.device)

    def launch(comm, kind, index, stream, workspace, traffic, sequence, lane_stream):
        run(comm, kind, index, stream, workspace, traffic, sequence, input, output)

    return _run("quantized_allgather", g, input, output, plan.workspace_bytes, launch, async_op)


def quantized_reduce_scatter(output: torch.Tensor, input: torch.Tensor, group=None, *, op: str = "avg",
                             intra_bits=REDUCE_SCATTER.intra_bits, inter_bits=REDUCE_SCATTER.inter_bits,
                             group_size: Optional[int] = None, pipeline_stages: Optional[int] = None,
                             hierarchical: Optional[bool] = None, error_feedback=None,
                             hadamard: bool = False, hadamard_size: Optional[int] = None,
                             async_op: bool = False):
    """reduce_scatter_tensor semantics: rank r's output = op over ranks of
    input[r*n:(r+1)*n], n = output.numel(). op: "avg" (true mean) or "sum"; reduced in fp32.

    Several nodes: 2-hop (intra-node all-to-all at intra_bits, fp32 reduce, inter-node
    all-to-all at inter_bits), pipelined over pipeline_stages slices (fewer where a slice
    would be below the measured size where pipelining pays). One node, or
    hierarchical=False: one all-to-all at intra_bits (one node) or inter_bits (several).
    Each bits argument: 8 / "int8", 4 / "int4", "fp8_e4m3", or None, which sends the input
    dtype; an unquantized inter-node hop carries the fp32 partial sums instead, so with both
    None a bf16/fp16 result is rounded once, within half an ulp of the exact sum (or mean)
    up to fp32 summation error (gloo's and NCCL's own bf16 sums round at every step). With
    hierarchical=False and the one hop unquantized this is the transport's own
    reduce-scatter (its own summation, in the input dtype).

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
    """
    size = _ranks_in(group)
    n = output.numel() if isinstance(output, torch.Tensor) else 0
    code = _check_pair(output, input, n, size * n, "quantized_reduce_scatter")
    _check_op(op)
    # pipeline_stages=None (one stage) stays this API's documented default: see qcoll.policy.
    policy = ReduceScatterPolicy(intra_bits, inter_bits, group_size, pipeline_stages, hierarchical,
                                 hadamard, hadamard_size)
    intra, inter, group_size = policy.intra_code, policy.inter_code, policy.group_size
    hadamard_size, stages = policy.hadamard_block, policy.pipeline_stages
    check_error_feedback(error_feedback)
    g = resolve_group(group)
    _debug_check(g, ("quantized_reduce_scatter", n, input.numel(), str(input.dtype), op, intra,
                     inter, group_size, stages, hierarchical, error_feedback is not None,
                     hadamard_size), input.device)
    plan, run, extra_comms = _reduce_scatter_core(g, n, code, op, intra_bits, inter_bits, group_size,
                                                  stages, hierarchical, input.device, hadamard_size)
    ef = residual = None
    if error_feedback is not None and (has_first_encode(plan) or has_inter_encode(plan)):
        ef = error_feedback.bind("quantized_reduce_scatter", input, g.size)
        if has_first_encode(plan):
            residual = ef.residual("input", input.numel(), input.device)
    inter = inter_residual(ef, plan, g.num_nodes, n, input.device)
    workspace_bytes = plan.workspace_bytes + (0 if residual is None else input.numel() * input.element_size() + 16)

    def launch(comm, kind, index, stream, workspace, traffic, sequence, lane_stream):
        source = input
        if residual is not None:  # the compensated input goes into the workspace, past the plan's
            source, _ = _carve(workspace, plan.workspace_bytes, input.numel(), input.dtype)
            source.copy_(input.reshape(-1))
            compensate_first_hop(source, residual, plan, group_size, g.size, n, hadamard_size)
            g._buffers.set(source, output, workspace)
        run(comm, kind, index, stream, workspace, traffic, sequence, source, output,
            lane_stream=lane_stream, residual=inter)

    return _run("quantized_reduce_scatter", g, input, output, workspace_bytes, launch, async_op,
                extra_comms=extra_comms)

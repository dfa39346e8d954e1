"""qcoll.quantized_allgather and qcoll.quantized_reduce_scatter.

Every argument is checked here, on every rank, before any communication; the algorithms
themselves run in the C++ core (src/collectives/) over the group's communicator: for CPU
tensors on the group's worker thread (_calls.py), for CUDA tensors in stream order."""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch
import torch.distributed as dist

from . import _C
from ._calls import Work, new_traffic
from ._device import device_args
from ._dtypes import BYTES_CODE, DTYPE_CODES, dtype_code
from .group import Group, resolve_group
from .quantization import check_group_size, check_hadamard

OPS = {"sum": 0, "avg": 1}
# Smallest pipeline stage (input bytes of one partition's slice) worth its exchanges;
# measured, see include/qcoll/plan.h. Tests lower it to exercise many stages on small data.
_MIN_STAGE_BYTES = _C.MIN_PIPELINE_STAGE_BYTES


def _check_bits(bits, name: str) -> int:
    """Wire bits: 4 or 8 quantize, None sends the input dtype (0 for the core)."""
    if bits is None:
        return 0
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in (4, 8):
        raise ValueError(f"{name} must be 4, 8 or None (no quantization), got {bits!r}")
    return int(bits)


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


def _group_size(group) -> int:
    """The group's size without creating a qcoll.Group (arguments are checked first)."""
    if isinstance(group, Group):
        return group.size
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a qcoll.Group, a torch ProcessGroup or None, got {type(group).__name__}")
    return dist.get_world_size(group)


def _debug_check(group: Group, meta: tuple) -> None:
    """QCOLL_DEBUG=1: compare the call's metadata across ranks and raise on a mismatch
    (instead of hanging or corrupting data inside the transport)."""
    if os.environ.get("QCOLL_DEBUG", "0") in ("", "0") or group.size == 1:
        return
    group._calls.drain()  # group.pg may be the worker's own (a sub-group's): never both at once
    metas = [None] * group.size
    dist.all_gather_object(metas, meta, group=group.pg)
    if any(m != metas[0] for m in metas):
        lines = "\n".join(f"  rank {r}: {m}" for r, m in enumerate(metas))
        raise ValueError(f"qcoll: ranks disagree on {meta[0]} arguments:\n{lines}")


def _describe(what: str, group: Group, sequence: int) -> str:
    return f"qcoll.{what} (call {sequence} of the group of global ranks {group.global_ranks})"


def _run(what: str, group: Group, input: torch.Tensor, output: torch.Tensor, workspace_bytes: int,
         launch, async_op: bool):
    """Run `launch(comm, kind, index, stream, workspace, traffic, sequence)` for one call.

    The output is written in place: its version counter is bumped now, as torch's in-place
    ops do, so autograd sees the write. CPU: the call runs on the group's worker thread,
    after every call issued before it on the group's family; the tensors stay referenced
    until it has run. CUDA: the call is enqueued on the caller's stream right here."""
    if not output.is_inference():
        torch.autograd.graph.increment_version(output)
    device = input.device
    if device.type == "cuda":
        group._calls.drain()  # CPU calls issued earlier on this family go first
    comm = group.communicator(device)
    kind, index, stream = device_args(input, "input")
    sequence = group._next_sequence()
    traffic = new_traffic()

    def call():
        workspace = _workspace(group, workspace_bytes, device)
        group._buffers.set(input, output, workspace)
        try:
            launch(comm, kind, index, stream, workspace, traffic, sequence)
        finally:
            group._buffers.clear()
        return workspace

    describe = _describe(what, group, sequence)
    if device.type == "cuda":
        workspace = call()
        if not async_op:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return Work(traffic=traffic, event=event, keep_alive=(input, output, workspace))
    work = Work(group._calls.submit(call, describe), traffic=traffic)
    if async_op:
        return work
    work.wait()
    return None


def _workspace(group: Group, nbytes: int, device: torch.device) -> torch.Tensor:
    """Scratch for one call. On CPU the group keeps one grow-only buffer: fresh large
    allocations come back from the OS as new pages, and faulting them in cost a quarter of
    a 64 MB reduce-scatter (bench/results/cluster-cpu.json). It is taken when the call runs
    on the family's worker thread, which runs one call at a time, so two calls in flight
    never share it. On GPU the caching allocator already reuses memory, in stream order."""
    if device.type != "cpu":
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    if group._cpu_workspace is None or group._cpu_workspace.numel() < nbytes:
        group._cpu_workspace = torch.empty(nbytes, dtype=torch.uint8)
    return group._cpu_workspace[:nbytes]


@functools.lru_cache(maxsize=1024)
def _allgather_plan(size, n, code, bits, group_size, headers):
    return _C.plan_all_gather(size, n, code, bits, group_size, headers)


@functools.lru_cache(maxsize=1024)
def _reduce_scatter_plan(size, node_size, n, code, intra, inter, group_size, stages, hierarchical,
                         headers, min_stage_bytes, hadamard_size):
    return _C.plan_reduce_scatter(size, node_size, n, code, intra, inter, group_size, stages,
                                  hierarchical, headers, min_stage_bytes, hadamard_size)


def quantized_allgather(output: torch.Tensor, input: torch.Tensor, group=None, *, bits: Optional[int] = 8,
                        group_size: Optional[int] = None, async_op: bool = False):
    """all_gather_into_tensor semantics: output = concatenation of every rank's input, in
    rank order. bits=8/4 block-quantizes what travels (every rank, this one included,
    dequantizes the same bytes, so all outputs are bit-identical); bits=None is the
    transport's own all-gather in the input dtype, which may then be any dtype (a
    non-float one travels as raw bytes, exactly). The input may be a view of this rank's
    slot of the output (in place)."""
    size = _group_size(group)
    n = input.numel() if isinstance(input, torch.Tensor) else 0
    wire_bits = _check_bits(bits, "bits")
    code = _check_pair(output, input, size * n, n, "quantized_allgather", raw_bytes_ok=wire_bits == 0)
    if code == BYTES_CODE:
        n *= input.element_size()
    group_size = check_group_size(group_size)
    g = resolve_group(group)
    _debug_check(g, ("quantized_allgather", n, output.numel(), str(input.dtype), bits, group_size))
    plan = _allgather_plan(g.size, n, code, wire_bits, group_size, input.device.type == "cpu")

    def launch(comm, kind, index, stream, workspace, traffic, sequence):
        _C.all_gather(plan, comm, code, input.data_ptr(), output.data_ptr(), workspace.data_ptr(),
                      kind, index, stream, traffic, sequence)

    return _run("quantized_allgather", g, input, output, plan.workspace_bytes, launch, async_op)


def quantized_reduce_scatter(output: torch.Tensor, input: torch.Tensor, group=None, *, op: str = "avg",
                             intra_bits: Optional[int] = 8, inter_bits: Optional[int] = 4,
                             group_size: Optional[int] = None, pipeline_stages: Optional[int] = None,
                             hierarchical: Optional[bool] = None, hadamard: bool = False,
                             hadamard_size: Optional[int] = None, async_op: bool = False):
    """reduce_scatter_tensor semantics: rank r's output = op over ranks of
    input[r*n:(r+1)*n], n = output.numel(). op: "avg" (true mean) or "sum"; reduced in fp32.

    Several nodes: 2-hop (intra-node all-to-all at intra_bits, fp32 reduce, inter-node
    all-to-all at inter_bits), pipelined over pipeline_stages slices (fewer where a slice
    would be below the measured size where pipelining pays). One node, or
    hierarchical=False: one all-to-all at intra_bits (one node) or inter_bits (several).
    bits=None sends the input dtype; with hierarchical=False and the one hop unquantized
    this is the transport's own reduce-scatter.

    hadamard=True (SDP4Bit's TLq-HS): the quantized hops carry the codes of Hadamard-smoothed
    values (blocks of hadamard_size, as qcoll.quantize), fused into the kernels: the sender
    transforms, the partial sums between the hops stay in the transformed domain, and the
    final decode transforms back. Raw hops (bits=None) carry plain values; with both bits
    None it is an error.
    """
    size = _group_size(group)
    n = output.numel() if isinstance(output, torch.Tensor) else 0
    code = _check_pair(output, input, n, size * n, "quantized_reduce_scatter")
    if not isinstance(op, str) or op not in OPS:
        raise ValueError(f"op must be one of {sorted(OPS)}, got {op!r}")
    intra = _check_bits(intra_bits, "intra_bits")
    inter = _check_bits(inter_bits, "inter_bits")
    group_size = check_group_size(group_size)
    hadamard_size = check_hadamard(hadamard, hadamard_size, group_size)
    if hadamard_size and not (intra or inter):
        raise ValueError("hadamard=True needs a quantized hop (intra_bits or inter_bits not None)")
    stages = 1 if pipeline_stages is None else pipeline_stages
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise ValueError(f"pipeline_stages must be a positive int or None, got {pipeline_stages!r}")
    if not (hierarchical is None or isinstance(hierarchical, bool)):
        raise ValueError(f"hierarchical must be True, False or None, got {hierarchical!r}")
    g = resolve_group(group)
    _debug_check(g, ("quantized_reduce_scatter", n, input.numel(), str(input.dtype), op, intra_bits,
                     inter_bits, group_size, stages, hierarchical, hadamard_size))
    hier = -1 if hierarchical is None else int(hierarchical)
    plan = _reduce_scatter_plan(g.size, g.node_size, n, code, intra, inter, group_size, stages, hier,
                                input.device.type == "cpu", _MIN_STAGE_BYTES, hadamard_size)
    intra_comm = g.intra.communicator(input.device) if plan.two_hop else None
    inter_comm = g.inter.communicator(input.device) if plan.two_hop else None
    op_code = OPS[op]

    def launch(comm, kind, index, stream, workspace, traffic, sequence):
        # g.intra and g.inter share g's buffer registry, which _run fills for this call.
        _C.reduce_scatter(plan, comm, intra_comm, inter_comm, code, op_code, input.data_ptr(),
                          output.data_ptr(), workspace.data_ptr(), kind, index, stream, traffic,
                          sequence)

    return _run("quantized_reduce_scatter", g, input, output, plan.workspace_bytes, launch, async_op)

"""qcoll.delta_allgather: SDP4Bit's qWD, the all-gather of quantized weight differences.

A composition over the one all-gather of the core (src/collectives/all_gather.cpp), run as
one call of the group: the difference is taken, quantized, gathered, dequantized and added
in that call, on the group's worker thread (CPU) or in stream order (CUDA), so it has the
all-gather's validation, byte accounting, transports and async semantics.

Determinism: every rank decodes the same bytes into the same fp32 differences (the core
decodes its own chunk too), and `full += difference` is one IEEE fp32 add per element,
rounded once to full's dtype, on inputs that are identical on every rank: so `full` stays
bit-identical everywhere, the sender's own partition included.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import auto
from ._dtypes import DTYPE_CODES
from ._formats import RAW_CODE
from ._runtime import args, call
from ._runtime.steps import AllGather
from .all_gather import all_gather_call
from .group import resolve_group
from .policy import DELTA_ALL_GATHER, AllGatherPolicy, cached

_F32 = torch.float32
_WHAT = "delta_allgather"
_ALIGN = 64  # bytes: each workspace region starts on a cache line (and a float boundary)


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def delta_allgather(full: torch.Tensor, shard: torch.Tensor, group=None, *,
                    bits: Optional[int] = DELTA_ALL_GATHER.bits,
                    group_size: Optional[int] = None, async_op: bool = False, policy=None):
    """Weight-difference all-gather (SDP4Bit's qWD).

    On entry `full` (group size * shard.numel() elements) holds last step's gathered tensor,
    identical on every rank, and `shard` this rank's new partition (same dtype: fp32, fp16
    or bf16).
    Each rank sends its difference `shard - full[its partition]`, computed in fp32 and
    block-quantized at `bits`; on exit every rank's `full` is the old value plus the
    dequantized difference of every partition (its own included), added in fp32 and rounded
    once to full's dtype: bit-identical on all ranks. The error of one call is carried into
    the next difference when `shard` is the exact (master) value.

    bits=None sends the new values themselves (the transport's all-gather in full's dtype):
    `full` becomes exactly the gathered shards. Bytes count under qcoll.stats()'s
    "allgather" (the core's all-gather carries them). policy="auto": the group's cost model
    chooses per call between the differences at `bits` and the values (bits=None; qcoll.auto)."""
    args.check_async_op(async_op)
    if policy is not None:
        return auto.delta_all_gather(delta_allgather, full, shard, group, policy, bits=bits,
                                     group_size=group_size, async_op=async_op)
    size = args.ranks_in(group)
    n = shard.numel() if isinstance(shard, torch.Tensor) else 0
    policy = cached(AllGatherPolicy, bits, group_size)
    code = args.check_pair(full, shard, size * n, n, _WHAT, names=("full", "shard"))
    if n and _overlaps(full, shard):
        raise ValueError("delta_allgather: shard must not share memory with full (full holds the "
                         "previous value the difference is taken from)")
    g = resolve_group(group)
    if policy.code == RAW_CODE:
        return all_gather_call(_WHAT, full, shard, g, policy, code, async_op)
    if call.debugging():
        call.debug_check(g, (_WHAT, n, full.numel(), str(full.dtype), str(shard.dtype), policy.code,
                             policy.group_size), full.device)
    step = AllGather(g, n, DTYPE_CODES[_F32], policy.code, policy.group_size, full.device)
    # Workspace: [the all-gather's own | this rank's fp32 difference | every rank's, decoded].
    scratch_bytes = step.plan.workspace_bytes
    diff_at = _round_up(scratch_bytes, _ALIGN)
    gathered_at = diff_at + _round_up(4 * n, _ALIGN)
    workspace_bytes = gathered_at + 4 * size * n
    flat = full.view(-1)  # any shape: the partitions are of the elements (both contiguous)
    mine = flat[g.rank * n:(g.rank + 1) * n]

    def launch(ctx, workspace):
        diff = workspace[diff_at:diff_at + 4 * n].view(_F32)
        gathered = workspace[gathered_at:gathered_at + 4 * size * n].view(_F32)
        diff.copy_(shard.view(-1))
        diff.sub_(mine)  # fp32: both operands are exact in fp32
        step.run(ctx, diff, gathered, workspace[:scratch_bytes])
        flat.add_(gathered)  # in fp32 (type promotion), rounded once to full's dtype

    return call.run(_WHAT, g, shard, full, workspace_bytes, launch, async_op)

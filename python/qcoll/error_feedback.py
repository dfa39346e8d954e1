"""Error feedback for the lossy gradient collectives: qcoll.ErrorFeedback.

A rank that quantizes a value it owns keeps what the code could not carry (the residual,
in fp32) and adds it to the same value of its next call, so quantization errors do not
accumulate over steps (EF-SGD; 1-bit Adam / LoCo keep the same state). Two encodes in
qcoll are made by one rank from a value only it holds:

  "input"  the first encode of a reduce-scatter (and of an all-reduce's reduce-scatter
           half): this rank's own tensor, as the first hop's code format groups it. Its
           residual has the input's numel (padded to a multiple of the number of ranks;
           an all-reduce of host tensors from 4 MB rounds it down instead: its last
           numel % ranks elements go unquantized, policy.HOST_TAIL_APART_MIN_BYTES).
  "shard"  an all-reduce's all-gather: the reduced shard this rank owns, re-encoded at
           `inter_bits or bits`. Every rank decodes those bytes, the owner included, so the
           owner's residual is exact. numel / ranks elements (rounded up, or down as the
           input's).
  "inter"  the 2-hop reduce-scatter's inter-node re-encode (also an all-reduce's
           reduce-scatter half), when that hop is quantized: the partial sums over its node
           that this rank re-encodes for each node, one per node (num_nodes x shard numel
           = numel / node_size elements). The core's fused dequantize-reduce-quantize
           kernel adds it and keeps the new one itself (ReduceArgs::residual, wire.h), in
           the inter-node chunks' domain (Hadamard-transformed with hadamard=True).
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch

from ._formats import format_of


class ErrorFeedback:
    """Error-feedback state for ONE tensor or bucket, kept by the caller across steps and
    passed as ``error_feedback=`` to quantized_reduce_scatter / quantized_all_reduce.

    Memory: fp32 residuals allocated on the first call, on the tensor's device: 4 bytes per
    element of the input ("input"), plus 4 bytes per element of this rank's shard for an
    all-reduce ("shard": numel / ranks), plus, when the call runs two hops with a
    quantized inter-node format, 4 bytes per element of numel / node_size ("inter": the
    partial sums re-encoded across nodes). E.g. a 2-hop all-reduce on nodes of 8 ranks
    keeps 4 + 4 / world + 0.5 bytes per element of the tensor. ``nbytes`` reports it; ``reset()`` frees it.
    The state binds to the first call's collective, numel, dtype, device and ranks; a
    call that differs raises ValueError (use one state per tensor or bucket). With
    async_op=True the state is updated when the call runs: do not pass it to another call
    before waiting."""

    def __init__(self):
        self._residuals: dict = {}
        self._binding: Optional[tuple] = None

    @property
    def nbytes(self) -> int:
        return sum(r.numel() * r.element_size() for r in self._residuals.values())

    def reset(self) -> None:
        """Forget the residuals (and the binding), e.g. when the bucket layout changes."""
        self._residuals = {}
        self._binding = None

    def bind(self, collective: str, tensor: torch.Tensor, ranks: Optional[int] = None, *,
             group_size: Optional[int] = None) -> "ErrorFeedback":
        """Check (or record, on first use) which call this state belongs to: `collective` of
        `tensor` over a group of `ranks` ranks. (group_size=: the deprecated name of ranks;
        group_size means the quantization block everywhere else.)"""
        if group_size is not None:
            warnings.warn("ErrorFeedback.bind(group_size=) is deprecated: pass ranks= (the "
                          "number of ranks)", DeprecationWarning, stacklevel=2)
            if ranks is not None:
                raise TypeError("ErrorFeedback.bind: pass ranks, not both ranks and group_size")
            ranks = group_size
        if ranks is None:
            raise TypeError("ErrorFeedback.bind: missing ranks (the group's number of ranks)")
        binding = (collective, tensor.numel(), tensor.dtype, tensor.device, ranks)
        if self._binding is None:
            self._binding = binding
        elif binding != self._binding:
            raise ValueError(f"error_feedback: this ErrorFeedback belongs to {_describe(self._binding)}, "
                             f"not {_describe(binding)}; keep one ErrorFeedback per tensor or bucket "
                             "(or reset() it)")
        return self

    def residual(self, role: str, numel: int, device: torch.device) -> torch.Tensor:
        """The fp32 residual of `role` (zeros at first)."""
        r = self._residuals.get(role)
        if r is None or r.numel() != numel:
            r = self._residuals[role] = torch.zeros(numel, dtype=torch.float32, device=device)
        return r

    def __repr__(self) -> str:
        bound = "unbound" if self._binding is None else _describe(self._binding)
        return f"ErrorFeedback({bound}, {self.nbytes} bytes)"


def inter_residual(ef: Optional[ErrorFeedback], plan, device: torch.device) -> Optional[torch.Tensor]:
    """The "inter" residual of a reduce-scatter plan (rows of plan.n, one per node:
    include/qcoll/collectives.h), or None without ef or without that encode (the plan says
    whether it re-encodes partial sums)."""
    if ef is None or not plan.reencodes_partial_sums:
        return None
    return ef.residual("inter", plan.nodes * plan.n, device)


def _describe(binding: tuple) -> str:
    collective, numel, dtype, device, ranks = binding
    return f"{collective} of {numel} {dtype} elements on {device} over {ranks} ranks"


def check_error_feedback(error_feedback) -> None:
    if error_feedback is not None and not isinstance(error_feedback, ErrorFeedback):
        raise TypeError("error_feedback must be a qcoll.ErrorFeedback or None, got "
                        f"{type(error_feedback).__name__}")


def _decode_first_hop(send: torch.Tensor, bits, group_size: int, world: int, n: int, stages: int,
                      slice_len: int, hadamard_size: int = 0) -> torch.Tensor:
    """What the receivers of a reduce-scatter's first encode decode (fp32): the input holds
    `world` partitions of n elements; stage s encodes elements [s * slice_len, ...) of every
    partition as one chunk whose groups (and Hadamard blocks) start at the slice's start
    (wire.h)."""
    from .quantization import dequantize, quantize  # the same codec as the wire's

    rows = send.view(world, n)
    decoded = torch.empty(world, n, dtype=torch.float32, device=send.device)
    for s in range(stages):
        begin = s * slice_len
        length = min(slice_len, n - begin)
        if length <= 0:
            continue
        block = rows[:, begin:begin + length]
        if hadamard_size and length % hadamard_size:
            # A partial last block stays untransformed on the wire: code each chunk alone.
            for r in range(world):
                q = quantize(block[r].contiguous(), bits=bits, group_size=group_size, hadamard=True,
                             hadamard_size=hadamard_size)
                decoded[r, begin:begin + length] = dequantize(q, dtype=torch.float32)
            continue
        padded = -(-length // group_size) * group_size
        if padded != length or not block.is_contiguous():
            # Zeros change no group's absmax, so every group is quantized as on the wire.
            block = torch.nn.functional.pad(block, (0, padded - length))
        q = quantize(block, bits=bits, group_size=group_size, hadamard=bool(hadamard_size),
                     hadamard_size=hadamard_size or None)
        decoded[:, begin:begin + length] = dequantize(q, dtype=torch.float32)[:, :length]
    return decoded.view(-1)


def compensate_first_hop(send: torch.Tensor, residual: torch.Tensor, plan, group_size: int,
                         world: int, n: int, hadamard_size: int = 0) -> None:
    """send (the buffer the first hop of the reduce-scatter `plan` encodes) += residual;
    residual = what that encode (in the format the plan gives the hop) loses on the
    compensated values, including their rounding to send's dtype."""
    wanted = send.float().add_(residual)
    send.copy_(wanted)
    torch.sub(wanted, _decode_first_hop(send, format_of(plan.first_format), group_size, world, n,
                                        plan.stages, plan.slice, hadamard_size), out=residual)


def compensate_shard(shard: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """shard += residual before it is all-gathered; returns the fp32 values meant."""
    wanted = shard.float().add_(residual)
    shard.copy_(wanted)
    return wanted


def keep_shard_residual(wanted: torch.Tensor, decoded: torch.Tensor, residual: torch.Tensor) -> None:
    """residual = the compensated shard minus what every rank decoded for it."""
    torch.sub(wanted, decoded.float(), out=residual)


__all__ = ["ErrorFeedback"]

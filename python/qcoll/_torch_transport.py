"""Transports the C++ collectives call back into: a torch.distributed ProcessGroup, and a
trivial one for a group of one rank. Buffers are addressed by (id, byte offset) into the
flat uint8 views the current call registered (see Buffers)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ._dtypes import DTYPE_CODES

_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
_SUM, _AVG = 0, 1

# torch >= 2.9 names; older releases only have the *_into_tensor / *_tensor ones.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Buffers:
    """The tensors of the collective call in flight, as flat uint8 views: 0 input,
    1 output, 2 workspace (the ids the C++ side uses)."""

    def __init__(self):
        self.views = None

    def set(self, *tensors):
        self.views = [t.reshape(-1).view(torch.uint8) for t in tensors]

    def clear(self):
        self.views = None

    def bytes(self, buffer: int, offset: int, nbytes: int) -> torch.Tensor:
        return self.views[buffer][offset : offset + nbytes]

    def typed(self, buffer: int, offset: int, count: int, dtype_code: int) -> torch.Tensor:
        dtype = _DTYPES[dtype_code]
        return self.bytes(buffer, offset, count * dtype.itemsize).view(dtype)


class ProcessGroupTransport:
    def __init__(self, pg, buffers: Buffers):
        self.pg = pg
        self.size = dist.get_world_size(pg)
        self.buffers = buffers
        self.is_nccl = dist.get_backend(pg) == "nccl"

    def all_to_all(self, send_id, send_off, recv_id, recv_off, nbytes):
        send = self.buffers.bytes(send_id, send_off, self.size * nbytes)
        recv = self.buffers.bytes(recv_id, recv_off, self.size * nbytes)
        dist.all_to_all_single(recv, send, group=self.pg)

    def all_gather(self, send_id, send_off, recv_id, recv_off, nbytes):
        send = self.buffers.bytes(send_id, send_off, nbytes)
        recv = self.buffers.bytes(recv_id, recv_off, self.size * nbytes)
        _all_gather(recv, send, group=self.pg)

    def reduce_scatter(self, send_id, send_off, recv_id, recv_off, count, dtype_code, op):
        send = self.buffers.typed(send_id, send_off, self.size * count, dtype_code)
        recv = self.buffers.typed(recv_id, recv_off, count, dtype_code)
        if op == _AVG and self.is_nccl:
            _reduce_scatter(recv, send, op=dist.ReduceOp.AVG, group=self.pg)
            return
        _reduce_scatter(recv, send, op=dist.ReduceOp.SUM, group=self.pg)
        if op == _AVG:  # gloo has no AVG
            recv.div_(self.size)


class SelfTransport:
    """A group of one rank: every exchange is a local copy."""

    def __init__(self, buffers: Buffers):
        self.buffers = buffers

    def all_to_all(self, send_id, send_off, recv_id, recv_off, nbytes):
        self.buffers.bytes(recv_id, recv_off, nbytes).copy_(self.buffers.bytes(send_id, send_off, nbytes))

    all_gather = all_to_all

    def reduce_scatter(self, send_id, send_off, recv_id, recv_off, count, dtype_code, op):
        recv = self.buffers.typed(recv_id, recv_off, count, dtype_code)
        recv.copy_(self.buffers.typed(send_id, send_off, count, dtype_code))

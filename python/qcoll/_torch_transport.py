"""Transports the C++ collectives call back into: a torch.distributed ProcessGroup, and a
trivial one for a group of one rank. Each exchange comes with the calling core call's own
buffers (_runtime/buffers.py's CallBuffers, passed through the core) and addresses them
by (buffer id, byte offset)."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from . import _C
from ._runtime.worker import CommunicationError
_SUM, _AVG = _C.OPS["sum"], _C.OPS["avg"]  # the core's ReduceOp codes

# torch >= 2.9 names; older releases only have the *_into_tensor / *_tensor ones.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class ProcessGroupTransport:
    """Exchanges over a ProcessGroup qcoll owns. `label` names the group in errors (for a
    2-hop call, which hop failed)."""

    def __init__(self, pg, label: str):
        self.pg = pg
        self.size = dist.get_world_size(pg)
        self.label = label
        self.is_nccl = dist.get_backend(pg) == "nccl"
        # The ProcessGroup's own methods where this torch has them (>= 2.9): the same
        # collectives as torch.distributed's functions without their Python wrapper, which
        # costs ~0.1 ms a call, several times per qcoll call (issue 26).
        self._direct = all(hasattr(pg, m) for m in ("all_gather_single", "reduce_scatter_single",
                                                    "all_to_all_single", "allreduce")) and all(
            hasattr(c10d, o) for o in ("AllgatherOptions", "AllToAllOptions", "ReduceScatterOptions",
                                       "AllreduceOptions"))
        self._opts = {}

    def _options(self, kind, op=None):
        opts = self._opts.get((kind, op))
        if opts is None:
            opts = kind()
            if op is not None:
                opts.reduceOp = op
            self._opts[(kind, op)] = opts
        return opts

    def _failed(self, what: str, exc: Exception) -> CommunicationError:
        return CommunicationError(f"{what} over {self.label}: {type(exc).__name__}: {exc}")

    def all_to_all(self, buffers, send_id, send_off, recv_id, recv_off, nbytes):
        send, recv = buffers.pair(send_id, send_off, self.size * nbytes, recv_id, recv_off,
                                  self.size * nbytes, nbytes)
        try:
            if self._direct:
                self.pg.all_to_all_single(recv, send, [], [], self._options(c10d.AllToAllOptions)).wait()
            else:
                dist.all_to_all_single(recv, send, group=self.pg)
        except Exception as exc:  # noqa: BLE001 - named and re-raised
            raise self._failed("all-to-all", exc) from exc

    def all_gather(self, buffers, send_id, send_off, recv_id, recv_off, nbytes):
        send, recv = buffers.pair(send_id, send_off, nbytes, recv_id, recv_off, self.size * nbytes, nbytes)
        try:
            if self._direct:
                self.pg.all_gather_single(recv, send, self._options(c10d.AllgatherOptions)).wait()
            else:
                _all_gather(recv, send, group=self.pg)
        except Exception as exc:  # noqa: BLE001
            raise self._failed("all-gather", exc) from exc

    def reduce_scatter(self, buffers, send_id, send_off, recv_id, recv_off, count, dtype_code, op):
        send = buffers.typed(send_id, send_off, self.size * count, dtype_code)
        recv = buffers.typed(recv_id, recv_off, count, dtype_code)
        native_avg = op == _AVG and self.is_nccl
        reduce = dist.ReduceOp.AVG if native_avg else dist.ReduceOp.SUM
        try:
            if self._direct:
                self.pg.reduce_scatter_single(recv, send, self._options(c10d.ReduceScatterOptions, reduce)).wait()
            else:
                _reduce_scatter(recv, send, op=reduce, group=self.pg)
        except Exception as exc:  # noqa: BLE001
            raise self._failed("reduce-scatter", exc) from exc
        if op == _AVG and not native_avg:  # gloo has no AVG
            recv.div_(self.size)

    def all_reduce(self, buffers, buf_id, offset, count, dtype_code, op):
        values = buffers.typed(buf_id, offset, count, dtype_code)
        native_avg = op == _AVG and self.is_nccl
        reduce = dist.ReduceOp.AVG if native_avg else dist.ReduceOp.SUM
        try:
            if self._direct:
                self.pg.allreduce([values], self._options(c10d.AllreduceOptions, reduce)).wait()
            else:
                dist.all_reduce(values, op=reduce, group=self.pg)
        except Exception as exc:  # noqa: BLE001
            raise self._failed("all-reduce", exc) from exc
        if op == _AVG and not native_avg:
            values.div_(self.size)


class SelfTransport:
    """A group of one rank: every exchange is a local copy."""

    def all_to_all(self, buffers, send_id, send_off, recv_id, recv_off, nbytes):
        buffers.bytes(recv_id, recv_off, nbytes).copy_(buffers.bytes(send_id, send_off, nbytes))

    all_gather = all_to_all

    def all_reduce(self, buffers, buf_id, offset, count, dtype_code, op):
        pass  # one rank: the values are the result

    def reduce_scatter(self, buffers, send_id, send_off, recv_id, recv_off, count, dtype_code, op):
        recv = buffers.typed(recv_id, recv_off, count, dtype_code)
        recv.copy_(buffers.typed(send_id, send_off, count, dtype_code))

"""The buffers of one exchange of a call: handed to the core with the exchange (each core
call takes one), and by the core back to the torch transport with each of its exchanges
(BufferRef::table, include/qcoll/comm.h), which addresses them by (buffer id, byte offset).
One object per core call, never a registry on the long-lived Group: two calls in flight,
or the two halves of an all-reduce, never see each other's tensors."""

from __future__ import annotations

import torch

from .. import _C
from .._dtypes import DTYPE_CODES

IDS = dict(_C.BUFFERS)  # name -> the core's BufferId, read once from the core
_INPUT, _OUTPUT, _WORKSPACE = IDS["input"], IDS["output"], IDS["workspace"]
if sorted(IDS.values()) != [0, 1, 2]:  # CallBuffers lists its tensors by id
    raise ImportError(f"qcoll: the core's buffer ids {IDS} are not 0, 1, 2")
_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
_WORDS = (torch.int64, torch.int32)  # what byte-moving exchanges travel as, widest first


class CallBuffers:
    """input, output and workspace of one core call, indexed by the core's buffer ids.
    `pointers` is what the core addresses them by; the flat uint8 views a torch transport
    needs are made on its first exchange (an NCCL call never needs them)."""

    __slots__ = ("_tensors", "_views", "pointers")

    def __init__(self, input: torch.Tensor, output: torch.Tensor, workspace: torch.Tensor):
        tensors = [None] * len(IDS)
        tensors[_INPUT], tensors[_OUTPUT], tensors[_WORKSPACE] = input, output, workspace
        self._tensors = tensors
        self._views = [None] * len(IDS)
        self.pointers = (tensors[0].data_ptr(), tensors[1].data_ptr(), tensors[2].data_ptr())

    def bytes(self, buffer: int, offset: int, nbytes: int) -> torch.Tensor:
        view = self._views[buffer]
        if view is None:
            t = self._tensors[buffer]
            # torch calls a tensor of at most one element contiguous whatever its stride
            # (x[::2][:1]); as bytes it needs stride 1, which addresses the same element.
            flat = t.reshape(-1) if t.numel() > 1 else t.as_strided((t.numel(),), (1,))
            view = self._views[buffer] = flat.view(torch.uint8)
        return view[offset:offset + nbytes]

    def pair(self, send: int, send_off: int, send_bytes: int, recv: int, recv_off: int,
             recv_bytes: int, peer_bytes: int) -> tuple:
        """(send, recv) views for a byte-moving exchange (all-gather, all-to-all) whose
        transport splits the ranges into pieces of peer_bytes, in the widest word that both
        ranges and every piece hold whole and aligned: int64, else int32, else bytes.

        Why not bytes: with more ranks than cores, a gloo all-gather of 64 KB as uint8 ran at
        1.4-5x the time of the same bytes as int32, the gap gone under
        OMP_WAIT_POLICY=passive: an OpenMP team spinning, likely on an element loop over
        more than ATen's 32,768-element grain (bench/results/probe-gloo-byte-dtype-cpu.txt).
        Whole 1-D buffers are used as they are (no slice made per call), and whole ones of
        one floating dtype whose elements the pieces hold whole travel in it, as torch's own
        call of them would (an unquantized call's tensors): each view costs about 7 us of a
        small call's CPU in situ (bench/results/probe-call-cpu-night.txt)."""
        s, r = self._tensors[send], self._tensors[recv]
        whole = (send_off == 0 and recv_off == 0 and s.dim() == 1 and r.dim() == 1
                 and s.nbytes == send_bytes and r.nbytes == recv_bytes)
        if whole and s.dtype is r.dtype and s.dtype in DTYPE_CODES and peer_bytes % s.element_size() == 0:
            return s, r
        if not whole:
            s, r = self.bytes(send, send_off, send_bytes), self.bytes(recv, recv_off, recv_bytes)
        alignment = (send_bytes | recv_bytes | peer_bytes | s.storage_offset() * s.element_size()
                     | r.storage_offset() * r.element_size())
        for word in _WORDS:
            if alignment % word.itemsize == 0:
                return s.view(word), r.view(word)
        if whole:  # in their own dtypes, which may differ: as bytes
            s, r = self.bytes(send, send_off, send_bytes), self.bytes(recv, recv_off, recv_bytes)
        return s, r

    def typed(self, buffer: int, offset: int, count: int, dtype_code: int) -> torch.Tensor:
        dtype = _DTYPES[dtype_code]
        return self.bytes(buffer, offset, count * dtype.itemsize).view(dtype)

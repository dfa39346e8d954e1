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
            view = self._views[buffer] = self._tensors[buffer].reshape(-1).view(torch.uint8)
        return view[offset:offset + nbytes]

    def typed(self, buffer: int, offset: int, count: int, dtype_code: int) -> torch.Tensor:
        dtype = _DTYPES[dtype_code]
        return self.bytes(buffer, offset, count * dtype.itemsize).view(dtype)

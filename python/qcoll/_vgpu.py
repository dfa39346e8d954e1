"""The virtual GPU (tests): qcoll's CUDA path executed on the CPU.

QCOLL_VIRTUAL_GPU=1 in the environment before qcoll is imported (README "The GPU host path
on the CPU"):

- qcoll._C is qcoll._C_emu, the same core built against an emulated CUDA runtime
  (src/testing/emu/cudart), whose CUDA host code (NCCL communicators, their watchdog, stream lanes)
  and kernels (run by the SIMT emulator) execute on emulated streams;
- NCCL is the stand-in libnccl_emu.so next to it (unless QCOLL_NCCL_PATH names another),
  which qcoll's loader loads like any libnccl;
- CPU tensors are device memory of cuda:0 for qcoll's collectives: they take the CUDA
  branch (qcoll's NCCL communicators, _runtime/streams.py's streams, events, workspaces and CUDA
  graphs), with the emulated streams behind torch.cuda's stream interface (EmuCuda).

torch's own operations on those tensors run on the host when they are called: the host is
CUDA's null stream, which every stream wait on it blocks. torch ops while stream(s) is
current run after the work already on s, as if enqueued there (not while s is captured:
such ops then run once, at capture). cpu_branch() switches back to the
CPU branch for a while (the gloo reference of a test, in the same process)."""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ._thread_flag import ThreadFlag

ENABLED = os.environ.get("QCOLL_VIRTUAL_GPU", "0") not in ("", "0")
_C = None
_host = threading.local()  # .streams: the current stream stack


def install() -> None:
    """Makes qcoll._C the emulated build (called by qcoll/__init__.py before anything
    imports _C)."""
    global _C
    if not ENABLED:
        return
    _C = importlib.import_module("qcoll._C_emu")
    package = sys.modules[__name__.rpartition(".")[0]]
    sys.modules[package.__name__ + "._C"] = _C
    package._C = _C
    os.environ.setdefault("QCOLL_NCCL_PATH",
                          os.path.join(os.path.dirname(_C.__file__), "libnccl_emu.so"))


def on_device(device: torch.device) -> bool:
    """Whether a tensor on `device` is device memory for qcoll (takes the CUDA branch)."""
    if device.type == "cuda":
        return True
    return ENABLED and device.type == "cpu" and not _cpu_branch


_cpu_branch = ThreadFlag()
cpu_branch = _cpu_branch.on  # `with cpu_branch():` CPU tensors take qcoll's CPU branch (this thread)


class Event:
    """torch.cuda.Event's interface over an emulated event."""

    def __init__(self):
        self.handle = _C.vgpu_event_create()

    def record(self, stream=None) -> None:
        _C.vgpu_event_record(self.handle, (stream or current_stream()).cuda_stream)

    def query(self) -> bool:
        return _C.vgpu_event_query(self.handle)

    def synchronize(self) -> None:
        _C.vgpu_event_synchronize(self.handle)

    def wait(self, stream=None) -> None:
        (stream or current_stream()).wait_event(self)

    def __del__(self):
        if _C is not None and self.handle:
            _C.vgpu_event_destroy(self.handle)
            self.handle = 0


class Stream:
    """torch.cuda.Stream's interface over an emulated stream; handle 0 is the host (the
    null stream)."""

    def __init__(self, handle: int | None = None):
        self.cuda_stream = _C.vgpu_stream_create() if handle is None else handle

    def wait_event(self, event: Event) -> None:
        _C.vgpu_stream_wait_event(self.cuda_stream, event.handle)

    def wait_stream(self, other: "Stream") -> None:
        event = Event()
        event.record(other)
        self.wait_event(event)

    def record_event(self, event: Event | None = None) -> Event:
        event = event or Event()
        event.record(self)
        return event

    def synchronize(self) -> None:
        _C.vgpu_stream_synchronize(self.cuda_stream)

    def query(self) -> bool:
        return _C.vgpu_stream_query(self.cuda_stream)

    def capture_status(self) -> tuple:
        """("none" | "active" | "invalidated", capture id)."""
        return tuple(_C.vgpu_capture_status(self.cuda_stream))

    def __eq__(self, other) -> bool:
        return isinstance(other, Stream) and other.cuda_stream == self.cuda_stream

    def __hash__(self) -> int:
        return hash(self.cuda_stream)

    def __repr__(self) -> str:
        return f"vgpu.Stream({self.cuda_stream:#x})"


HOST = None  # the null stream, made on first use


def current_stream(device=None) -> Stream:
    global HOST
    stack = getattr(_host, "streams", None)
    if stack:
        return stack[-1]
    if HOST is None:
        HOST = Stream(0)
    return HOST


class _InStreamOrder(TorchDispatchMode):
    """torch ops while an emulated stream is current run as if enqueued on it: each waits
    for the work already on the stream (a qcoll call's own torch ops between its kernels,
    e.g. delta_allgather's difference and sum), except during a capture. The host waits for
    the stream: conservative (no overlap with the stream's work), never a hidden race."""

    def __init__(self, s: "Stream"):
        super().__init__()
        self._stream = s

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # Only the innermost current stream orders the op (an outer one is not current);
        # views and allocations touch no data: they need no order (and keep a call's
        # enqueue from waiting for the calls before it).
        if (current_stream() is self._stream and not func.is_view
                and any(isinstance(a, torch.Tensor) for a in tree_leaves((args, kwargs)))
                and self._stream.capture_status()[0] == "none"):
            self._stream.synchronize()
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def stream(s: Stream):
    """Makes `s` this thread's current stream; host work inside runs in s's order."""
    stack = _host.__dict__.setdefault("streams", [])
    stack.append(s)
    try:
        if not s.cuda_stream:
            yield s
            return
        with _InStreamOrder(s):
            yield s
    finally:
        stack.pop()


class Graph:
    """torch.cuda.CUDAGraph's capture and replay over the emulated runtime: capture() runs
    its body on a side stream captured in `mode` (torch's default: "global"), forked from
    and joined back into the current stream; replay() runs the recorded work on the current
    stream."""

    def __init__(self):
        self._exec = 0

    @contextlib.contextmanager
    def capture(self, mode: str = "global"):
        caller = current_stream()
        side = Stream()
        side.wait_stream(caller)
        with stream(side):
            _C.vgpu_begin_capture(side.cuda_stream, mode)
            try:
                yield self
            finally:
                self._exec = _C.vgpu_end_capture(side.cuda_stream)
        caller.wait_stream(side)

    def replay(self) -> None:
        _C.vgpu_graph_launch(self._exec, current_stream().cuda_stream)

    def __del__(self):
        if _C is not None and self._exec:
            _C.vgpu_graph_destroy(self._exec)


class EmuCuda:
    """_streams.TorchCuda's operations over the emulated runtime."""

    def current_stream(self, device):
        return current_stream(device)

    def new_stream(self, device):
        return Stream()

    def new_event(self):
        return Event()

    def use_stream(self, s):
        return stream(s)

    def capturing(self, device) -> bool:
        return current_stream(device).capture_status()[0] != "none"

    def capture_id(self, device) -> int:
        return _C.cuda_capture_id(current_stream(device).cuda_stream)

    def empty(self, nbytes: int, device) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

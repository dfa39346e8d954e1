"""qcoll calls on CUDA tensors: a group's own streams, the events that order a call against
the caller's stream, and what keeps a call's memory alive (docs/design.md, decision 10, as
torch's ProcessGroupNCCL does).

Per Group family (a Group and its intra/inter sub-groups, which share NCCL communicators)
and per CUDA device: a communication stream, on which every call of the family runs in
issue order, and a lane stream for the inter-node hops of the pipelined reduce-scatter
(src/cuda/stream_lanes.cu forks it off the communication stream and joins it back). A call

1. makes the communication stream wait for the caller's current stream (an event): the
   input, and everything the caller enqueued before, is ready;
2. is enqueued on the communication stream, with that stream current, so the caching
   allocator and a torch ProcessGroup transport order their own work on it too;
3. records its completion event there. async_op=False: the caller's stream waits for it
   before the call returns. async_op=True: the Work's wait() makes the then-current stream
   wait for it. The host never blocks.

Memory. The input and output of an async_op=True call stay referenced until its Work is
waited (the caller's stream is then ordered after the call, so the caching allocator may
hand the memory to the caller's next allocation) or, when it is never waited, until its
completion event is seen done at a later call: ProcessGroupNCCL's
TORCH_NCCL_AVOID_RECORD_STREAMS=1 policy, chosen over record_stream because memory comes back
when the caller waits rather than when the allocator next polls events. As there, wait() on
the stream the tensors were allocated on (the one current at the call). A Group dropped
without close() hands its calls still in flight, and their workspace, to _ORPHANS, where
they stay until seen completed. A synchronous call
needs nothing: the caller's stream waits before it returns. The workspace is one cached
buffer per family and device, allocated on the communication stream, which alone uses it,
one call after the other.

CUDA graphs. Under torch.cuda.graph the same steps are captured: the events fork the
family's streams off the capture stream and join them back. A captured async_op=True call
keeps its tensors until its wait() inside the capture (a temporary of the capture is then
not handed back to the graph's pool while the captured communication still reads it).
Each capture owns its workspace: a replay is not ordered against the communication stream
nor against another graph's replay, so no two may share one. The first captured call of a
capture takes the cached workspace out of the eager cache (the capture's calls share it,
one after the other on the captured stream; it is kept until the Group is closed) and the
next eager call allocates a new one. So a capture allocates nothing when an eager call at
least as large ran on the family since the previous capture (torch's warm-up before each
capture); otherwise it allocates its workspace from the graph's pool.
"""

from __future__ import annotations

import collections
from typing import Callable, Optional, Sequence

import torch

from .. import _C, _vgpu
from .worker import CommunicationError


class TorchCuda:
    """The few torch.cuda operations the bookkeeping uses (tests pass a stand-in)."""

    def current_stream(self, device: torch.device):
        return torch.cuda.current_stream(device)

    def new_stream(self, device: torch.device):
        return torch.cuda.Stream(device=device)

    def new_event(self):
        return torch.cuda.Event()

    def use_stream(self, stream):
        return torch.cuda.stream(stream)

    def capturing(self, device: torch.device) -> bool:
        with torch.cuda.device(device):
            return torch.cuda.is_current_stream_capturing()

    def capture_id(self, device: torch.device) -> int:
        """The id of the CUDA graph capture the current stream is part of; 0: none."""
        return _C.cuda_capture_id(torch.cuda.current_stream(device).cuda_stream)

    def empty(self, nbytes: int, device: torch.device) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)


# Dropped Group families' calls still in flight, with the workspace they may use: a Group
# dropped without close() while an async_op=True call whose Work was dropped too is still
# queued would otherwise free that call's input, output and workspace under the running
# stream (the caching allocator hands the memory out again; on the virtual GPU, glibc's heap
# is corrupted). Its finalizer (group.py) moves them here, without blocking (a call may wait
# on a dead peer); each later call of any family releases those seen completed.
_ORPHANS: "collections.deque[tuple]" = collections.deque()


def _release_orphans() -> None:
    while _ORPHANS and all(call.done() for call in _ORPHANS[0][0]):
        _ORPHANS.popleft()


def _default_runtime():
    """torch.cuda, or the virtual GPU's emulated streams (_vgpu.py)."""
    return _vgpu.EmuCuda() if _vgpu.ENABLED else TorchCuda()


class CudaCall:
    """One async_op=True call on CUDA tensors (the GPU half of a Work).

    marks[i]: how many operations comms[i] had enqueued under its watchdog once this call
    was enqueued; the call failed when the watchdog gave up on one of them (failed_op <
    mark), not when a later call failed after this one had completed."""

    def __init__(self, runtime, device, done, tensors, comms: Sequence, marks: Sequence[int],
                 describe: str, captured: bool):
        self._rt = runtime
        self._device = device
        self._done = done
        self.tensors = tensors  # None once the memory may be reused (see the module notes)
        self._comms = comms
        self._marks = marks
        self._describe = describe
        self._captured = captured

    def failure(self) -> Optional[CommunicationError]:
        """The error a communicator of this call recorded when its watchdog gave up on this
        call or an earlier one (a peer died, timed out or NCCL failed), or None."""
        for comm, mark in zip(self._comms, self._marks):
            why = getattr(comm, "error", "")  # only NCCL communicators have a watchdog
            if why and comm.failed_op < mark:
                return CommunicationError(f"{self._describe} failed: {why}")
        return None

    def wait(self) -> None:
        if self._captured and not self._rt.capturing(self._device):
            raise self._outside_capture()  # its event exists only inside the graph
        error = self.failure()
        if error is not None:
            raise error
        self._rt.current_stream(self._device).wait_event(self._done)
        self.tensors = None  # the waiting stream now runs after the call

    def done(self) -> bool:
        """Completed on the GPU (event query; never for a call captured into a graph)."""
        return not self._captured and self._done.query()

    def is_completed(self) -> bool:
        if self.failure() is not None:
            return True
        if self._captured:
            raise self._outside_capture()
        return self._done.query()

    def _outside_capture(self) -> RuntimeError:
        return RuntimeError(f"{self._describe} was captured into a CUDA graph: it runs when "
                            "the graph replays; wait() it inside the capture instead")


class CudaCalls:
    """A Group family's streams, workspaces and async calls in flight, per CUDA device."""

    def __init__(self, runtime=None):
        self._rt = runtime if runtime is not None else _default_runtime()
        self._streams: dict = {}  # device -> (communication stream, lane stream)
        self._workspaces: dict = {}  # device -> the eager calls' workspace (uint8)
        self._captures: dict = {}  # (device, capture id) -> that graph's workspaces, newest last
        self._in_flight: "collections.deque[CudaCall]" = collections.deque()

    def streams(self, device: torch.device) -> tuple:
        if device not in self._streams:
            self._streams[device] = (self._rt.new_stream(device), self._rt.new_stream(device))
        return self._streams[device]

    def capturing(self, device: torch.device) -> bool:
        return self._rt.capturing(device)

    def run(self, device: torch.device, launch: Callable, workspace_bytes: int,
            tensors: tuple, comms: Sequence, describe: str, async_op: bool) -> Optional[CudaCall]:
        """Enqueue one call: launch(stream, lane_stream, workspace) on the family's streams,
        ordered after the caller's current stream. Returns the CudaCall of an async_op=True
        call, None otherwise (the caller's stream then already waits for it)."""
        caller = self._rt.current_stream(device)
        capture = self._rt.capture_id(device)
        if not capture:  # a query during capture would invalidate it
            self._release_completed()
            _release_orphans()
        stream, lane = self.streams(device)
        ready = self._rt.new_event()
        ready.record(caller)
        stream.wait_event(ready)
        done = self._rt.new_event()
        try:
            with self._rt.use_stream(stream):
                launch(stream, lane, self._workspace(device, workspace_bytes, capture))
        except BaseException:
            # Part of the call may be enqueued (it reads the input): the caller's stream waits
            # for it, so the caller may free or reuse the tensors.
            done.record(stream)
            caller.wait_event(done)
            raise
        done.record(stream)
        if not async_op:
            caller.wait_event(done)
            return None
        marks = tuple(getattr(comm, "ops_enqueued", 0) for comm in comms)
        call = CudaCall(self._rt, device, done, tensors, comms, marks, describe, bool(capture))
        if not capture:  # a captured call keeps its tensors until its wait() in the capture
            self._in_flight.append(call)
        return call

    def _workspace(self, device: torch.device, nbytes: int, capture: int) -> torch.Tensor:
        """The workspace of an eager call (the family's cached one, grown as needed) or of
        a captured one (its graph's own; see the module notes). Allocated while the
        communication stream is current, so only that stream reuses its memory."""
        if capture:
            owned = self._captures.setdefault((device, capture), [])
            if not owned or owned[-1].numel() < nbytes:
                cached = self._workspaces.get(device)
                if cached is not None and cached.numel() >= nbytes:
                    owned.append(self._workspaces.pop(device))  # the graph's from now on
                else:  # not warmed up: the graph's pool; earlier captured calls keep theirs
                    owned.append(self._rt.empty(nbytes, device))
            return owned[-1][:nbytes]
        ws = self._workspaces.get(device)
        if ws is None or ws.numel() < nbytes:
            ws = self._rt.empty(nbytes, device)
            self._workspaces[device] = ws
        return ws[:nbytes]

    def _release_completed(self) -> None:
        """Forget the tensors of calls waited for or seen completed, in issue order."""
        while self._in_flight and (self._in_flight[0].tensors is None or self._in_flight[0].done()):
            self._in_flight.popleft().tensors = None

    def orphan(self) -> None:
        """The family's Group was dropped without close(): its calls still in flight and the
        eager workspace move to _ORPHANS until the calls are seen completed (the graphs'
        workspaces stay with this object, as the graphs' own)."""
        pending = [c for c in self._in_flight if c.tensors is not None and not c.done()]
        if pending:
            _ORPHANS.append((pending, list(self._workspaces.values())))
        self._in_flight.clear()
        self._workspaces.clear()

    def close(self) -> None:
        """Called once the family's communicators are destroyed (their work finished or
        aborted, so nothing on the family's streams can wait forever): the host waits for
        both streams of every device, then the tensors of calls never waited, the
        workspaces (the graphs' included) and the streams are dropped."""
        for stream, lane in self._streams.values():
            stream.synchronize()
            lane.synchronize()
        self._in_flight.clear()
        self._workspaces.clear()
        self._captures.clear()
        self._streams.clear()

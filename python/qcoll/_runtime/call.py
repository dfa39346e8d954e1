"""One call of a group, from its launch to its Work: the call's number, its context, its
workspace, and where it runs (CPU: the family's worker, worker.py; CUDA: the family's
communication stream, streams.py). This module, with steps.py, is the one place that
reads a Group's private state; the API modules and the plug-ins go through the functions
here."""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from .. import _C
from .._thread_flag import ThreadFlag
from .._device import CUDA, device_args, on_gpu
from .steps import CallContext
from .worker import Work


class Describe:
    """A call's name for its errors, formatted only when one is raised (a per-call f-string
    of the group's ranks is a measurable part of a small call)."""

    __slots__ = ("what", "ranks", "sequence")

    def __init__(self, what: str, group, sequence: int):
        self.what, self.ranks, self.sequence = what, group.global_ranks, sequence  # not the group: no cycle

    def __str__(self) -> str:
        return f"qcoll.{self.what} (call {self.sequence} of the group of global ranks {self.ranks})"

    __format__ = lambda self, spec: format(str(self), spec)  # noqa: E731


# Inside `with uncounted():` the calls this thread issues are left out of qcoll.stats()
# (their Works still hold their own bytes): qcoll's own measurements (the cost probe), not
# the user's traffic.
_uncounted = ThreadFlag()
uncounted = _uncounted.on


def drain(group) -> None:
    """Wait until the family's queued CPU calls have run, before this thread uses group.pg
    itself (an object exchange, a probe): group.pg may be the worker's own (a sub-group's),
    and one ProcessGroup is never used by two threads at once."""
    group._calls.drain()


def kernel_threads(group) -> int:
    """The OpenMP team size this thread's CPU calls on the group run their kernels with:
    its own, at most the rank's share of its host's cores (worker.CallQueue)."""
    return group._calls.kernel_threads()


def debugging() -> bool:
    """QCOLL_DEBUG=1 (read per call: a test may set it mid-run; os.environ's writes reach
    getenv). The API modules ask before building debug_check's metadata, which costs a
    measurable part of a small call."""
    return _C.env_flag("QCOLL_DEBUG")


def debug_check(group, meta: tuple, device: torch.device) -> None:
    """Under QCOLL_DEBUG=1 (callers ask debugging() first, to skip building `meta`): compare
    the call's metadata across ranks and raise on a mismatch (instead of hanging or
    corrupting data inside the transport). Skipped while a CUDA graph is being captured on
    `device`: the check synchronizes the host, which a capture forbids (the eager warm-up
    calls before the capture are checked)."""
    if not debugging() or group.size == 1:  # a caller that did not ask exchanges nothing
        return
    if on_gpu(device) and group._cuda.capturing(device):
        return
    drain(group)
    metas = [None] * group.size
    dist.all_gather_object(metas, meta, group=group.pg)
    if any(m != metas[0] for m in metas):
        lines = "\n".join(f"  rank {r}: {m}" for r, m in enumerate(metas))
        raise ValueError(f"qcoll: ranks disagree on {meta[0]} arguments:\n{lines}")


def has_transport_all_reduce(group, device: torch.device) -> bool:
    """Whether the group's transport for `device` has its own all-reduce (a torch one)."""
    return group.size > 1 and group.communicator(device).has_all_reduce


def account(group, collective: str, bytes_per_peer: int) -> None:
    """Count a call made outside qcoll (torch's own, the baselines') in qcoll.stats()'s
    counter `collective` under qcoll's rule, as if it ran over the group."""
    group._torch_comm.account(collective, bytes_per_peer)


def run(what: str, group, input: torch.Tensor, output: torch.Tensor, workspace_bytes: int,
        launch: Callable[[CallContext, torch.Tensor], None], async_op: bool, comms: tuple = (),
        keep: tuple = ()):
    """Run `launch(context, workspace)` as one call of the group: its steps (steps.py) in
    order, under one sequence number, with one Traffic and one Work.

    The output is written in place: its version counter is bumped now, as torch's in-place
    ops do, so autograd sees the write. CPU: the call runs on the family's worker (the
    caller's thread when the family is idle), after every call issued before it; the
    tensors stay referenced until it has run. CUDA: the call runs on the family's
    communication stream, ordered after the caller's current stream (streams.py); comms:
    the call's other communicators (a 2-hop reduce-scatter's), whose recorded failures its
    Work raises too. keep: other tensors the call reads or writes (error-feedback
    residuals), referenced like input and output until it has run (a residual reset() and
    freed meanwhile would otherwise be reused while the call's stream still writes it)."""
    if not output.is_inference():
        torch.autograd.graph.increment_version(output)
    kind, index, _ = device_args(input, "input")
    gpu = kind == CUDA  # a CUDA tensor, or a CPU one under the virtual GPU (as on_gpu)
    if gpu:
        group._calls.drain()  # CPU calls issued earlier on this family go first
    comm = group.communicator(input.device)
    sequence = group._next_sequence()
    traffic = _C.Traffic()
    counted = not _uncounted  # read here: the call may run on the worker
    describe = Describe(what, group, sequence)

    if gpu:
        def enqueue(stream, lane, workspace):
            launch(CallContext(comm, kind, index, stream.cuda_stream, lane.cuda_stream, sequence, traffic,
                               counted), workspace)

        call = group._cuda.run(input.device, enqueue, workspace_bytes, (input, output, *keep), (comm, *comms),
                               describe, async_op)
        return None if call is None else Work(traffic=traffic, cuda_call=call)

    def on_worker():
        launch(CallContext(comm, kind, index, 0, 0, sequence, traffic, counted),
               _cpu_workspace(group, workspace_bytes))

    if not async_op:
        group._calls.call(on_worker, describe)
        return None
    return Work(group._calls.submit(on_worker, describe), traffic=traffic)


def _cpu_workspace(group, nbytes: int) -> torch.Tensor:
    """Scratch for one CPU call: one grow-only buffer per group. Fresh large allocations
    come back from the OS as new pages, and faulting them in cost a quarter of a 64 MB
    reduce-scatter (bench/results/cluster-cpu.json). It is taken when the call runs on the
    family's worker, which runs one call at a time, so two calls in flight never share it.
    (CUDA calls use their family's cached workspace: streams.py.) It is handed over whole,
    not sliced to nbytes: the core and the transport address it by offset, and a slice is
    a tensor made per call (a few us of a small call in situ)."""
    workspace = group._cpu_workspace
    if workspace is None or workspace.numel() < nbytes:
        workspace = group._cpu_workspace = torch.empty(nbytes, dtype=torch.uint8)
    return workspace


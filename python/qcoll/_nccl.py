"""qcoll's own NCCL communicators (raw ncclComm_t), created per qcoll.Group on first use.

The root's ncclUniqueId travels through the group's ProcessGroup; NCCL itself is the
libnccl.so.2 torch already loaded (or QCOLL_NCCL_PATH), resolved at run time by the core.

Lifetime: communicators are created nonblocking and polled, so creation never waits past
the group's timeout (src/comm/nccl_comm.h). Group.close() / qcoll.destroy() destroy them in
the same order on every rank (finalize may wait for the node's other members, at most the
timeout, then aborts). A Group (or sub-group) dropped without close() hands its
communicator to release_communicator, destroyed on a thread of its own: the ranks drop
their Groups at different times (or never), and the thread that drops one must not wait
for the others. Any communicator still alive at interpreter exit is aborted, never destroyed: a
peer may already be gone (an abort also ends a release still waiting)."""

from __future__ import annotations

import atexit
import contextlib
import functools
import queue
import threading
import weakref

import torch
import torch.distributed as dist

from . import _C
from .info import _static_info

_live_comms: "weakref.WeakSet" = weakref.WeakSet()  # aborted at interpreter exit
_live_lock = threading.Lock()  # release threads discard from it while exit may iterate it
_to_release: "queue.SimpleQueue" = queue.SimpleQueue()  # dropped Groups' (reentrant put)
_release_thread = None


@functools.lru_cache(maxsize=None)
def nccl_version() -> str:
    """Version of the NCCL library qcoll would use, "" if none can be loaded."""
    if not _static_info()["cuda"]:
        return ""
    return _C.nccl_version()


def nccl_available() -> bool:
    return bool(nccl_version())


def _local_problem() -> str | None:
    """Why this rank cannot create an NCCL communicator, or None."""
    if not _static_info()["cuda"]:
        return "qcoll was built without CUDA kernels (build it where nvcc is found)"
    if not nccl_available():
        return ("no NCCL library could be loaded (set QCOLL_NCCL_PATH to libnccl.so.2, or "
                "import torch's CUDA build first)")
    return None


def usable_on_every_rank(group, device: torch.device) -> bool:
    """backend=None: whether every member of the group can create an NCCL communicator,
    agreed in one exchange (collective), so that all take NCCL or all the torch transport:
    a rank without NCCL deciding alone would leave the others waiting in the creation."""
    problems = [_local_problem()]
    if group.size > 1:
        mine, problems = problems[0], [None] * group.size
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            dist.all_gather_object(problems, mine, group=group.pg)
    return all(p is None for p in problems)


def create_nccl_communicator(group, device: torch.device):
    """Collective over the group's members: every rank reports whether it can use NCCL and
    rank 0 adds the unique id, in one exchange, so a rank without NCCL makes every rank
    raise instead of leaving the others waiting in ncclCommInitRankConfig (which, past the
    group's timeout, raises too). The exchange runs on
    `device` (the call's tensor's), not on whatever device happens to be current."""
    problem = _local_problem()
    uid = _C.nccl_unique_id() if group.rank == 0 and problem is None else None
    infos = [(problem, uid)]
    if group.size > 1:
        infos = [None] * group.size
        # Object collectives of an NCCL pg use the current device (none: the virtual GPU's).
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            dist.all_gather_object(infos, (problem, uid), group=group.pg)
    failed = {r: p for r, (p, _) in enumerate(infos) if p is not None}
    if failed:
        where = "; ".join(f"rank {r}: {p}" for r, p in sorted(failed.items()))
        raise RuntimeError(f"backend='nccl' cannot create an NCCL communicator for the group of "
                           f"global ranks {group.global_ranks} ({where})")
    local = [p // group.node_size == group.node for p in range(group.size)]
    # The group's timeout bounds every NCCL call (the core's watchdog aborts past it).
    _start_release_thread()  # first: a communicator must never be left without one
    comm = _C.NcclCommunicator(infos[0][1], group.rank, group.size, local, device.index or 0,
                               group.timeout.total_seconds())
    with _live_lock:
        _live_comms.add(comm)
    return comm


def destroy_communicator(comm) -> None:
    """ncclCommDestroy now (ncclCommAbort after an asynchronous error). Collective in order:
    every rank destroys its communicators in the same sequence (Group.close does)."""
    with _live_lock:
        _live_comms.discard(comm)
    comm.destroy()


def release_communicator(comm) -> None:
    """A dropped Group's communicator, from its finalizer: queued for the release thread,
    which destroys each on a daemon thread of its own, so the thread that dropped the Group
    (the garbage collector's, perhaps) never waits and starts no thread. A finalize meets
    the other members' as they drop theirs; past the timeout (a member that keeps its
    Group, or died), it aborts. Concurrent, not in sequence: the ranks' drops need no
    common order."""
    _to_release.put(comm)


def _start_release_thread() -> None:
    """Started before each communicator is made (outside any finalizer) unless running:
    again after a failed start, and in a forked child, which has no threads."""
    global _release_thread
    with _live_lock:
        if _release_thread is None or not _release_thread.is_alive():
            thread = threading.Thread(target=_release_loop, daemon=True,
                                      name="qcoll-nccl-release")
            thread.start()
            _release_thread = thread


def _release_loop() -> None:
    while True:
        comm = _to_release.get()
        try:
            threading.Thread(target=_destroy_released, args=(comm,), daemon=True,
                             name="qcoll-nccl-destroy").start()
        except Exception:  # noqa: BLE001 - no thread to wait in: free it without waiting
            _abort_released(comm)
        del comm  # the destroy thread holds it; its last reference must not end here


def _destroy_released(comm) -> None:
    try:
        comm.destroy()  # aborts by itself when the finalize fails or does not settle
    except Exception:  # noqa: BLE001 - no caller is left to report to
        pass
    finally:
        with _live_lock:
            _live_comms.discard(comm)


def _abort_released(comm) -> None:
    try:
        comm.abort()
    except Exception:  # noqa: BLE001 - nothing left to do; its resources go with the process
        pass
    with _live_lock:
        _live_comms.discard(comm)


@atexit.register
def _abort_at_exit() -> None:
    # At exit a peer may already be gone: abort frees without waiting for it.
    with _live_lock:
        live = list(_live_comms)
    for comm in live:
        try:
            comm.abort()
        except Exception:  # noqa: BLE001 - exit must go on; nothing can be reported to
            pass
    with _live_lock:
        _live_comms.clear()

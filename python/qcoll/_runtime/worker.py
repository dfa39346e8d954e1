"""The worker thread that runs a group's collectives, and the Work handle of each call.

Every qcoll.Group (with its intra/inter sub-groups: one family) owns one CallQueue. Calls
run on its thread in issue order, over ProcessGroups that qcoll created for itself, so a
call never races the caller's own collectives, nor another family's. A call that fails
in its transport (a peer died or timed out) leaves the family unusable: later calls raise
at once instead of pairing with the wrong messages of other ranks. A call whose ranks
disagree (ValueError, raised on every rank by the call check) leaves it usable."""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Callable, Optional

import torch

from .. import _C


# One class for every transport failure, defined by the core so that its NCCL driver raises
# it too (at enqueue, at communicator creation) and not a bare RuntimeError.
CommunicationError = _C.CommunicationError
CommunicationError.__doc__ = """A collective failed in its transport: a peer died, timed out or
left the group unusable (a RuntimeError). The message names the qcoll call and the exchange
that failed."""


class Work:
    """Handle of an async_op=True call.

    CPU: the call runs on the group's worker thread; wait() blocks until it has run and
    re-raises its error. GPU: the call runs on the group's communication stream
    (streams.py); wait() makes the current stream wait for it (the host never blocks) and
    raises the CommunicationError the call's NCCL watchdog recorded, if any."""

    def __init__(self, future: Optional[Future] = None, traffic=None, cuda_call=None):
        self._future = future
        self._traffic = traffic
        self._cuda = cuda_call  # streams.CudaCall

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Wait for the call (CPU) or order the current stream after it (GPU). timeout:
        seconds to block at most (CPU); the call itself is bounded by its group's timeout.
        From a callback chained on a call of the same group (it runs on the group's worker
        thread, which runs this call too) it raises RuntimeError unless the call is done."""
        if self._future is not None:
            if not self._future.done():
                self._future.queue.refuse_waiting_on_itself("Work.wait()")
            self._future.result(timeout)
        if self._cuda is not None:
            self._cuda.wait()
        return True

    def is_completed(self) -> bool:
        if self._future is not None:
            return self._future.done()
        return self._cuda is None or self._cuda.is_completed()

    def exception(self) -> Optional[BaseException]:
        """The call's error once it has completed (None if it succeeded or is running)."""
        if self._cuda is not None:
            return self._cuda.failure()
        if self._future is None or not self._future.done():
            return None
        return self._future.exception()

    def get_future(self, value=None) -> "torch.futures.Future":
        """A torch Future that completes with `value` once the call has (CPU: set from the
        worker thread, or set with the call's error), for APIs that chain futures (DDP comm
        hooks). GPU: the current stream is ordered after the call first, then it completes."""
        if self._future is None:
            self.wait()
            result: torch.futures.Future = torch.futures.Future()
            result.set_result(value)
            return result
        # The error travels as a callback's exception, which torch records on the C++ future:
        # Future.set_exception only wraps the Python side, and C++ readers of the value (DDP's
        # reducer) then failed with "Unable to cast <the error> to Tensor". Python waiters get
        # a RuntimeError carrying the call's message.
        outcome: torch.futures.Future = torch.futures.Future()
        self._future.add_done_callback(lambda f: outcome.set_result(f.exception()))
        return outcome.then(lambda done: _value_or_raise(done.value(), value))

    @property
    def traffic(self) -> dict:
        """This call's own bytes, by qcoll.stats()'s rule (complete once the call is)."""
        return self._traffic.as_dict() if self._traffic is not None else {}


def _value_or_raise(error: Optional[BaseException], value):
    if error is not None:
        raise error
    return value


class CallQueue:
    """Runs a family's calls one at a time, in issue order: async ones on a daemon thread,
    a synchronous one on its caller's thread when nothing is queued or running (a hand-off
    to another thread and back cost more than a small call on a loaded machine). It holds no
    reference to its Group, so a dropped Group is freed (and its finalizer closes the queue).

    A call runs its kernels with the OpenMP team size of the thread that issued it, at most
    `max_threads` (this rank's share of its host's cores). After each parallel region,
    libgomp's idle team threads spin (its default active wait) on cores that the host's
    other ranks need to progress the exchange that follows: calls then stall for tens of ms
    (issue 26). A team no larger than the rank's share of cores spins on no one's core; and
    a new thread would otherwise start from the process default (every core), ignoring
    torch.set_num_threads(1) (torchrun's OMP_NUM_THREADS=1 reaches it: 6x slower calls)."""

    def __init__(self, name: str, max_threads: int = 1 << 16):
        self._name = name
        self._max_threads = max(1, max_threads)
        self._tasks: "queue.SimpleQueue" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._running = threading.Lock()  # held by whichever thread runs a call
        self._pending = 0  # calls submitted or running, not finished
        self._thread: Optional[threading.Thread] = None
        self._failure: Optional[str] = None
        self._closed = False

    def _on_worker(self) -> bool:
        """Whether the caller is this queue's worker thread (a callback chained on a call)."""
        return self._thread is not None and threading.current_thread() is self._thread

    def refuse_waiting_on_itself(self, describe: str) -> None:
        """Raise where the worker thread itself would wait for the queue: a callback chained
        on a call's Work (a done-callback, get_future().then) runs on the thread that runs
        the calls queued after it, so it would wait for itself, past any timeout."""
        if self._on_worker():
            raise RuntimeError(
                f"{describe} waits for calls queued on its qcoll group from the group's own worker "
                f"thread (a callback chained on a qcoll Work runs there), which would wait for itself: "
                f"issue the call with async_op=True and chain on its Work, or from the caller's thread")

    def _refuse(self, describe: str) -> None:
        if self._closed:
            raise RuntimeError(f"{describe}: the group was closed")
        if self._failure is not None:
            raise CommunicationError(f"{describe}: the group is unusable after an earlier "
                                     f"failure ({self._failure}); create a new group")

    def kernel_threads(self) -> int:
        """The OpenMP team size a call issued by this thread runs its kernels with."""
        return min(_C.openmp_threads(), self._max_threads)

    def submit(self, run: Callable[[], None], describe: str) -> Future:
        """Queue `run`; its error (wrapped to name `describe`) is set on the Future."""
        threads = self.kernel_threads()
        with self._lock:
            self._refuse(describe)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            future = _CallFuture(self)
            self._pending += 1
            self._tasks.put((future, run, describe, threads))
        return future

    def call(self, run: Callable[[], None], describe: str) -> None:
        """Run `run` and return once it has, raising its (wrapped) error: on this thread when
        the family is idle, else after the calls queued before it."""
        with self._lock:
            self._refuse(describe)
            # On the worker thread (a callback chained on a call that just ran) nothing runs
            # but this thread: the call runs now, before the calls queued behind the one whose
            # completion ran the callback, rather than wait for them to run on this thread.
            inline = self._pending == 0 or self._on_worker()
            if inline:
                self._pending += 1
        if not inline:
            self.submit(run, describe).result()
            return
        previous = _C.openmp_threads()
        capped = previous > self._max_threads  # else the caller's team is the call's as is
        if capped:
            _C.set_openmp_threads(self._max_threads)
        try:
            with self._running:
                error = self._execute(run, describe)
        finally:
            if capped:
                _C.set_openmp_threads(previous)  # the caller's own setting, for its own ops
            with self._lock:
                self._pending -= 1
        if error is not None:
            raise error

    def drain(self) -> None:
        """Wait until every call queued so far has run (so that the caller may use the
        family's ProcessGroups itself: never two threads on one). On the worker thread (a
        callback chained on a call) nothing runs meanwhile and the queued calls run on this
        thread after it, so that already holds: it returns at once."""
        if self._on_worker():
            return
        with self._lock:
            thread = self._thread
            running = thread is not None and not self._closed
            if running:
                done: Future = Future()
                self._pending += 1
                self._tasks.put((done, lambda: None, "drain", None))
        if running:
            done.result()
        elif thread is not None:  # closed (by another thread): the queued calls end with it
            thread.join()

    def close(self) -> None:
        """Run what is queued, then stop the thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        if thread is not None:
            self._tasks.put(None)
            if thread is not threading.current_thread():
                thread.join()

    def _execute(self, run: Callable[[], None], describe: str) -> Optional[BaseException]:
        """Run one call (the caller holds _running); its wrapped error, or None."""
        if self._failure is not None and describe != "drain":
            return CommunicationError(f"{describe}: not run, the group failed earlier ({self._failure})")
        try:
            run()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter
            if describe != "drain" and not isinstance(exc, ValueError):
                self._failure = f"{describe}: {type(exc).__name__}"
            return _named(exc, describe)
        return None

    def _loop(self) -> None:
        while True:
            item = self._tasks.get()
            if item is None:
                return
            future, run, describe, threads = item
            del item
            error = None
            try:
                if not future.set_running_or_notify_cancel():
                    continue
                if threads is not None:
                    _C.set_openmp_threads(threads)
                with self._running:
                    error = self._execute(run, describe)
            finally:
                # Release the call (its tensors, and through its closure its Group) before
                # the waiter wakes: a Group dropped right after wait() is then freed at once.
                del run
                with self._lock:
                    self._pending -= 1
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(None)
            del future, error


class _CallFuture(Future):
    """A queued call's Future, which knows its queue (Work.wait refuses to wait on it from
    the queue's own thread)."""

    def __init__(self, owner: CallQueue):
        super().__init__()
        self.queue = owner


def _named(exc: BaseException, describe: str) -> BaseException:
    """The worker's error, re-raised in wait() with the qcoll call it belongs to."""
    if isinstance(exc, CommunicationError):
        error: BaseException = CommunicationError(f"{describe} failed: {exc}")
    elif isinstance(exc, ValueError):  # ranks disagree (wire header check)
        error = ValueError(f"{describe}: {exc}")
    elif isinstance(exc, Exception):
        error = CommunicationError(f"{describe} failed: {type(exc).__name__}: {exc}")
    else:
        return exc
    error.__cause__ = exc
    return error

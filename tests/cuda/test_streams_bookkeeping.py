"""The stream/event bookkeeping of qcoll calls on CUDA tensors (python/qcoll/_runtime/streams.py),
run on CPU against a stand-in for torch.cuda that logs every stream operation and models
stream order. The same code drives real streams on a GPU (test_gpu_streams.py)."""

from __future__ import annotations

import types

import pytest
import torch

import qcoll._nccl
from qcoll._runtime import call as runtime_call
from qcoll._runtime.streams import CudaCalls
from qcoll._runtime.worker import CommunicationError, Work
from qcoll.group import Group
from tests.support.distributed import run_ranks

DEV = torch.device("cuda", 0)


class FakeEvent:
    """Records the position of the last op of the stream it was recorded on."""

    def __init__(self, rt):
        self.rt, self.stream, self.upto = rt, None, -1

    def record(self, stream):
        self.stream, self.upto = stream, len(stream.ops) - 1
        self.rt.log.append(("record", stream.name))

    def query(self):
        if self.rt.capturing_now:
            raise AssertionError("event queried while capturing (would invalidate the capture)")
        self.rt.log.append(("query", self.stream.name))
        return self.stream.finished >= self.upto


class FakeStream:
    def __init__(self, rt, name):
        self.rt, self.name, self.ops, self.finished = rt, name, [], -1
        self.cuda_stream = 1000 + len(rt.streams)
        self.waits = []  # (stream, op index) pairs this stream waits for

    def wait_event(self, event):
        self.rt.log.append(("wait", self.name, event.stream.name))
        self.waits.append((event.stream, event.upto))
        self.ops.append(("wait", event.stream.name))

    def complete_all(self):
        self.finished = len(self.ops) - 1

    def synchronize(self):
        self.rt.log.append(("synchronize", self.name))
        self.complete_all()


class FakeCuda:
    def __init__(self):
        self.log, self.streams, self.allocations = [], [], []
        self.capture = 0  # id of the capture in progress (0: none)
        self.caller = self._stream("caller")
        self.current = self.caller

    def _stream(self, name):
        s = FakeStream(self, name)
        self.streams.append(s)
        return s

    def current_stream(self, device):
        return self.current

    def new_stream(self, device):
        return self._stream(f"qcoll{len(self.streams)}")

    def new_event(self):
        return FakeEvent(self)

    def use_stream(self, stream):
        rt = self

        class Use:
            def __enter__(self):
                rt.previous, rt.current = rt.current, stream
                rt.log.append(("enter", stream.name))

            def __exit__(self, *exc):
                rt.current = rt.previous
                rt.log.append(("exit", stream.name))

        return Use()

    @property
    def capturing_now(self):
        return self.capture != 0

    def capturing(self, device):
        return self.capturing_now

    def capture_id(self, device):
        return self.capture

    def empty(self, nbytes, device):
        t = torch.empty(nbytes, dtype=torch.uint8)
        self.allocations.append(nbytes)
        self.log.append(("alloc", self.current.name, nbytes))
        return t


class FakeComm:
    """An NCCL communicator's watchdog state: operations numbered in enqueue order."""

    def __init__(self):
        self.error, self.failed_op, self.ops_enqueued = "", -1, 0


def _launcher(rt, seen, comms=()):
    def launch(stream, lane, workspace):
        assert rt.current is stream, "the call must run with the communication stream current"
        for comm in comms:  # one watched NCCL operation each
            comm.ops_enqueued += 1
        stream.ops.append(("kernel", workspace.numel()))
        rt.log.append(("launch", stream.name, lane.name, workspace.numel()))
        seen.append((stream, lane, workspace))
    return launch


def test_sync_call_orders_comm_stream_after_caller_and_caller_after_call():
    rt, seen = FakeCuda(), []
    calls = CudaCalls(rt)
    assert calls.run(DEV, _launcher(rt, seen), 64, (), (FakeComm(),), "call 0", async_op=False) is None
    stream, lane, ws = seen[0]
    assert stream is not rt.caller and lane is not rt.caller and lane is not stream
    comm = stream.name
    assert rt.log == [("record", "caller"), ("wait", comm, "caller"), ("enter", comm),
                      ("alloc", comm, 64), ("launch", comm, lane.name, 64), ("exit", comm),
                      ("record", comm), ("wait", "caller", comm)]
    # The caller waits for the event recorded after the call's kernel.
    (waited, upto), = rt.caller.waits
    assert waited is stream and stream.ops[upto] == ("kernel", 64)
    # The communication stream waited for everything on the caller before the call.
    assert stream.ops[0] == ("wait", "caller")


def test_async_call_keeps_tensors_until_waited_and_wait_orders_current_stream():
    rt, seen = FakeCuda(), []
    calls = CudaCalls(rt)
    x, y = torch.ones(3), torch.zeros(3)
    call = calls.run(DEV, _launcher(rt, seen), 8, (x, y), (FakeComm(),), "call 0", async_op=True)
    stream = seen[0][0]
    assert not rt.caller.waits, "async_op=True must not make the caller wait"
    assert call.tensors == (x, y)
    work = Work(cuda_call=call)
    assert not work.is_completed()
    side = rt._stream("side")
    rt.current = side  # wait() orders whatever stream is current then
    work.wait()
    (waited, upto), = side.waits
    assert waited is stream and stream.ops[upto] == ("kernel", 8)
    assert call.tensors is None, "wait() releases the tensors: the waiting stream runs after the call"
    stream.complete_all()
    assert work.is_completed() and work.exception() is None


def test_unwaited_calls_release_tensors_once_seen_complete_in_issue_order():
    rt, seen = FakeCuda(), []
    calls = CudaCalls(rt)
    first = calls.run(DEV, _launcher(rt, seen), 8, ("a",), (), "call 0", async_op=True)
    second = calls.run(DEV, _launcher(rt, seen), 8, ("b",), (), "call 1", async_op=True)
    assert first.tensors == ("a",) and second.tensors == ("b",), "nothing completed yet"
    stream = seen[0][0]
    first_done = first._done.upto
    stream.finished = first_done  # only the first call has completed on the GPU
    calls.run(DEV, _launcher(rt, seen), 8, (), (), "call 2", async_op=False)
    assert first.tensors is None and second.tensors == ("b",)
    stream.complete_all()
    calls.run(DEV, _launcher(rt, seen), 8, (), (), "call 3", async_op=False)
    assert second.tensors is None


def test_workspace_is_cached_and_grown_on_the_comm_stream():
    rt, seen = FakeCuda(), []
    calls = CudaCalls(rt)
    launch = _launcher(rt, seen)
    calls.run(DEV, launch, 100, (), (), "c0", async_op=False)
    calls.run(DEV, launch, 60, (), (), "c1", async_op=False)
    assert rt.allocations == [100], "a smaller call reuses the cached workspace"
    assert seen[1][2].numel() == 60 and seen[1][2].data_ptr() == seen[0][2].data_ptr()
    calls.run(DEV, launch, 500, (), (), "c2", async_op=False)
    assert rt.allocations == [100, 500]
    allocs = [e for e in rt.log if e[0] == "alloc"]
    assert all(stream.startswith("qcoll") for _, stream, _ in allocs), allocs


def test_each_capture_owns_its_workspace_taken_from_the_warm_up():
    rt, seen = FakeCuda(), []
    calls = CudaCalls(rt)
    launch = _launcher(rt, seen)
    calls.run(DEV, launch, 100, (), (), "warm-up", async_op=False)
    warm = seen[-1][2].data_ptr()
    # Graph 1, warmed up: its calls allocate nothing and share the warm-up's workspace.
    rt.capture = 1
    calls.run(DEV, launch, 100, (), (), "g1 c0", async_op=False)
    calls.run(DEV, launch, 80, (), (), "g1 c1", async_op=False)
    assert rt.allocations == [100]
    assert seen[-2][2].data_ptr() == seen[-1][2].data_ptr() == warm
    rt.capture = 0
    # Replays of graph 1 write that workspace unordered with the communication stream: the
    # next eager call gets a new one.
    calls.run(DEV, launch, 100, (), (), "eager", async_op=False)
    eager = seen[-1][2].data_ptr()
    assert rt.allocations == [100, 100] and eager != warm
    # Graph 2, warmed up by that eager call: takes it; graph 3 (no warm-up since graph 2)
    # allocates its own instead of sharing graph 2's.
    rt.capture = 2
    calls.run(DEV, launch, 100, (), (), "g2", async_op=False)
    g2 = seen[-1][2].data_ptr()
    rt.capture = 3
    calls.run(DEV, launch, 100, (), (), "g3", async_op=False)
    g3 = seen[-1][2].data_ptr()
    assert g2 == eager and len({warm, g2, g3}) == 3 and rt.allocations == [100, 100, 100]
    # A larger call later in graph 3 grows it, keeping the smaller one its earlier call uses.
    calls.run(DEV, launch, 300, (), (), "g3 big", async_op=False)
    rt.capture = 0
    kept = {ws.data_ptr() for owned in calls._captures.values() for ws in owned}
    assert kept == {warm, g2, g3, seen[-1][2].data_ptr()}
    allocs = [e for e in rt.log if e[0] == "alloc"]
    assert all(stream.startswith("qcoll") for _, stream, _ in allocs), allocs


def test_captured_async_call_keeps_tensors_until_waited_inside_the_capture():
    rt, seen = FakeCuda(), []
    calls = CudaCalls(rt)
    launch = _launcher(rt, seen)
    calls.run(DEV, launch, 8, (), (), "warm-up", async_op=False)
    rt.capture = 7
    x, y = torch.ones(2), torch.zeros(2)
    call = calls.run(DEV, launch, 8, (x, y), (), "c1", async_op=True)
    assert call.tensors == (x, y), "the capture's temporaries must outlive the captured reads"
    assert not calls._in_flight, "nothing is queried during a capture"
    with pytest.raises(RuntimeError, match="captured into a CUDA graph"):
        call.is_completed()
    Work(cuda_call=call).wait()  # joins the capture: the current stream waits for it
    assert call.tensors is None
    assert rt.caller.waits[-1][0] is seen[-1][0]


def test_waiting_a_captured_call_outside_its_capture_raises():
    rt, seen = FakeCuda(), []
    calls = CudaCalls(rt)
    rt.capture = 7
    call = calls.run(DEV, _launcher(rt, seen), 8, ("x",), (), "qcoll.quantized_allgather (call 3)",
                     async_op=True)
    rt.capture = 0
    waits = len(rt.caller.waits)
    with pytest.raises(RuntimeError, match=r"call 3\) was captured into a CUDA graph.*inside the capture"):
        Work(cuda_call=call).wait()
    assert len(rt.caller.waits) == waits, "no wait on an event recorded inside the capture"
    assert call.tensors == ("x",)


def test_a_later_failure_does_not_fail_a_call_that_completed_before_it():
    rt, seen = FakeCuda(), []
    calls = CudaCalls(rt)
    comm, other = FakeComm(), FakeComm()
    first = calls.run(DEV, _launcher(rt, seen, (comm,)), 8, (), (comm,), "call 0", async_op=True)
    second = calls.run(DEV, _launcher(rt, seen, (comm, other)), 8, (), (comm, other), "call 1",
                       async_op=True)
    third = calls.run(DEV, _launcher(rt, seen, (other,)), 8, (), (other,), "call 2",
                      async_op=True)
    seen[0][0].finished = first._done.upto
    # The watchdog gave up on comm's operation 1 (call 1's): operation 0 had completed.
    comm.error, comm.failed_op = "NCCL all-to-all did not complete within 5 s", 1
    assert first.failure() is None and Work(cuda_call=first).exception() is None
    Work(cuda_call=first).wait()
    with pytest.raises(CommunicationError, match=r"call 1 failed: NCCL all-to-all"):
        Work(cuda_call=second).wait()
    assert third.failure() is None, "call 2 used only the healthy communicator"
    # A communicator that failed from its first operation on fails every call on it.
    other.error, other.failed_op = "NCCL reported an asynchronous error", 0
    assert isinstance(Work(cuda_call=third).exception(), CommunicationError)
    assert Work(cuda_call=third).is_completed()


def test_wait_raises_the_watchdog_error_naming_the_call():
    rt, seen = FakeCuda(), []
    calls = CudaCalls(rt)
    healthy, intra = FakeComm(), FakeComm()
    call = calls.run(DEV, _launcher(rt, seen, (healthy, intra)), 8, (), (healthy, intra),
                     "qcoll.quantized_reduce_scatter (call 7 of the group of global ranks [0, 1])",
                     async_op=True)
    work = Work(cuda_call=call)
    intra.error = "NCCL communicator aborted: NCCL all-to-all did not complete within 5 s"
    intra.failed_op = 0  # the first operation: this call's
    assert work.is_completed(), "a failed call is complete (it will never finish otherwise)"
    assert isinstance(work.exception(), CommunicationError)
    with pytest.raises(CommunicationError, match=r"quantized_reduce_scatter \(call 7.*did not complete"):
        work.wait()
    assert not rt.caller.waits


def test_a_failed_enqueue_still_orders_the_caller_after_what_was_enqueued():
    rt = FakeCuda()
    calls = CudaCalls(rt)

    def launch(stream, lane, workspace):
        stream.ops.append(("kernel", "encode"))
        raise RuntimeError("NCCL communicator aborted: peer gone")

    with pytest.raises(RuntimeError, match="peer gone"):
        calls.run(DEV, launch, 8, (), (), "c0", async_op=True)
    (waited, upto), = rt.caller.waits
    assert waited.ops[upto] == ("kernel", "encode")


def test_close_synchronizes_both_streams_before_dropping_unwaited_calls():
    rt, seen = FakeCuda(), []
    calls = CudaCalls(rt)
    call = calls.run(DEV, _launcher(rt, seen), 8, ("x",), (), "c0", async_op=True)
    rt.capture = 1
    calls.run(DEV, _launcher(rt, seen), 8, (), (), "captured", async_op=False)
    rt.capture = 0
    stream, lane, _ = seen[0]
    calls.close()
    assert ("synchronize", stream.name) in rt.log and ("synchronize", lane.name) in rt.log
    assert not calls._in_flight and not calls._workspaces and not calls._captures
    assert call.tensors == ("x",), "the Work still holds its tensors; the group no longer does"


def test_a_dropped_family_keeps_its_running_calls_memory_until_they_complete():
    """A Group dropped (not closed) with an unwaited async call still queued: the call's
    tensors and the workspace it uses outlive the family until the call is seen completed."""
    import gc
    import weakref

    from qcoll._runtime import streams

    rt, seen = FakeCuda(), []
    calls = CudaCalls(rt)
    x, out = torch.ones(3), torch.zeros(3)
    done_call = calls.run(DEV, _launcher(rt, seen), 8, (torch.ones(1),), (), "c0", async_op=True)
    seen[0][0].complete_all()  # the first call has completed: nothing to keep for it
    calls.run(DEV, _launcher(rt, seen), 16, (x, out), (), "c1", async_op=True)  # its Work dropped
    stream, _, workspace = seen[1]
    alive = [weakref.ref(t) for t in (x, out)]
    del x, out, workspace, seen
    calls.orphan()
    del calls
    gc.collect()
    assert all(r() is not None for r in alive), "the running call's tensors were freed"
    assert any(w.numel() >= 16 for _, ws in streams._ORPHANS for w in ws), "its workspace too"
    assert not any(done_call in c for c, _ in streams._ORPHANS), "a completed call is not kept"
    other = CudaCalls(rt)
    other.run(DEV, _launcher(rt, []), 8, (), (), "another family", async_op=False)
    assert all(r() is not None for r in alive), "released before the call completed"
    stream.complete_all()
    other.run(DEV, _launcher(rt, []), 8, (), (), "another family", async_op=False)
    gc.collect()
    assert all(r() is None for r in alive) and not streams._ORPHANS


def _drop_a_group(rank, world):
    """A real Group made and dropped (no close()): its family's CudaCalls is told."""
    import gc

    import qcoll.group

    log = []

    class Recording(CudaCalls):
        def orphan(self):
            log.append("orphan")
            super().orphan()

    qcoll.group.CudaCalls = Recording  # this worker process only
    group = qcoll.new_group(node_size=1)
    group.intra, group.inter  # noqa: B018 - sub-groups share the family: told once
    del group
    gc.collect()
    return log


def test_a_dropped_group_orphans_its_cuda_calls():
    assert run_ranks(2, _drop_a_group, timeout=60) == [["orphan"], ["orphan"]]


def test_group_close_destroys_communicators_before_releasing_cuda_calls(monkeypatch):
    order = []
    monkeypatch.setattr(qcoll._nccl, "destroy_communicator", lambda comm: order.append(comm))

    class Calls:
        def close(self):
            order.append("cuda streams")

    def member(name):
        return types.SimpleNamespace(_closed=False, _nccl_comm=name, _owned_pg=None, _gather_pg=None,
                                     _transport=None, _cpu_workspace=None, _member=name,
                                     _nccl_release=types.SimpleNamespace(
                                         detach=lambda: order.append(f"{name} detached")))

    def leave(open_members, m):  # _Family.leave: whether m was the last open member
        if m not in open_members:
            return False
        open_members.remove(m)
        return not open_members

    def family_member(name, open_members):
        g = member(name)
        g.__dict__.update(_intra=None, _inter=None, _cuda=Calls(),
                          _family=types.SimpleNamespace(leave=lambda m: leave(open_members, m)),
                          _calls=types.SimpleNamespace(close=lambda: order.append("cpu queue"),
                                                       drain=lambda: order.append("cpu queue drained")))
        return g

    group = family_member("own", ["intra", "inter", "own"])
    group.__dict__.update(_intra=member("intra"), _inter=member("inter"))
    Group.close(group)
    # Each destroyed, then no longer released when its Group is dropped.
    assert order == ["cpu queue", "intra", "intra detached", "inter", "inter detached", "own",
                     "own detached", "cuda streams"]

    # A sub-group closed alone, its family's other members open: the calls queued so far
    # run, its communicator is destroyed, the worker and streams go on for the others.
    order.clear()
    open_members = ["intra", "inter", "own"]
    intra = family_member("intra", open_members)
    Group.close(intra)
    assert order == ["cpu queue drained", "intra", "intra detached"] and intra._closed
    # Then the parent: it closes the rest, and as the last open member stops the family.
    order.clear()
    group = family_member("own", open_members)
    group.__dict__.update(_intra=intra, _inter=member("inter"))
    Group.close(group)
    assert order == ["cpu queue", "inter", "inter detached", "own", "own detached", "cuda streams"]


def test_debug_check_is_skipped_while_capturing(monkeypatch):
    rt, exchanged = FakeCuda(), []

    def all_gather_object(out, obj, group=None):
        assert not rt.capturing_now, "a capture cannot synchronize the host"
        exchanged.append(obj)
        out[:] = [obj] * len(out)

    group = types.SimpleNamespace(size=2, _cuda=CudaCalls(rt), pg=None,
                                  _calls=types.SimpleNamespace(drain=lambda: None))
    monkeypatch.setenv("QCOLL_DEBUG", "1")
    monkeypatch.setattr(runtime_call.dist, "all_gather_object", all_gather_object)
    meta = ("quantized_allgather", 8)
    rt.capture = 5
    runtime_call.debug_check(group, meta, DEV)
    assert exchanged == []
    rt.capture = 0
    runtime_call.debug_check(group, meta, DEV)  # eager calls (the warm-up) are checked
    assert exchanged == [meta]

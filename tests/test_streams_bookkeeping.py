"""The stream/event bookkeeping of qcoll calls on CUDA tensors (python/qcoll/_streams.py),
run on CPU against a stand-in for torch.cuda that logs every stream operation and models
stream order. The same code drives real streams on a GPU (test_gpu_streams.py)."""

from __future__ import annotations

import pytest
import torch

from qcoll._calls import CommunicationError, Work
from qcoll._streams import CudaCalls

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


class FakeCuda:
    def __init__(self):
        self.log, self.streams, self.allocations = [], [], []
        self.capturing_now = False
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

    def capturing(self, device):
        return self.capturing_now

    def empty(self, nbytes, device):
        t = torch.empty(nbytes, dtype=torch.uint8)
        self.allocations.append(nbytes)
        self.log.append(("alloc", self.current.name, nbytes))
        return t


class FakeComm:
    error = ""


def _launcher(rt, seen):
    def launch(stream, lane, workspace):
        assert rt.current is stream, "the call must run with the communication stream current"
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


def test_workspace_is_cached_grown_on_the_comm_stream_and_kept_for_graphs():
    rt, seen = FakeCuda(), []
    calls = CudaCalls(rt)
    launch = _launcher(rt, seen)
    calls.run(DEV, launch, 100, (), (), "c0", async_op=False)
    calls.run(DEV, launch, 60, (), (), "c1", async_op=False)
    assert rt.allocations == [100], "a smaller call reuses the cached workspace"
    assert seen[1][2].numel() == 60 and seen[1][2].data_ptr() == seen[0][2].data_ptr()
    # Warmed up: a captured call of the same size allocates nothing and queries nothing.
    rt.capturing_now = True
    call = calls.run(DEV, launch, 100, ("x",), (), "c2", async_op=True)
    assert rt.allocations == [100]
    assert call.tensors is None, "a captured call stashes nothing (the graph owner's tensors)"
    with pytest.raises(RuntimeError, match="captured into a CUDA graph"):
        call.is_completed()
    Work(cuda_call=call).wait()  # joins the capture: the current stream waits for it
    rt.capturing_now = False
    captured = seen[2][2]
    # A larger eager call grows the workspace; the captured one stays alive for replays.
    calls.run(DEV, launch, 500, (), (), "c3", async_op=False)
    assert rt.allocations == [100, 500]
    assert any(captured.data_ptr() == kept.data_ptr() for kept in calls._retained)
    allocs = [e for e in rt.log if e[0] == "alloc"]
    assert all(stream.startswith("qcoll") for _, stream, _ in allocs), allocs


def test_wait_raises_the_watchdog_error_naming_the_call():
    rt, seen = FakeCuda(), []
    calls = CudaCalls(rt)
    healthy, intra = FakeComm(), FakeComm()
    call = calls.run(DEV, _launcher(rt, seen), 8, (), (healthy, intra),
                     "qcoll.quantized_reduce_scatter (call 7 of the group of global ranks [0, 1])",
                     async_op=True)
    work = Work(cuda_call=call)
    intra.error = "NCCL communicator aborted: NCCL all-to-all did not complete within 5 s"
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


def test_close_orders_current_stream_after_both_family_streams():
    rt, seen = FakeCuda(), []
    calls = CudaCalls(rt)
    calls.run(DEV, _launcher(rt, seen), 8, ("x",), (), "c0", async_op=True)
    stream, lane, _ = seen[0]
    calls.close()
    assert {s.name for s, _ in rt.caller.waits} == {stream.name, lane.name}
    assert not calls._in_flight and not calls._workspaces

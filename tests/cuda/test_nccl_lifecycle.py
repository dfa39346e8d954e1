"""The parts of qcoll's NCCL communicator lifecycle that run without a GPU: creating one is a
collective that fails on every rank when any rank cannot use NCCL, its exchange runs on the
call's device, Group.close() destroys the communicators in the same order on every rank,
and interpreter exit aborts (never destroys) the ones still alive. The communicators
themselves are stand-ins here; test_nccl.py runs real ones on a GPU."""

from __future__ import annotations

import contextlib
import gc
import subprocess
import sys
import textwrap
import threading
import time
import types
from datetime import timedelta

import pytest
import torch

import qcoll
from qcoll import _nccl
from tests.support.distributed import run_ranks


class FakeComm:
    """Records destroy/abort in `log` (a list shared by a rank's communicators)."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def destroy(self):
        self.log.append(("destroy", self.name))

    def abort(self):
        self.log.append(("abort", self.name))


def _close_order_worker(rank, world):
    g = qcoll.new_group(node_size=2)  # 4 ranks: intra and inter are real sub-groups
    log = []
    for name, sub in (("group", g), ("intra", g.intra), ("inter", g.inter)):
        sub._hold_nccl_comm(FakeComm(name, log))  # as the communicators' creation does
        _nccl._live_comms.add(sub._nccl_comm)
    g.close()
    left = len(_nccl._live_comms)
    try:
        g.inter.communicator(torch.device("cpu"))
    except RuntimeError as exc:
        refused = "closed" in str(exc)
    else:
        refused = False
    return log, left, refused


def test_close_destroys_nccl_communicators_in_the_same_order_on_every_rank():
    for log, left, refused in run_ranks(4, _close_order_worker, timeout=60):
        assert log == [("destroy", "intra"), ("destroy", "inter"), ("destroy", "group")], log
        assert left == 0, "destroyed communicators must leave the exit-abort registry"
        assert refused, "a closed group's sub-group must refuse to hand out a communicator"



class BlockingComm:
    """destroy() waits (as a finalize waits for peers that still hold their Group) until
    `release` is set, and logs the thread it ran on."""

    def __init__(self, log, release):
        self.log, self.release = log, release

    def destroy(self):
        self.log.append(threading.current_thread().name)
        self.release.wait(30)

    def abort(self):
        self.log.append("abort")


def _dropped_group_worker(rank, world):
    g = qcoll.new_group(node_size=2)
    log, release = [], threading.Event()
    comms = [BlockingComm(log, release) for _ in ("group", "intra", "inter")]
    for sub, comm in zip((g, g.intra, g.inter), comms):  # as the communicators' creation does
        sub._hold_nccl_comm(comm)
        _nccl._live_comms.add(comm)
    _nccl._start_release_thread()
    start = time.monotonic()
    del g, sub
    gc.collect()
    dropped = time.monotonic() - start
    while len(log) < 3 and time.monotonic() - start < 10:
        time.sleep(0.01)
    release.set()
    while any(c in _nccl._live_comms for c in comms) and time.monotonic() - start < 10:
        time.sleep(0.01)
    return dropped, log, sum(c in _nccl._live_comms for c in comms)


def test_a_dropped_group_destroys_its_communicators_without_waiting_for_them():
    """Dropped without close(), a Group's NCCL communicators are destroyed on threads of
    their own, all at once: their finalize waits for the peers, which drop theirs when
    they do (or never), and must not hold up the thread that dropped the Group."""
    for dropped, log, left in run_ranks(4, _dropped_group_worker, timeout=60):
        assert dropped < 2.0, dropped  # each destroy blocks until released (30 s)
        assert log == ["qcoll-nccl-destroy"] * 3, log  # concurrently, none on the dropping thread
        assert left == 0, "destroyed communicators must leave the exit-abort registry"

def test_interpreter_exit_aborts_live_communicators_instead_of_destroying_them(tmp_path):
    log_path = tmp_path / "log.txt"
    script = textwrap.dedent(f"""
        from qcoll import _nccl

        class Comm:
            def destroy(self):
                open({str(log_path)!r}, "a").write("destroy\\n")
            def abort(self):
                open({str(log_path)!r}, "a").write("abort\\n")
                raise RuntimeError("NCCL error: the peer is gone")  # must not stop the exit

        keep = [Comm(), Comm()]
        for c in keep:
            _nccl._live_comms.add(c)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert log_path.read_text().split() == ["abort", "abort"]


def _fake_cuda_device(seen):
    @contextlib.contextmanager
    def device(d):
        seen.append(d)
        yield
    return device


def _refusal_worker(rank, world):
    """Rank 1 can use NCCL, rank 0 cannot: both must raise, naming rank 0's reason, and no
    communicator is created anywhere. Real gloo exchange; CUDA stand-ins."""
    seen = []
    torch.cuda.device = _fake_cuda_device(seen)  # this worker process only
    made = []
    _nccl._C = types.SimpleNamespace(
        nccl_unique_id=lambda: (_ for _ in ()).throw(AssertionError("rank 0 has no NCCL")),
        NcclCommunicator=lambda *a: made.append(a))
    if rank == 0:
        _nccl._local_problem = lambda: "no NCCL library could be loaded (test)"
    else:
        _nccl._local_problem = lambda: None
    g = qcoll.new_group(node_size=1)
    try:
        _nccl.create_nccl_communicator(g, torch.device("cuda", 1))
    except RuntimeError as exc:
        return str(exc), made, seen
    return None, made, seen


def test_a_rank_without_nccl_makes_every_rank_raise_before_any_init():
    for msg, made, seen in run_ranks(2, _refusal_worker, timeout=60):
        assert msg is not None and "rank 0: no NCCL library could be loaded (test)" in msg, msg
        assert "rank 1" not in msg, msg
        assert made == [], "no communicator may be created when a rank cannot use NCCL"
        assert seen == [torch.device("cuda", 1)], "the exchange must run on the call's device"


def test_exchange_runs_on_the_tensors_device_and_passes_rank_0s_id(monkeypatch):
    seen, gathered, made = [], [], []
    uid = bytes(range(128))
    monkeypatch.setattr(torch.cuda, "device", _fake_cuda_device(seen))
    monkeypatch.setattr(_nccl, "_local_problem", lambda: None)

    def all_gather_object(out, obj, group):
        gathered.append((obj, group))
        out[:] = [(None, uid)] + [(None, None)] * (len(out) - 1)  # rank 0's id, as the pg would

    monkeypatch.setattr(_nccl.dist, "all_gather_object", all_gather_object)
    monkeypatch.setattr(_nccl, "_C", types.SimpleNamespace(
        nccl_unique_id=lambda: pytest.fail("only rank 0 makes the id"),
        NcclCommunicator=lambda *a: made.append(a) or FakeComm("c", [])))
    group = types.SimpleNamespace(rank=1, size=4, node_size=2, node=0, pg="the group's pg",
                                  global_ranks=[0, 1, 2, 3], timeout=timedelta(seconds=42))
    comm = _nccl.create_nccl_communicator(group, torch.device("cuda", 3))
    assert seen == [torch.device("cuda", 3)]
    assert gathered == [((None, None), "the group's pg")]
    assert made == [(uid, 1, 4, [True, True, False, False], 3, 42.0)]
    assert comm in _nccl._live_comms
    _nccl.destroy_communicator(comm)
    assert comm not in _nccl._live_comms

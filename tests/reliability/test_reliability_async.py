"""Issue 14.3 / 14.4 / 9.2: async_op=True really is asynchronous on CPU, calls complete in
issue order, groups are safe to use from several threads, outputs behave like torch's
collectives under autograd, argument checks name their argument, and a dropped Group is
freed at once."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest
import torch
import torch.distributed as dist

import qcoll
from tests.support.distributed import run_ranks
from tests.collectives.test_collectives_errors import CommCounter

F32 = torch.float32


# ---- asynchrony and order -----------------------------------------------------------------
def _async_worker(rank, world):
    g = qcoll.new_group(node_size=2)
    x = torch.randn(world * 3000, generator=torch.Generator().manual_seed(rank))
    sync_out = torch.empty(3000)
    qcoll.quantized_reduce_scatter(sync_out, x, g)
    dist.barrier()
    if rank == 1:
        time.sleep(1.5)  # the peer is late: rank 0's async call cannot complete before
    start = time.monotonic()
    out = torch.empty(3000)
    work = qcoll.quantized_reduce_scatter(out, x, g, async_op=True)
    issued = time.monotonic() - start
    pending = not work.is_completed()
    work.wait()
    waited = time.monotonic() - start
    same = torch.equal(out, sync_out)  # bit-identical to the synchronous call

    # Many calls in flight on one family (group, intra, inter): each completes in issue
    # order with its own result, whatever order they are waited in.
    works, checks = [], []
    for k in range(6):
        y = torch.arange(world * 5, dtype=F32) * (k + 1) + rank
        o = torch.empty(5)
        grp = (g, g.intra, g)[k % 3]
        if grp is g.intra:
            o = torch.empty(grp.size * 5)
            works.append(qcoll.quantized_allgather(o, y[:5], grp, bits=None, async_op=True))
            base = g.node * g.node_size  # global rank of the node's first member
            want = torch.cat([torch.arange(5, dtype=F32) * (k + 1) + base + r for r in range(grp.size)])
        else:
            works.append(qcoll.quantized_reduce_scatter(o, y, grp, op="sum", intra_bits=None,
                                                        inter_bits=None, async_op=True))
            want = world * (torch.arange(5, dtype=F32) + rank * 5) * (k + 1) + sum(range(world))
        checks.append((o, want))
    for w in reversed(works):
        w.wait()
    ordered = all(torch.equal(o, want) for o, want in checks)
    traffic = works[0].traffic
    return issued, pending, waited, same, ordered, traffic


def test_async_op_returns_at_once_and_wait_waits():
    for rank, (issued, pending, waited, same, ordered, traffic) in enumerate(
            run_ranks(4, _async_worker, timeout=60)):
        assert same and ordered, rank
        assert traffic["calls"] == 1 and traffic["intra_bytes"] > 0, traffic
        if rank == 0:
            assert issued < 0.5 and pending, (issued, pending)
            assert waited > 1.0, waited


def _chained_worker(rank, world):
    """A callback chained on a Work runs on the group's worker thread when the call completes
    there: a synchronous call from it runs at once (before the calls queued behind), and a
    wait on a queued Work of the same group raises instead of waiting for itself."""
    g = qcoll.new_group(node_size=world, timeout=__import__("datetime").timedelta(seconds=20))
    a, b, c = torch.full((64,), 1.0 + rank), torch.full((64,), 10.0), torch.full((8,), 100.0 * (rank + 1))
    dist.barrier()
    if rank == 1:
        time.sleep(1.0)  # the peer is late: rank 0's call is still pending when it chains
    w1 = qcoll.quantized_all_reduce(a, g, op="sum", bits=None, async_op=True)

    def then(fut):  # a DDP-style second phase: one more (synchronous) call on the group
        from qcoll._runtime import call

        call.drain(g)  # as a new auto description or QCOLL_DEBUG's check does first: returns
        qcoll.quantized_all_reduce(c, g, op="sum", bits=None)
        return fut.value()

    chained = w1.get_future(a).then(then)
    w2 = qcoll.quantized_all_reduce(b, g, op="sum", bits=None, async_op=True)  # queued behind w1
    w2.wait(timeout=30)
    chained.wait()
    sums = (a.tolist()[0], b.tolist()[0], c.tolist()[0])

    dist.barrier()
    if rank == 1:
        time.sleep(1.0)
    w3 = qcoll.quantized_all_reduce(torch.ones(64), g, bits=None, async_op=True)
    w4 = qcoll.quantized_all_reduce(torch.ones(64), g, bits=None, async_op=True)
    waited = w3.get_future().then(lambda fut: w4.wait())
    try:
        waited.wait()
        refused = None
    except RuntimeError as exc:
        refused = str(exc)
    w4.wait(timeout=30)
    after = torch.full((4,), float(rank))
    qcoll.quantized_all_reduce(after, g, op="sum", bits=None)  # the group is still usable
    g.close()
    return sums, refused, after.tolist()


def test_a_callback_chained_on_a_work_never_waits_for_its_own_thread():
    results = run_ranks(2, _chained_worker, timeout=120)
    for sums, refused, after in results:
        assert sums == (3.0, 20.0, 300.0)
        assert after == [1.0] * 4
    # Rank 0's w3 was pending when chained: its callback ran on the worker thread.
    assert "async_op=True" in results[0][1] and "Work.wait()" in results[0][1], results[0][1]


# ---- threads --------------------------------------------------------------------------------
def _threads_worker(rank, world, calls):
    groups = [qcoll.new_group(node_size=2), qcoll.new_group(node_size=2)]  # same default PG
    errors, wrong = [], []

    def use(index):
        g = groups[index]
        try:
            for k in range(calls):
                n = 7 + index + k % 3
                x = torch.arange(world * n, dtype=F32) * (k + 1) + rank * (index + 1)
                out = torch.empty(n)
                qcoll.quantized_reduce_scatter(out, x, g, op="sum", intra_bits=None, inter_bits=None,
                                               pipeline_stages=2)
                want = world * (torch.arange(n, dtype=F32) + rank * n) * (k + 1) + (index + 1) * sum(range(world))
                if not torch.equal(out, want):
                    wrong.append((index, k))
                full = torch.empty(world * n)
                qcoll.quantized_allgather(full, x[:n], g, bits=None)
                if not torch.equal(full[rank * n:(rank + 1) * n], x[:n]):
                    wrong.append((index, k, "ag"))
        except Exception as exc:  # noqa: BLE001
            errors.append(repr(exc))

    def callers_own_collectives():
        # The caller's own collectives on the default ProcessGroup, meanwhile.
        for _ in range(calls):
            t = torch.ones(3)
            dist.all_reduce(t)
            if not torch.equal(t, torch.full((3,), float(world))):
                wrong.append("all_reduce")

    threads = [threading.Thread(target=use, args=(i,)) for i in range(2)]
    threads.append(threading.Thread(target=callers_own_collectives))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors, wrong


def test_groups_on_one_process_group_are_safe_from_several_threads():
    for errors, wrong in run_ranks(4, _threads_worker, 25, timeout=120):
        assert errors == [] and wrong == []


# ---- autograd -------------------------------------------------------------------------------
PATHS = {
    "ag_int8": lambda out, g, w, a: qcoll.quantized_allgather(out, torch.ones(4), g, async_op=a),
    "ag_raw": lambda out, g, w, a: qcoll.quantized_allgather(out, torch.ones(4), g, bits=None, async_op=a),
    "rs_int8": lambda out, g, w, a: qcoll.quantized_reduce_scatter(out[:4], torch.ones(w * 4), g, async_op=a),
    "rs_raw": lambda out, g, w, a: qcoll.quantized_reduce_scatter(
        out[:4], torch.ones(w * 4), g, intra_bits=None, inter_bits=None, hierarchical=False, async_op=a),
}


def _autograd_worker(rank, world):
    g = qcoll.new_group(node_size=1)
    res = {}
    for name, call in PATHS.items():
        for async_op in (False, True):
            w = torch.randn(world * 4, requires_grad=True)
            buf = torch.empty(world * 4)
            loss = (w * buf).sum()  # buf is saved for backward
            before = buf._version
            work = call(buf, g, world, async_op)
            if work is not None:
                work.wait()
            bumped = buf._version > before
            try:
                loss.backward()
            except RuntimeError as exc:
                raised = "modified by an inplace operation" in str(exc)
            else:
                raised = False
            res[name, async_op] = (bumped, raised)
    # A requires_grad leaf output is refused, before any communication.
    counter = CommCounter()
    try:
        leaf = torch.zeros(world * 4, requires_grad=True)
        try:
            qcoll.quantized_allgather(leaf, torch.ones(4), g)
        except RuntimeError as exc:
            res["leaf"] = ("output" in str(exc) and "requires grad" in str(exc), counter.count)
        else:
            res["leaf"] = (False, counter.count)
    finally:
        counter.restore()
    with torch.no_grad():  # an inference-style tensor is written without complaint
        out = torch.empty(world * 4)
        qcoll.quantized_allgather(out, torch.ones(4), g, bits=None)
    with torch.inference_mode():
        out = torch.empty(world * 4)
        qcoll.quantized_allgather(out, torch.ones(4), g, bits=None)
        res["inference"] = torch.equal(out, torch.ones(world * 4))
    return res


@pytest.mark.parametrize("world", [1, 2])
def test_outputs_behave_like_torch_collectives_under_autograd(world):
    for res in run_ranks(world, _autograd_worker, timeout=60):
        for key, (bumped, raised) in ((k, v) for k, v in res.items() if isinstance(k, tuple)):
            assert bumped, f"{key}: version counter not bumped"
            assert raised, f"{key}: backward used the overwritten tensor silently"
        assert res["leaf"] == (True, 0), res["leaf"]
        assert res["inference"]


# ---- argument checks with unhashable values ---------------------------------------------------
def _unhashable_worker(rank, world):
    g = qcoll.new_group(node_size=1)
    out, x = torch.empty(4), torch.empty(world * 4)
    calls = {
        "op": lambda: qcoll.quantized_reduce_scatter(out, x, g, op=["sum"]),
        "intra_bits": lambda: qcoll.quantized_reduce_scatter(out, x, g, intra_bits=[8]),
        "inter_bits": lambda: qcoll.quantized_reduce_scatter(out, x, g, inter_bits={4: 4}),
        "group_size": lambda: qcoll.quantized_reduce_scatter(out, x, g, group_size=[256]),
        "pipeline_stages": lambda: qcoll.quantized_reduce_scatter(out, x, g, pipeline_stages=[2]),
        "hierarchical": lambda: qcoll.quantized_reduce_scatter(out, x, g, hierarchical=[True]),
        "bits": lambda: qcoll.quantized_allgather(x, out, g, bits=[8]),
        "group": lambda: qcoll.quantized_allgather(x, out, [g]),
        "node_size": lambda: qcoll.new_group(node_size=[1]),
        "backend": lambda: qcoll.new_group(backend=["torch"]),
        "timeout": lambda: qcoll.new_group(timeout=[5]),
    }
    seen = {}
    counter = CommCounter()
    try:
        for name, call in calls.items():
            try:
                call()
            except (TypeError, ValueError) as exc:
                seen[name] = str(exc)
            else:
                seen[name] = "no exception"
    finally:
        count = counter.count
        counter.restore()
    return seen, count


def test_argument_checks_name_the_argument_for_unhashable_values():
    for seen, count in run_ranks(2, _unhashable_worker, timeout=60):
        assert count == 0, "communicated before raising"
        for name, msg in seen.items():
            assert name in msg and "unhashable" not in msg, (name, msg)


# ---- lifetime -------------------------------------------------------------------------------
def _lifetime_worker(rank, world):
    gc.disable()
    try:
        g = qcoll.new_group(node_size=2)
        # async: the worker thread (a synchronous call on an idle group runs in the caller's)
        qcoll.quantized_allgather(torch.empty(world * 4), torch.ones(4), g, async_op=True).wait()
        ref = weakref.ref(g)
        thread = g._calls._thread
        del g
        freed = ref() is None  # no reference cycle: freed without the garbage collector
    finally:
        gc.enable()
    thread.join(timeout=5)
    stopped = not thread.is_alive()
    # close(): the group's calls finish, its thread stops, its ProcessGroups are destroyed.
    h = qcoll.new_group(node_size=2)
    qcoll.quantized_reduce_scatter(torch.empty(4), torch.ones(world * 4), h)
    owned = h._owned_pg
    h.close()
    closed = h._owned_pg is None and owned not in dist.distributed_c10d._world.pg_map
    try:
        qcoll.quantized_reduce_scatter(torch.empty(4), torch.ones(world * 4), h)
    except RuntimeError as exc:
        refused = "closed" in str(exc)
    else:
        refused = False
    k = qcoll.new_group(node_size=2)
    qcoll.quantized_allgather(torch.empty(world * 4), torch.ones(4), None)
    # The Group made for group=None, closed (on every rank): the next call makes it again.
    cached = qcoll.group.resolve_group(None)
    cached.close()
    out = torch.empty(world * 4)
    qcoll.quantized_allgather(out, torch.full((4,), float(rank)), None)
    remade = qcoll.group.resolve_group(None) is not cached and torch.equal(
        out, torch.arange(world, dtype=torch.float32).repeat_interleave(4))
    qcoll.destroy()
    destroyed = k._closed and k._calls._closed
    return freed, stopped, closed, refused, destroyed, remade


def test_groups_are_freed_when_dropped_and_closed_on_request():
    for res in run_ranks(4, _lifetime_worker, timeout=60):
        assert res == (True, True, True, True, True, True), res

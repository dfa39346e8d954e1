"""Argument errors, QCOLL_DEBUG metadata checks, and the group / async_op forms of the API.

Bad input must raise on every rank, before any communication, with a message naming
the problem. Each worker records (exception type, message) per case; the parent checks
that every rank raised the expected type with the expected words, and the worker checks
that no transport call, no all_gather_object and no counted collective happened in
between (the transports are wrapped to count calls)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import qcoll
from tests.support.distributed import run_ranks

F32 = torch.float32


# ---- counting every way a rank can communicate --------------------------------------------
class CommCounter:
    """Counts the transport exchanges and torch.distributed object collectives."""

    METHODS = ("all_to_all", "all_gather", "reduce_scatter")

    def __init__(self):
        from qcoll import _torch_transport as tt

        self.count = 0
        self._undo = []
        for cls in (tt.ProcessGroupTransport, tt.SelfTransport):
            for name in self.METHODS:
                self._wrap(cls, name)
        for name in ("all_gather_object", "broadcast_object_list", "barrier", "all_to_all_single",
                     "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce"):
            self._wrap(dist, name)

    def _wrap(self, owner, name):
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            self.count += 1
            return original(*args, **kwargs)

        setattr(owner, name, counted)
        self._undo.append((owner, name, original))

    def restore(self):
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)


def _calls() -> int:
    st = qcoll.stats()
    return st["allgather"]["calls"] + st["reduce_scatter"]["calls"]


# ---- the bad-input cases ------------------------------------------------------------------
# name -> (call(g, world), exception type, words the message must contain)
def _rs(out, x, g, **kw):
    return qcoll.quantized_reduce_scatter(out, x, g, **kw)


def _ag(out, x, g, **kw):
    return qcoll.quantized_allgather(out, x, g, **kw)


N = 12
CASES = {
    "rs_output_too_big": (lambda g, w: _rs(torch.empty(N + 1), torch.empty(w * N), g),
                          ValueError, ["numel"]),
    "rs_input_too_small": (lambda g, w: _rs(torch.empty(N), torch.empty(w * N - 1), g),
                           ValueError, ["numel"]),
    "ag_output_wrong_size": (lambda g, w: _ag(torch.empty(w * N - 1), torch.empty(N), g),
                             ValueError, ["numel"]),
    "ag_output_wrong_size_raw": (lambda g, w: _ag(torch.empty(w * N + 3), torch.empty(N), g,
                                                  bits=None), ValueError, ["numel"]),
    "rs_dtype_mismatch": (lambda g, w: _rs(torch.empty(N, dtype=torch.float16), torch.empty(w * N), g),
                          ValueError, ["dtype", "float16", "float32"]),
    "ag_dtype_mismatch": (lambda g, w: _ag(torch.empty(w * N, dtype=torch.bfloat16), torch.empty(N), g),
                          ValueError, ["dtype", "bfloat16", "float32"]),
    "rs_input_not_contiguous": (lambda g, w: _rs(torch.empty(N), torch.empty(2 * w * N)[::2], g),
                                ValueError, ["input", "contiguous"]),
    "rs_output_not_contiguous": (lambda g, w: _rs(torch.empty(2, N).t(), torch.empty(w * 2 * N), g),
                                 ValueError, ["output", "contiguous"]),
    "ag_input_not_contiguous": (lambda g, w: _ag(torch.empty(w * N), torch.empty(N, 2)[:, 0], g),
                                ValueError, ["input", "contiguous"]),
    "ag_output_not_contiguous": (lambda g, w: _ag(torch.empty(N, w + 1).t()[:w], torch.empty(N), g,
                                                  bits=None), ValueError, ["output", "contiguous"]),
    "rs_int32": (lambda g, w: _rs(torch.empty(N, dtype=torch.int32),
                                  torch.empty(w * N, dtype=torch.int32), g),
                 TypeError, ["dtype", "int32"]),
    "ag_int64_quantized": (lambda g, w: _ag(torch.empty(w * N, dtype=torch.int64),
                                            torch.empty(N, dtype=torch.int64), g, bits=8),
                           TypeError, ["dtype", "int64"]),
    "ag_uint8": (lambda g, w: _ag(torch.empty(w * N, dtype=torch.uint8),
                                  torch.empty(N, dtype=torch.uint8), g),
                 TypeError, ["dtype", "uint8"]),
    "ag_bits_2": (lambda g, w: _ag(torch.empty(w * N), torch.empty(N), g, bits=2),
                  ValueError, ["bits", "2"]),
    "ag_bits_16": (lambda g, w: _ag(torch.empty(w * N), torch.empty(N), g, bits=16),
                   ValueError, ["bits", "16"]),
    "ag_bits_true": (lambda g, w: _ag(torch.empty(w * N), torch.empty(N), g, bits=True),
                     ValueError, ["bits"]),
    "ag_bits_0": (lambda g, w: _ag(torch.empty(w * N), torch.empty(N), g, bits=0),
                  ValueError, ["bits"]),
    "rs_intra_bits_2": (lambda g, w: _rs(torch.empty(N), torch.empty(w * N), g, intra_bits=2),
                        ValueError, ["intra_bits"]),
    "rs_inter_bits_32": (lambda g, w: _rs(torch.empty(N), torch.empty(w * N), g, inter_bits=32),
                         ValueError, ["inter_bits"]),
    "rs_inter_bits_str": (lambda g, w: _rs(torch.empty(N), torch.empty(w * N), g, inter_bits="4"),
                          ValueError, ["inter_bits"]),
    "rs_bad_op": (lambda g, w: _rs(torch.empty(N), torch.empty(w * N), g, op="max"),
                  ValueError, ["op", "max"]),
    "rs_bad_stages": (lambda g, w: _rs(torch.empty(N), torch.empty(w * N), g, pipeline_stages=0),
                      ValueError, ["pipeline_stages"]),
    "rs_bad_group_size": (lambda g, w: _rs(torch.empty(N), torch.empty(w * N), g, group_size=12),
                          ValueError, ["group_size"]),
    "ag_bad_group_size": (lambda g, w: _ag(torch.empty(w * N), torch.empty(N), g, group_size=0),
                          ValueError, ["group_size"]),
    "rs_bad_hierarchical": (lambda g, w: _rs(torch.empty(N), torch.empty(w * N), g, hierarchical="yes"),
                            ValueError, ["hierarchical"]),
    "rs_not_a_tensor": (lambda g, w: _rs([0.0] * N, torch.empty(w * N), g),
                        TypeError, ["output", "Tensor"]),
    "ag_not_a_tensor": (lambda g, w: _ag(torch.empty(w * N), None, g),
                        TypeError, ["input", "Tensor"]),
    "rs_group_str": (lambda g, w: _rs(torch.empty(N), torch.empty(w * N), "world"),
                     TypeError, ["group"]),
    "ag_group_int": (lambda g, w: _ag(torch.empty(w * N), torch.empty(N), 3),
                     TypeError, ["group"]),
    # A truthy non-bool async_op would return a Work nobody waits for.
    "rs_async_op_str": (lambda g, w: _rs(torch.empty(N), torch.empty(w * N), g, async_op="no"),
                        TypeError, ["async_op", "'no'"]),
    "ag_async_op_int": (lambda g, w: _ag(torch.empty(w * N), torch.empty(N), g, async_op=1),
                        TypeError, ["async_op"]),
    "ar_async_op_none": (lambda g, w: qcoll.quantized_all_reduce(torch.empty(N), g, async_op=None),
                         TypeError, ["async_op"]),
    "delta_async_op_str": (lambda g, w: qcoll.delta_allgather(torch.empty(w * N), torch.empty(N), g,
                                                              async_op="yes"), TypeError, ["async_op"]),
    # policy="auto" agrees on the call and probes the cost model first: error_feedback is
    # checked before either.
    "rs_auto_error_feedback_true": (lambda g, w: _rs(torch.empty(N), torch.empty(w * N), g, policy="auto",
                                                     error_feedback=True), TypeError, ["error_feedback"]),
    "ar_auto_error_feedback_true": (lambda g, w: qcoll.quantized_all_reduce(torch.empty(N), g, policy="auto",
                                                                            error_feedback=True),
                                    TypeError, ["error_feedback"]),
}


def _bad_input_worker(rank, world, node_size, names):
    g = qcoll.new_group(node_size=node_size)
    seen = {}
    counter = CommCounter()
    try:
        for name in names:
            call = CASES[name][0]
            before, calls = counter.count, _calls()
            try:
                call(g, world)
            except Exception as exc:  # noqa: BLE001 - the parent checks the type
                seen[name] = (type(exc).__name__, str(exc))
            else:
                seen[name] = (None, "no exception")
            assert counter.count == before, f"{name}: communicated before raising"
            assert _calls() == calls, f"{name}: a collective was started"
    finally:
        counter.restore()
    # Nothing was left half-done: a correct call still works (exact small integers).
    x = torch.arange(world * N, dtype=F32) + rank
    out = torch.empty(N)
    qcoll.quantized_reduce_scatter(out, x, g, op="sum", intra_bits=None, inter_bits=None)
    want = world * (torch.arange(N, dtype=F32) + rank * N) + sum(range(world))
    assert torch.equal(out, want), "a correct call after the errors"
    return seen


def _assert_every_rank_raised(results, names):
    for name in names:
        _, exc_type, words = CASES[name] if name in CASES else DEBUG_CASES[name]
        for rank, seen in enumerate(results):
            got_type, msg = seen[name]
            assert got_type == exc_type.__name__, (
                f"{name}: rank {rank} raised {got_type} ({msg!r}), expected {exc_type.__name__}")
            for word in words:
                assert word in msg, f"{name}: rank {rank}'s message {msg!r} does not name {word!r}"


@pytest.mark.parametrize("world,node_size", [(1, 1), (4, 2)])
def test_bad_input_raises_on_every_rank_before_communicating(world, node_size):
    names = list(CASES)
    results = run_ranks(world, _bad_input_worker, node_size, names, timeout=60)
    _assert_every_rank_raised(results, names)


# ---- new_group errors ---------------------------------------------------------------------
def _new_group_worker(rank, world, cases):
    seen = {}
    for name, kwargs in cases.items():
        try:
            qcoll.new_group(**kwargs)
        except Exception as exc:  # noqa: BLE001
            seen[name] = (type(exc).__name__, str(exc))
        else:
            seen[name] = (None, "no exception")
    g = qcoll.new_group(node_size=2)  # still fine afterwards
    return seen, (g.size, g.node_size, g.num_nodes)


def test_new_group_rejects_node_size_not_dividing_the_world():
    cases = {"three": dict(node_size=3), "zero": dict(node_size=0), "five": dict(node_size=5),
             "bool": dict(node_size=True), "float": dict(node_size=2.0),
             "backend": dict(backend="mpi"), "pg": dict(pg="world")}
    results = run_ranks(4, _new_group_worker, cases, timeout=60)
    for rank, (seen, shape) in enumerate(results):
        assert shape == (4, 2, 2)
        for name in cases:
            got_type, msg = seen[name]
            want = "TypeError" if name == "pg" else "ValueError"
            assert got_type == want, f"{name}: rank {rank} raised {got_type}: {msg}"
            word = name if name in ("backend", "pg") else "node_size"
            assert word in msg, f"{name}: {msg!r}"
        assert "3" in seen["three"][1] and "4" in seen["three"][1]  # the value and the size


def _local_world_worker(rank, world):
    try:
        qcoll.new_group()
    except ValueError as exc:
        return str(exc)
    return None


def test_local_world_size_not_dividing_the_world():
    env = {r: {"LOCAL_WORLD_SIZE": "3"} for r in range(4)}
    results = run_ranks(4, _local_world_worker, env=env, timeout=60)
    assert all(msg is not None and "LOCAL_WORLD_SIZE" in msg for msg in results), results


@pytest.mark.parametrize("case", ["one rank's node_size", "LOCAL_WORLD_SIZE per host", "LOCAL_WORLD_SIZE text"])
def test_a_node_size_wrong_on_some_ranks_raises_on_every_rank(case):
    """A value that only some ranks get wrong (or get at all) is exchanged before anyone
    raises: every rank raises, naming the rank, instead of the others waiting for the
    sub-groups that rank never creates."""
    if case == "one rank's node_size":
        env, kwargs = None, {0: dict(node_size=3)}
    elif case == "LOCAL_WORLD_SIZE per host":  # heterogeneous nodes: 2 ranks here, 4 there
        env, kwargs = {r: {"LOCAL_WORLD_SIZE": "2" if r < 2 else "4"} for r in range(4)}, {}
    else:
        env, kwargs = {r: {"LOCAL_WORLD_SIZE": "two" if r == 3 else "2"} for r in range(4)}, {}
    results = run_ranks(4, _some_ranks_worker, kwargs, env=env, timeout=60)
    word = {"one rank's node_size": "rank 0: node_size must be a positive divisor",
            "LOCAL_WORLD_SIZE per host": "different LOCAL_WORLD_SIZE",
            "LOCAL_WORLD_SIZE text": "rank 3: LOCAL_WORLD_SIZE='two'"}[case]
    assert all(msg is not None and word in msg for msg in results), results


def _some_ranks_worker(rank, world, kwargs):
    try:
        qcoll.new_group(**kwargs.get(rank, dict(node_size=2) if kwargs else {}))
    except ValueError as exc:
        return str(exc)
    return None


def _layout_worker(rank, world, node_size):
    try:
        g = qcoll.new_group(node_size=node_size)
    except ValueError as exc:
        return "error", str(exc)
    return "ok", (g.node_size, g.num_nodes)


@pytest.mark.parametrize("hosts,node_size,ok", [
    ("ABAB", 2, False),   # node 0 = ranks 0,1 on hosts A and B
    ("AABB", 4, False),   # one node cannot span two hosts
    ("AABB", 2, True),
    ("AABB", 1, True),    # an explicit node_size may split a host into several nodes
    ("AAAA", 2, True),
])
def test_rank_layout_must_be_node_contiguous(hosts, node_size, ok):
    env = {r: {"QCOLL_HOST_ID": f"h{h}"} for r, h in enumerate(hosts)}
    results = run_ranks(len(hosts), _layout_worker, node_size, env=env, timeout=60)
    for rank, (status, payload) in enumerate(results):
        if ok:
            assert status == "ok" and payload == (node_size, len(hosts) // node_size), (rank, payload)
        else:
            assert status == "error", f"rank {rank}: no error for hosts {hosts}"
            assert "node-contiguous" in payload and "hA" in payload and "hB" in payload, payload


# ---- QCOLL_DEBUG=1: metadata mismatches across ranks ----------------------------------------
def _mismatch(rank_call, other_call):
    return lambda g, w, rank: (rank_call if rank == 0 else other_call)(g, w)


DEBUG_CASES = {
    "rs_n": (_mismatch(lambda g, w: _rs(torch.empty(N + 1), torch.empty(w * (N + 1)), g),
                       lambda g, w: _rs(torch.empty(N), torch.empty(w * N), g)),
             ValueError, ["disagree", str(N + 1), str(N)]),
    "rs_bits": (_mismatch(lambda g, w: _rs(torch.empty(N), torch.empty(w * N), g, inter_bits=8),
                          lambda g, w: _rs(torch.empty(N), torch.empty(w * N), g, inter_bits=4)),
                ValueError, ["disagree"]),
    "rs_dtype": (_mismatch(lambda g, w: _rs(torch.empty(N, dtype=torch.bfloat16),
                                            torch.empty(w * N, dtype=torch.bfloat16), g),
                           lambda g, w: _rs(torch.empty(N), torch.empty(w * N), g)),
                 ValueError, ["disagree", "bfloat16", "float32"]),
    "rs_op": (_mismatch(lambda g, w: _rs(torch.empty(N), torch.empty(w * N), g, op="sum"),
                        lambda g, w: _rs(torch.empty(N), torch.empty(w * N), g, op="avg")),
              ValueError, ["disagree"]),
    "rs_stages": (_mismatch(lambda g, w: _rs(torch.empty(N), torch.empty(w * N), g, pipeline_stages=2),
                            lambda g, w: _rs(torch.empty(N), torch.empty(w * N), g)),
                  ValueError, ["disagree"]),
    "ag_n": (_mismatch(lambda g, w: _ag(torch.empty(w * 5), torch.empty(5), g),
                       lambda g, w: _ag(torch.empty(w * N), torch.empty(N), g)),
             ValueError, ["disagree"]),
    "ag_bits": (_mismatch(lambda g, w: _ag(torch.empty(w * N), torch.empty(N), g, bits=4),
                          lambda g, w: _ag(torch.empty(w * N), torch.empty(N), g, bits=8)),
                ValueError, ["disagree"]),
    "ag_bits_none": (_mismatch(lambda g, w: _ag(torch.empty(w * N), torch.empty(N), g, bits=None),
                               lambda g, w: _ag(torch.empty(w * N), torch.empty(N), g, bits=8)),
                     ValueError, ["disagree"]),
    "ag_dtype": (_mismatch(lambda g, w: _ag(torch.empty(w * N, dtype=torch.float16),
                                            torch.empty(N, dtype=torch.float16), g),
                           lambda g, w: _ag(torch.empty(w * N), torch.empty(N), g)),
                 ValueError, ["disagree", "float16"]),
}


def _debug_worker(rank, world, node_size, names):
    assert os.environ.get("QCOLL_DEBUG") == "1"
    g = qcoll.new_group(node_size=node_size)
    seen = {}
    for name in names:
        calls = _calls()
        try:
            DEBUG_CASES[name][0](g, world, rank)
        except Exception as exc:  # noqa: BLE001
            seen[name] = (type(exc).__name__, str(exc))
        else:
            seen[name] = (None, "no exception")
        assert _calls() == calls, f"{name}: a collective started despite the mismatch"
    # Matching calls still work in debug mode, quantized and not.
    x = torch.arange(world * N, dtype=F32) + rank
    out = torch.empty(N)
    qcoll.quantized_reduce_scatter(out, x, g, op="sum", intra_bits=None, inter_bits=None)
    want = world * (torch.arange(N, dtype=F32) + rank * N) + sum(range(world))
    assert torch.equal(out, want)
    qcoll.quantized_reduce_scatter(out, x, g, op="avg")
    assert torch.allclose(out, want / world, rtol=0.1, atol=1.0)
    return seen


@pytest.mark.parametrize("world,node_size", [(2, 2), (4, 2)])
def test_debug_mode_mismatch_raises_on_every_rank(world, node_size):
    names = list(DEBUG_CASES)
    env = {r: {"QCOLL_DEBUG": "1"} for r in range(world)}
    results = run_ranks(world, _debug_worker, node_size, names, env=env, timeout=60)
    _assert_every_rank_raised(results, names)
    # The message shows what each rank passed.
    for seen in results:
        assert "rank 0" in seen["rs_n"][1] and f"rank {world - 1}" in seen["rs_n"][1]


# ---- the accepted forms of group, and async_op ----------------------------------------------
def _api_worker(rank, world):
    res = {}
    x = torch.arange(world * N, dtype=F32) * (rank + 1)
    total = sum(range(1, world + 1))
    want = torch.arange(N, dtype=F32).add(rank * N) * total

    # group=None: the default group; group=ProcessGroup: wrapped once and cached.
    for label, group in (("none", None), ("world_pg", dist.group.WORLD)):
        out = torch.empty(N)
        qcoll.quantized_reduce_scatter(out, x, group, op="sum", intra_bits=None, inter_bits=None)
        assert torch.equal(out, want), label
        ag = torch.empty(world * 3)
        qcoll.quantized_allgather(ag, torch.full((3,), float(rank)), group, bits=None)
        assert torch.equal(ag, torch.arange(world, dtype=F32).repeat_interleave(3)), label
    from qcoll.group import resolve_group
    assert resolve_group(None) is resolve_group(dist.group.WORLD) is resolve_group(None)
    assert resolve_group(None).size == world and resolve_group(None).node_size == world

    # A ProcessGroup of some ranks: results over its members only.
    members = [r for r in range(world) if r % 2 == 1]
    sub = dist.new_group(members)
    if rank in members:
        k = members.index(rank)
        y = torch.arange(len(members) * N, dtype=F32) * (rank + 1)
        out = torch.empty(N)
        qcoll.quantized_reduce_scatter(out, y, sub, op="sum", intra_bits=None, inter_bits=None)
        assert torch.equal(out, torch.arange(N, dtype=F32).add(k * N) * sum(m + 1 for m in members))
        # ... also as a qcoll.Group of several emulated nodes, on the 2-hop path.
        gs = qcoll.new_group(sub, node_size=1 if len(members) % 2 else 2)
        qcoll.quantized_reduce_scatter(out, y, gs, op="avg", intra_bits=None, inter_bits=None)
        expect = torch.arange(N, dtype=F32).add(k * N) * sum(m + 1 for m in members)
        assert torch.equal(out, expect / torch.full_like(expect, len(members)))
        res["sub"] = gs.global_ranks

    # async_op=True: a handle whose wait() returns, with the result in place.
    g = qcoll.new_group(node_size=2)
    for kwargs in (dict(intra_bits=None, inter_bits=None), dict(intra_bits=None, inter_bits=None,
                                                                 hierarchical=False)):
        out = torch.empty(N)
        h = qcoll.quantized_reduce_scatter(out, x, g, op="sum", async_op=True, **kwargs)
        assert h is not None and callable(h.wait)
        h.wait()
        assert torch.equal(out, want), kwargs
    ag = torch.empty(world * 4)
    # Codes times scale (rank + 1) are exact: int8 reproduces these values exactly.
    piece = torch.tensor([1.0, -2.0, 3.0, 127.0]) * (rank + 1)
    h = qcoll.quantized_allgather(ag, piece, g, bits=8, async_op=True)
    h.wait()
    gathered = torch.cat([torch.tensor([1.0, -2.0, 3.0, 127.0]) * (r + 1) for r in range(world)])
    assert torch.equal(ag, gathered), (ag, gathered)
    assert qcoll.quantized_allgather(ag, piece, g, bits=None) is None  # sync: no handle
    return res


def test_group_forms_and_async_op():
    results = run_ranks(4, _api_worker, timeout=60)
    assert results[1]["sub"] == results[3]["sub"] == [1, 3]
    assert results[0] == results[2] == {}


# ---- regressions: node_size disagreement, sub-groups spanning hosts, check-before-comm ------
def _node_size_disagreement_worker(rank, world):
    try:
        qcoll.new_group(node_size=2 if rank == 0 else 4)
    except ValueError as exc:
        return str(exc)
    return None


def test_ranks_passing_different_node_sizes_raise_instead_of_hanging():
    results = run_ranks(4, _node_size_disagreement_worker, timeout=60)
    for rank, msg in enumerate(results):
        assert msg is not None and "different node_size" in msg, (rank, msg)
        assert "rank 0: 2" in msg and "rank 1: 4" in msg, msg


def _replicate_group_worker(rank, world):
    # HSDP-style replicate groups: one rank per host. LOCAL_WORLD_SIZE=2 describes the
    # world; the sub-group's node size must come from its own members' hosts.
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    pg = groups[rank % 2]
    x = torch.arange(4, dtype=torch.float32) + 10 * rank
    out = torch.empty(2)
    qcoll.quantized_reduce_scatter(out, x, pg, op="sum", intra_bits=None, inter_bits=None)
    g = qcoll.new_group(pg)
    return out.tolist(), (g.size, g.node_size, g.num_nodes)


def test_sub_group_spanning_hosts_takes_its_node_size_from_its_hosts():
    env = {r: {"QCOLL_HOST_ID": "hA" if r < 2 else "hB", "LOCAL_WORLD_SIZE": "2"} for r in range(4)}
    results = run_ranks(4, _replicate_group_worker, env=env, timeout=60)
    for rank, (out, shape) in enumerate(results):
        peer = rank + 2 if rank < 2 else rank - 2
        x = [float(i + 10 * rank) for i in range(4)]
        y = [float(i + 10 * peer) for i in range(4)]
        me = 0 if rank < 2 else 1  # position in its replicate group
        assert out == [x[2 * me] + y[2 * me], x[2 * me + 1] + y[2 * me + 1]], (rank, out)
        assert shape == (2, 1, 2), shape


def _first_call_worker(rank, world):
    # The very first call with group=None must check its arguments before the default
    # qcoll.Group is built (which communicates).
    counter = CommCounter()
    try:
        qcoll.quantized_reduce_scatter(torch.empty(3), torch.ones(5), None)  # wrong size
    except ValueError as exc:
        msg = str(exc)
    else:
        msg = None
    finally:
        count = counter.count
        counter.restore()
    return msg, count


def test_first_call_with_default_group_checks_before_communicating():
    for rank, (msg, count) in enumerate(run_ranks(2, _first_call_worker, timeout=60)):
        assert msg is not None and "numel" in msg, (rank, msg)
        assert count == 0, f"rank {rank} communicated {count} times before raising"


def _strict_subgroup_worker(rank, world):
    # A qcoll.Group of several emulated nodes over a ProcessGroup that not every rank is in:
    # its intra/inter sub-groups must be created by the members alone.
    sub = dist.new_group([0, 1, 2, 3])
    if rank >= 4:
        return None
    g = qcoll.new_group(sub, node_size=2)
    x = torch.arange(8, dtype=F32) * (rank + 1)
    out = torch.empty(2)
    qcoll.quantized_reduce_scatter(out, x, g, op="sum", intra_bits=None, inter_bits=None)
    return out.tolist()


def test_two_hop_group_over_a_strict_sub_group():
    results = run_ranks(6, _strict_subgroup_worker, timeout=60)
    for rank in range(4):
        out = results[rank]
        assert out == [float(2 * rank * 10), float((2 * rank + 1) * 10)], (rank, out)
    assert results[4] is None and results[5] is None

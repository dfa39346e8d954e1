"""The gloo transport's all-gather: an all-to-all of the rank's bytes sent to every rank, on
a ProcessGroup of its own (ProcessGroupTransport.gather_pg), except past a size limit over
nodes of several ranks, where each size band takes whichever of it and the ring measured
faster at its first gather (GatherPaths), the same on every rank. Past
PAIRS_GATHER_ABOVE_BYTES the all-to-all pattern is posted as send/recv pairs of the rank's
own bytes (unless those overlap the output elsewhere than in their own slot), and the ring
as send/recv steps into the output's slots. Every rank's bytes land at its offset for every dtype the core sends, on every path;
the send buffer is kept only up to its size limit; a peer that dies or stalls mid-gather is
an error within the group's timeout."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import qcoll
from qcoll import _torch_transport as tt
from tests.support.distributed import run_ranks

TIMEOUT = 5.0
SLACK = 6.0  # spawn jitter on a shared 2-core machine


def _recording(seen: list):
    """Patches the two ways the all-to-all pattern posts (ProcessGroupTransport._replicated,
    _gather_by_pairs) and the ring's send/recv steps (_gather_by_ring) to record (transport,
    bytes sent to each rank, "all_to_all", "pairs" or "ring"); returns the function that
    restores them."""
    cls = tt.ProcessGroupTransport
    replicated, pairs, ring = cls._replicated, cls._gather_by_pairs, cls._gather_by_ring

    def recorded_replicated(self, send):
        seen.append((self, send.numel() * send.element_size(), "all_to_all"))
        return replicated(self, send)

    def recorded_pairs(self, recv, send):
        seen.append((self, send.numel() * send.element_size(), "pairs"))
        return pairs(self, recv, send)

    def recorded_ring(self, recv, send):
        seen.append((self, send.numel() * send.element_size(), "ring"))
        return ring(self, recv, send)
    cls._replicated, cls._gather_by_pairs, cls._gather_by_ring = recorded_replicated, recorded_pairs, recorded_ring

    def restore():
        cls._replicated, cls._gather_by_pairs, cls._gather_by_ring = replicated, pairs, ring
    return restore


def _quantized_gather(rank, world, numel, g, seen) -> tuple:
    """An 8-bit all-gather of numel elements per rank (its codes travel through the same
    exchange): (within 1% of the inputs' range, how its payload was posted)."""
    xs = [torch.randn(numel, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    q = torch.empty(world * numel)
    before = len(seen)
    qcoll.quantized_allgather(q, xs[rank], g, bits=8)
    every = torch.cat(xs)
    return bool((q - every).abs().max() <= every.abs().max() / 100), {how for _, b, how in seen[before:] if b >= numel}


def _gather(rank, world, sizes, keep_bytes, node_size):
    tt._KEEP_BUFFER_BYTES = keep_bytes
    g = qcoll.new_group(node_size=node_size)  # the flat group's transport: bits=None, bits=8
    seen = []
    restore = _recording(seen)
    out = []
    try:
        for numel in sizes:
            for dtype in (torch.float32, torch.bfloat16):
                base = torch.arange(world * numel, dtype=torch.float64).remainder(251).to(dtype)
                shard = base[rank * numel:(rank + 1) * numel].clone()
                full = torch.full((world * numel,), float("nan"), dtype=dtype)
                before = len(seen)
                qcoll.quantized_allgather(full, shard, g, bits=None)
                # The payload's exchange (not the 32-byte call check of a new signature).
                through = {how for _, b, how in seen[before:] if b >= numel * dtype.itemsize}
                kept = seen[-1][0]._replicas.numel() if seen[-1][0]._replicas is not None else None
                out.append((numel, str(dtype), torch.equal(full, base), through, kept))
            close, through = _quantized_gather(rank, world, numel, g, seen)
            out.append((numel, "int8", close, through, seen[-1][0]._replicas.numel()))
        distinct = all(t.gather_pg is not None and t.gather_pg is not t.pg for t, _, _ in seen)
    finally:
        restore()
    g.close()
    return out, distinct


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_lands_at_its_offset(world):
    # Odd sizes (unaligned chunk tails), the large one just within the pairs' limit as fp32.
    small, large = 1000, tt.PAIRS_GATHER_ABOVE_BYTES // 4 // world - 17
    keep = 64 << 10  # the small gathers' buffer is kept, the large ones' is not
    results = run_ranks(world, _gather, [small, large], keep, world, timeout=120)
    for out, distinct in results:
        assert distinct, "the all-gathers must run on a ProcessGroup of their own"
        for numel, dtype, placed, through, kept in out:
            assert placed, (numel, dtype)
            assert through == {"all_to_all"}, (numel, dtype, through)  # one node: always
            # Kept: the first (small) gather's buffer; the large ones' (over `keep`) are
            # allocated per call and dropped.
            assert kept == world * small * 4, (numel, dtype, kept)


# Scripted trial times (seconds) per rank, in the trials' order: ring, all-to-all,
# all-to-all, ring. APART: rank 0 times the all-to-all fastest by far, the others the ring.
APART = {0: (0.010, 0.002, 0.003, 0.011)}
OTHERS = (0.003, 0.005, 0.006, 0.004)


def _measured(rank, world, script):
    """Gathers over 2 nodes x 2 past the limit with the trials' times scripted per rank:
    for each gather, whether it went through the all-to-all, how many trial gathers ran, the
    transport's choices, and whether it landed."""
    g = qcoll.new_group(node_size=2)
    trials = []
    real_timed = tt._timed

    def timed(gather, by_all_to_all):
        seconds = real_timed(gather, by_all_to_all)  # the gather runs: every rank's collectives pair up
        trials.append(by_all_to_all)
        return script.get(rank, OTHERS)[(len(trials) - 1) % 4] if script else seconds
    tt._timed = timed
    seen = []
    restore = _recording(seen)
    limit = tt.ALL_TO_ALL_GATHER_SPANNING_MAX_BYTES
    out = []
    try:
        # Just within the limit (no trials), then two bands past it, the first gathered twice.
        for numel in (limit // 4 // world, limit // 4 // world + 5, limit // 4 // world + 9,
                      4 * limit // 4 // world + 3):
            base = torch.arange(world * numel, dtype=torch.float32)
            full = torch.full((world * numel,), float("nan"))
            before, trials_before = len(seen), len(trials)
            qcoll.quantized_allgather(full, base[rank * numel:(rank + 1) * numel].clone(), g, bits=None)
            # Through the all-to-all pattern (its copy, or past the pairs' limit its pairs).
            through = any(b >= numel * 4 and how != "ring" for _, b, how in seen[before:])
            out.append((numel, torch.equal(full, base), through, list(trials[trials_before:])))
        chosen = g.gather_paths
    finally:
        restore()
        tt._timed = real_timed
    g.close()
    return out, chosen


def _pairs(rank, world, node_size, in_place):
    """Gathers past PAIRS_GATHER_ABOVE_BYTES (odd sizes, fp32 and bf16, and an 8-bit one):
    whether each landed and how it was posted, with the shard a view of the output's own
    slot when in_place; then shards that overlap the output elsewhere (copied first, then
    posted as any other): another rank's slot on every rank, and slot 0 on every rank (in
    place on rank 0 only)."""
    g = qcoll.new_group(node_size=node_size)
    seen = []
    restore = _recording(seen)
    out = []
    try:
        for dtype in (torch.float32, torch.bfloat16):
            numel = tt.PAIRS_GATHER_ABOVE_BYTES // dtype.itemsize // world + 3
            base = torch.arange(world * numel, dtype=torch.float64).remainder(251).to(dtype)
            full = torch.full((world * numel,), float("nan"), dtype=dtype)
            mine = slice(rank * numel, (rank + 1) * numel)
            if in_place:
                full[mine] = base[mine]
                shard = full[mine]
            else:
                shard = base[mine].clone()
            hows = []
            for _ in range(2):  # spanning groups: the band's trials, then its chosen path
                before = len(seen)
                qcoll.quantized_allgather(full, shard, g, bits=None)
                # The payload's posts (not the call check of a new signature's first call).
                hows.append({how for _, b, how in seen[before:] if b >= numel * dtype.itemsize})
            out.append((str(dtype), torch.equal(full, base), hows))
        # An 8-bit gather's codes, a little over the limit.
        close, through = _quantized_gather(rank, world, tt.PAIRS_GATHER_ABOVE_BYTES // world + 5, g, seen)
        out.append(("int8", close, [through]))
        # The shard is the next rank's slot of the output, whose bytes it must send intact
        # (through the band's trials too).
        numel = tt.PAIRS_GATHER_ABOVE_BYTES // 4 // world + 3
        base = torch.arange(world * numel, dtype=torch.float32)
        full = base.clone()
        theirs = (rank + 1) % world
        before = len(seen)
        qcoll.quantized_allgather(full, full[theirs * numel:(theirs + 1) * numel], g, bits=None)
        expected = base.view(world, numel).roll(-1, 0).reshape(-1)
        out.append(("overlapping", torch.equal(full, expected),
                    [{how for _, b, how in seen[before:] if b >= numel * 4}]))
        # Every rank's shard is slot 0: in place on rank 0 alone, an overlap on the others,
        # which must still post what rank 0 posts.
        numel += 2  # a new size band's gather on 2 x 2: its trials
        full = torch.full((world * numel,), float(rank))
        before = len(seen)
        qcoll.quantized_allgather(full, full[:numel], g, bits=None)
        expected = torch.arange(world, dtype=torch.float32).repeat_interleave(numel)
        out.append(("slot 0 on every rank", torch.equal(full, expected),
                    [{how for _, b, how in seen[before:] if b >= numel * 4}]))
    finally:
        restore()
    g.close()
    return out


@pytest.mark.parametrize("world,node_size,in_place", [(3, 3, False), (3, 3, True), (4, 2, True)])
def test_past_the_pairs_limit_every_rank_lands_at_its_offset(world, node_size, in_place):
    """One node: the all-to-all pattern, as pairs past their limit, whatever the shard's
    overlap with the output. 2 x 2 (every gather in one size band): the band's first
    gather (its trials) runs the pairs and the ring's send/recv steps, the others whichever
    path measured faster."""
    for out in run_ranks(world, _pairs, node_size, in_place, timeout=120):
        for what, landed, hows in out:
            assert landed, (what, out)
            if node_size == world:
                assert all(how == {"pairs"} for how in hows), (what, out)
            else:
                assert all(how and how <= {"pairs", "ring"} for how in hows), (what, out)
        if node_size < world:
            assert out[0][2][0] == {"pairs", "ring"}, out


@pytest.mark.parametrize("world", [4, 6])  # 2 and 3 nodes of 2 ranks
def test_past_the_limit_over_nodes_the_faster_path_measured_is_taken_on_every_rank(world):
    """Rank 0 times the all-to-all fastest by far, the others the ring: the slowest rank's
    times decide (each path's faster trial per rank: ring 10 ms, all-to-all 5 ms), so every
    rank takes the all-to-all, measured once per size band; within the limit, no trials."""
    results = run_ranks(world, _measured, APART, timeout=120)
    band = tt.gather_band
    for out, chosen in results:
        assert [placed for _, placed, _, _ in out] == [True] * 4, out
        (n0, _, via0, trials0), (n1, _, _, trials1), (n2, _, via2, trials2), (n3, _, via3, trials3) = out
        assert 4 * world * n0 <= tt.ALL_TO_ALL_GATHER_SPANNING_MAX_BYTES and via0 and trials0 == []
        assert band(4 * world * n1) == band(4 * world * n2) != band(4 * world * n3)
        assert trials1 == trials3 == [False, True, True, False] and trials2 == []
        assert via2 and via3  # the chosen all-to-all (the first gather's trials went both ways)
        agreed = {"path": "all_to_all", "measured_s": {"ring": 0.010, "all_to_all": 0.005}}
        assert chosen == {tt.band_bounds(band(4 * world * n)): agreed for n in (n1, n3)}, chosen


def _ring(rank, world):
    """Gathers past PAIRS_GATHER_ABOVE_BYTES over nodes of 2 with the ring adopted for their
    size bands (no trials): whether each landed and how it was posted, for an out-of-place
    shard, one in its own slot, one that is another rank's slot, odd sizes in fp32 and bf16,
    and an 8-bit gather's codes."""
    g = qcoll.new_group(node_size=2)
    seen = []
    restore = _recording(seen)
    out = []
    try:
        numels = [tt.PAIRS_GATHER_ABOVE_BYTES // 4 // world + 3, 4 * tt.PAIRS_GATHER_ABOVE_BYTES // 4 // world + 7]
        g.adopt_gather_paths({tt.gather_band(b): "ring" for numel in numels
                              for b in (world * numel * 4, world * numel * 2, world * numel)})
        for numel in numels:
            for dtype in (torch.float32, torch.bfloat16):
                for shard_is in ("apart", "own slot", "next rank's slot"):
                    base = torch.arange(world * numel, dtype=torch.float64).remainder(251).to(dtype)
                    full = torch.full((world * numel,), float("nan"), dtype=dtype)
                    slot = lambda r: slice(r * numel, (r + 1) * numel)  # noqa: E731
                    expected = base
                    if shard_is == "apart":
                        shard = base[slot(rank)].clone()
                    elif shard_is == "own slot":
                        full[slot(rank)] = base[slot(rank)]
                        shard = full[slot(rank)]
                    else:  # every rank sends the next rank's slot of its output: rotated
                        full.copy_(base)
                        shard = full[slot((rank + 1) % world)]
                        expected = base.view(world, numel).roll(-1, 0).reshape(-1)
                    before = len(seen)
                    qcoll.quantized_allgather(full, shard, g, bits=None)
                    hows = {how for _, b, how in seen[before:] if b >= numel * dtype.itemsize}
                    out.append((world * numel * dtype.itemsize, str(dtype), shard_is, torch.equal(full, expected), hows))
            close, hows = _quantized_gather(rank, world, numel, g, seen)
            out.append((world * numel, "int8", "apart", close, hows))  # its codes' bytes (and scales')
    finally:
        restore()
    g.close()
    return out


@pytest.mark.parametrize("world", [4, 6])  # 2 and 3 nodes of 2 ranks
def test_the_ring_past_the_pairs_limit_lands_every_rank_at_its_offset(world):
    """The ring, taken for a band (measured faster there, or from the cost model), posted
    as send/recv steps into the output's slots: every rank's bytes at its offset, whatever
    the shard's overlap with the output; up to the limit gloo's own ring (not recorded)."""
    for out in run_ranks(world, _ring, timeout=120):
        for gathered, dtype, shard_is, landed, hows in out:
            past = gathered > tt.PAIRS_GATHER_ABOVE_BYTES
            assert landed and hows == ({"ring"} if past else set()), (gathered, dtype, shard_is, landed, hows)
        assert sum(1 for row in out if row[4]) >= 7, out  # fp32 twice, bf16 once, int8 once past it


def test_each_path_counts_its_faster_trial_and_a_tie_keeps_the_ring():
    """A first all-to-all faster than a first ring, but the second ring faster than either:
    the ring. Equal times: the ring (fewer bytes across nodes)."""
    second_ring = {r: (0.010, 0.005, 0.006, 0.004) for r in range(4)}
    tie = {r: (0.009, 0.009, 0.009, 0.009) for r in range(4)}
    for script in (second_ring, tie):
        for out, chosen in run_ranks(4, _measured, script, timeout=120):
            _, (_, placed, _, trials), (_, _, via2, none), _ = out
            assert placed and trials == [False, True, True, False] and none == [], out
            assert not via2 and {c["path"] for c in chosen.values()} == {"ring"}, (script, out, chosen)


def test_measured_unscripted_every_rank_agrees():
    """Real trials: whichever path wins on this machine, every rank holds the same choice
    and every gather lands."""
    results = run_ranks(4, _measured, None, timeout=120)
    choices = [chosen for _, chosen in results]
    assert all(c == choices[0] for c in choices) and len(choices[0]) == 2, choices
    assert all(c["path"] in ("ring", "all_to_all") and min(c["measured_s"].values()) > 0
               for c in choices[0].values()), choices
    for out, _ in results:
        assert all(placed for _, placed, _, _ in out), out


def _logged(rank, world):
    """What QCOLL_LOG=transport writes to this rank's stderr over two gathers of one band."""
    import io
    import sys
    os.environ["QCOLL_LOG"] = "transport"
    captured = sys.stderr = io.StringIO()
    g = qcoll.new_group(node_size=2)
    numel = tt.ALL_TO_ALL_GATHER_SPANNING_MAX_BYTES // 4 // world + 5
    full = torch.empty(world * numel)
    for _ in range(2):
        qcoll.quantized_allgather(full, torch.ones(numel), g, bits=None)
    paths = g.gather_paths
    g.close()
    sys.stderr = sys.__stderr__
    return captured.getvalue(), paths


def test_each_choice_is_logged_once_on_rank_zero():
    results = run_ranks(4, _logged, timeout=120)
    (text, paths), others = results[0], results[1:]
    ((low, high), chosen), = paths.items()
    path = "the all-to-all" if chosen["path"] == "all_to_all" else "the ring"
    lines = [line for line in text.splitlines() if line.startswith("qcoll transport:")]
    assert len(lines) == 1 and f"({low >> 10}, {high >> 10}] KB" in lines[0] and f"by {path}" in lines[0], text
    assert all("qcoll transport:" not in t for t, _ in others)


def test_the_rule():
    limit = tt.ALL_TO_ALL_GATHER_SPANNING_MAX_BYTES
    assert not tt.measures_gather_path(6, 6, 1 << 30) and not tt.measures_gather_path(6, 1, 1 << 30)
    assert not tt.measures_gather_path(6, 2, limit) and tt.measures_gather_path(6, 2, limit + 1)
    # Bands of 4x: (4^(k-1), 4^k] bytes.
    assert [tt.gather_band(b) for b in (4 ** 9, 4 ** 9 + 1, 4 ** 10, 4 ** 10 + 1)] == [9, 10, 10, 11]
    assert tt.band_bounds(10) == (4 ** 9, 4 ** 10)


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _dies_in_the_gather(rank, world, how, numel, path):
    ring = path == "ring"  # over nodes of 2, the ring adopted for the band: its send/recv steps
    g = qcoll.new_group(node_size=2 if ring else world, timeout=timedelta(seconds=TIMEOUT))
    if ring:
        g.adopt_gather_paths({tt.gather_band(world * numel * 4): "ring"})
    shard = torch.ones(numel)
    full = torch.empty(world * numel)
    qcoll.quantized_allgather(full, shard, g, bits=None)  # warm: connections, worker
    threads = _threads()
    if rank == world - 1:
        # The all-to-all's send buffer, the pairs or the ring's steps, never reached.
        posts = {"all_to_all": "_replicated", "pairs": "_gather_by_pairs", "ring": "_gather_by_ring"}[path]
        if how == "dies":  # posts nothing, gone
            setattr(tt.ProcessGroupTransport, posts, lambda *a: os._exit(0))
        else:  # alive, but its sends never come
            def stall(*args):
                time.sleep(TIMEOUT + SLACK + 2)
                os._exit(0)
            setattr(tt.ProcessGroupTransport, posts, stall)
    start = time.monotonic()
    try:
        qcoll.quantized_allgather(full, shard, g, bits=None)
    except qcoll.CommunicationError as exc:
        elapsed, msg = time.monotonic() - start, str(exc)
    else:
        raise AssertionError(f"rank {rank}: the all-gather returned although rank {world - 1} is gone")
    time.sleep(0.2)
    leaked = _threads() - threads
    _wait_for_the_other_survivors(world)
    return elapsed, msg, leaked


def _wait_for_the_other_survivors(world) -> None:
    """Keep this process, and its connections, until every surviving rank has raised: on the
    ring a survivor waits on another one, which, gone sooner, would show it "Connection
    closed by peer" before its own timeout (run_ranks skips the final barrier here)."""
    store, key = dist.distributed_c10d._get_default_store(), "survivors raised"
    store.add(key, 1)
    deadline = time.monotonic() + 2 * (TIMEOUT + SLACK)
    while store.add(key, 0) < world - 1 and time.monotonic() < deadline:
        time.sleep(0.05)


@pytest.mark.parametrize("path,world,numel", [("all_to_all", 3, 4096),
                                              ("pairs", 3, tt.PAIRS_GATHER_ABOVE_BYTES // 12 + 1),
                                              ("ring", 4, tt.PAIRS_GATHER_ABOVE_BYTES // 16 + 1)],
                         ids=["all_to_all", "pairs", "ring"])
@pytest.mark.parametrize("how", ["dies", "stalls"])
def test_a_peer_lost_mid_gather_is_an_error_within_the_timeout(how, path, world, numel):
    results = run_ranks(world, _dies_in_the_gather, how, numel, path, timeout=60, dead=(world - 1,))
    for rank, (elapsed, msg, leaked) in enumerate(results[: world - 1]):
        assert elapsed < TIMEOUT + SLACK, f"rank {rank} raised after {elapsed:.1f} s"
        assert "qcoll.quantized_allgather" in msg and "all-gather over" in msg, msg
        # gloo's own error: the connection lost, or the timeout. On the ring a rank whose
        # neighbour is alive but failed waits for it until the timeout.
        expected = ("Timed out",) if how == "stalls" else ("peer", "Timed out") if path == "ring" else ("peer",)
        assert any(e in msg for e in expected), msg
        assert leaked <= 0, f"rank {rank}: {leaked} thread(s) left running after the error"

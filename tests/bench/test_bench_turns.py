"""The suites' timing in turns (_worker.Bench.time_interleaved, the sizes worker): with
rotate, the turns follow timing.balanced_sequence, whole cycles of it, so every call follows
every other call equally often; without it, the order is the same every round."""

from __future__ import annotations

import os
import sys

from tests.support.distributed import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "bench")


def _orders(rank, world, rotate, min_seconds=0.0):
    sys.path.insert(0, BENCH)
    from suites._worker import Bench

    seen = []
    fns = {name: (lambda name=name: seen.append(name)) for name in "abc"}
    cfg = dict(world=world, node_size=1, device="cpu", warmup=1, repeats=1)
    timed = Bench(cfg, rank).time_interleaved(fns, rotate=rotate, min_seconds=min_seconds)
    return "".join(seen[3:]), {k: len(v["times_s"]) for k, v in timed.items()}  # after the warm-up round


def _balanced_sequence(n):
    sys.path.insert(0, BENCH)
    from timing import balanced_sequence

    return balanced_sequence(n)


def _follows(sequence):
    """(before, after) -> times, the sequence taken as a cycle (it repeats)."""
    pairs = {}
    for a, b in zip(sequence, sequence[1:] + sequence[:1]):
        pairs[(a, b)] = pairs.get((a, b), 0) + 1
    return pairs


def test_balanced_sequence_every_call_follows_every_other_once_a_cycle():
    assert _balanced_sequence(1) == [0]
    for n in range(2, 9):
        cycle = _balanced_sequence(n)
        assert len(cycle) == n * (n - 1) and all(cycle.count(c) == n - 1 for c in range(n)), (n, cycle)
        assert _follows(cycle) == {(a, b): 1 for a in range(n) for b in range(n) if a != b}, (n, cycle)
        # spread over the cycle: no call holds a stretch of turns (its n - 1 turns never all
        # in one half of the cycle, from 3 calls on)
        if n >= 3:
            for c in range(n):
                at = [i for i, x in enumerate(cycle) if x == c]
                assert at[-1] - at[0] >= len(cycle) // 3, (n, c, at)


def test_rotated_turns_balance_what_each_call_follows():
    # Quick calls get 4x the repeats: 4 rounds, 12 turns; rotated, whole cycles of 6 turns
    # (12), each call following each other call twice (counting across the cycles' ends).
    for rotate in (True, False):
        (stream, counts), = run_ranks(1, _orders, rotate)
        assert len(stream) == 12 and counts == dict.fromkeys("abc", 4)
        if rotate:
            assert _follows(list(stream)) == {(a, b): 2 for a in "abc" for b in "abc" if a != b}, stream
        else:
            assert stream == "abc" * 4  # each call always after the same one


def test_min_seconds_adds_rounds_up_to_eight_times_the_repeats():
    # Calls of about nothing: a floor of 10 s wants far more rounds than the cap allows, 8 x
    # 1 repeat (24 turns, whole cycles of 6); a floor of a nanosecond changes nothing (4, as
    # above).
    for min_seconds, expected in ((10.0, 8), (1e-9, 4)):
        (stream, counts), = run_ranks(1, _orders, True, min_seconds)
        assert len(stream) == 3 * expected and counts == dict.fromkeys("abc", expected)


def _first_call_slow(rank, world):
    sys.path.insert(0, BENCH)
    import time
    from suites._worker import Bench

    calls = []

    def slow_once():
        calls.append(1)
        if len(calls) == 1:  # first use (allocations, a band's path trials): 0.2 s
            time.sleep(0.2)

    fns = {"a": slow_once, "b": lambda: None, "c": lambda: None}
    cfg = dict(world=world, node_size=1, device="cpu", warmup=2, repeats=1)
    timed = Bench(cfg, rank).time_interleaved(fns, rotate=True, min_seconds=0.05)
    return {k: len(v["times_s"]) for k, v in timed.items()}


def test_min_seconds_forecast_from_the_fastest_warm_up_round():
    # The first warm-up round takes 0.2 s, the second about nothing: forecast from the
    # fastest, a 0.05 s floor wants the cap (8 rounds); from their mean (0.1 s a round) it
    # would want 1 (2: whole cycles of 6 turns).
    counts, = run_ranks(1, _first_call_slow)
    assert counts == dict.fromkeys("abc", 8), counts

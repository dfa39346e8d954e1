"""The suites' timing in turns (_worker.Bench.time_interleaved): with rotate, each round
starts one call later and the rounds are a multiple of the calls, so every call holds every
place in the order equally often; without it, the order is the same every round."""

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
    rounds = [seen[i:i + 3] for i in range(3, len(seen), 3)]  # after the warm-up round
    return rounds, {k: len(v["times_s"]) for k, v in timed.items()}


def test_rotated_turns_give_every_call_every_place():
    # Quick calls get 4x the repeats: 4 rounds; rotated, 6 (a multiple of the 3 calls).
    for rotate, expected in ((True, 6), (False, 4)):
        (rounds, counts), = run_ranks(1, _orders, rotate)
        assert len(rounds) == expected and counts == dict.fromkeys("abc", expected)
        if rotate:
            assert ["".join(r) for r in rounds] == ["abc", "bca", "cab"] * 2
        else:
            assert all(r == list("abc") for r in rounds)


def test_min_seconds_adds_rounds_up_to_eight_times_the_repeats():
    # Calls of about nothing: a floor of 10 s wants far more rounds than the cap allows, 8 x
    # 1 repeat, rotated up to 9; a floor of a nanosecond changes nothing (6, as above).
    for min_seconds, expected in ((10.0, 9), (1e-9, 6)):
        (rounds, counts), = run_ranks(1, _orders, True, min_seconds)
        assert len(rounds) == expected and counts == dict.fromkeys("abc", expected)


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
    # fastest, a 0.05 s floor wants the cap (8 rounds, rotated 9); from their mean (0.1 s a
    # round) it would want 1 (rotated 3).
    counts, = run_ranks(1, _first_call_slow)
    assert counts == dict.fromkeys("abc", 9), counts

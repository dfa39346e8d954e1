"""The suites' timing in turns (_worker.Bench.time_interleaved, the sizes worker): with
rotate, the rounds cycle through timing.balanced_orders, so every call holds every place and
follows every other call equally often; without it, the order is the same every round."""

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


def _balanced_orders(n):
    sys.path.insert(0, BENCH)
    from timing import balanced_orders

    return balanced_orders(n)


def test_balanced_orders_balance_places_and_predecessors():
    for n in range(1, 9):
        orders = _balanced_orders(n)
        assert len(orders) == (n if n % 2 == 0 or n == 1 else 2 * n), (n, orders)
        assert all(sorted(order) == list(range(n)) for order in orders)
        for place in range(n):  # each call in each place equally often
            at = [order[place] for order in orders]
            assert all(at.count(c) == len(orders) // n for c in range(n)), (n, place, at)
        follows = {}  # (before, after) -> times, within an order
        for order in orders:
            for a, b in zip(order, order[1:]):
                follows[(a, b)] = follows.get((a, b), 0) + 1
        pairs = [(a, b) for a in range(n) for b in range(n) if a != b]
        assert sorted(follows) == pairs and len(set(follows.values())) <= 1, (n, follows)


def test_rotated_turns_give_every_call_every_place():
    # Quick calls get 4x the repeats: 4 rounds; rotated, 6 (balanced_orders(3): 6 orders).
    for rotate, expected in ((True, 6), (False, 4)):
        (rounds, counts), = run_ranks(1, _orders, rotate)
        assert len(rounds) == expected and counts == dict.fromkeys("abc", expected)
        if rotate:
            assert ["".join(r) for r in rounds] == ["abc", "bca", "cab", "cba", "acb", "bac"]
        else:
            assert all(r == list("abc") for r in rounds)


def test_min_seconds_adds_rounds_up_to_eight_times_the_repeats():
    # Calls of about nothing: a floor of 10 s wants far more rounds than the cap allows, 8 x
    # 1 repeat, rotated up to 12 (a multiple of the 6 orders); a floor of a nanosecond
    # changes nothing (6, as above).
    for min_seconds, expected in ((10.0, 12), (1e-9, 6)):
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
    # fastest, a 0.05 s floor wants the cap (8 rounds, rotated 12); from their mean (0.1 s a
    # round) it would want 1 (rotated 6).
    counts, = run_ranks(1, _first_call_slow)
    assert counts == dict.fromkeys("abc", 12), counts

"""The suites' timing in turns (_worker.Bench.time_interleaved): with rotate, each round
starts one call later and the rounds are a multiple of the calls, so every call holds every
place in the order equally often; without it, the order is the same every round."""

from __future__ import annotations

import os
import sys

from tests.support.distributed import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "bench")


def _orders(rank, world, rotate):
    sys.path.insert(0, BENCH)
    from suites._worker import Bench

    seen = []
    fns = {name: (lambda name=name: seen.append(name)) for name in "abc"}
    cfg = dict(world=world, node_size=1, device="cpu", warmup=1, repeats=1)
    timed = Bench(cfg, rank).time_interleaved(fns, rotate=rotate)
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

"""The suites' timing in turns (_worker.Bench.time_interleaved): with rotate, each round
starts one call later, so every call holds every place in the order equally often; without
it, the order is the same every round."""

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
    fns = {name: (lambda name=name: seen.append(name)) for name in "abcd"}
    cfg = dict(world=world, node_size=1, device="cpu", warmup=1, repeats=2)
    timed = Bench(cfg, rank).time_interleaved(fns, rotate=rotate)
    rounds = [seen[i:i + 4] for i in range(4, len(seen), 4)]  # after the warm-up round
    return rounds, {k: len(v["times_s"]) for k, v in timed.items()}


def test_rotated_turns_give_every_call_every_place():
    for rotate in (True, False):
        (rounds, counts), = run_ranks(1, _orders, rotate)
        assert len(rounds) == 8 and counts == dict.fromkeys("abcd", 8)  # quick calls: 4x the repeats
        if rotate:
            assert [r[0] for r in rounds] == list("abcdabcd")
            assert all("".join(r) in "abcdabc" for r in rounds)  # rotations of a, b, c, d
            assert all(sorted(r[i] for r in rounds) == sorted("abcd" * 2) for i in range(4))
        else:
            assert all(r == list("abcd") for r in rounds)

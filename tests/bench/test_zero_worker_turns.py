"""The zero suite's worker stepping its configurations in turns (config "interleave", which
the auto suite's ZeRO step uses): every configuration trains exactly as it does alone, one
after another: the same losses, bytes and step counts, row for row."""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))

from suites import _ranks, zero  # noqa: E402

CONFIGS = [("ZeRO-3", dict(qwz=False, hpz=False, qgz=False)),
           ("ZeRO++", dict(qwz=True, hpz=True, qgz=True))]


def _rows(interleave: bool) -> list:
    cfg = zero.config(quick=False, tiny=True, dtype="fp32")
    cfg.update(configs=CONFIGS, interleave=interleave, steps=4, warmup=1)
    return _ranks.launch(cfg, timeout=300, worker=zero.WORKER)["rows"]


def test_configurations_in_turns_train_as_they_do_one_after_another():
    alone, in_turns = _rows(False), _rows(True)
    assert [r["config"] for r in in_turns] == [name for name, _ in CONFIGS]
    for a, t in zip(alone, in_turns):
        assert t["losses"] == a["losses"], (t["config"], t["losses"], a["losses"])
        assert len(t["step_times_s"]) == len(a["step_times_s"]) == 3  # 4 steps, 1 warm-up
        for key in ("inter_bytes_per_rank", "intra_bytes_per_rank"):
            assert t[key] == a[key], (t["config"], key)
    assert in_turns[1]["inter_bytes_per_rank"] < in_turns[0]["inter_bytes_per_rank"]  # ZeRO++ is ZeRO++

"""Smoke test of the benchmark entry point: `bench/run.py kernels --quick` on one tiny size
runs every kernel and ends with a `RESULT {json}` line that parses."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_kernels_quick_result_line():
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "run.py"), "kernels", "--quick", "--device", "cpu",
         "--sizes", "64K"],
        capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT "), last
    result = json.loads(last[len("RESULT "):])
    assert result["suite"] == "kernels" and result["quick"] is True
    rows = result["rows"]
    assert {r["bytes"] for r in rows} == {64 << 10}
    kernels = {r["kernel"] for r in rows}
    for k in ("copy", "quantize int8", "dequantize int4", "swizzled quantize int8",
              "dq-reduce-q int8x2->int4", "dq-reduce-q int8x4->int4", "dq-reduce int4x2"):
        assert k in kernels, (k, kernels)
    assert all(r["gbps"] > 0 for r in rows)
    assert "cpu_kernels_frac_of_copy" in result["targets"]


def test_sizes_option_is_refused_where_it_does_not_apply():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "run.py"), "group_size", "--sizes", "1M"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2 and "does not take --sizes" in proc.stderr

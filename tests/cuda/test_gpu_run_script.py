"""bench/gpu/run.sh, the one-call GPU run, cannot run here; its step machinery can:
QCOLL_GPU_DRY_RUN=1 runs it on a fake step list (a pass, a failure, a pytest step whose test
hangs past its per-test timeout, a step hanging past its limit, a step left without time)
and must record each in the one results JSON."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "bench" / "gpu" / "run.sh"

HANGING_TEST = '''
import time

def test_sleeps_forever():
    time.sleep(60)
'''


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                    reason="needs bash and coreutils timeout")
def test_dry_run_records_every_step_outcome(tmp_path):
    pytest.importorskip("pytest_timeout")  # requirements-test.txt; the GPU machine has it
    out = tmp_path / "out"
    hang = tmp_path / "test_hang.py"
    hang.write_text(HANGING_TEST)
    # A 20 s budget: the pytest step (its start included) ends inside it even under load.
    env = dict(os.environ, QCOLL_GPU_DRY_RUN="1", QCOLL_GPU_BUDGET_S="20",
               QCOLL_GPU_DRY_TEST=str(hang), QCOLL_GPU_DRY_TIMEOUT="1",
               QCOLL_GPU_DRY_HANG_S="60",  # cut to what is left of the budget
               PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]))
    done = subprocess.run(["bash", str(SCRIPT), str(out)], capture_output=True, text=True,
                          env=env, timeout=90)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((out / "gpu-results.json").read_text())
    steps = {s["step"]: s for s in result["steps"]}
    assert list(steps) == ["passes", "fails", "pytest_hang", "hangs", "late"]
    assert result["failed_steps"] == ["fails", "pytest_hang", "hangs", "late"]

    assert steps["passes"]["rc"] == 0 and "hello from passes" in steps["passes"]["log_tail"]
    assert steps["fails"]["rc"] == 3 and not steps["fails"]["timed_out"]
    # The per-test timeout fired inside the step's limit and names the test.
    p = steps["pytest_hang"]
    assert p["rc"] == 1 and not p["timed_out"], p
    assert "test_sleeps_forever" in p["log_tail"] and "Timeout" in p["log_tail"], p["log_tail"]
    assert "--timeout=1" in p["command"]
    # A step past its limit is killed and marked; the next one finds no time left.
    assert steps["hangs"]["rc"] == 124 and steps["hangs"]["timed_out"]
    assert steps["late"]["rc"] == 124 and "out of time budget" in steps["late"]["log_tail"]
    assert all(s["limit_s"] <= 20 for s in result["steps"]), "no limit past the budget"

    for name in steps:  # whole logs, written as the steps run
        assert (out / "steps" / f"{name}.log").exists(), name
    assert "=== step hangs: rc=124" in (out / "gpu-run.log").read_text()


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_step_selects_every_gpu_test(tmp_path):
    env = dict(os.environ, QCOLL_GPU_DRY_RUN="list",
               PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]))
    done = subprocess.run(["bash", str(SCRIPT), str(tmp_path)], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    collected = [line for line in done.stdout.splitlines() if line.startswith("tests/")]
    selected = {line.split("::")[0].rsplit("/", 1)[-1] for line in collected}
    marking = re.compile(r"^(pytestmark = .*pytest\.mark\.gpu|@pytest\.mark\.gpu)", re.M)
    marked = {p.name for p in SCRIPT.parents[2].joinpath("tests").rglob("test_*.py")
              if marking.search(p.read_text()) and p.name != "test_expect_gpu.py"}  # its sample
    assert {"test_nccl.py", "test_gpu_streams.py", "test_quantize_cuda.py"} <= marked
    assert marked <= selected, f"GPU tests the GPU step would not run: {sorted(marked - selected)}"
    assert "tests/cuda/test_gpu_streams.py::test_cuda_graph_capture_replays_the_same_bits" in collected
    assert not [c for c in collected if "smoke" in c], "the smoke test has its own step"


def test_script_needs_no_git_and_expects_a_gpu():
    text = SCRIPT.read_text()
    assert "git " not in text.replace("digit", ""), "the GPU machine has no .git"
    assert "QCOLL_EXPECT_GPU=1" in text

"""QCOLL_EXPECT_GPU (tests/conftest.py): on a machine that should have N GPUs, a test marked
gpu(count <= N) that skips fails instead; without the variable it stays skipped. Runs pytest
on a small test file with this suite's conftest."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
from xml.etree import ElementTree

TESTS = pathlib.Path(__file__).resolve().parents[1]  # tests/, whose conftest.py is copied

SAMPLE = '''
import pytest

pytestmark = pytest.mark.gpu

@pytest.mark.skipif(True, reason="needs a CUDA device")
def test_marked_skipif():
    pass

def test_skips_inside():
    pytest.skip("qcoll could not load NCCL")

@pytest.mark.gpu(count=2)
@pytest.mark.skipif(True, reason="needs two GPUs")
def test_needs_two():
    pass

def test_runs():
    pass
'''

PLAIN = '''
import pytest

@pytest.mark.skipif(True, reason="not a GPU test")
def test_plain_skip():
    pass
'''


def _outcomes(tmp_path, expect):
    shutil.copy(TESTS / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    (tmp_path / "test_plain.py").write_text(PLAIN)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS.parent), os.environ.get("PYTHONPATH", "")]))
    env.pop("QCOLL_EXPECT_GPU", None)
    if expect is not None:
        env["QCOLL_EXPECT_GPU"] = expect
    xml = tmp_path / "report.xml"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), "-W", "ignore::pytest.PytestUnknownMarkWarning",
                           f"--junitxml={xml}", str(tmp_path)], capture_output=True, text=True,
                          env=env, timeout=120, cwd=tmp_path)
    result = {}
    for case in ElementTree.parse(xml).iter("testcase"):
        kinds = [c.tag for c in case if c.tag in ("skipped", "failure", "error")]
        kind = {"skipped": "SKIPPED", "failure": "FAILED", "error": "ERROR"}[kinds[0]] if kinds else "PASSED"
        result[case.get("name").removeprefix("test_")] = (kind, case)
    return done, result


def test_gpu_tests_skip_without_qcoll_expect_gpu(tmp_path):
    done, res = _outcomes(tmp_path, None)
    assert done.returncode == 0, done.stdout
    assert {k: v[0] for k, v in res.items()} == {
        "marked_skipif": "SKIPPED", "skips_inside": "SKIPPED", "needs_two": "SKIPPED",
        "runs": "PASSED", "plain_skip": "SKIPPED"}, done.stdout


def test_skipped_gpu_tests_fail_with_qcoll_expect_gpu(tmp_path):
    done, res = _outcomes(tmp_path, "1")
    assert done.returncode == 1, done.stdout
    kinds = {k: v[0] for k, v in res.items()}
    assert kinds == {"marked_skipif": "ERROR", "skips_inside": "FAILED", "needs_two": "SKIPPED",
                     "runs": "PASSED", "plain_skip": "SKIPPED"}, done.stdout
    for name, reason in (("marked_skipif", "needs a CUDA device"),
                         ("skips_inside", "qcoll could not load NCCL")):
        text = ElementTree.tostring(res[name][1], encoding="unicode")
        assert f"QCOLL_EXPECT_GPU=1 but this GPU test was skipped: {reason}" in text, text


def test_two_expected_gpus_fail_the_two_gpu_test_too(tmp_path):
    done, res = _outcomes(tmp_path, "2")
    assert res["needs_two"][0] == "ERROR", done.stdout

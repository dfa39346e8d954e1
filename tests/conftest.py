"""The suite's pytest hooks (QCOLL_EXPECT_GPU) and the `values` fixture (tests/support/values.py)."""

from __future__ import annotations

import os

import pytest

from tests.support.values import make_values


def _expected_gpus() -> int:
    value = os.environ.get("QCOLL_EXPECT_GPU", "").strip()
    try:
        return int(value) if value else 0
    except ValueError:
        raise pytest.UsageError(f"QCOLL_EXPECT_GPU must be a number of GPUs, got {value!r}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """QCOLL_EXPECT_GPU=N (N >= 1: the machine has N GPUs, as on a lent GPU machine): a test
    marked gpu(count <= N) that skips, for whatever reason, fails instead, so a broken CUDA
    build or a missing NCCL cannot pass as "skipped"."""
    outcome = yield
    report = outcome.get_result()
    mark = item.get_closest_marker("gpu")
    if not (report.skipped and mark is not None):
        return
    expected = _expected_gpus()
    if expected >= 1 and mark.kwargs.get("count", 1) <= expected:
        why = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        why = why.removeprefix("Skipped: ")
        report.outcome = "failed"
        report.longrepr = f"QCOLL_EXPECT_GPU={expected} but this GPU test was skipped: {why}"


@pytest.fixture
def values():
    return make_values

"""The speed gate (`bench/run.py gate`): its verdict rules on made-up ratios, and end to end,
that a deliberately slowed kernel fails it against the committed floors."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from tests.bench.test_bench import ROOT, _run

sys.path.insert(0, os.path.join(ROOT, "bench"))
from suites import gate  # noqa: E402


def test_compare_flags_a_ratio_below_tolerance_of_its_floor():
    floors = {"a": 1.0, "b": 0.5, "c": 0.4}
    measured = {"a": 0.76, "b": 0.37, "c": 0.9}  # b: 0.74 of its floor
    verdict = gate.compare(measured, floors, tolerance=0.75)
    assert {c: v["status"] for c, v in verdict["cells"].items()} == {"a": "ok", "b": "slow", "c": "ok"}
    assert abs(verdict["cells"]["b"]["of_floor"] - 0.74) < 1e-9
    assert verdict["new"] == {}


def _kernels(of_floor: list) -> tuple:
    """Made-up kernel cells (floors 0.5) measured at the given fractions of their floors."""
    floors = {f"kernel k{i} fp32 16 MB": 0.5 for i in range(len(of_floor))}
    return {c: 0.5 * f for c, f in zip(floors, of_floor)}, floors


def test_a_host_slower_at_every_kernel_lowers_their_floors_together():
    """Every kernel at 0.75 of its floor (a slow host, unchanged code) passes; one of them
    at 0.7 of that again (0.525 of its floor) fails; a collective cell is not scaled."""
    measured, floors = _kernels([0.75] * 7 + [0.75 * 0.7])
    measured["allgather x vs torch"], floors["allgather x vs torch"] = 0.7, 1.0
    verdict = gate.compare(measured, floors, tolerance=0.75)
    assert abs(verdict["kernel_drift"]["value"] - 0.75) < 1e-9
    assert verdict["kernel_drift"]["status"] == "ok"
    status = {c: v["status"] for c, v in verdict["cells"].items()}
    assert [status[f"kernel k{i} fp32 16 MB"] for i in range(8)] == ["ok"] * 7 + ["slow"]
    assert status["allgather x vs torch"] == "slow"  # 0.7 < 0.75 x 1.0: no drift for calls
    assert gate.failing(verdict) == ["kernel k7 fp32 16 MB", "allgather x vs torch"]


def test_a_faster_host_does_not_raise_the_floors():
    measured, floors = _kernels([1.5] * 6 + [0.76, 0.74])
    verdict = gate.compare(measured, floors, tolerance=0.75)
    assert verdict["kernel_drift"]["value"] == 1.0
    assert [v["status"] for v in verdict["cells"].values()] == ["ok"] * 7 + ["slow"]


def test_half_the_kernels_slower_cannot_hide_behind_the_drift():
    """The drift is the upper quartile: five of eight kernels at 0.6 of their floors leave
    it at 1, so each of them fails (with the median, 0.6, they would all pass)."""
    measured, floors = _kernels([1.0] * 3 + [0.6] * 5)
    verdict = gate.compare(measured, floors, tolerance=0.75)
    assert verdict["kernel_drift"]["value"] == 1.0
    assert [v["status"] for v in verdict["cells"].values()] == ["ok"] * 3 + ["slow"] * 5


def test_the_drift_is_the_upper_quartile_not_the_fastest_kernel():
    measured, floors = _kernels([0.8] * 7 + [1.5])
    verdict = gate.compare(measured, floors, tolerance=0.75)
    assert abs(verdict["kernel_drift"]["value"] - 0.8) < 1e-9
    assert all(v["status"] == "ok" for v in verdict["cells"].values())


def test_every_kernel_slower_fails_on_the_drift_itself():
    measured, floors = _kernels([0.65] * 8)
    verdict = gate.compare(measured, floors, tolerance=0.75)
    assert all(v["status"] == "ok" for v in verdict["cells"].values())  # each like its peers
    assert verdict["kernel_drift"]["status"] == "slow" and gate.DRIFT_MIN == 0.7
    assert gate.failing(verdict) == [gate.DRIFT_CELL]


class _Progress:
    def add_task(self, *a, **k):
        return 0

    def advance(self, *a):
        pass


def _gate_with(monkeypatch, tmp_path, kernel_floors: dict, kernel_ratios) -> tuple:
    """gate.run over the kernels and one collective cell (floor 1.0, measured at it), the
    kernels' ratios from kernel_ratios(cells asked for, the calls so far): the result and
    gate._measure's calls, (part, cells)."""
    path = tmp_path / "gate.json"
    path.write_text(json.dumps({"cpu_vendor": gate.cpu_vendor(),
                                "floors": {**kernel_floors, "allgather x vs torch": 1.0}}))
    calls = []

    def measure(part, slow, cells=None):
        calls.append((part, cells))
        return {"allgather x vs torch": 1.0} if part == "collectives" else kernel_ratios(cells, calls)

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(gate, "_measure", measure)
    monkeypatch.setattr(gate, "_floors_isa", lambda path: None)
    return gate.run(False, _Progress(), gate_parts="kernels,collectives", floors_path=str(path)), calls


def _asked(measured: dict, cells) -> dict:
    return {c: r for c, r in measured.items() if cells is None or c in cells}


def test_a_slow_kernel_cell_is_measured_again_alone(monkeypatch, tmp_path):
    """run() retries a kernel cell below its floor by itself (every kernel is timed on its own
    against the copy), twice while it stays slow, keeping its best; the collectives, which
    passed, are not run again."""
    measured, floors = _kernels([1.0] * 7 + [0.5])
    slow_cell = list(floors)[-1]

    def kernel_ratios(cells, calls):
        out = _asked(measured, cells)
        if len(calls) == 4:  # the second retry: back at its floor
            out[slow_cell] = 0.5
        return out

    result, calls = _gate_with(monkeypatch, tmp_path, floors, kernel_ratios)
    assert calls == [("kernels", None), ("collectives", None), ("kernels", {slow_cell}), ("kernels", {slow_cell})]
    assert not result["failed"] and result["retried"] == ["kernels"]
    assert result["cells"][slow_cell]["ratio"] == 0.5
    assert all(result["cells"][c]["ratio"] == measured[c] for c in floors if c != slow_cell)


def test_a_cell_the_rising_drift_fails_is_measured_again_too(monkeypatch, tmp_path):
    """A kernel cell measured again can raise the drift, and with it the mark of a cell that
    passed on its first measure: that cell gets its own retries (counted per cell, not per
    round) rather than failing unmeasured. Drift 0.825 first (cell b at 0.62 of its floor
    passes 0.75 x 0.825), 0.9 once cell a comes back."""
    measured, floors = _kernels([0.3, 0.62] + [0.8] * 4 + [0.9] * 2)
    a, b = list(floors)[:2]

    def kernel_ratios(cells, calls):
        out = _asked(measured, cells)
        if cells == {a} and calls.count(("kernels", {a})) == 2:
            out[a] = 0.5  # back at its floor on its second retry
        if cells == {b}:
            out[b] = 0.5 * 0.7
        return out

    result, calls = _gate_with(monkeypatch, tmp_path, floors, kernel_ratios)
    assert calls == [("kernels", None), ("collectives", None), ("kernels", {a}), ("kernels", {a}), ("kernels", {b})]
    assert abs(result["kernel_drift"]["value"] - 0.9) < 1e-9
    assert not result["failed"], result["failing_cells"]


def test_kernel_rows_are_named_as_the_gate_asks_for_them():
    """kernels._rows_at times exactly the rows `want` takes, under the names the gate's cells
    use (a retry of a cell whose name no row carries would keep its first ratio)."""
    from suites import kernels

    class Untimed:  # each row's call run once, no timing
        def time(self, fn, rotate):
            fn(0)
            return 1.0, 1.0

    dev = torch.device("cpu")
    every = [(k, d) for k, d, _, _ in kernels._rows_at(Untimed(), 64 << 10, dev)]
    floors = {c for c in gate.load_floors()["floors"] if c.startswith("kernel ")}
    assert {gate.kernel_cell(k, d) for k, d in every} == floors
    for kernel, dtype in (("dequantize int4", "fp32"), ("quantize fp8_e4m3 SR", "bf16"), ("dq-reduce int4x2", "bf16")):
        rows = list(kernels._rows_at(Untimed(), 64 << 10, dev, lambda k, d: (k, d) == (kernel, dtype)))
        assert [(k, d) for k, d, _, _ in rows] == [(kernel, dtype)]


def test_a_retry_of_a_cell_no_kernel_row_carries_is_an_error(monkeypatch):
    monkeypatch.setattr(gate.kernels, "Copy", lambda *a, **k: None)
    monkeypatch.setattr(gate.kernels, "_rows_at", lambda copy, nbytes, dev, want: iter(()))
    with pytest.raises(RuntimeError, match="no kernel row"):
        gate.measure_kernels(cells={"kernel renamed fp32 16 MB", "allgather x vs torch"})


def test_a_drift_failure_measures_the_kernels_again_and_names_the_drift(monkeypatch, tmp_path):
    """run() retries the kernels (not the collectives) when only the drift fails, keeps each
    cell's best, and passes once the kernels come back; the table names the drift."""
    measured, floors = _kernels([0.6] * 8)
    result, calls = _gate_with(monkeypatch, tmp_path, floors, lambda cells, calls: {
        c: r * (1 if len(calls) == 1 else 1.5) for c, r in _asked(measured, cells).items()})
    # The drift is every kernel's measure: all of them again, not the cells alone.
    assert calls == [("kernels", None), ("collectives", None), ("kernels", None)]
    assert not result["failed"] and result["retried"] == ["kernels"]
    assert abs(result["kernel_drift"]["value"] - 0.9) < 1e-9
    result, calls = _gate_with(monkeypatch, tmp_path, floors, lambda cells, calls: _asked(measured, cells))
    assert result["failed"] and result["failing_cells"] == [gate.DRIFT_CELL]
    assert result["retried"] == ["kernels"]
    assert calls == [("kernels", None), ("collectives", None), ("kernels", None), ("kernels", None)]
    assert "gate FAILED on the kernels' drift (0.60 < 0.7)" in gate.table(result)[-1]


def test_another_cpu_vendor_is_held_to_its_own_kernel_floors(monkeypatch):
    spec = {"cpu_vendor": "GenuineIntel",
            "floors": {"kernel k fp32 16 MB": 1.0, "allgather x vs torch": 0.8},
            "kernel_floors_by_vendor": {"AuthenticAMD": {"kernel k fp32 16 MB": 0.6}}}
    monkeypatch.setattr(gate, "cpu_vendor", lambda: "AuthenticAMD")
    assert gate.floors_for_this_cpu(spec) == {"kernel k fp32 16 MB": 0.6, "allgather x vs torch": 0.8}
    monkeypatch.setattr(gate, "cpu_vendor", lambda: "GenuineIntel")
    assert gate.floors_for_this_cpu(spec) == spec["floors"]
    monkeypatch.setattr(gate, "cpu_vendor", lambda: "HygonGenuine")  # no section: the main floors
    assert gate.floors_for_this_cpu(spec) == spec["floors"]


def test_update_on_another_cpu_vendor_writes_its_kernel_floors_and_keeps_the_main_ones(monkeypatch, tmp_path):
    path = tmp_path / "gate.json"
    main = {"kernel k fp32 16 MB": 1.0, "allgather x vs torch": 0.8}
    path.write_text(json.dumps({"cpu_isa": "avx512", "cpu_vendor": "GenuineIntel", "floors": main}))
    measured = iter([0.7, 0.5, 0.6])  # --update keeps each cell's lowest run
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(gate.qcoll, "build_info", lambda: {"cpu_isa": "avx512"})
    monkeypatch.setattr(gate, "_measure", lambda part, slow, cells=None: {"kernel k fp32 16 MB": next(measured)})
    monkeypatch.setattr(gate, "cpu_vendor", lambda: "AuthenticAMD")
    gate.run(False, _Progress(), update=True, gate_parts="kernels", floors_path=str(path))
    written = json.loads(path.read_text())
    assert written["floors"] == main and written["cpu_vendor"] == "GenuineIntel"
    assert written["kernel_floors_by_vendor"] == {"AuthenticAMD": {"kernel k fp32 16 MB": 0.5}}


def test_compare_fails_a_floor_whose_cell_is_gone_and_reports_new_cells():
    verdict = gate.compare({"renamed": 1.0}, {"old": 1.0})
    assert verdict["cells"]["old"]["status"] == "missing"
    assert verdict["new"] == {"renamed": 1.0}


def test_committed_floors_cover_every_kernel_and_collective_cell():
    floors = gate.load_floors()["floors"]
    assert floors, "bench/gate.json has no floors"
    assert all(0 < f < 10 for f in floors.values())
    names = {c for c in floors if c.startswith("kernel ")}
    for kernel in ("quantize int8", "quantize int4", "quantize fp8_e4m3", "dequantize int8",
                   "swizzled quantize int8", "dq-reduce-q int8x2->int4", "dq-reduce int4x2"):
        for dtype in ("fp32", "bf16") if "dq-reduce-q" not in kernel else ("fp32",):
            assert gate.kernel_cell(kernel, dtype) in names, (kernel, dtype)
    for collective in ("allgather", "reduce_scatter", "all_reduce"):
        for impl in gate.COLLECTIVE_IMPLS:
            for n in gate.COLLECTIVE_BYTES:
                assert gate.collective_cell(collective, impl, n) in floors
    assert any(c.endswith("(sizes, blocks)") for c in floors)


def test_gate_refuses_other_thread_counts_than_its_floors():
    proc = _run("gate", "--gate-parts", "kernels", env=dict(os.environ, OMP_NUM_THREADS="2"))
    assert proc.returncode != 0 and "OMP_NUM_THREADS=1" in proc.stderr


def test_gate_refuses_another_isa_path_than_its_floors():
    """Floors measured on one CPU kernel path (bench/gate.json's cpu_isa) do not judge another:
    the gate stops, naming both, before measuring."""
    floors_isa = gate.load_floors()["cpu_isa"]
    assert floors_isa in ("baseline", "avx2", "avx512")
    if floors_isa == "baseline":
        pytest.skip("the floors are the baseline path's: every CPU can take it")
    proc = _run("gate", "--gate-parts", "kernels",
                env=dict(os.environ, OMP_NUM_THREADS="1", QCOLL_CPU_ISA="baseline"))
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert f"measured on the CPU kernels' {floors_isa} path" in proc.stderr, proc.stderr[-2000:]
    assert "this machine runs baseline" in proc.stderr


def test_gate_fails_on_a_deliberately_slowed_kernel():
    """qcoll.dequantize doing its work four times: every dequantize cell falls to about a
    quarter of its floor, the gate retries them (twice), still fails, exits 1 and names them.
    (dequantize, not quantize: its 4x fall on the fastest cells, where quantize's took this
    test from 108 s to 141 s on the 2-core VM.)"""
    proc = _run("gate", "--gate-parts", "kernels", "--slow", "dequantize", timeout=300,
                env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1][len("RESULT "):])
    assert result["failed"] and result["retried"] == ["kernels"]
    dequantize = [c for c in result["cells"] if c.startswith("kernel dequantize ")]
    assert len(dequantize) >= 6  # int8, int4, fp8 x fp32, bf16 (and their +H rows)
    for cell in dequantize:
        assert result["cells"][cell]["status"] == "slow", (cell, result["cells"][cell])
        assert cell in result["failing_cells"]
    assert "gate FAILED" in proc.stdout


def _row(collective, nbytes, ratio, control=False, mode="2 threads"):
    return dict(world=4, node_size=2, mode=mode, dtype="fp32", bytes=nbytes, collective=collective,
                control=control, ratio=ratio, qcoll_per_call_s=0.003, qcoll_stalls=0, torch_stalls=0)


def test_sizes_targets_leave_the_control_cells_out_and_report_their_band():
    from suites import sizes

    rows = [_row("allgather", 1 << 20, 1.2), _row("all_reduce", 1 << 10, 1.45),
            _row("allgather", 1 << 20, 1.4, control=True), _row("all_reduce", 64 << 10, 0.9, control=True)]
    verdict = sizes.targets(rows)
    assert verdict["ratio"]["met"] and verdict["ratio"]["worst"] == 1.45  # 1 KB: limit 1.5
    assert sizes.control(rows) == {"cells": 2, "min": 0.9, "max": 1.4, "median": 1.15}
    rows[0]["ratio"] = 1.26  # over the 1.25 limit from 64 KB up
    assert sizes.targets(rows)["ratio"]["over_limit"] == ["allgather 1 MB fp32 2x2 2 threads: 1.26"]
    assert sizes.control([r for r in rows if not r["control"]]) == {}


def test_sizes_puts_each_stalled_call_down_to_the_evidence_kept_for_it():
    from suites import sizes

    k = 4  # calls a block; 3 blocks; medians 2 ms, so a stall is above 22 ms
    calls = [0.002] * 12
    calls[1] = 0.060   # block 0: a full collection ran during it (and steal too: gc wins)
    calls[4] = 0.050   # block 1, first call: delayed ACKs during it, no steal
    calls[6] = 0.045   # block 1, not the first call: its first call's ACKs say nothing about it
    calls[8] = 0.050   # block 2, first call, with steal in the block
    calls[10] = 0.021  # above 3x the median but not the median + 20 ms: no stall
    record = dict(calls_s=calls, calls_per_block=k, full_gc=[0.0, 1.0] + [0.0] * 10,
                  block_steal_s=[0.02, 0.0, 0.01], first_call_delayed_acks=[0.0, 3.0, 2.0])
    assert sizes.stalled(calls) == [1, 4, 6, 8]
    assert sizes.stall_causes(record) == {"full_gc": 1, "steal": 1, "delayed_ack": 1, "unexplained": 1}
    assert sizes.stall_causes({"calls_s": calls, "calls_per_block": k}) == {}  # an older result
    # Delayed ACKs during block 1's later calls account for its later stall (call 6).
    later = dict(record, later_calls_delayed_acks=[5.0, 1.0, 0.0])
    assert sizes.stall_causes(later) == {"full_gc": 1, "steal": 1, "delayed_ack": 2, "unexplained": 0}
    # Each part of a block answers for its own calls: with ACKs only during block 1's later
    # calls, its first call's stall (call 4) is unexplained and call 6's is theirs.
    apart = dict(record, first_call_delayed_acks=[0.0, 0.0, 2.0], later_calls_delayed_acks=[0.0, 4.0, 0.0])
    assert sizes.stall_causes(apart) == {"full_gc": 1, "steal": 1, "delayed_ack": 1, "unexplained": 1}

    rows = [dict(_row("allgather", 1 << 20, 1.0), qcoll_stalls=4, torch_stalls=0,
                 qcoll_stall_causes=sizes.stall_causes(record), torch_stall_causes={})]
    verdict = sizes.targets(rows)["stalls"]
    assert not verdict["met"] and verdict["calls"] == 4
    assert verdict["causes"] == {"full_gc": 1, "steal": 1, "delayed_ack": 1, "unexplained": 1}
    assert verdict["torch_causes"] == dict.fromkeys(sizes.STALL_CAUSES, 0)


def test_auto_names_each_cell_over_its_limit_beside_that_cells_control():
    from suites import auto

    def row(collective, ratio, control, errors=(0.1, 0.1)):
        return dict(collective=collective, bytes=1 << 20, topology="2x2", link="1 Gbit/s",
                    auto_vs_best_fixed=ratio, control_ratio=control,
                    uncompressed_prediction_error=errors[0], quantized_prediction_error=errors[1])

    rows = [row("allgather", 1.2, 1.15), row("all_reduce", 1.0, 0.9, errors=(0.1, -0.3)),
            row("reduce_scatter", 1.05, 1.02)]
    verdict = auto.targets({"rows": rows, "steps": []})
    assert verdict["auto_within_1.1x"]["over"] == ["allgather 1 MB 2x2 1 Gbit/s: 1.20 (control 1.15)"]
    assert not verdict["auto_within_1.1x"]["met"] and verdict["auto_within_1.1x"]["cells_over"] == 1
    assert verdict["prediction_within_20pct"]["within"] == 5  # the -30% one is out
    assert auto.control(rows) == {"cells": 3, "min": 0.9, "max": 1.15, "median": 1.02}
    assert auto.control([{k: v for k, v in rows[0].items() if k != "control_ratio"}]) == {}  # older rows

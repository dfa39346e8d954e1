"""Smoke test of the benchmark entry point: `bench/run.py kernels --quick` on one tiny size
runs every kernel and ends with a `RESULT {json}` line that parses."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(*args, timeout=120, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(ROOT, "bench", "run.py"), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def _result(*args, timeout=120) -> dict:
    """The run's RESULT line, parsed (the run must succeed)."""
    proc = _run(*args, timeout=timeout)
    assert proc.returncode == 0, proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("RESULT "), last
    return json.loads(last[len("RESULT "):])


def test_kernels_quick_result_line():
    result = _result("kernels", "--quick", "--device", "cpu", "--sizes", "64K")
    assert result["suite"] == "kernels" and result["quick"] is True
    rows = result["rows"]
    assert {r["bytes"] for r in rows} == {64 << 10}
    kernels = {r["kernel"] for r in rows}
    for k in ("copy", "quantize int8", "dequantize int4", "swizzled quantize int8",
              "dq-reduce-q int8x2->int4", "dq-reduce-q int8x4->int4", "dq-reduce int4x2",
              "quantize fp8_e4m3", "dequantize fp8_e4m3"):
        assert k in kernels, (k, kernels)
    assert all(r["gbps"] > 0 for r in rows)
    assert "cpu_kernels_frac_of_copy" in result["targets"]


def test_sizes_option_is_refused_where_it_does_not_apply():
    proc = _run("group_size", "--sizes", "1M", timeout=60)
    assert proc.returncode == 2 and "does not take --sizes" in proc.stderr


def test_zero_tiny_result_line():
    """`bench/run.py zero --tiny`: a tiny GPT, ZeRO-3 vs ZeRO++ and FSDP2 vs FSDP2+qcoll, 3 steps on
    4 gloo ranks (~15 s)."""
    result = _result("zero", "--tiny")
    assert result["suite"] == "zero" and result["world"] == 4 and result["node_size"] == 2
    rows = {r["config"]: r for r in result["rows"]}
    assert set(rows) == {"ZeRO-3", "ZeRO++", "FSDP2", "FSDP2+qcoll"}
    for r in rows.values():
        assert r["step_time_s"] > 0 and r["inter_bytes_per_rank"] > 0
        assert len(r["losses"]) == r["steps"] and all(l == l for l in r["losses"])  # no NaN
    # qwZ + hpZ + qgZ send far fewer bytes across nodes than plain ZeRO-3.
    assert rows["ZeRO++"]["inter_bytes_per_rank"] < 0.5 * rows["ZeRO-3"]["inter_bytes_per_rank"]
    # ... and so does FSDP2 with qcoll's collectives than with its own.
    assert rows["FSDP2+qcoll"]["inter_bytes_per_rank"] < 0.5 * rows["FSDP2"]["inter_bytes_per_rank"]
    assert rows["FSDP2"]["phase_s"]["gather"] is None  # FSDP2 does not time its collectives
    assert "zeropp_step_speedup_local" in result["targets"]


def test_link_option_is_refused_where_it_does_not_apply():
    proc = _run("collectives", "--link", "1", timeout=60)
    assert proc.returncode == 2 and "does not take --link" in proc.stderr


def test_zero_ddp_tiny_result_line():
    """`bench/run.py zero --ddp --tiny`: DDP's default all-reduce vs qcoll.ddp's hook."""
    result = _result("zero", "--ddp", "--tiny")
    rows = {r["config"]: r for r in result["rows"]}
    assert set(rows) == {"DDP", "DDP+qcoll"}
    assert all(r["step_time_s"] > 0 and len(r["losses"]) == r["steps"] for r in rows.values())
    assert 0 < rows["DDP+qcoll"]["inter_bytes_per_rank"] < 0.5 * rows["DDP"]["inter_bytes_per_rank"]


def test_zero_stage2_tiny_result_line():
    """`bench/run.py zero --stage2 --tiny`: stage 2 waiting vs overlap_publish, the same
    losses, and the back-to-back time that the speedup is taken from."""
    result = _result("zero", "--stage2", "--tiny")
    rows = {r["config"]: r for r in result["rows"]}
    assert set(rows) == {"stage 2", "stage 2 overlap"}
    wait, overlap = rows["stage 2"], rows["stage 2 overlap"]
    assert overlap["overlap_publish"] is True and wait["losses"] == overlap["losses"]
    assert all(r["loop_steps"] == r["steps"] - r["warmup"] and r["loop_step_time_s"] > 0 for r in rows.values())
    assert overlap["speedup_vs_zero3"] == wait["loop_step_time_s"] / overlap["loop_step_time_s"]


def test_fidelity_tiny_result_line():
    """`bench/run.py fidelity --tiny`: the fp32 reference, ZeRO-3, ZeRO++ and SDP4Bit without
    Hadamard on the convergence test's model, 3 steps on 4 gloo ranks."""
    result = _result("fidelity", "--tiny", timeout=180)
    rows = {r["config"]: r for r in result["rows"]}
    assert set(rows) == {"fp32 reference", "ZeRO-3", "ZeRO++", "SDP4Bit, no Hadamard"}
    assert rows["fp32 reference"]["loss_gap_vs_reference"] == 0 and rows["fp32 reference"]["inter_bytes_per_rank"] == 0
    # The first step's loss is the same model on the same batch: all rows agree closely.
    first = rows["fp32 reference"]["losses"][0]
    assert all(abs(r["losses"][0] - first) < 1e-2 * first for r in rows.values())
    # qWD int4 weights + int8/int4 gradients: well under ZeRO-3's cross-node bytes.
    assert rows["SDP4Bit, no Hadamard"]["inter_bytes_vs_zero3"] < 0.15
    assert "loss_gap_ZeRO++" in result["targets"]


def test_project_result_line():
    """The projection covers every GPU count and link, and its model behaves: a faster
    link shrinks ZeRO++'s speedup, and the paper rows carry both figures."""
    result = _result("project")
    rows = result["rows"]
    assert {(r["gpus"], r["inter_gbit_per_node"]) for r in rows} == \
        {(g, b) for g in (16, 32, 64, 128, 256, 512, 1024) for b in (100, 200, 400)}
    for g in (16, 1024):
        speedups = [next(r["step"]["zeropp_speedup"] for r in rows if (r["gpus"], r["inter_gbit_per_node"]) == (g, b))
                    for b in (100, 200, 400)]
        assert speedups == sorted(speedups, reverse=True) and speedups[-1] > 1
    for r in rows:  # auto is never slower than either fixed configuration
        s = r["step"]
        assert s["auto"]["step_s"] <= min(s["ZeRO-3"]["step_s"], s["ZeRO++"]["step_s"]) * (1 + 1e-9)
    assert set(result["papers"]) == {"zeropp_2.16x", "zeropp_4x_bytes", "sdp4bit_4.08x",
                                     "agoq_allreduce_200g", "agoq_allreduce_10g"}
    assert all(p["projected"] > 1 for p in result["papers"].values())
    assert "HBM" in result["assumptions"]["kernel_rates"] or "measured" in result["assumptions"]["kernel_rates"]


def test_project_charges_measured_bandwidth_with_the_models_bytes(tmp_path, monkeypatch):
    """A GPU result where every kernel ran at the same bandwidth B gives the rates of the HBM
    model at B: the kernels suite's GB/s counts bytes read + written, so the projection may
    not divide it by the input's element size alone (it did, 1.5x to 2x too fast)."""
    monkeypatch.syspath_prepend(ROOT)
    from bench.suites import project

    bandwidth = 1.2e12
    rows = [dict(device="cuda", kernel=k, dtype="bf16", bytes=256 << 20, gbps=bandwidth / 1e9)
            for k in ["copy"] + [f"{kind} {f}" for kind in ("quantize", "dequantize")
                                 for f in project.FORMATS]]
    (tmp_path / "gpu-results-test.json").write_text(json.dumps({"kernels_cuda": {"rows": rows}}))
    monkeypatch.setattr(project, "RESULTS", str(tmp_path))
    rates, source = project._gpu_kernel_rates()
    assert source == "measured: gpu-results-test.json"
    want = project.hbm_kernel_rates(bandwidth / project.HBM_FRACTION)
    assert set(rates) == set(want)
    for name, rate in rates.items():
        assert abs(rate.encode - want[name].encode) < 1e-6 * want[name].encode, name
        assert abs(rate.decode - want[name].decode) < 1e-6 * want[name].decode, name
    int8 = project.FORMATS["int8"]["bits"] / 8
    assert abs(rates["int8"].encode - bandwidth / (2 + int8)) < 1  # bf16 in, int8 out

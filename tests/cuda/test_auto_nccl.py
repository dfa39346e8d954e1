"""policy="auto" and the cost probe on a GPU: 4 ranks sharing ONE GPU as 2 nodes x 2 over
qcoll's raw-NCCL transport (test_nccl.py's NCCL_HOSTID set-up).

- The probe measures on CUDA (kernels on the GPU, links and whole calls over NCCL): it ends
  near its budget, every rank holds the same model, and the second lookup is the cached one.
- Every auto call, under the probed model and under two forced ones (quantizing pays /
  does not), equals one of the fixed calls it chooses between bit for bit, the same choice
  on every rank; the forced models give the choices they give on CPU (test_auto.py).

The worker takes the device, so the same scenario runs on gloo CPU ranks too
(test_auto_scenario_on_cpu_ranks): the harness and its checks are proven there first."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from tests.collectives.test_auto import _calls, _which
from tests.collectives.test_cost_model import NODE_SIZE, synthetic
from tests.cuda.test_nccl import _REASON, _nccl_env
from tests.support.distributed import run_ranks

WORLD = 4
BUDGET_S = 3.0
KINDS = {"allgather", "reduce_scatter", "all_reduce", "delta_allgather"}


def _worker(rank, world, device_type):
    import qcoll

    cuda = device_type == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    backend = "nccl" if cuda else "torch"
    g = qcoll.new_group(None, node_size=NODE_SIZE, backend=backend)
    t0 = time.perf_counter()
    probed = qcoll.cost_model(g, device=device_type, budget_s=BUDGET_S)
    elapsed = time.perf_counter() - t0
    cached = qcoll.cost_model(g, device=device_type) is probed
    results = {}
    forced = {"slow": synthetic(inter_gbit=0.1),  # quantizing pays
              "fast": synthetic(inter_gbit=5000.0, intra_gbit=5000.0, kernel=1e8)}  # it does not
    for name in ("probed", "slow", "fast"):
        if name != "probed":
            g = qcoll.new_group(None, node_size=NODE_SIZE, backend=backend)
            qcoll.cost_model(g, device=device_type, model=dataclasses.replace(forced[name], device=device_type))
        qcoll.reset_stats()
        out, fixed = _calls(g, rank, world, device_type)
        if cuda:
            torch.cuda.synchronize()
        results[name] = {"which": _which(out, fixed), "stats": qcoll.stats()["auto"],
                         "decisions": {d[0]: v["choice"] for d, v in qcoll.auto.decisions(g).items()}}
        g.close()
    return probed.to_dict(), elapsed, cached, results


def _check(runs):
    model, elapsed, cached, results = runs[0]
    for other in runs[1:]:  # identical model and choices on every rank
        assert other[0] == model
        assert {k: (v["which"], v["decisions"]) for k, v in other[3].items()} == \
            {k: (v["which"], v["decisions"]) for k, v in results.items()}
    assert model["source"] == "probe" and model["world"] == WORLD and model["node_size"] == NODE_SIZE
    assert model["inter"]["bandwidth"] > 0 and model["intra"]["bandwidth"] > 0
    assert all(r["encode"] > 0 and r["decode"] > 0 for r in model["kernels"].values())
    # 2 + 3 + 3 kinds; on host ranks the bits=None all-reduce on both of its paths (+1).
    assert len(model["calibration"]) == (9 if model["device"] == "cpu" else 8), sorted(model["calibration"])
    for _, seconds, hit, _ in runs:
        # A next size runs only where its forecast ends within the budget; the first sizes
        # always run and a forecast can miss (loaded host, ranks time-slicing one GPU).
        assert seconds < BUDGET_S + 10.0, seconds
        assert hit
    for name, r in results.items():
        # Each auto output is some fixed call's, bit for bit; one choice per kind, counted once.
        assert all(r["which"][k] for k in ("ag", "rs", "ar", "delta")), (name, r["which"])
        assert set(r["decisions"]) == KINDS and set(r["stats"]) == KINDS
        assert all(sum(c.values()) == 1 and len(c) == 1 for c in r["stats"].values()), r["stats"]
    s, f = results["slow"]["which"], results["fast"]["which"]
    assert s["ag"] == ["('ag', 8)"] and f["ag"] == ["('ag', None)"]
    assert s["delta"] == ["('delta', 4)"] and f["delta"] == ["('delta', None)"]
    assert f["rs"] == ["('rs', None)"] and f["ar"] == ["('ar', None)"]
    assert all("8)" in k for k in s["rs"]) and all("None" not in k for k in s["ar"])
    return model, elapsed


def test_auto_scenario_on_cpu_ranks():
    _check(run_ranks(WORLD, _worker, "cpu", timeout=240))


@pytest.mark.gpu
@pytest.mark.skipif(_REASON is not None, reason=_REASON or "")
def test_auto_and_probe_on_nccl():
    runs = run_ranks(WORLD, _worker, "cuda", env={r: _nccl_env(r) for r in range(WORLD)}, timeout=300)
    model, elapsed = _check(runs)
    rates = {k: (round(v["encode"] / 1e9, 2), round(v["decode"] / 1e9, 2)) for k, v in model["kernels"].items()}
    print(f"probe on {WORLD} NCCL ranks sharing one GPU: {elapsed:.1f} s; kernel rates (Gelem/s encode, decode) "
          f"{rates}; links intra {model['intra']}, inter {model['inter']}")

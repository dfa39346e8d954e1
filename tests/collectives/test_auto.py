"""policy="auto" (qcoll.auto): on 4 gloo ranks as 2 nodes x 2, with cost models given to
the groups (a slow cross-node link, a fast one), every collective runs the choice the model
predicts faster (the configured call kept within KEEP_MARGIN), bit-identical to that fixed
call, the same on every rank, counted in qcoll.stats()["auto"] and logged once per decision
with QCOLL_LOG=policy; a rank with another configuration raises on every rank; argument
checks come before communication."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch

import qcoll
import qcoll.ddp
from tests.support.distributed import run_ranks
from qcoll.auto import Auto
from qcoll.policy import ALL_GATHER, take_policy
from qcoll.zero import ZeroConfig
from tests.collectives.test_cost_model import NODE_SIZE, synthetic

N = 1 << 16  # elements per rank's part: 256 KB of fp32


def _calls(g, rank, world, device="cpu"):
    """Every auto entry point once, on `device`; returns (outputs, the same calls' fixed
    outputs for both choices)."""
    x = torch.randn(world * N, generator=torch.Generator().manual_seed(rank)).to(device)
    mine = x[:N].clone()
    out = {}
    fixed = {}
    out["ag"] = torch.empty(world * N, device=device)
    qcoll.quantized_allgather(out["ag"], mine, g, policy="auto")
    for bits in (None, 8):
        fixed[("ag", bits)] = torch.empty(world * N, device=device)
        qcoll.quantized_allgather(fixed[("ag", bits)], mine, g, bits=bits)
    out["rs"] = torch.empty(N, device=device)
    qcoll.quantized_reduce_scatter(out["rs"], x, g, policy="auto")
    fixed[("rs", None)] = torch.empty(N, device=device)
    qcoll.quantized_reduce_scatter(fixed[("rs", None)], x, g, intra_bits=None, inter_bits=None, hierarchical=False)
    for hier in (None, False):
        fixed[("rs", hier, 8)] = torch.empty(N, device=device)
        qcoll.quantized_reduce_scatter(fixed[("rs", hier, 8)], x, g, hierarchical=hier)
    out["ar"] = x.clone()
    qcoll.quantized_all_reduce(out["ar"], g, policy="auto")
    fixed[("ar", None)] = x.clone()
    qcoll.quantized_all_reduce(fixed[("ar", None)], g, bits=None)
    for hier in (True, False):
        for stages in (1, 2):
            fixed[("ar", hier, stages)] = x.clone()
            qcoll.quantized_all_reduce(fixed[("ar", hier, stages)], g, hierarchical=hier, pipeline_stages=stages)
    full = torch.zeros(world * N, device=device)
    out["delta"] = full.clone()
    qcoll.delta_allgather(out["delta"], mine, g, policy="auto")
    for bits in (None, 4):
        fixed[("delta", bits)] = full.clone()
        qcoll.delta_allgather(fixed[("delta", bits)], mine, g, bits=bits)
    return out, fixed


def _which(out, fixed) -> dict:
    """Which fixed call each auto output equals bit for bit."""
    return {name: sorted(str(k) for k, v in fixed.items() if k[0] == name and torch.equal(v, out[name]))
            for name in out}


def _auto_ranks(rank, world, slow, fast):
    import os

    os.environ["QCOLL_LOG"] = "policy"
    result = {}
    for name, model in (("slow", slow), ("fast", fast)):
        g = qcoll.new_group(node_size=NODE_SIZE)
        qcoll.cost_model(g, model=model)
        qcoll.reset_stats()
        log = io.StringIO()
        with contextlib.redirect_stderr(log):
            out, fixed = _calls(g, rank, world)
            out2, _ = _calls(g, rank, world)  # the same descriptions again: no new log line
        result[name] = {"which": _which(out, fixed), "again": _which(out2, fixed),
                        "stats": qcoll.stats()["auto"], "log": log.getvalue()}
        g.close()
    return result


def test_auto_chooses_by_the_model_on_every_rank():
    slow = synthetic(inter_gbit=0.1)  # quantizing pays
    fast = synthetic(inter_gbit=5000.0, intra_gbit=5000.0, kernel=1e8)  # it does not
    results = run_ranks(4, _auto_ranks, slow, fast, timeout=240)
    for r in results[1:]:  # the same choices on every rank
        assert {k: (v["which"], v["stats"]) for k, v in r.items()} == \
            {k: (v["which"], v["stats"]) for k, v in results[0].items()}
    s, f = results[0]["slow"], results[0]["fast"]
    assert s["which"]["ag"] == ["('ag', 8)"] and f["which"]["ag"] == ["('ag', None)"]
    assert s["which"]["delta"] == ["('delta', 4)"] and f["which"]["delta"] == ["('delta', None)"]
    assert f["which"]["rs"] == ["('rs', None)"] and f["which"]["ar"] == ["('ar', None)"]
    assert s["which"]["rs"] and all("8)" in k for k in s["which"]["rs"])  # a quantized path
    assert s["which"]["ar"] and all("None" not in k for k in s["which"]["ar"])
    for r in (s, f):
        assert r["again"] == r["which"]
        # calls per choice: two of each kind, one choice each
        assert {kind: sum(c.values()) for kind, c in r["stats"].items()} == \
            {"allgather": 2, "reduce_scatter": 2, "all_reduce": 2, "delta_allgather": 2}
        assert all(len(c) == 1 for c in r["stats"].values())
    assert f["stats"]["allgather"] == {"uncompressed": 2} and s["stats"]["allgather"] == {"quantized": 2}
    # QCOLL_LOG=policy: one line per distinct decision (rank 0 only), with the predicted times
    lines = s["log"].strip().splitlines()
    assert len(lines) == 4 and all(line.startswith("qcoll policy auto:") and " ms" in line for line in lines)
    assert results[1]["slow"]["log"] == ""


def _one_rank_differs(rank, world, model, case):
    """case "bits": rank 3 configures int4, the others int8; "no auto": rank 0 alone passes
    policy="auto"."""
    g = qcoll.new_group(node_size=NODE_SIZE)
    qcoll.cost_model(g, model=model)
    if case == "bits":
        kwargs = dict(policy="auto", bits=4 if rank == 3 else 8)
    else:
        kwargs = dict(policy="auto" if rank == 0 else None)
    try:
        qcoll.quantized_allgather(torch.empty(world * N), torch.randn(N), g, **kwargs)
        return "no error"
    except ValueError as e:
        return str(e)
    finally:
        g.close()


def test_a_rank_with_another_configuration_raises_on_every_rank():
    for message in run_ranks(4, _one_rank_differs, synthetic(inter_gbit=0.1), "bits", timeout=120):
        assert "ranks disagree on the call" in message
        assert "rank 3: ('allgather'" in message and "bits=4" in message


def test_a_rank_without_auto_among_ranks_with_it_raises_on_every_rank():
    """The first exchange of a new auto description is a qcoll call, whose call check meets
    the other ranks' call: an error on every rank, not a hang."""
    for message in run_ranks(4, _one_rank_differs, synthetic(inter_gbit=0.1), "no auto", timeout=120):
        assert "ranks disagree on the call" in message and "32 bytes" in message, message


def test_argument_checks_before_communication():
    # No process group exists here: each check must fire before any group is resolved.
    x = torch.randn(8)
    with pytest.raises(ValueError, match="policy must be None or 'auto'"):
        qcoll.quantized_allgather(torch.empty(8), x, policy="fast")
    with pytest.raises(ValueError, match="policy must be None or 'auto'"):
        qcoll.quantized_reduce_scatter(torch.empty(8), x, policy=True)
    with pytest.raises(ValueError, match="policy must be None or 'auto'"):
        qcoll.quantized_all_reduce(x, policy="Auto")
    with pytest.raises(ValueError, match="policy must be None or 'auto'"):
        qcoll.delta_allgather(torch.empty(8), x, policy=1)
    with pytest.raises(ValueError, match="bits must be"):
        qcoll.quantized_allgather(torch.empty(8), x, policy="auto", bits=3)
    with pytest.raises(ValueError, match="policy must be None or 'auto'"):
        ZeroConfig(policy="fastest")


def test_plugins_take_auto():
    wrapped = take_policy("auto", qcoll.AllGatherPolicy(bits=4), ALL_GATHER)
    assert isinstance(wrapped, Auto) and wrapped.bits == 4
    assert wrapped.kwargs() == dict(bits=4, group_size=qcoll.DEFAULT_GROUP_SIZE, policy="auto")
    cfg = ZeroConfig(policy="auto")
    assert cfg.weight_policy.kwargs()["policy"] == "auto" and cfg.grad_policy.inter_bits == 4
    assert "policy" not in ZeroConfig().grad_policy.kwargs()
    with pytest.raises(TypeError, match="'auto' or None"):
        take_policy("fast", qcoll.AllGatherPolicy(), ALL_GATHER)


def _engine_losses(rank, world, fast):
    from qcoll.zero import ZeroEngine
    from tests.support.zero_helpers import OddNet, OptimizerFactory, oddnet_batch, train_engine

    out = {}
    for name, config in (("auto", ZeroConfig(compute_dtype=torch.float32, policy="auto")),
                         ("ZeRO-3 + hpZ", ZeroConfig(compute_dtype=torch.float32, qwz=False, qgz=False)),
                         ("ZeRO++", ZeroConfig(compute_dtype=torch.float32))):
        g = qcoll.new_group(node_size=NODE_SIZE)
        qcoll.cost_model(g, model=fast if fast else synthetic(inter_gbit=0.01))
        qcoll.reset_stats()
        torch.manual_seed(0)
        engine = ZeroEngine(OddNet(), OptimizerFactory("adamw"), g, config=config)
        out[name] = (train_engine(engine, lambda s: oddnet_batch(s, 8), 3, rank, world), qcoll.stats()["auto"])
        g.close()
    return out


@pytest.mark.parametrize("fast", [True, False])
def test_zero_engine_with_auto_trains_as_the_chosen_configuration(fast):
    """With a fast link auto runs every call uncompressed: the losses are ZeRO-3's (hpZ's
    backward gather of exact weights is exact); with a slow one every weight gather is
    quantized and the losses differ from ZeRO-3's. Both count their choices."""
    model = synthetic(inter_gbit=5000.0, intra_gbit=5000.0, kernel=1e6) if fast else None
    results = run_ranks(4, _engine_losses, model, timeout=240)
    for r in results[1:]:
        assert r == results[0]
    (auto, counts), (zero3, _), (zeropp, _) = (results[0][k] for k in ("auto", "ZeRO-3 + hpZ", "ZeRO++"))
    assert zero3 != zeropp
    if fast:
        assert auto == zero3
        assert set(counts) == {"allgather", "reduce_scatter"} and all(set(c) == {"uncompressed"} for c in counts.values())
    else:
        assert auto != zero3
        assert set(counts["allgather"]) == {"quantized"}
        assert all(name.startswith("quantized") for name in counts["reduce_scatter"])


def test_the_configured_call_is_kept_unless_another_is_clearly_faster():
    from qcoll.auto import KEEP_MARGIN, choose

    assert KEEP_MARGIN == pytest.approx(0.10)
    # [uncompressed, configured]: kept while at most 10% slower, replaced beyond.
    assert choose([1.0, 1.05], configured=1) == 1
    assert choose([1.0, 1.10], configured=1) == 1
    assert choose([1.0, 1.11], configured=1) == 0
    assert choose([1.2, 1.0], configured=1) == 1
    # Several paths: the fastest of the others only when it beats the configured one by
    # more than the margin; among equals, the first.
    assert choose([2.0, 1.0, 0.95, 0.8], configured=1) == 3
    assert choose([2.0, 1.0, 0.95, 0.95], configured=1) == 1
    assert choose([1.0, 1.0, 2.0], configured=None) == 0


def _allgather_choices(rank, world, models):
    out = {}
    for name, model in models.items():
        g = qcoll.new_group(node_size=NODE_SIZE)
        qcoll.cost_model(g, model=model)
        x = torch.randn(1000)
        qcoll.quantized_allgather(torch.empty(world * 1000), x, g, bits=8, policy="auto")
        out[name] = [d["choice"] for d in qcoll.auto.decisions(g).values()]
        g.close()
    return out


def test_auto_keeps_the_configured_call_within_the_margin():
    # Calibrations that make every all-gather take about 1 s uncompressed and 1.05 s or
    # 1.2 s quantized: 5% slower keeps the configured int8 call, 20% slower does not.
    import dataclasses

    from qcoll.cost import Calibration

    base = synthetic(inter_gbit=0.1)

    def model(quantized_s):
        return dataclasses.replace(base, calibration={"allgather/uncompressed": Calibration(1.0, 1e-9),
                                                      "allgather/quantized": Calibration(quantized_s, 1e-9)})
    results = run_ranks(4, _allgather_choices, {"close": model(1.05), "far": model(1.2)}, timeout=120)
    assert all(r == {"close": ["quantized"], "far": ["uncompressed"]} for r in results), results


def _reduce_scatter_paths(rank, world, models):
    out = {}
    for name, model in models.items():
        g = qcoll.new_group(node_size=NODE_SIZE)
        qcoll.cost_model(g, model=model)
        got, fixed = _calls(g, rank, world)
        out[name] = _which(got, fixed)["rs"]
        g.close()
    return out


def test_calibration_decides_between_the_paths():
    # The same rates (quantizing pays); a calibration that makes one path's calls 10x their
    # estimate sends auto down the other one.
    import dataclasses

    from qcoll.cost import Calibration

    base = synthetic(inter_gbit=0.1)
    models = {slow: dataclasses.replace(base, calibration={f"reduce_scatter/quantized {slow}": Calibration(0.0, 10.0)})
              for slow in ("flat", "2-hop")}
    results = run_ranks(4, _reduce_scatter_paths, models, timeout=240)
    assert all(r == results[0] for r in results)
    assert results[0]["flat"] == ["('rs', None, 8)"]  # the 2-hop call, bit for bit
    assert results[0]["2-hop"] == ["('rs', False, 8)"]  # the flat one

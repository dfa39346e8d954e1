"""qcoll.zero's public surface: ZeroConfig (defaults, validation naming the field, frozen),
ZeroEngine's arguments (group as None / ProcessGroup / qcoll.Group), zero_grad and
gradient accumulation, stats() keys, and hpZ secondary groups smaller than a node."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
import torch

import qcoll
from tests.support.distributed import run_ranks
from qcoll.zero import ZeroConfig, ZeroEngine
from tests.support.zero_helpers import ALL_OFF_FP32, OptimizerFactory, assert_same_but_call_checks, gpt, lm_loss

WORLD, NODE_SIZE = 4, 2
CFG = gpt.GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, d_model=16)
STAT_KEYS = {"forward_allgather", "backward_allgather", "reduce_scatter"}
# Two emulated hosts of two ranks each, so group=None and a bare ProcessGroup see 2 nodes.
ENV = {r: {"LOCAL_WORLD_SIZE": str(NODE_SIZE), "QCOLL_HOST_ID": f"host{r // NODE_SIZE}"} for r in range(WORLD)}


# ---- ZeroConfig -----------------------------------------------------------------------------
def test_defaults_follow_the_contract():
    c = ZeroConfig()
    assert (c.qwz, c.hpz, c.qgz, c.prefetch) == (True, True, True, True)
    assert c.compute_dtype == torch.bfloat16
    assert (c.weight_bits, c.grad_intra_bits, c.grad_inter_bits) == (8, 8, 4)
    assert c.hpz_group_size is None and c.max_grad_norm is None


def test_config_is_frozen():
    c = ZeroConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.qwz = False
    assert dataclasses.replace(c, qwz=False).qwz is False


@pytest.mark.parametrize("field,value", [
    ("compute_dtype", torch.float64),
    ("compute_dtype", torch.int8),
    ("compute_dtype", "bf16"),
    ("weight_bits", 2),
    ("weight_bits", None),
    ("weight_bits", True),
    ("grad_intra_bits", 16),
    ("grad_inter_bits", 3),
    ("grad_pipeline_stages", 0),
    ("grad_pipeline_stages", 1.5),
    ("hpz_group_size", 0),
    ("hpz_group_size", 2.0),
    ("hpz_group_size", True),
    ("max_grad_norm", 0.0),
    ("max_grad_norm", -1.0),
    ("loss_scale", 0.0),
    ("loss_scale", -2.0),
    ("initial_loss_scale", 0.0),
    ("loss_scale_window", 0),
    ("max_grad_norm", "1.0"),  # compared, a string failed with Python's own words, naming no field
    ("max_grad_norm", True),
    ("loss_scale", "128"),
    ("initial_loss_scale", None),
    ("group_size", 100),
    ("group_size", 0),
    ("qwz", "yes"),
    ("hpz", 1),
    ("qgz", None),
    ("prefetch", "no"),
])
def test_invalid_values_raise_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        ZeroConfig(**{field: value})


@pytest.mark.parametrize("kwargs", [
    dict(weight_bits=4, grad_intra_bits=4, grad_inter_bits=8),
    dict(compute_dtype=torch.float16, loss_scale=128.0),
    dict(compute_dtype=torch.float32, max_grad_norm=1.0, group_size=64, grad_pipeline_stages=3),
    dict(hpz_group_size=1),
    dict(max_grad_norm=np.float32(0.5), initial_loss_scale=np.int64(1024)),  # numpy's reals too
])
def test_valid_values_accepted(kwargs):
    c = ZeroConfig(**kwargs)
    for k, v in kwargs.items():
        assert getattr(c, k) == v


def test_stage_defaults():
    assert ZeroConfig().stage == 3 and ZeroConfig().hpz is True and ZeroConfig().qwd is False
    c = ZeroConfig(stage=2, qwd=True, weight_bits=4, grad_hadamard=True)
    assert (c.stage, c.hpz, c.qwd, c.grad_hadamard) == (2, False, True, True)


@pytest.mark.parametrize("kwargs,words", [
    (dict(stage=1), "stage"),
    (dict(stage=True), "stage"),
    (dict(stage=2, hpz=True), "hpz=True does not apply to stage=2"),
    (dict(stage=2, hpz_group_size=2), "hpz_group_size"),
    (dict(qwd=True), "qwd=True needs stage=2"),
    (dict(stage=2, qwd=True, qwz=False), "qwd=True needs qwz=True"),
    (dict(grad_hadamard=True, qgz=False), "grad_hadamard=True needs qgz=True"),
    (dict(qwd=1, stage=2), "qwd"),
    (dict(grad_hadamard="yes"), "grad_hadamard"),
    (dict(overlap_publish=True), "overlap_publish=True needs stage=2"),
    (dict(stage=2, overlap_publish=1), "overlap_publish"),
])
def test_switches_that_do_not_apply_to_the_stage_raise(kwargs, words):
    with pytest.raises(ValueError, match=words):
        ZeroConfig(**kwargs)


def test_engine_rejects_a_config_that_is_not_a_zeroconfig():
    with pytest.raises(TypeError, match="config"):
        ZeroEngine(torch.nn.Linear(2, 2), torch.optim.SGD, config={"qwz": False})


def test_engine_rejects_a_model_or_factory_of_the_wrong_kind_before_any_group():
    # Raised before resolve_group (no process group is initialized here).
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got str"):
        ZeroEngine("gpt", torch.optim.SGD)
    with pytest.raises(TypeError, match="optimizer_factory must be a callable"):
        ZeroEngine(torch.nn.Linear(2, 2), "adamw")


# ---- engines on 4 ranks ------------------------------------------------------------------
def _batch(step):
    return gpt.MarkovLanguage(CFG.vocab_size).batch(step, 2 * WORLD, CFG.block_size)


def _one_step(engine, rank, step=0):
    x, y = _batch(step)
    engine.zero_grad()
    loss = lm_loss(engine(x.chunk(WORLD)[rank]), y.chunk(WORLD)[rank])
    engine.backward(loss)
    engine.step()
    return loss.item()


def _engine(group, **kwargs):
    torch.manual_seed(0)
    return ZeroEngine(gpt.GPT(CFG), OptimizerFactory("adamw"), group, config=ZeroConfig(**kwargs))


def _worker(rank, world):
    import torch.distributed as dist

    out = {}
    # The same training through each way of naming the group: same losses, same bytes.
    groups = {"none": None, "process_group": dist.group.WORLD, "qcoll_group": qcoll.new_group(node_size=NODE_SIZE)}
    for name, group in groups.items():
        engine = _engine(group)
        losses = [_one_step(engine, rank, s) for s in range(2)]
        out[name] = dict(losses=losses, stats=engine.stats(), node_size=engine.group.node_size,
                         state=engine.full_state_dict())

    # zero_grad: gradients accumulate over backward() calls until zero_grad().
    engine = _engine(None, **ALL_OFF_FP32)
    x, y = _batch(0)
    xs, ys = x.chunk(WORLD)[rank], y.chunk(WORLD)[rank]
    engine.backward(lm_loss(engine(xs), ys))
    once = [u.master.grad.clone() for u in engine.flat_params]
    engine.backward(lm_loss(engine(xs), ys))
    twice = [u.master.grad.clone() for u in engine.flat_params]
    engine.zero_grad()
    cleared = all(u.master.grad is None for u in engine.flat_params)
    before = engine.full_state_dict()
    engine.step()  # nothing to apply
    after = engine.full_state_dict()
    out["zero_grad"] = dict(once=once, twice=twice, cleared=cleared,
                            unchanged=all(torch.equal(before[k], after[k]) for k in before))

    # hpZ secondary partitions over fewer ranks than a node.
    for size in (1, 2):
        engine = _engine(None, hpz_group_size=size)
        losses = [_one_step(engine, rank, s) for s in range(2)]
        out[f"hpz{size}"] = dict(losses=losses, stats=engine.stats())

    # SDP4Bit's switches: Hadamard-smoothed gradients (stage 3), and stage 2 with qWD.
    for name, kwargs in (("hadamard", dict(grad_hadamard=True)),
                         ("sdp4bit", dict(stage=2, qwd=True, weight_bits=4, grad_hadamard=True))):
        engine = _engine(None, **kwargs)
        started = engine.stats()  # stage 2: the unquantized all-gather that starts the replicas
        losses = [_one_step(engine, rank, s) for s in range(2)]
        out[name] = dict(losses=losses, stats=engine.stats(), state=engine.full_state_dict(), started=started)

    # Stage 2 with the weights' all-gathers left in flight by step(): the same training.
    engine = _engine(None, stage=2, qwd=True, weight_bits=4, grad_hadamard=True, overlap_publish=True)
    losses = [_one_step(engine, rank, s) for s in range(2)]
    pending = sorted(engine._publishing)  # after the last step(): still in flight
    engine.wait_weights()
    weights = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    out["sdp4bit_overlap"] = dict(losses=losses, stats=engine.stats(), state=engine.full_state_dict(),
                                  pending=pending, left=len(engine._publishing), weights=weights,
                                  trainable=sorted(f.index for f in engine.flat_params if f.requires_grad))

    # An hpZ group size that does not divide the node size: a clear error on every rank.
    try:
        _engine(None, hpz_group_size=3)
        out["hpz3"] = None
    except ValueError as e:
        out["hpz3"] = str(e)
    return out


@functools.lru_cache(maxsize=None)
def _runs():
    return run_ranks(WORLD, _worker, env=ENV, timeout=240)


def test_group_none_processgroup_and_qcoll_group_agree():
    for r in _runs():
        base = r["qcoll_group"]
        for name in ("none", "process_group"):
            assert r[name]["node_size"] == NODE_SIZE  # from LOCAL_WORLD_SIZE / the host ids
            assert r[name]["losses"] == base["losses"], name
            # One Group serves both (resolve_group's cache): the second skips the call checks.
            assert_same_but_call_checks(r[name]["stats"], base["stats"], name)
            for k, v in base["state"].items():
                assert torch.equal(r[name]["state"][k], v), (name, k)


def test_stats_keys_and_fields():
    for r in _runs():
        stats = r["none"]["stats"]
        assert set(stats) == STAT_KEYS
        for value in stats.values():
            assert set(value) == {"calls", "intra_bytes", "inter_bytes"}
            assert value["calls"] > 0 and value["intra_bytes"] > 0


def test_zero_grad_and_accumulation():
    for r in _runs():
        z = r["zero_grad"]
        assert len(z["once"]) > 0
        for g1, g2 in zip(z["once"], z["twice"]):
            assert torch.equal(g2, 2 * g1)  # the same gradient added twice, in fp32
        assert z["cleared"] and z["unchanged"]


def test_hpz_group_smaller_than_node():
    for r in _runs():
        # The secondary shard holds exactly what forward used, whatever its group size.
        assert r["hpz1"]["losses"] == r["hpz2"]["losses"] == r["none"]["losses"]
        one, node = r["hpz1"]["stats"]["backward_allgather"], r["hpz2"]["stats"]["backward_allgather"]
        assert one["inter_bytes"] == 0 and one["intra_bytes"] == 0  # a group of one: local copy
        assert node["inter_bytes"] == 0 and node["intra_bytes"] > 0
        assert one["calls"] == node["calls"]
        assert r["hpz1"]["stats"]["forward_allgather"] == r["hpz2"]["stats"]["forward_allgather"]


def test_grad_hadamard_reaches_the_reduce_scatter():
    """Same bytes, other (smoothed) gradient codes: the weights differ after a step, but
    the training stays close to the unsmoothed one."""
    for r in _runs():
        had, base = r["hadamard"], r["none"]
        assert had["stats"]["reduce_scatter"] == base["stats"]["reduce_scatter"]
        assert had["losses"][0] == base["losses"][0]  # the same first forward
        assert any(not torch.equal(had["state"][k], base["state"][k]) for k in base["state"])
        assert had["losses"][1] == pytest.approx(base["losses"][1], rel=0.05)


def test_stage2_qwd_engine_on_two_nodes():
    """Stage 2: no backward gather; per step only the int4 differences of the updated weights
    cross nodes: about half of stage 3's int8 forward gathers (hpZ's backward ones stay in
    the node)."""
    for r in _runs():
        sdp, base = r["sdp4bit"]["stats"], r["none"]["stats"]
        started = r["sdp4bit"]["started"]["forward_allgather"]
        assert sdp["backward_allgather"]["calls"] == 0 and started["calls"] > 0
        per_steps = sdp["forward_allgather"]["inter_bytes"] - started["inter_bytes"]
        assert 0 < per_steps < 0.6 * base["forward_allgather"]["inter_bytes"]
        assert r["sdp4bit"]["losses"][0] == pytest.approx(r["none"]["losses"][0], rel=1e-2)


def test_hpz_group_size_must_divide_node_size():
    for r in _runs():
        assert r["hpz3"] is not None and "hpz_group_size" in r["hpz3"]


def test_stage2_overlap_publish_trains_the_same():
    """overlap_publish: step() leaves every trainable unit's all-gather in flight, each
    forward waits for its own, and the training is bit for bit the waiting one's."""
    for r in _runs():
        ovl, base = r["sdp4bit_overlap"], r["sdp4bit"]
        assert ovl["pending"] == ovl["trainable"] and ovl["left"] == 0
        assert ovl["losses"] == base["losses"]
        assert_same_but_call_checks(ovl["stats"], base["stats"])
        for k, v in base["state"].items():
            assert torch.equal(ovl["state"][k], v), k
    # The replicas' weights agree after wait_weights() (every rank decoded the same bytes).
    first = _runs()[0]["sdp4bit_overlap"]["weights"]
    for r in _runs()[1:]:
        for name, w in r["sdp4bit_overlap"]["weights"].items():
            assert torch.equal(w, first[name]), name

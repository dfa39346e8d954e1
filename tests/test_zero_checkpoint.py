"""ZeroEngine checkpoints through torch.distributed.checkpoint (DCP): saved on 4 ranks as
2 nodes x 2, resumed on 4, on 6 (3 x 2), on 2 and on 1.

- Same size: 10 steps, dcp.save(engine.state_dict()), a new process group, a new model (other
  seed), engine and optimizer, dcp.load + load_state_dict(), 10 more steps: losses and weights
  bit-identical to 20 steps straight (ZeRO++ bf16 with clipping; fp16 with dynamic loss
  scaling, whose scale changes along the way; stage 2 with qWD int4 weights). The same state
  dict saved per rank with torch.save and loaded with torch.load restores the same state.
- Other sizes: the loaded engine holds exactly the saved weights (full_state_dict), optimizer
  state (every state tensor gathered whole by the test itself), resident weights (stage 2),
  loss scale and step count, and trains on like the straight run.
- A checkpoint of another config, model or optimizer raises naming the difference, and the
  engine is left exactly as it was.
- load_full_state_dict(): full_state_dict() of the 4-rank run, and a single process's
  state_dict(), onto 2 ranks; bad state dicts raise naming the keys.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

from checkpoints import same, scratch
from distributed import run_ranks
from zero_helpers import OddNet, OptimizerFactory, gpt, lm_loss, oddnet_batch

WORLD, NODE_SIZE = 4, 2
CFG = gpt.GPTConfig(vocab_size=16, block_size=8, n_layer=2, n_head=2, d_model=16)
OTHER_CFG = gpt.GPTConfig(vocab_size=16, block_size=8, n_layer=2, n_head=2, d_model=32)
GLOBAL_BATCH, HALF, ON = 12, 10, 4  # 12 rows split over 2, 4 and 6 ranks; ON: steps after a resize
SCENARIOS = {
    "zeropp_bf16": dict(compute_dtype=torch.bfloat16, max_grad_norm=1.0),
    "zeropp_fp16": dict(compute_dtype=torch.float16, initial_loss_scale=2.0**20, loss_scale_window=4),
    # Stage 2 with qWD: the resident weights carry the quantization of the last steps'
    # differences, so the checkpoint must restore them, not re-derive them from the masters.
    "sdp4bit_bf16": dict(stage=2, qwd=True, weight_bits=4, compute_dtype=torch.bfloat16),
}


def _batch(step):
    return gpt.MarkovLanguage(CFG.vocab_size).batch(step, GLOBAL_BATCH, CFG.block_size)


def _engine(group, seed=0, cfg=CFG, optimizer="adamw", **kwargs):
    from qcoll.zero import ZeroConfig, ZeroEngine

    torch.manual_seed(seed)
    return ZeroEngine(gpt.GPT(cfg), OptimizerFactory(optimizer), group, config=ZeroConfig(**kwargs))


def _train(engine, steps, rank, world):
    losses = []
    for s in steps:
        x, y = _batch(s)
        engine.zero_grad()
        loss = lm_loss(engine(x.chunk(world)[rank]), y.chunk(world)[rank])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _global_losses(engine, steps, rank, world):
    """The mean loss over the ranks per step (comparable across world sizes)."""
    import torch.distributed as dist

    local = torch.tensor(_train(engine, steps, rank, world), dtype=torch.float64) * (GLOBAL_BATCH // world)
    dist.all_reduce(local)
    return (local / GLOBAL_BATCH).tolist()


def _optimizer_full(engine):
    """Every optimizer state of every flat buffer, gathered whole over the ranks by plain
    all-gathers (padding cut off): independent of the checkpoint code."""
    import torch.distributed as dist

    out = {}
    for i, flat in enumerate(engine.flat_params):
        for name, value in engine.optimizer.state.get(flat.master, {}).items():
            if torch.is_tensor(value) and value.shape == flat.master.shape:
                whole = torch.empty(flat.padded_numel, dtype=value.dtype)
                dist.all_gather_single(whole, value.contiguous(), group=engine.group.pg)
                out[(i, name)] = whole[:flat.numel]
            else:
                out[(i, name)] = value.clone() if torch.is_tensor(value) else value
    return out


def _resident(engine):
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()} if engine.resident else None


def _snapshot(engine):
    """Everything a rejected load must leave alone."""
    return (engine.full_state_dict(), [f.master.detach().clone() for f in engine.flat_params],
            _optimizer_full(engine), engine.optimizer.state_dict()["param_groups"],
            engine.scaler.state_dict(), engine.steps)


def _load(engine, path):
    import torch.distributed.checkpoint as dcp

    sd = engine.state_dict()
    dcp.load(sd, checkpoint_id=path)
    engine.load_state_dict(sd)


def _rejected(engine, load):
    from torch.distributed.checkpoint.api import CheckpointException

    before = _snapshot(engine)
    try:
        load()
        message = None
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        message = f"{type(e).__name__}: {e}"
    return message, same(before, _snapshot(engine))


def _worker_4(rank, world, tmp):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import qcoll

    out = {}
    for name, kwargs in SCENARIOS.items():
        straight = _engine(qcoll.new_group(node_size=NODE_SIZE), **kwargs)
        losses = _global_losses(straight, range(2 * HALF), rank, world)
        out[name] = dict(straight=(losses, straight.full_state_dict(), straight.loss_scale))

        first = _engine(qcoll.new_group(dist.new_group(list(range(world))), node_size=NODE_SIZE), **kwargs)
        losses = _global_losses(first, range(HALF), rank, world)
        dcp.save(first.state_dict(), checkpoint_id=os.path.join(tmp, name))
        per_rank = os.path.join(tmp, f"{name}.rank{rank}.pt")
        torch.save(first.state_dict(), per_rank)  # the earlier way, at the same world size
        out[name]["saved"] = (first.full_state_dict(), _optimizer_full(first), _resident(first),
                              first.loss_scale, first.steps)
        del first

        by_torch_load = _engine(qcoll.new_group(dist.new_group(list(range(world))), node_size=NODE_SIZE), seed=3,
                                **kwargs)
        by_torch_load.load_state_dict(torch.load(per_rank))
        out[name]["torch_load"] = (by_torch_load.full_state_dict(), _optimizer_full(by_torch_load),
                                   _resident(by_torch_load), by_torch_load.loss_scale, by_torch_load.steps)
        del by_torch_load

        resumed = _engine(qcoll.new_group(dist.new_group(list(range(world))), node_size=NODE_SIZE), seed=1,
                          **kwargs)
        _load(resumed, os.path.join(tmp, name))
        losses += _global_losses(resumed, range(HALF, 2 * HALF), rank, world)
        out[name]["resumed"] = (losses, resumed.full_state_dict(), resumed.loss_scale, resumed.steps)

    # Mismatches, against the bf16 checkpoint, on a trained engine (optimizer state present).
    group = qcoll.new_group(node_size=NODE_SIZE)
    path = os.path.join(tmp, "zeropp_bf16")
    cases = {
        "config": _engine(group, **dict(SCENARIOS["zeropp_bf16"], qgz=False)),
        "model": _engine(group, cfg=OTHER_CFG, **SCENARIOS["zeropp_bf16"]),
        "optimizer": _engine(group, optimizer="sgd", **SCENARIOS["zeropp_bf16"]),
    }
    out["mismatch"] = {}
    for case, engine in cases.items():
        _train(engine, range(1), rank, world)
        out["mismatch"][case] = _rejected(engine, lambda: _load(engine, path))
    engine = _engine(group, **SCENARIOS["zeropp_bf16"])
    out["mismatch"]["not_a_checkpoint"] = _rejected(engine, lambda: engine.load_state_dict({"weights": 1}))
    out["mismatch"]["older_format"] = _rejected(
        engine, lambda: engine.load_state_dict({"format": "qcoll.zero.ZeroEngine/1", "master": []}))
    return out


def _worker_resized(rank, world, node_size, tmp):
    """The 4-rank checkpoints loaded on another world size, then ON steps more."""
    import qcoll

    out = {}
    for name, kwargs in SCENARIOS.items():
        engine = _engine(qcoll.new_group(node_size=node_size), seed=2, **kwargs)
        _load(engine, os.path.join(tmp, name))
        loaded = (engine.full_state_dict(), _optimizer_full(engine), _resident(engine), engine.loss_scale,
                  engine.steps)
        out[name] = dict(loaded=loaded, losses=_global_losses(engine, range(HALF, HALF + ON), rank, world))
    return out


def _worker_full(rank, world, tmp):
    import qcoll

    group = qcoll.new_group(node_size=world)
    out = {}
    engine = _engine(group, **SCENARIOS["zeropp_bf16"])
    _train(engine, range(1), rank, world)
    full = torch.load(os.path.join(tmp, "zeropp_bf16.full.pt"))
    engine.load_full_state_dict(full)
    out["full_from_4_ranks"] = (full, engine.full_state_dict())

    torch.manual_seed(5)
    single = gpt.GPT(CFG).state_dict()
    engine.load_full_state_dict(single)
    out["full_from_one_process"] = (single, engine.full_state_dict())

    load = lambda state: lambda: engine.load_full_state_dict(state)  # noqa: E731
    out["missing"] = _rejected(engine, load({k: v for k, v in single.items() if k != "blocks.1.mlp.fc.bias"}))
    out["unexpected"] = _rejected(engine, load(dict(single, extra=torch.zeros(1))))
    out["shape"] = _rejected(engine, load(dict(single, **{"ln_f.weight": torch.ones(3)})))
    out["tied_differ"] = _rejected(engine, load(dict(single, **{"head.weight": single["wte.weight"] + 1})))
    return out


def _odd_engine(group, seed):
    from qcoll.zero import ZeroConfig, ZeroEngine

    torch.manual_seed(seed)
    return ZeroEngine(OddNet(), OptimizerFactory("adamw"), group, config=ZeroConfig(unit_modules=(torch.nn.Linear,)))


def _worker_odd_save(rank, world, tmp):
    """OddNet (frozen buffers next to trainable ones, a 0-dim, an empty and an unused
    parameter, a tied head; prime sizes): saved before its first step and after three."""
    import torch.distributed.checkpoint as dcp

    import qcoll

    engine = _odd_engine(qcoll.new_group(node_size=world), seed=0)
    dcp.save(engine.state_dict(), checkpoint_id=os.path.join(tmp, "odd_fresh"))
    fresh = engine.full_state_dict()
    for step in range(3):
        x, y = oddnet_batch(step, 2 * world)
        engine.zero_grad()
        engine.backward(lm_loss(engine(x.chunk(world)[rank]), y.chunk(world)[rank]))
        engine.step()
    dcp.save(engine.state_dict(), checkpoint_id=os.path.join(tmp, "odd_trained"))
    return fresh, (engine.full_state_dict(), _optimizer_full(engine), engine.steps)


def _worker_odd_load(rank, world, tmp):
    import qcoll

    engine = _odd_engine(qcoll.new_group(node_size=1), seed=1)
    _load(engine, os.path.join(tmp, "odd_trained"))
    trained = (engine.full_state_dict(), _optimizer_full(engine), engine.steps)
    _load(engine, os.path.join(tmp, "odd_fresh"))  # a checkpoint without optimizer state
    return trained, (engine.full_state_dict(), len(engine.optimizer.state), engine.steps)


def test_odd_model_from_2_ranks_onto_3_before_and_after_its_first_step():
    saved = run_ranks(2, _worker_odd_save, _dir(), timeout=240)[0]
    for trained, (fresh, optimizer_entries, steps) in run_ranks(3, _worker_odd_load, _dir(), timeout=240):
        assert same(trained, saved[1]) and saved[1][1] and saved[1][2] == 3
        assert same(fresh, saved[0]) and optimizer_entries == 0 and steps == 0


def _dir():
    return scratch("qcoll-zero-ckpt-")


@functools.lru_cache(maxsize=None)
def _runs(world):
    if world == WORLD:
        runs = run_ranks(WORLD, _worker_4, _dir(), timeout=300)
        torch.save(runs[0]["zeropp_bf16"]["saved"][0], os.path.join(_dir(), "zeropp_bf16.full.pt"))
        return runs
    _runs(WORLD)  # writes the checkpoints
    return run_ranks(world, _worker_resized, min(NODE_SIZE, world), _dir(), timeout=300)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_same_size_resume_is_bit_identical(name):
    for rank, result in enumerate(_runs(WORLD)):
        (want_losses, want_state, want_scale), (losses, state, scale, steps) = \
            result[name]["straight"], result[name]["resumed"]
        assert losses == want_losses, (rank, losses, want_losses)
        assert scale == want_scale and steps <= 2 * HALF
        assert state.keys() == want_state.keys()
        for key, value in want_state.items():
            assert torch.equal(state[key], value), (rank, key)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_per_rank_torch_save_still_resumes_at_the_same_size(name):
    for rank, result in enumerate(_runs(WORLD)):
        assert same(result[name]["torch_load"], result[name]["saved"]), (rank, name)


def test_fp16_scenario_changed_the_loss_scale():
    """The fp16 run really exercises the scaler: its scale moved from the initial value."""
    assert _runs(WORLD)[0]["zeropp_fp16"]["straight"][2] != 2.0**20


@pytest.mark.parametrize("world", [6, 2, 1], ids=["6_ranks_3x2", "2_ranks", "1_rank"])
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_resume_on_another_world_size_restores_exactly_and_trains_on(name, world):
    saved = _runs(WORLD)[0][name]["saved"]
    straight = _runs(WORLD)[0][name]["straight"][0]
    for rank, result in enumerate(_runs(world)):
        loaded = result[name]["loaded"]
        assert same(loaded, saved), (rank, name)  # weights, optimizer, resident weights, scale, steps
        assert saved[1], "the optimizer state is there to compare"
        # Training goes on like the 4-rank run (other partitions quantize in other groups).
        losses = result[name]["losses"]
        assert losses == pytest.approx(straight[HALF:HALF + ON], rel=0.02), (losses, straight)


@pytest.mark.parametrize("case,words", [
    ("config", ["ZeroConfig differs", "qgz"]),
    ("model", ["Size mismatch", "model."]),  # DCP's planner: names the unit's buffer
    ("optimizer", ["optim."]),
    ("not_a_checkpoint", ["not a ZeroEngine"]),
    ("older_format", ["earlier qcoll", "load_full_state_dict"]),
])
def test_mismatch_raises_naming_it_and_changes_nothing(case, words):
    for result in _runs(WORLD):
        message, unchanged = result["mismatch"][case]
        assert message is not None, case
        for word in words:
            assert word in message, (case, message)
        assert unchanged, case


@functools.lru_cache(maxsize=None)
def _full_runs():
    _runs(WORLD)
    return run_ranks(2, _worker_full, _dir(), timeout=240)


@pytest.mark.parametrize("source", ["full_from_4_ranks", "full_from_one_process"])
def test_load_full_state_dict_onto_another_world_size(source):
    for result in _full_runs():
        want, got = result[source]
        assert got.keys() == want.keys()
        for key, value in want.items():
            assert torch.equal(got[key], value.float()), key


@pytest.mark.parametrize("case,word", [("missing", "blocks.1.mlp.fc.bias"), ("unexpected", "extra"),
                                       ("shape", "ln_f.weight"), ("tied_differ", "tied")])
def test_bad_full_state_dict_raises_and_changes_nothing(case, word):
    for result in _full_runs():
        message, unchanged = result[case]
        assert message is not None and word in message, (case, message)
        assert unchanged, case

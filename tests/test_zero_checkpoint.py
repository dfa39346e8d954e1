"""ZeroEngine checkpoints, 4 ranks as 2 nodes x 2 (and 2 ranks for other world sizes).

- Resume: 10 steps, state_dict() saved per rank with torch.save, a new process group, a new
  model (other seed), engine and optimizer, load_state_dict(), 10 more steps: losses and
  weights bit-identical to 20 steps straight (ZeRO++ bf16 with clipping; fp16 with dynamic
  loss scaling, whose scale changes along the way; stage 2 with qWD int4 weights).
- A checkpoint of another config, model, rank or world size raises ValueError naming the
  mismatch, and the engine is left exactly as it was.
- load_full_state_dict(): full_state_dict() of the 4-rank run, and a single process's
  state_dict(), onto 2 ranks; bad state dicts raise naming the keys.
"""

from __future__ import annotations

import functools
import os
import tempfile

import pytest
import torch

from distributed import run_ranks
from zero_helpers import OptimizerFactory, gpt, lm_loss

WORLD, NODE_SIZE = 4, 2
CFG = gpt.GPTConfig(vocab_size=16, block_size=8, n_layer=2, n_head=2, d_model=16)
OTHER_CFG = gpt.GPTConfig(vocab_size=16, block_size=8, n_layer=2, n_head=2, d_model=32)
PER_RANK, HALF = 2, 10
SCENARIOS = {
    "zeropp_bf16": dict(compute_dtype=torch.bfloat16, max_grad_norm=1.0),
    "zeropp_fp16": dict(compute_dtype=torch.float16, initial_loss_scale=2.0**20, loss_scale_window=4),
    # Stage 2 with qWD: the resident weights carry the quantization of the last steps'
    # differences, so the checkpoint must restore them, not re-derive them from the masters.
    "sdp4bit_bf16": dict(stage=2, qwd=True, weight_bits=4, compute_dtype=torch.bfloat16),
}


def _batch(step, world):
    return gpt.MarkovLanguage(CFG.vocab_size).batch(step, PER_RANK * world, CFG.block_size)


def _engine(group, seed=0, cfg=CFG, **kwargs):
    from qcoll.zero import ZeroConfig, ZeroEngine

    torch.manual_seed(seed)
    return ZeroEngine(gpt.GPT(cfg), OptimizerFactory("adamw"), group, config=ZeroConfig(**kwargs))


def _train(engine, steps, rank, world):
    losses = []
    for s in steps:
        x, y = _batch(s, world)
        engine.zero_grad()
        loss = lm_loss(engine(x.chunk(world)[rank]), y.chunk(world)[rank])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _snapshot(engine):
    """Everything a rejected load must leave alone."""
    opt = engine.optimizer.state_dict()
    return (engine.full_state_dict(), [f.master.detach().clone() for f in engine.flat_params],
            {k: {n: v.clone() for n, v in s.items()} for k, s in opt["state"].items()},
            engine.scaler.state_dict(), engine.steps)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _rejected(engine, state, load="load_state_dict"):
    before = _snapshot(engine)
    try:
        getattr(engine, load)(state)
        message = None
    except ValueError as e:
        message = str(e)
    return message, _same(before, _snapshot(engine))


def _worker_4(rank, world, tmp):
    import torch.distributed as dist

    import qcoll

    out = {}
    for name, kwargs in SCENARIOS.items():
        straight = _engine(qcoll.new_group(node_size=NODE_SIZE), **kwargs)
        losses = _train(straight, range(2 * HALF), rank, world)
        out[name] = dict(straight=(losses, straight.full_state_dict(), straight.loss_scale))

        first = _engine(qcoll.new_group(dist.new_group(list(range(world))), node_size=NODE_SIZE), **kwargs)
        losses = _train(first, range(HALF), rank, world)
        path = os.path.join(tmp, f"{name}.rank{rank}.pt")
        torch.save(first.state_dict(), path)
        full = first.full_state_dict()  # a collective: every rank
        if rank == 0:
            torch.save(full, os.path.join(tmp, f"{name}.full.pt"))
        del first

        resumed = _engine(qcoll.new_group(dist.new_group(list(range(world))), node_size=NODE_SIZE), seed=1,
                          **kwargs)
        resumed.load_state_dict(torch.load(path))
        losses += _train(resumed, range(HALF, 2 * HALF), rank, world)
        out[name]["resumed"] = (losses, resumed.full_state_dict(), resumed.loss_scale, resumed.steps)

    # Mismatches, against the bf16 checkpoint, on a trained engine (optimizer state present).
    group = qcoll.new_group(node_size=NODE_SIZE)
    state = torch.load(os.path.join(tmp, f"zeropp_bf16.rank{rank}.pt"))
    other_rank = torch.load(os.path.join(tmp, f"zeropp_bf16.rank{(rank + 1) % world}.pt"))
    cases = {
        "config": (_engine(group, **dict(SCENARIOS["zeropp_bf16"], qgz=False)), state),
        "model": (_engine(group, cfg=OTHER_CFG, **SCENARIOS["zeropp_bf16"]), state),
        "rank": (_engine(group, **SCENARIOS["zeropp_bf16"]), other_rank),
        "not_a_checkpoint": (_engine(group, **SCENARIOS["zeropp_bf16"]), {"weights": 1}),
        "optimizer": (_engine(group, **SCENARIOS["zeropp_bf16"]), dict(state, optimizer=torch.optim.SGD(
            [torch.nn.Parameter(torch.zeros(1))], lr=0.1, momentum=0.9).state_dict())),
    }
    out["mismatch"] = {}
    for case, (engine, bad) in cases.items():
        _train(engine, range(1), rank, world)
        out["mismatch"][case] = _rejected(engine, bad)
    return out


def _worker_2(rank, world, tmp):
    import qcoll

    group = qcoll.new_group(node_size=world)
    out = {}
    engine = _engine(group, **SCENARIOS["zeropp_bf16"])
    _train(engine, range(1), rank, world)
    out["world_size"] = _rejected(engine, torch.load(os.path.join(tmp, f"zeropp_bf16.rank{rank}.pt")))

    full = torch.load(os.path.join(tmp, "zeropp_bf16.full.pt"))
    engine.load_full_state_dict(full)
    out["full_from_4_ranks"] = (full, engine.full_state_dict())

    torch.manual_seed(5)
    single = gpt.GPT(CFG).state_dict()
    engine.load_full_state_dict(single)
    out["full_from_one_process"] = (single, engine.full_state_dict())

    out["missing"] = _rejected(engine, {k: v for k, v in single.items() if k != "blocks.1.mlp.fc.bias"},
                               "load_full_state_dict")
    out["unexpected"] = _rejected(engine, dict(single, extra=torch.zeros(1)), "load_full_state_dict")
    out["shape"] = _rejected(engine, dict(single, **{"ln_f.weight": torch.ones(3)}), "load_full_state_dict")
    out["tied_differ"] = _rejected(engine, dict(single, **{"head.weight": single["wte.weight"] + 1}),
                                   "load_full_state_dict")
    return out


@functools.lru_cache(maxsize=None)
def _tmp():
    return tempfile.mkdtemp(prefix="qcoll-zero-ckpt-")


@functools.lru_cache(maxsize=None)
def _runs(world):
    if world == 2:
        _runs(4)  # writes the checkpoints
        return run_ranks(2, _worker_2, _tmp(), timeout=240)
    return run_ranks(WORLD, _worker_4, _tmp(), timeout=240)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_resume_is_bit_identical(name):
    for rank, result in enumerate(_runs(4)):
        (want_losses, want_state, want_scale), (losses, state, scale, steps) = \
            result[name]["straight"], result[name]["resumed"]
        assert losses == want_losses, (rank, losses, want_losses)
        assert scale == want_scale and steps <= 2 * HALF
        assert state.keys() == want_state.keys()
        for key, value in want_state.items():
            assert torch.equal(state[key], value), (rank, key)


def test_fp16_scenario_changed_the_loss_scale():
    """The fp16 run really exercises the scaler: its scale moved from the initial value."""
    assert _runs(4)[0]["zeropp_fp16"]["straight"][2] != 2.0**20


@pytest.mark.parametrize("case,words", [
    ("config", ["qgz"]), ("rank", ["rank"]),
    ("model", ["another model", "wte.weight[16, 16] there and wte.weight[16, 32] here"]),
    ("not_a_checkpoint", ["not a ZeroEngine"]), ("optimizer", ["optimizer"]),
])
def test_mismatch_raises_naming_it_and_changes_nothing(case, words):
    for result in _runs(4):
        message, unchanged = result["mismatch"][case]
        assert message is not None, case
        for word in words:
            assert word in message, (case, message)
        assert unchanged, case


def test_other_world_size_raises_and_changes_nothing():
    for result in _runs(2):
        message, unchanged = result["world_size"]
        assert message is not None and "world_size 4" in message and "load_full_state_dict" in message
        assert unchanged


@pytest.mark.parametrize("source", ["full_from_4_ranks", "full_from_one_process"])
def test_load_full_state_dict_onto_another_world_size(source):
    for result in _runs(2):
        want, got = result[source]
        assert got.keys() == want.keys()
        for key, value in want.items():
            assert torch.equal(got[key], value.float()), key


@pytest.mark.parametrize("case,word", [("missing", "blocks.1.mlp.fc.bias"), ("unexpected", "extra"),
                                       ("shape", "ln_f.weight"), ("tied_differ", "tied")])
def test_bad_full_state_dict_raises_and_changes_nothing(case, word):
    for result in _runs(2):
        message, unchanged = result[case]
        assert message is not None and word in message, (case, message)
        assert unchanged, case

"""FSDP2 + qcoll checkpoints through torch.distributed.checkpoint exactly like FSDP2 alone.

Saved on 4 gloo ranks as 2 nodes x 2 (torch.distributed.checkpoint.state_dict.get_state_dict,
then dcp.save), after training with FSDP2's own collectives and with qcoll's (int8 weights,
int8/int4 gradients, hpZ): both checkpoints hold the same entries (names, shapes, dtypes).
Loaded on 2 ranks and on 6 (3 x 2) into FSDP2 with and without qcoll (set_state_dict), each
holds exactly the saved parameters and optimizer state (gathered whole by torch's
full_state_dict option), and training goes on: qcoll's unquantized collectives match
FSDP2's step by step from the resumed state.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

import zero_models
from checkpoints import copied, same, scratch
from distributed import run_ranks
from zero_helpers import gpt

SAVE_WORLD, NODE_SIZE, GLOBAL_BATCH = 4, 2, 12
MODES = ("default", "qcoll")


def _model(world, mode, *, quantized=True, seed=0):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import qcoll.fsdp

    torch.manual_seed(seed)
    model = zero_models.build("torch_encoder")
    mesh = init_device_mesh("cpu", (world,))
    hpz = NODE_SIZE if mode == "qcoll" and quantized and world > NODE_SIZE else True
    for layer in model.encoder.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=hpz)
    fully_shard(model, mesh=mesh)
    if mode == "qcoll":
        bits = {} if quantized else dict(weight_bits=None, grad_intra_bits=None, grad_inter_bits=None)
        qcoll.fsdp.use_qcoll(model, node_size=NODE_SIZE, **bits)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def _train(model, optimizer, steps, rank, world, start=0):
    losses = []
    for step in range(start, start + steps):
        x, y = gpt.MarkovLanguage(zero_models.VOCAB).batch(step, GLOBAL_BATCH, zero_models.SEQ)
        loss = gpt.lm_loss(zero_models.logits(model, x.chunk(world)[rank]), y.chunk(world)[rank])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _full(model, optimizer):
    """Parameters and optimizer state gathered whole by torch's own state-dict helpers (copies:
    a state tensor such as Adam's step is returned as the optimizer's own)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return copied(get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True)))


def _save_worker(rank, world, tmp):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    out = {}
    for mode in MODES:
        model, optimizer = _model(world, mode)
        _train(model, optimizer, 4, rank, world)
        msd, osd = get_state_dict(model, optimizer)
        path = os.path.join(tmp, mode)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
        out[mode] = _full(model, optimizer)
    return out


def _load_worker(rank, world, tmp):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    out = {}
    for saved in MODES:
        for mode in MODES:
            model, optimizer = _model(world, mode, quantized=False, seed=1)
            msd, osd = get_state_dict(model, optimizer)
            state = {"model": msd, "optim": osd}
            dcp.load(state, checkpoint_id=os.path.join(tmp, saved))
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
            loaded = _full(model, optimizer)
            out[(saved, mode)] = (loaded, _train(model, optimizer, 3, rank, world, start=4))
    return out


def _dir():
    return scratch("qcoll-fsdp-ckpt-")


@functools.lru_cache(maxsize=None)
def _runs(world):
    if world == SAVE_WORLD:
        return run_ranks(world, _save_worker, _dir(), timeout=240)
    _runs(SAVE_WORLD)
    return run_ranks(world, _load_worker, _dir(), timeout=300)


def _entries(path):
    from torch.distributed.checkpoint import FileSystemReader, TensorStorageMetadata

    meta = FileSystemReader(path).read_metadata().state_dict_metadata
    return {k: (tuple(v.size), v.properties.dtype) if isinstance(v, TensorStorageMetadata) else type(v).__name__
            for k, v in meta.items()}


def test_qcoll_checkpoint_has_fsdp2s_entries():
    _runs(SAVE_WORLD)
    default, qcoll_ = (_entries(os.path.join(_dir(), mode)) for mode in MODES)
    assert any(k.startswith("optim.state.") for k in default)  # the optimizer state is there
    assert qcoll_ == default


@pytest.mark.parametrize("world", [2, 6])
def test_resume_on_another_world_size_with_and_without_qcoll(world):
    saved = _runs(SAVE_WORLD)[0]
    for rank, result in enumerate(_runs(world)):
        for source in MODES:
            for mode in MODES:
                loaded, _ = result[(source, mode)]
                assert same(loaded, saved[source]), (rank, source, mode)
            # From the same state, qcoll's unquantized collectives train on like FSDP2's own.
            default_losses, qcoll_losses = result[(source, "default")][1], result[(source, "qcoll")][1]
            assert qcoll_losses == pytest.approx(default_losses, rel=1e-5), (source, qcoll_losses, default_losses)

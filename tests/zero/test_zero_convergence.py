"""ZeRO++ (qwZ int8 + hpZ + qgZ int8/int4, bf16 compute) trains as well as fp32: a small
GPT (tests/support/gpt.py) on a synthetic second-order Markov language, 4 ranks as 2 nodes x 2,
against a single fp32 process on the same global batches. The mean loss of the last 20
steps stays within 2% of the reference's, and both fall far below the uniform ln(vocab).

Stage 2 with int4 weights (SDP4Bit's setting, qgZ int8/int4): all-gathering the int4
weights themselves visibly loses; all-gathering their int4 differences (qWD) stays within
1% of the reference.
"""

from __future__ import annotations

import functools
import math

import torch

from tests.support.distributed import run_ranks
from tests.support.zero_helpers import gpt, train_engine, train_reference

WORLD, NODE_SIZE = 4, 2
STEPS = 200
PER_RANK = 8
CFG = gpt.GPTConfig(vocab_size=16, block_size=32, n_layer=1, n_head=4, d_model=64, tie_weights=True)
LR = 5e-3
LOSE = 1.03  # int4 weights without qWD: measured 7% above the reference (bench fidelity suite)


def _optimizer(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.01)


def _batch(step: int):
    return _language().batch(step, PER_RANK * WORLD, CFG.block_size)


@functools.lru_cache(maxsize=None)
def _language():
    return gpt.MarkovLanguage(CFG.vocab_size)


def _worker(rank, world, configs):
    import time

    import qcoll
    from qcoll.zero import ZeroConfig, ZeroEngine

    group = qcoll.new_group(node_size=NODE_SIZE)
    out = []
    for config in configs:
        torch.manual_seed(0)
        engine = ZeroEngine(gpt.GPT(CFG), _optimizer, group, config=ZeroConfig(**config))
        start = time.perf_counter()
        losses = train_engine(engine, _batch, STEPS, rank, world)
        out.append((losses, time.perf_counter() - start))
    return out if len(out) > 1 else out[0]


def _tail(losses, n=20):
    return sum(losses[-n:]) / n


@functools.lru_cache(maxsize=None)
def _reference():
    torch.manual_seed(0)
    ref_model = gpt.GPT(CFG)
    return train_reference(ref_model, _optimizer(ref_model.parameters()), _batch, STEPS)[0]


def test_zeropp_bf16_final_loss_within_2_percent_of_fp32_reference():
    ref_losses = _reference()
    zeropp = dict(qwz=True, hpz=True, qgz=True, compute_dtype=torch.bfloat16)
    runs = run_ranks(WORLD, _worker, [zeropp], timeout=300)
    losses = runs[0][0]
    assert all(r[0] == losses for r in runs)  # the global mean loss, the same on every rank
    assert all(math.isfinite(v) for v in losses)
    ref, ours = _tail(ref_losses), _tail(losses)
    uniform = math.log(CFG.vocab_size)
    # The language is learnable and both really learned it (the chain's entropy is ~0.64).
    assert ref < 0.45 * uniform, (ref, uniform)
    # No worse than 2% (a lower loss is trajectory noise, not lost fidelity: seen 3% lower
    # once the pipeline threshold changed the grouping of the gradient chunks).
    assert ours <= 1.02 * ref, f"ZeRO++ bf16 {ours:.4f} vs fp32 reference {ref:.4f}"
    assert ours > _language().entropy  # no model beats the chain's entropy rate


def test_stage2_int4_weights_need_qwd():
    ref = _tail(_reference())
    sdp = dict(stage=2, qwz=True, weight_bits=4, qgz=True, grad_intra_bits=8, grad_inter_bits=4,
               compute_dtype=torch.bfloat16)
    runs = run_ranks(WORLD, _worker, [dict(sdp, qwd=False), dict(sdp, qwd=True)], timeout=400)
    (plain, _), (qwd, _) = runs[0]
    assert all(r[0][0] == plain and r[1][0] == qwd for r in runs)
    plain, qwd = _tail(plain), _tail(qwd)
    # Quantizing the weights themselves to int4 costs visibly ...
    assert plain > LOSE * ref, f"int4 weights without qWD {plain:.4f} vs fp32 reference {ref:.4f}"
    # ... quantizing their step-to-step differences does not.
    assert qwd <= 1.01 * ref, f"int4 weights with qWD {qwd:.4f} vs fp32 reference {ref:.4f}"
    assert qwd < plain

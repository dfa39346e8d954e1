"""ZeRO++ (qwZ int8 + hpZ + qgZ int8/int4, bf16 compute) trains as well as fp32: a small
GPT (examples/gpt.py) on a synthetic second-order Markov language, 4 ranks as 2 nodes x 2,
against a single fp32 process on the same global batches. The mean loss of the last 20
steps stays within 2% of the reference's, and both fall far below the uniform ln(vocab).
"""

from __future__ import annotations

import functools
import math

import torch

from distributed import run_ranks
from zero_helpers import gpt, train_engine, train_reference

WORLD, NODE_SIZE = 4, 2
STEPS = 200
PER_RANK = 8
CFG = gpt.GPTConfig(vocab_size=16, block_size=32, n_layer=1, n_head=4, d_model=64, tie_weights=True)
LR = 5e-3


def _optimizer(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.01)


def _batch(step: int):
    return _language().batch(step, PER_RANK * WORLD, CFG.block_size)


@functools.lru_cache(maxsize=None)
def _language():
    return gpt.MarkovLanguage(CFG.vocab_size)


def _worker(rank, world):
    import time

    import qcoll
    from qcoll.zero import ZeroConfig, ZeroEngine

    group = qcoll.new_group(node_size=NODE_SIZE)
    torch.manual_seed(0)
    engine = ZeroEngine(gpt.GPT(CFG), _optimizer, group,
                        config=ZeroConfig(qwz=True, hpz=True, qgz=True, compute_dtype=torch.bfloat16))
    start = time.perf_counter()
    losses = train_engine(engine, _batch, STEPS, rank, world)
    return losses, time.perf_counter() - start


def _tail(losses, n=20):
    return sum(losses[-n:]) / n


def test_zeropp_bf16_final_loss_within_2_percent_of_fp32_reference():
    torch.manual_seed(0)
    ref_model = gpt.GPT(CFG)
    ref_losses, _ = train_reference(ref_model, _optimizer(ref_model.parameters()), _batch, STEPS)
    runs = run_ranks(WORLD, _worker, timeout=300)
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

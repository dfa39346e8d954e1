"""ZeroEngine at the edges a user's loop reaches: a unit that a later step skips on every
rank (layer drop) with hpZ and prefetch on; a state_dict() taken between backward() and the
first step; an engine on a one-rank Group, whose reductions stay on that rank."""

from __future__ import annotations

import torch
import torch.nn as nn

from tests.support.distributed import run_ranks


class _Drop(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])
        self.skip = False

    def forward(self, x):
        for i, b in enumerate(self.blocks):
            if not (self.skip and i == 1):
                x = b(x)
        return x


def _layer_drop(rank, world):
    from qcoll.zero import ZeroConfig, ZeroEngine

    model = _Drop()
    eng = ZeroEngine(model, lambda ps: torch.optim.SGD(ps, lr=0.1),
                     config=ZeroConfig(compute_dtype=torch.float32, hpz=True, prefetch=True))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    for step in range(3):
        model.skip = step == 1  # every rank drops block 1 at step 1
        eng.zero_grad()
        eng.backward(eng(x).sum())
        assert eng.step()
    return True


def test_a_unit_skipped_by_a_later_step_is_not_prefetched_for_backward():
    """Step 0 records the backward order; step 1 skips block 1, which hpZ holds no secondary
    shard of: its backward prefetch raised (blaming forward without gradients)."""
    assert run_ranks(2, _layer_drop, timeout=120) == [True, True]


def _state_dict_before_first_step(rank, world):
    from qcoll.zero import ZeroConfig, ZeroEngine

    torch.manual_seed(0)
    eng = ZeroEngine(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1)), lambda ps: torch.optim.SGD(ps, lr=0.1),
                     config=ZeroConfig(compute_dtype=torch.float32))
    eng.zero_grad()
    eng.backward(eng(torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))).sum())
    grads = [None if f.master.grad is None else f.master.grad.clone() for f in eng.flat_params]
    eng.state_dict()  # the optimizer has no state yet: its shapes come from a step at lr 0
    kept = all((a is None and f.master.grad is None) or torch.equal(a, f.master.grad)
               for a, f in zip(grads, eng.flat_params))
    before = {k: v.clone() for k, v in eng.full_state_dict().items()}
    eng.step()
    moved = max(float((eng.full_state_dict()[k] - before[k]).abs().max()) for k in before)
    return kept, any(g is not None for g in grads), moved


def test_a_state_dict_before_the_first_step_keeps_the_gradients():
    for kept, had, moved in run_ranks(2, _state_dict_before_first_step, timeout=120):
        assert had and kept and moved > 0, (had, kept, moved)


def _one_rank_group(rank, world):
    import qcoll
    from qcoll.zero import ZeroConfig, ZeroEngine

    parent = qcoll.new_group(node_size=1)
    torch.manual_seed(0)
    eng = ZeroEngine(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)), lambda ps: torch.optim.SGD(ps, lr=0.1),
                     parent.intra, config=ZeroConfig(compute_dtype=torch.float32))
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(rank)) * (1 + 10 * rank)
    eng.backward(eng(x).sum())
    local = float(torch.sqrt(sum(f.master.grad.double().pow(2).sum() for f in eng.flat_params)))
    if rank == 0:  # rank 0 alone clips: an all-reduce over the world would wait for rank 1
        norm = eng.clip_grad_norm(1e9)
    else:
        norm = local
    return local, norm


def test_an_engine_on_a_one_rank_group_reduces_nothing_across_ranks():
    for local, norm in run_ranks(2, _one_rank_group, timeout=60):
        assert abs(norm - local) <= 1e-9 * max(1.0, local), (local, norm)

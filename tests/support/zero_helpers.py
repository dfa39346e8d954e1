"""Shared pieces of the ZeRO engine tests (tests/zero/): the models, the data, a training
loop for the engine on gloo ranks and a single-process reference loop.

The small GPT and its synthetic language are tests/support/gpt.py (the examples and the
benchmarks train the same model).
"""

from __future__ import annotations


import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from tests.support import distributed, gpt

# Building a torch optimizer imports torch._dynamo (~1 s a process, ~3 s when four ranks
# import it at once on two cores). Every engine test builds one in every rank: import it
# once in the forkserver instead. Collection imports every test module before the first
# spawn starts the forkserver, so this takes effect for the whole session.
distributed._CTX.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "qcoll", "pytest"])

ALL_OFF_FP32 = dict(qwz=False, hpz=False, qgz=False, compute_dtype=torch.float32)


# ---- models ------------------------------------------------------------------------------
class OddNet(nn.Module):
    """Everything that makes flat units awkward, in one small model:
    prime-sized parameters (vocab 37, width 13, hidden 29); a 1-element (`gain`), a 0-dim
    (`temperature`), an empty (`empty`) and a never-used (`unused`) parameter owned by the
    root module; a module whose bias is frozen
    (requires_grad=False) next to its trainable weight; a wholly frozen module; two modules
    (`l1`, `l2`) run twice in one forward; and an output head tied to the embedding.
    """

    VOCAB = 37

    def __init__(self, width: int = 13, hidden: int = 29):
        super().__init__()
        self.emb = nn.Embedding(self.VOCAB, width)
        self.l1 = nn.Linear(width, hidden)
        self.l2 = nn.Linear(hidden, width)
        self.mix = nn.Linear(width, width)
        self.mix.bias.requires_grad_(False)  # frozen, in the same unit as a trainable weight
        self.fixed = nn.Linear(width, width, bias=False)
        self.fixed.weight.requires_grad_(False)  # a unit with nothing to train
        self.norm = nn.LayerNorm(width)
        self.gain = nn.Parameter(torch.full((1,), 1.5))
        self.temperature = nn.Parameter(torch.tensor(0.9))  # 0-dim
        self.empty = nn.Parameter(torch.zeros(0, 3))  # no elements
        self.unused = nn.Parameter(torch.randn(7))  # never touched by forward
        self.head = nn.Linear(width, self.VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied: the head owns no parameter of its own

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for _ in range(2):  # the same modules twice
            h = h + self.l2(torch.tanh(self.l1(h)))
        h = self.mix(h) + 0.5 * self.fixed(h)
        h = self.norm(h) * self.gain + self.empty.sum()
        return self.head(h) * self.temperature


CALL_HEADER = 32  # bytes per peer of a call check (include/qcoll/wire_header.h)


def assert_same_but_call_checks(a: dict, b: dict, what="") -> None:
    """Engine stats of two runs that made the same calls: the same calls, and bytes that
    differ only by call checks. The first call of each signature on a group also sends a
    32-byte call header to every peer; a run on a group that already made those calls
    sends none (issue 26)."""
    assert set(a) == set(b), what
    for kind in a:
        assert a[kind]["calls"] == b[kind]["calls"], (what, kind, a[kind], b[kind])
        for field in ("intra_bytes", "inter_bytes"):
            assert (a[kind][field] - b[kind][field]) % CALL_HEADER == 0, (what, kind, a[kind], b[kind])


def oddnet_batch(step: int, batch_size: int, length: int = 5):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, OddNet.VOCAB, (batch_size, length), generator=g)
    y = torch.randint(0, OddNet.VOCAB, (batch_size, length), generator=g)
    return x, y


def make_optimizer(name: str, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    raise ValueError(name)


class OptimizerFactory:
    """Picklable optimizer factory (a lambda would do inside a rank, not across a spawn)."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self, params):
        return make_optimizer(self.name, params)


lm_loss = gpt.lm_loss


# ---- training loops ----------------------------------------------------------------------
def mean_over_ranks(value: torch.Tensor) -> float:
    t = value.detach().float().reshape(1).clone()
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def train_engine(engine, batch_fn, steps: int, rank: int, world: int, micro: int = 1,
                 loss_fn=lm_loss, on_backward=None) -> list:
    """Each step: this rank's slice of the global batch, split into `micro` micro-batches
    (each loss divided by `micro`), then step(). Returns the global mean loss per step."""
    losses = []
    for s in range(steps):
        x, y = batch_fn(s)
        xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
        engine.zero_grad()
        total = torch.zeros(())
        for xm, ym in zip(xs.chunk(micro), ys.chunk(micro)):
            loss = loss_fn(engine(xm), ym)
            engine.backward(loss / micro)
            total += loss.detach().float() / micro
        if on_backward is not None:
            on_backward(s)
        engine.step()
        losses.append(mean_over_ranks(total))
    return losses


def train_reference(model: nn.Module, optimizer, batch_fn, steps: int, max_grad_norm=None,
                    loss_fn=lm_loss) -> tuple:
    """Single process, whole global batch. A trainable parameter that forward did not use
    gets a zero gradient (not None), which is what the engine does: its flat gradient
    buffers hold zeros there. Returns (losses, gradient norms before clipping)."""
    losses, norms = [], []
    for s in range(steps):
        x, y = batch_fn(s)
        loss = loss_fn(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        for p in model.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        if max_grad_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)))
        optimizer.step()
        losses.append(loss.item())
    return losses, norms


def full_state(model: nn.Module) -> dict:
    """Every parameter name (tied ones under each name, like state_dict) -> fp32 copy."""
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}

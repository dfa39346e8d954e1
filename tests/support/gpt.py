"""A small GPT-style language model and a learnable synthetic language, for the examples
(examples/train_zero3.py, train_fsdp2.py, accelerate_fsdp2.py), the tests (tests/zero/,
tests/plugins/) and the benchmarks (bench/suites/zero.py, error_feedback.py, fidelity.py).

Plain PyTorch: pre-LayerNorm blocks in an nn.ModuleList (each block one ZeRO-3 unit under
ZeroConfig's default unit rule; the root holds the embeddings, final norm and head), causal
self-attention through F.scaled_dot_product_attention, and an output head that can share
the token embedding's weight.

The data is a fixed random second-order Markov chain over the vocabulary: each pair of
previous tokens picks the next one from a few likely successors. A model that reads the
last two tokens can bring the loss from ln(vocab) down to the chain's entropy rate
(`MarkovLanguage.entropy`), so training curves drop meaningfully within a few hundred
steps, and the data is reproducible from a seed on every rank without files.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 64
    block_size: int = 32  # longest sequence
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 64
    tie_weights: bool = True  # the head shares the token embedding's weight


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        assert cfg.d_model % cfg.n_head == 0
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.block_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2: scale the residual projections
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))
        if cfg.tie_weights:
            self.head.weight = self.wte.weight

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids (batch, time) -> logits (batch, time, vocab) in the weights' dtype."""
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, computed in fp32 whatever the logits' dtype."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


class MarkovLanguage:
    """A fixed random second-order Markov chain: P(next | prev2, prev1) puts most of its mass
    on `branching` successors per context (Dirichlet weights), the rest spread thin."""

    def __init__(self, vocab_size: int, seed: int = 0, branching: int = 2, smoothing: float = 0.02):
        g = torch.Generator().manual_seed(seed)
        v = vocab_size
        logits = torch.full((v * v, v), math.log(smoothing / v))
        succ = torch.stack([torch.randperm(v, generator=g)[:branching] for _ in range(v * v)])
        weights = -torch.log(torch.rand(v * v, branching, generator=g))  # Dirichlet(1, ..., 1)
        weights = weights / weights.sum(1, keepdim=True)
        logits.scatter_(1, succ, torch.log(weights + smoothing / v))
        self.probs = torch.softmax(logits, dim=1)  # (v*v, v), row = prev2 * v + prev1
        self.vocab_size = v

    @property
    def entropy(self) -> float:
        """Entropy rate in nats (uniform weight on contexts; the stationary distribution of a
        dense chain like this one is close to uniform): the best achievable loss."""
        p = self.probs
        return float(-(p * p.clamp_min(1e-30).log()).sum(1).mean())

    def batch(self, step: int, batch_size: int, length: int, seed: int = 0):
        """(inputs, targets), each (batch_size, length) int64; a pure function of its arguments,
        so every rank (and the single-process reference) can draw the same global batch."""
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        v = self.vocab_size
        seq = torch.empty(batch_size, length + 1, dtype=torch.long)
        seq[:, :2] = torch.randint(0, v, (batch_size, 2), generator=g)
        for i in range(2, length + 1):
            rows = self.probs[seq[:, i - 2] * v + seq[:, i - 1]]
            seq[:, i] = torch.multinomial(rows, 1, generator=g).squeeze(1)
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

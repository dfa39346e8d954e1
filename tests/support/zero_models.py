"""Models nobody here wrote, for the ZeRO engine's tests (tests/zero/test_zero_models.py), each
a tiny random language model over the Markov language of tests/support/gpt.py (no downloads):

- "torch_encoder": nn.TransformerEncoder of nn.TransformerEncoderLayer (causal mask). Its
  nn.MultiheadAttention reads out_proj.weight without calling out_proj.
- "torch_seq2seq": nn.Transformer (encoder and nn.TransformerDecoderLayer decoder), the
  source and target embeddings and the output head one tied weight.
- "hf_gpt2", "hf_llama": HuggingFace transformers' GPT-2 (tied head, Conv1D layers) and
  Llama (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU), from configs.

Every builder gives (model, logits_fn): logits_fn(model_or_engine, tokens) -> logits.
"""

from __future__ import annotations

import torch
import torch.nn as nn

VOCAB, SEQ, WIDTH = 16, 8, 16
NAMES = ("torch_encoder", "torch_seq2seq", "hf_gpt2", "hf_llama")
# Import transformers once in the forkserver, not in every rank (~10 s on two busy cores).
PRELOAD = ["transformers.models.gpt2.modeling_gpt2", "transformers.models.llama.modeling_llama"]


def _causal(t: int, device) -> torch.Tensor:
    return torch.triu(torch.ones(t, t, dtype=torch.bool, device=device), diagonal=1)


class TorchEncoderLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        layer = nn.TransformerEncoderLayer(WIDTH, nhead=2, dim_feedforward=2 * WIDTH, dropout=0.0,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, x):
        return self.head(self.encoder(self.emb(x), mask=_causal(x.shape[1], x.device)))


class TorchSeq2Seq(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.transformer = nn.Transformer(WIDTH, nhead=2, num_encoder_layers=1, num_decoder_layers=2,
                                          dim_feedforward=2 * WIDTH, dropout=0.0, batch_first=True)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        h = self.emb(x)
        return self.head(self.transformer(h, h, tgt_mask=_causal(x.shape[1], x.device)))


def build(name: str) -> nn.Module:
    if name == "torch_encoder":
        return TorchEncoderLM()
    if name == "torch_seq2seq":
        return TorchSeq2Seq()
    if name == "hf_gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=WIDTH, n_layer=2, n_head=2,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                          eos_token_id=0, attn_implementation="eager"))
    if name == "hf_llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH,
                                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                            max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0,
                                            attn_implementation="eager"))
    raise ValueError(name)


def logits(model, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return out.logits if hasattr(out, "logits") else out

"""A small GPT-style transformer (nanoGPT-shaped) for tests, examples and benchmarks.

Token + positional embedding, pre-LN blocks (causal self-attention through
``F.scaled_dot_product_attention(is_causal=True)``, MLP with GELU), a final
LayerNorm and an output layer whose weight is tied to the token embedding
(``lm_head.weight = wte.weight``). ``forward(idx, targets)`` returns the mean
cross-entropy loss, so :func:`fusion.ir.trace.trace` turns it into a training
graph with ``targets`` as a LABEL placeholder (see ``GPT.fusion_labels``).

Entry points for ``fusion graph`` / ``fusion compile`` (``file.py:function``):

- ``tiny``: 2 layers, width 32, 16 tokens, vocabulary 64 (tests);
- ``small``: 4 layers, width 128, 64 tokens, vocabulary 512 (CPU benchmarks);
- ``gpt2_xl_meta``: GPT-2 XL (48 layers, width 1600, 25 heads, 1024 tokens,
  vocabulary 50257) on the meta device: shapes only, no memory, for the
  compiler benchmark.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    """Model shape. ``dropout`` must stay 0 for runs compared across partitions
    (random masks are not reproduced identically by a partitioned run)."""

    vocab: int = 64  #: vocabulary size
    n_layer: int = 2  #: transformer blocks
    n_head: int = 2  #: attention heads (d_model must divide by it)
    d_model: int = 32  #: residual stream width
    seq_len: int = 16  #: context length (positional embedding rows)
    dropout: float = 0.0
    tie_embeddings: bool = True  #: output layer reuses the token embedding weight
    bias: bool = True  #: biases in Linear and LayerNorm layers (GPT-2 has them)

    def __post_init__(self):
        if self.d_model % self.n_head:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_head={self.n_head}")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.resid_drop = nn.Dropout(cfg.dropout)
        self.attn_p = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_p if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """``forward(idx, targets)``: idx and targets are int64 ``[batch, seq_len]``."""

    #: forward arguments that :func:`fusion.ir.trace.trace` makes LABEL placeholders
    fusion_labels = ("targets",)

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab, cfg.d_model),
            wpe=nn.Embedding(cfg.seq_len, cfg.d_model),
            drop=nn.Dropout(cfg.dropout),
            h=nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)]),
            ln_f=nn.LayerNorm(cfg.d_model, bias=cfg.bias),
        ))
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2's scaled init of residual projections
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        B, T = idx.size()
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def gpt_model(cfg: GPTConfig, batch: int, seed: int = 0, device: str = "cpu") -> tuple[GPT, dict[str, torch.Tensor]]:
    """``(module, example)``: a GPT initialised from ``seed`` and one random micro-batch
    of ``batch`` sequences (token ids drawn from a generator seeded with ``seed``).

    ``device="meta"`` builds the module without memory (compile-only).
    """
    with torch.device(device):
        if device == "meta":
            module = GPT(cfg)
        else:
            state = torch.random.get_rng_state()
            torch.manual_seed(seed)
            try:
                module = GPT(cfg)
            finally:
                torch.random.set_rng_state(state)
    g = torch.Generator().manual_seed(seed + 1)
    idx = torch.randint(0, cfg.vocab, (batch, cfg.seq_len), generator=g)
    targets = torch.randint(0, cfg.vocab, (batch, cfg.seq_len), generator=g)
    return module, {"idx": idx, "targets": targets}


TINY = GPTConfig(vocab=64, n_layer=2, n_head=2, d_model=32, seq_len=16)
SMALL = GPTConfig(vocab=512, n_layer=4, n_head=4, d_model=128, seq_len=64)
GPT2_XL = GPTConfig(vocab=50257, n_layer=48, n_head=25, d_model=1600, seq_len=1024)


def tiny() -> tuple[GPT, dict[str, torch.Tensor]]:
    """The test-sized GPT and a micro-batch of 2 sequences (``fusion compile examples/models/gpt.py:tiny``)."""
    return gpt_model(TINY, batch=2, seed=0)


def tiny_bf16() -> tuple[GPT, dict[str, torch.Tensor]]:
    """``tiny`` with bfloat16 weights and activations (mixed-precision users' case); the loss stays
    bfloat16 as the module computes it, and fed data is float32, rounded by the engine."""
    module, example = gpt_model(TINY, batch=2, seed=0)
    return module.to(torch.bfloat16), example


def small() -> tuple[GPT, dict[str, torch.Tensor]]:
    """The benchmark-sized GPT (about 1 M parameters) and a micro-batch of 8 sequences."""
    return gpt_model(SMALL, batch=8, seed=0)


def gpt2_xl_meta(batch: int = 1) -> tuple[GPT, dict[str, torch.Tensor]]:
    """GPT-2 XL (about 1.56 B parameters) on the meta device with a micro-batch of
    ``batch`` sequences of 1024 tokens: trace it to compile plans without memory."""
    return gpt_model(GPT2_XL, batch=batch, seed=0, device="meta")

"""A tiny GPT-style decoder (token + position embeddings, pre-LN causal
self-attention blocks, MLP with GELU, tied-free LM head) that returns its own
cross-entropy loss. Small enough for equivalence tests; written with plain
torch ops so that ``torch.onnx.export`` produces the usual transformer ONNX
ops (Gather, LayerNormalization, MatMul, Split, Reshape, Transpose, Softmax,
Where, Gelu, SoftmaxCrossEntropyLoss).

    fusion graph examples/models/tiny_transformer.py:model
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int, heads: int, seq: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.register_buffer("mask", torch.tril(torch.ones(seq, seq)).view(1, 1, seq, seq))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        hd = C // self.heads
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q = q.view(B, T, self.heads, hd).transpose(1, 2)
        k = k.view(B, T, self.heads, hd).transpose(1, 2)
        v = v.view(B, T, self.heads, hd).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(hd)
        att = att.masked_fill(self.mask[:, :, :T, :T] == 0, float("-inf"))
        y = (F.softmax(att, dim=-1) @ v).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc(self.ln2(x))))


class TinyTransformer(nn.Module):
    """forward(idx[B, T], targets[B, T] | None) -> loss (or logits when targets is None)."""

    def __init__(self, vocab: int = 13, d: int = 16, heads: int = 2, seq: int = 8, layers: int = 2):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Parameter(torch.randn(seq, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, heads, seq) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = self.wte(idx) + self.wpe[: idx.shape[1]]
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def model(batch: int = 2, seq: int = 8, vocab: int = 13):
    """(module, example inputs of one micro-batch), the loader's convention."""
    torch.manual_seed(0)
    m = TinyTransformer(vocab=vocab, seq=seq)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, vocab, (batch, seq), generator=g)
    return m, (idx, torch.randint(0, vocab, (batch, seq), generator=g))

"""Models for compiler tests and benchmarks, built with the op-node API.

:func:`gpt_model` builds a GPT-2-style OP-DAG at realistic block granularity:
token and position embeddings, then per block ``ln1, attn, add1, ln2, fc,
gelu, proj, add2`` (attention is one registered module node), the final
LayerNorm, the LM head (tied to the token embedding, as in GPT-2), and the
cross-entropy loss. With ``device="meta"`` no weights are allocated, so a
GPT-2 XL-sized graph (48 layers, width 1600) costs only its metadata.

:func:`branchy_model` is a small DAG with parallel branches and a long skip
connection, for partitioners that must handle general DAGs.

The module types register under ``tests.testing_models.*``; a graph using
them lists this module as a plugin, so executors can import it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fusion.ir.builder import GraphBuilder
from fusion.ir.model import Model
from fusion.ir.registry import register_module


@register_module("tests.testing_models.CausalSelfAttention")
class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention (GPT-2's ``attn``: c_attn, SDPA, c_proj)."""

    def __init__(self, d_model: int, n_head: int, bias: bool = True):
        super().__init__()
        if d_model % n_head:
            raise ValueError(f"d_model {d_model} is not divisible by n_head {n_head}")
        self.d_model, self.n_head, self.bias = d_model, n_head, bias
        self.c_attn = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.c_proj = nn.Linear(d_model, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, c))


@register_module("tests.testing_models.PositionalEmbedding")
class PositionalEmbedding(nn.Module):
    """Adds a learned position embedding: ``x + weight[:seq]`` (GPT-2's ``wpe``)."""

    def __init__(self, n_positions: int, d_model: int):
        super().__init__()
        self.n_positions, self.d_model = n_positions, d_model
        self.weight = nn.Parameter(torch.empty(n_positions, d_model))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.weight[: x.shape[1]]


def gpt_model(n_layer: int = 48, d_model: int = 1600, n_head: int = 25, vocab: int = 50257, seq: int = 1024,
              batch: int = 1, tied: bool = True, device: str = "meta", seed: int = 0) -> Model:
    """A GPT-2-style model; the defaults are GPT-2 XL with a micro-batch of one 1024-token sequence.

    ``device="meta"`` builds the graph with shapes only (no weights).
    """
    b = GraphBuilder()
    idx, labels = b.input("idx"), b.label("labels")
    h = b.module("wte", "torch.nn.Embedding", idx, num_embeddings=vocab, embedding_dim=d_model)
    h = b.module("wpe", PositionalEmbedding, h, n_positions=seq, d_model=d_model)
    for i in range(n_layer):
        p = f"h{i}."
        a = b.module(p + "ln1", "torch.nn.LayerNorm", h, normalized_shape=d_model)
        a = b.module(p + "attn", CausalSelfAttention, a, d_model=d_model, n_head=n_head)
        h = b.function(p + "add1", "operator.add", h, a)
        m = b.module(p + "ln2", "torch.nn.LayerNorm", h, normalized_shape=d_model)
        m = b.module(p + "fc", "torch.nn.Linear", m, in_features=d_model, out_features=4 * d_model)
        m = b.function(p + "gelu", "torch.nn.functional.gelu", m)
        m = b.module(p + "proj", "torch.nn.Linear", m, in_features=4 * d_model, out_features=d_model)
        h = b.function(p + "add2", "operator.add", h, m)
    h = b.module("ln_f", "torch.nn.LayerNorm", h, normalized_shape=d_model)
    logits = b.module("head", "torch.nn.Linear", h, in_features=d_model, out_features=vocab, bias=False,
                      params={"weight": "wte.weight"} if tied else None)
    flat = b.function("logits_flat", "torch.flatten", logits, 0, 1)
    lab = b.function("labels_flat", "torch.flatten", labels)
    b.loss("loss", "torch.nn.functional.cross_entropy", flat, lab)
    g = torch.Generator().manual_seed(seed)
    example = {"idx": torch.randint(0, vocab, (batch, seq), generator=g),
               "labels": torch.randint(0, vocab, (batch, seq), generator=g)}
    return b.build(example, seed=seed, device=device)


def branchy_model(width: int = 8, device: str = "cpu", seed: int = 0) -> Model:
    """Stem -> two parallel conv branches -> add -> conv -> add(stem skip) -> head -> loss."""
    b = GraphBuilder()
    x, y = b.input("x"), b.label("y")
    s = b.module("stem", "torch.nn.Conv2d", x, in_channels=3, out_channels=width, kernel_size=3, padding=1)
    s = b.function("stem_relu", "torch.relu", s)
    l = b.module("left", "torch.nn.Conv2d", s, in_channels=width, out_channels=width, kernel_size=3, padding=1)
    l = b.function("left_relu", "torch.relu", l)
    r = b.module("right", "torch.nn.Conv2d", s, in_channels=width, out_channels=width, kernel_size=1)
    r = b.function("right_relu", "torch.relu", r)
    h = b.function("join", "operator.add", l, r)
    h = b.module("mid", "torch.nn.Conv2d", h, in_channels=width, out_channels=width, kernel_size=3, padding=1)
    h = b.function("mid_relu", "torch.relu", h)
    h = b.module("deep", "torch.nn.Conv2d", h, in_channels=width, out_channels=width, kernel_size=3, padding=1)
    h = b.function("skip", "operator.add", h, s)  # long skip connection from the stem
    h = b.function("pool", "torch.nn.functional.adaptive_avg_pool2d", h, 1)
    h = b.function("flat", "torch.flatten", h, 1)
    o = b.module("fc", "torch.nn.Linear", h, in_features=width, out_features=5)
    b.loss("loss", "torch.nn.functional.cross_entropy", o, y)
    g = torch.Generator().manual_seed(seed)
    example = {"x": torch.randn(2, 3, 8, 8, generator=g), "y": torch.randint(0, 5, (2,), generator=g)}
    return b.build(example, seed=seed, device=device)

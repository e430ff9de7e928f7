"""Models and helpers shared by the tracing tests (not a test module)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fusion.ir.node import PLACEHOLDER_KINDS

ROOT = Path(__file__).resolve().parents[2]


def load_gpt():
    """The example GPT module file (examples/ is not a package)."""
    name = "fusion_examples_gpt"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / "models" / "gpt.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def contiguous_parts(graph, n: int) -> dict[str, str]:
    """Contiguous ranges of compute nodes in topological order, one per part;
    each placeholder goes with its first user."""
    compute = [name for name, node in graph.nodes.items() if node.kind not in PLACEHOLDER_KINDS]
    bounds = np.linspace(0, len(compute), n + 1).round().astype(int)
    assign = {}
    for p in range(n):
        for name in compute[bounds[p]:bounds[p + 1]]:
            assign[name] = f"p{p}"
    order = {name: i for i, name in enumerate(compute)}
    users = graph.users()
    for node in graph.nodes.values():
        if node.kind in PLACEHOLDER_KINDS:
            first = min(users[node.name], key=order.__getitem__)
            assign[node.name] = assign[first]
    return assign


def plain_step(module: nn.Module, opt: torch.optim.Optimizer, batch: dict, micro_batches: int, loss_of=lambda out: out):
    """One plain-PyTorch step with gradient accumulation over micro-batches; returns the mean loss."""
    opt.zero_grad(set_to_none=True)
    total = 0.0
    chunks = {k: v.chunk(micro_batches) for k, v in batch.items()}
    for i in range(micro_batches):
        loss = loss_of(module(**{k: c[i] for k, c in chunks.items()})) / micro_batches
        loss.backward()
        total += loss.item()
    grads = {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}
    opt.step()
    return total, grads


class TiedLM(nn.Module):
    """Output layer written as ``F.linear(h, self.wte.weight)`` (tying through a functional call)."""

    fusion_labels = ("y",)

    def __init__(self, vocab: int = 16, d: int = 8):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.fc = nn.Linear(d, d)

    def forward(self, x, y):
        h = torch.tanh(self.fc(self.wte(x)))
        logits = F.linear(h, self.wte.weight)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())


class HFStyle(nn.Module):
    """What symbolic tracing cannot follow: Python control flow on shapes, keyword
    arguments with defaults, a cache object built in forward, a dict output."""

    def __init__(self, vocab: int = 16, d: int = 8):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([nn.Linear(d, d) for _ in range(2)])
        self.head = nn.Linear(d, vocab)

    def forward(self, input_ids, attention_mask=None, labels=None, use_cache: bool = False):
        h = self.emb(input_ids)
        if attention_mask is not None:
            h = h * attention_mask.unsqueeze(-1).to(h.dtype)
        cache = {"layers": []}
        for blk in self.blocks:
            h = h + torch.relu(blk(h))
            cache["layers"].append(h)
        if input_ids.shape[1] > 4:  # shape-dependent Python branch: fx cannot, export can
            h = h * 0.5
        logits = self.head(h)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))
        if use_cache:
            out["cache"] = tuple(cache["layers"])
        return out


class AttnNet(nn.Module):
    """A leaf module with a tuple output (MultiheadAttention returns (out, weights))."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.fc = nn.Linear(d, 1)

    def forward(self, x, y):
        a = self.attn(x, x, x, need_weights=False)[0]
        return F.mse_loss(self.fc(a + x).squeeze(-1), y)

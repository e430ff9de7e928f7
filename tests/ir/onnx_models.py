"""Models and helpers shared by the ONNX and mixed-engine tests.

Exports use ``torch.onnx.export(..., dynamo=True, optimize=False)``: the
dynamo exporter is torch 2.13's default and keeps ``state_dict`` names on the
initializers; its optimiser is turned off because it rewrites the graph for
inference (fuses BatchNorm into Conv, merges equal-valued LayerNorm weights
into one initializer, pre-transposes Linear weights under new names), which
would change what training the graph means.
"""
from __future__ import annotations

import contextlib
import importlib.util
import io
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[2]


def tiny_transformer_module():
    spec = importlib.util.spec_from_file_location("fusion_example_tiny_transformer", ROOT / "examples/models/tiny_transformer.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc3(torch.tanh(self.fc2(F.gelu(self.fc1(x)))))


class BranchCNN(nn.Module):
    """Conv -> BatchNorm -> ReLU -> MaxPool, two branches concatenated, AvgPool, slice, Linear."""

    def __init__(self):
        super().__init__()
        self.c1, self.bn = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.a, self.b = nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 4, 1)
        self.fc = nn.Linear(4 * 2 * 2, 5)

    def forward(self, x):
        h = F.max_pool2d(F.relu(self.bn(self.c1(x))), 2)
        h = F.avg_pool2d(torch.cat([F.relu(self.a(h)), self.b(h)], 1), 2)[:, :4]
        return self.fc(torch.flatten(h, 1))


def export(module: nn.Module, args: tuple, path: Path) -> Path:
    module.eval()
    with contextlib.redirect_stdout(io.StringIO()):
        torch.onnx.export(module, args, str(path), dynamo=True, optimize=False)
    return path


def two_part_assignment(graph) -> dict[str, str]:
    """First half of the nodes (a topological prefix) on part "a", the rest on "b"."""
    names = list(graph.nodes)
    half = len(names) // 2
    return {n: ("a" if i < half else "b") for i, n in enumerate(names)}


def assert_trains_like(executor, module, batches, feed, torch_loss, n_micro, opt, steps=3):
    """``steps`` training steps of ``executor`` equal plain torch: losses rtol 1e-5, grads rtol 1e-4."""
    params = dict(module.named_parameters())
    for step in range(steps):
        batch = batches[step % len(batches)]
        r = executor.step(feed(batch))
        opt.zero_grad()
        loss = sum(torch_loss(*mb) for mb in zip(*(t.chunk(n_micro) for t in batch))) / n_micro
        loss.backward()
        np.testing.assert_allclose(r.loss, loss.item(), rtol=1e-5, err_msg=f"loss at step {step}")
        assert set(r.grads) == set(params), sorted(set(r.grads) ^ set(params))
        for n, p in params.items():
            np.testing.assert_allclose(r.grads[n], p.grad.numpy(), rtol=1e-4, atol=1e-6, err_msg=f"grad {n} at step {step}")
        opt.step()

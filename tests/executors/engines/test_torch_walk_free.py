"""The torch engine's interpreted forward frees each activation after its last reader (fusion.ir.walk's
last-use freeing), keeps what the part sends, and leaves what backward needs to autograd.

A ``record`` callback that holds only weak references sees, at each node, which earlier outputs are
still alive. Compiled parts need no such check: fx's generated code drops each local after its last
use (``x = None``), and tests/executors/engines/test_torch_parts.py checks both paths agree bit for bit.
"""
from __future__ import annotations

import weakref

import pytest
import torch

from fusion.executors.engines.torch.engine import TorchPart
from fusion.ir.boundary import partition
from fusion.ir.builder import GraphBuilder


def _parts(op: str, *extra):
    """x -> h1 .. h4 (each ``op(previous, *extra)``) on p0; y = h4 + h1 on p1, so p0 sends h1 and h4."""
    b = GraphBuilder()
    h = x = b.input("x")
    hs = []
    for i in range(1, 5):
        h = b.function(f"h{i}", op, h, *extra)
        hs.append(h)
    b.output("out", b.function("y", "operator.add", hs[3], hs[0]))
    model = b.build({"x": torch.zeros(4, 8)})
    subs = partition(model.graph, {"x": "p0", "h1": "p0", "h2": "p0", "h3": "p0", "h4": "p0", "y": "p1", "out": "p1"})
    return model, subs


def _alive_at_each_node(part: TorchPart, x: torch.Tensor) -> tuple[dict[str, set[str]], dict]:
    """Run ``part``'s forward; for each node, the names of earlier outputs alive when it is recorded."""
    refs: dict[str, weakref.ref] = {}
    alive: dict[str, set[str]] = {}

    def record(name, out):
        alive[name] = {n for n, r in refs.items() if r() is not None}
        refs[name] = weakref.ref(out)

    sent, _ = part.forward(0, {}, {"x": x}, record=record)
    return alive, sent


@pytest.mark.parametrize("op, extra, grad", [("torch.tanh", (), False), ("torch.mul", (2.0,), True)])
def test_interpreted_forward_frees_dead_activations_and_keeps_sent_ones(op, extra, grad):
    """Under no_grad (a recomputed part's first forward, evaluation), and with autograd when the ops save
    no activation (``mul`` by a number): h2 is gone once h3, its last reader, has run; h1 is sent, so it
    stays, though h2 was its last reader in the part; x stays in the engine's fed values."""
    model, subs = _parts(op, *extra)
    part = TorchPart(model.graph, subs["p0"], model.params, compiled=False)
    assert set(part.send_keys) == {("h1", None), ("h4", None)} and not part.compiled
    with torch.set_grad_enabled(grad):
        alive, sent = _alive_at_each_node(part, torch.randn(4, 8, requires_grad=grad))
    assert alive["h3"] == {"x", "h1", "h2"}
    assert alive["h4"] == {"x", "h1", "h3"}  # h2 freed after h3
    assert set(sent) == {("h1", None), ("h4", None)}
    part.walk.free_values = False  # the walk before last-use freeing: everything stays to the end
    with torch.set_grad_enabled(grad):
        assert _alive_at_each_node(part, torch.randn(4, 8, requires_grad=grad))[0]["h4"] == {"x", "h1", "h2", "h3"}


def _grads(part: TorchPart, x: torch.Tensor, seeds: dict) -> dict:
    part.forward(0, {}, {"x": x})
    part.backward(0, seeds)
    out = {n: g.copy() for n, g in part.grads().items()}
    for p in part.trainable().values():
        p.grad = None
    return out


def test_what_autograd_saves_is_autograds():
    """tanh saves its output for backward, the Linear its input: the walk drops fc and h1 .. h3 after their
    readers all the same (autograd's saved variables hold the data, not the walk's tensor objects), and the
    part's backward gives the same parameter gradients, bit for bit, as with every value kept."""
    b = GraphBuilder()
    h = b.module("fc", "torch.nn.Linear", b.input("x"), in_features=8, out_features=8)
    for i in range(1, 5):
        h = b.function(f"h{i}", "torch.tanh", h)
    b.output("out", b.function("y", "operator.add", h, b.function("c", "torch.tanh", h)))
    model = b.build({"x": torch.zeros(4, 8)})
    subs = partition(model.graph, {**{n: "p0" for n in ("x", "fc", "h1", "h2", "h3", "h4")},
                                   "c": "p1", "y": "p1", "out": "p1"})
    part = TorchPart(model.graph, subs["p0"], model.params, compiled=False)
    x = torch.randn(4, 8)
    alive, _ = _alive_at_each_node(part, x)
    part.forget()
    assert alive["h4"] == {"x", "h3"}  # h3: h4's argument; x: fed
    seeds = {("h4", None): torch.randn(4, 8).numpy()}
    freed = _grads(part, x, seeds)
    part.walk.free_values = False
    kept = _grads(part, x, seeds)
    assert len(freed) == 2  # the Linear's weight and bias
    for n in freed:
        assert freed[n] is not None and (freed[n] == kept[n]).all(), n

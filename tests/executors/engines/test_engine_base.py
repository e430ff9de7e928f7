"""Engine abilities declared on ``EnginePart`` (executors/engines/base.py): an engine that lacks one gets a
default the runtime can call without probing, and every engine part must subclass the base."""
import numpy as np
import pytest

from fusion.executors.engines import select
from fusion.executors.engines.base import EnginePart
from fusion.executors.engines.numpy.engine import NumpyPart
from fusion.ir.boundary import subgraph
from fusion.ir.builder import GraphBuilder
from fusion.ir.errors import FusionError


class Minimal(EnginePart):
    """Only what every engine must implement: it records the calls the defaults make."""

    engine = "minimal"

    def __init__(self):
        self.calls = []

    def forward(self, mb_key, inputs, feeds):
        self.calls.append(("forward", mb_key))
        return {}, None

    def backward(self, mb_key, grads, loss_scale=1.0):
        self.calls.append(("backward", mb_key, loss_scale))
        return {("x", None): np.ones(2)}

    def trainable(self):
        return {}

    def state(self):
        return {}

    def grads(self):
        return {}

    def set_grad(self, name, grad):
        pass


def test_an_engine_without_the_optional_abilities_gets_their_defaults():
    e = Minimal()
    assert e.OPTIONS == () and e.RECORDS_OUTPUTS is False
    got = e.backward_input((0, 1), {}, 0.5)  # a split backward's B: the whole backward
    assert e.calls == [("backward", (0, 1), 0.5)] and list(got) == [("x", None)]
    assert e.backward_weight((0, 1)) is None and e.calls == [("backward", (0, 1), 0.5)]  # W: nothing left
    e.forget()
    e.forget((0, 1))
    assert e.codec_device is None  # encoded on the host
    assert e.keep_tensors(frozenset({("x", 0)}), frozenset()) is None


def test_an_engine_part_must_implement_the_required_methods():
    class Incomplete(EnginePart):
        engine = "incomplete"

        def forward(self, mb_key, inputs, feeds):
            return {}, None

    with pytest.raises(TypeError, match="abstract"):
        Incomplete()
    assert isinstance(Minimal(), EnginePart)


def _graph():
    b = GraphBuilder()
    h = b.module("fc", "torch.nn.Linear", b.input("x"), in_features=3, out_features=2)
    b.loss("loss", "torch.nn.functional.cross_entropy", h, b.label("y"))
    import torch

    return b.build(example={"x": torch.randn(2, 3), "y": torch.tensor([0, 1])}, seed=0)


def test_numpy_forget_drops_what_forward_kept():
    model = _graph()
    g = model.graph
    part = select.make_engine_part("numpy", g, subgraph(g, list(g.nodes)), model.params)
    assert isinstance(part, NumpyPart) and isinstance(part, EnginePart)
    feeds = {"x": np.ones((2, 3), np.float32), "y": np.array([0, 1])}
    for k in ((0, 0), (0, 1)):
        part.forward(k, {}, feeds)
    part.forget((0, 0))
    assert list(part.stash) == [(0, 1)]
    part.forget()
    assert part.stash == {}


def test_a_part_factory_that_does_not_build_an_engine_part_is_refused(monkeypatch):
    model = _graph()
    g = model.graph
    monkeypatch.setitem(select._ENGINES, "odd", select.EngineSpec(lambda graph, sub, params, device: object(), "x:y"))
    with pytest.raises(FusionError, match="engine 'odd': its part factory returned a object, not a subclass of "
                                          "fusion.executors.engines.base.EnginePart"):
        select.make_engine_part("odd", g, subgraph(g, list(g.nodes)), model.params)

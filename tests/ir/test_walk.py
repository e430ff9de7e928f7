"""The one graph walk (fusion.ir.walk): environment, Ref resolution, what a part sends, errors naming the node.

The walk here calls plain Python functions on ints and lists, so each check is about the walk alone;
the engines and shape inference that override it are checked by their own tests (tests/executors/engines,
tests/ir) and against plain PyTorch (tests/executors/test_equivalence.py).
"""
from __future__ import annotations

import pytest

from fusion.ir.boundary import partition
from fusion.ir.errors import GraphError
from fusion.ir.graph import OpGraph, ParamSpec
from fusion.ir.node import NodeKind, OpNode, ParamRef, Ref
from fusion.ir.walk import GraphWalk


def _fail(*_):
    raise ValueError("bad value")


#: target -> the Python function the test walk calls for it
FUNCS = {
    "add": lambda a, b, scale=1: (a + b) * scale,
    "pair": lambda a: (a, 10 * a),
    "total": lambda xs, extra=None: sum(xs) + sum((extra or {}).values()),
    "fail": _fail,
    "graph_error": lambda a: (_ for _ in ()).throw(GraphError("checked by the op itself", "somewhere")),
}


class IntWalk(GraphWalk):
    """Calls FUNCS by target; parameters from a dict; placeholders fed as ints."""

    def __init__(self, graph, sub=None, params=None):
        self.params = params or {}
        self.calls: list[str] = []
        super().__init__(graph, sub)

    def call(self, node):
        if node.kind == NodeKind.OUTPUT:
            return None
        self.calls.append(node.name)
        return FUNCS[node.target]

    def param(self, name):
        return self.params[name]

    def fetch_placeholder(self, name, value):
        return int(value)

    def fetch_received(self, key, value, needs_grad):
        return ("received", value) if needs_grad else value


def _graph() -> OpGraph:
    g = OpGraph()
    g.add_param(ParamSpec("w", ()))
    g.add(OpNode("x", NodeKind.INPUT))
    g.add(OpNode("p", NodeKind.FUNCTION, "pair", args=(Ref("x"),)))  # (x, 10x)
    g.add(OpNode("a", NodeKind.FUNCTION, "add", args=(Ref("p", 1), ParamRef("w")), kwargs={"scale": 2}))
    g.add(OpNode("t", NodeKind.FUNCTION, "total", args=([Ref("p", 0), Ref("a"), 5],),
                 kwargs={"extra": {"w": ParamRef("w"), "one": 1}}))
    g.add(OpNode("loss", NodeKind.LOSS, "add", args=(Ref("t"), Ref("a"))))
    g.add(OpNode("out", NodeKind.OUTPUT, args=(Ref("t"),)))
    return g


def test_resolves_refs_params_literals_and_nested_containers():
    walk = IntWalk(_graph(), params={"w": 3})
    assert walk.calls == ["p", "a", "t", "loss"]  # callables made once, when the walk is built
    seen = []
    sent, losses = walk.run({}, walk.feed({"x": "2"}), lambda name, v: seen.append((name, v)))
    # p = (2, 20); a = (20 + w) * 2 = 46; t = 2 + 46 + 5 + (w + 1) = 57; loss = 57 + 46
    assert seen == [("x", 2), ("p", (2, 20)), ("a", 46), ("t", 57), ("loss", 103), ("out", 57)]
    assert losses == [103] and sent == {}
    assert walk.run({}, walk.feed({"x": 1}))[1] == [(10 + 3) * 2 + 1 + 26 + 5 + 4]  # runs again, fresh env
    steps = {s.name: s for s in walk.steps}
    assert steps["a"].fast and steps["a"].args == (Ref("p", 1), 3) and steps["a"].arg_refs == ((0, "p", 1),)
    assert not steps["t"].fast  # refs nested in a list and a dict: resolved per run


def test_part_env_receives_and_sends_by_key():
    g = _graph()
    subs = partition(g, {"x": "p0", "p": "p0", "a": "p0", "t": "p1", "loss": "p1", "out": "p1"})
    first, second = IntWalk(g, subs["p0"], {"w": 3}), IntWalk(g, subs["p1"], {"w": 3})
    assert first.send_keys == [("p", 0), ("a", None)] and not first.recv_keys
    assert set(second.recv_keys) == {("p", 0), ("a", None)} and second.placeholders == ()
    assert second.env_key(Ref("p", 0)) == (("p", 0), None) and first.env_key(Ref("p", 1)) == ("p", 1)
    sent, losses = first.run(first.receive({}), first.feed({"x": 2}))
    assert sent == {("p", 0): 2, ("a", None): 46} and losses == []
    # no shape metadata: every edge is taken to need a gradient, so fetch_received sees needs_grad=True
    leaves = IntWalk(g, subs["p1"], {"w": 3}).receive(sent)
    assert leaves == {("p", 0): ("received", 2), ("a", None): ("received", 46)}
    second.fetch_received = lambda key, value, needs_grad: value
    assert second.run(second.receive(sent), {})[1] == [57 + 46]


def test_missing_values_name_the_node():
    g = _graph()
    walk = IntWalk(g, params={"w": 3})
    with pytest.raises(GraphError, match="node 'x': no data fed to this placeholder"):
        walk.feed({})
    subs = partition(g, {"x": "p0", "p": "p0", "a": "p0", "t": "p1", "loss": "p1", "out": "p1"})
    with pytest.raises(GraphError, match=r"node 'p': missing activation \('p', 0\) from another part"):
        IntWalk(g, subs["p1"], {"w": 3}).receive({("a", None): 1})


def _failing_graph(target: str) -> OpGraph:
    g = OpGraph()
    g.add(OpNode("x", NodeKind.INPUT))
    g.add(OpNode("ok", NodeKind.FUNCTION, "pair", args=(Ref("x"),)))
    g.add(OpNode("bad", NodeKind.FUNCTION, target, args=(Ref("ok", 0),)))
    return g


def test_an_op_error_keeps_its_type_and_names_the_node():
    walk = IntWalk(_failing_graph("fail"))
    with pytest.raises(ValueError, match="bad value") as info:
        walk.run({}, walk.feed({"x": 1}))
    assert info.value.__notes__ == ["while running node 'bad' (fail)"]
    walk = IntWalk(_failing_graph("graph_error"))  # a GraphError already names its node: unchanged
    with pytest.raises(GraphError, match="node 'somewhere': checked by the op itself") as info:
        walk.run({}, walk.feed({"x": 1}))
    assert not getattr(info.value, "__notes__", None)


def test_failed_hook_chooses_the_error():
    class Strict(IntWalk):
        def failed(self, step, error):
            return GraphError(f"{step.node.target} failed: {error}", step.name)

    walk = Strict(_failing_graph("fail"))
    with pytest.raises(GraphError, match="node 'bad': fail failed: bad value") as info:
        walk.run({}, walk.feed({"x": 1}))
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_torch_engine_error_names_the_node():
    """The torch engine's interpreted walk: an op that fails on a bad feed names its node."""
    torch = pytest.importorskip("torch")
    from fusion.ir.builder import GraphBuilder
    from fusion.executors.engines.torch.engine import TorchPart
    from fusion.ir.boundary import subgraph

    b = GraphBuilder()
    x = b.input("x")
    h = b.module("fc", "torch.nn.Linear", x, in_features=4, out_features=3)
    b.output("y", h)
    model = b.build({"x": torch.zeros(2, 4)})
    part = TorchPart(model.graph, subgraph(model.graph, list(model.graph.nodes)), model.params, compiled=False)
    with pytest.raises(RuntimeError) as info:
        part.forward(0, {}, {"x": torch.zeros(2, 5)})
    assert info.value.__notes__ == ["while running node 'fc' (torch.nn.Linear)"]


def test_shape_inference_names_the_node():
    """Shape inference's walk on the meta device: a failing op and a missing example value name the node."""
    torch = pytest.importorskip("torch")
    from fusion.ir.builder import GraphBuilder

    def builder():
        b = GraphBuilder()
        b.output("y", b.module("fc", "torch.nn.Linear", b.input("x"), in_features=4, out_features=3))
        return b

    with pytest.raises(RuntimeError) as info:
        builder().build({"x": torch.zeros(2, 5)}, device="meta")
    assert info.value.__notes__ == ["while running node 'fc' (torch.nn.Linear)"]
    with pytest.raises(GraphError, match="^node 'x': no example value for this placeholder"):
        builder().build({}, device="meta")
    model = builder().build({"x": torch.zeros(2, 4)}, device="meta")
    assert model.graph["fc"].meta.outputs[0].shape == (2, 3) and model.graph["y"].meta.outputs[0].requires_grad

"""OpGraph <-> JSON: exact round trips, equal forward results, clear errors for bad files."""
import json
import math

import pytest
import torch

from fusion.executors.engines.torch.engine import TorchPart
from fusion.ir.boundary import subgraph
from fusion.ir.builder import GraphBuilder
from fusion.ir.errors import GraphError
from fusion.ir.graph import OpGraph
from fusion.ir.node import NodeKind, OpNode, ParamRef, Ref
from fusion.ir.serialize import decode_value, encode_value, graph_from_dict, graph_to_dict, load_graph, save_graph


def _strict_loads(text: str):
    def no_constants(c):
        raise AssertionError(f"non-standard JSON constant {c}")
    return json.loads(text, parse_constant=no_constants)


def _rich_model():
    """A graph whose arguments use every encodable kind of value."""
    b = GraphBuilder()
    x, y = b.input("x"), b.label("y")
    w = b.parameter("proj", torch.randn(6, 6, generator=torch.Generator().manual_seed(1)))
    h = b.module("fc", "torch.nn.Linear", x, in_features=6, out_features=6)
    h = b.function("proj_h", "torch.nn.functional.linear", h, w, None)  # ParamRef and None
    h = b.function("perm", "torch.Tensor.permute", h, (0, 2, 1))  # a tuple
    h = b.function("back", "torch.Tensor.transpose", h, 1, 2)
    b.function("split", "torch.split", h, [2, 4], dim=-1)  # a list and a multi-output node
    lo, hi = Ref("split", 0), Ref("split", 1)
    scores = b.function("scores", "torch.matmul", hi, b.function("hiT", "torch.Tensor.transpose", hi, -2, -1))
    ones = b.function("ones", "torch.ones", (4, 4), dtype=torch.bool)  # a dtype keyword
    causal = b.function("causal", "torch.triu", ones, 1)
    scores = b.function("masked", "torch.Tensor.masked_fill", scores, causal, float("-inf"))  # -inf
    att = b.function("att", "torch.softmax", scores, -1)
    z = b.function("mix", "torch.matmul", att, hi)
    z = b.function("tail", "torch.Tensor.__getitem__", z, (slice(None), slice(1, None, 2), Ellipsis))  # slices, ...
    z = b.function("scale", "torch.mul", z, 0.125)  # a float
    z = b.function("clamp", "torch.clamp", z, min=float("-inf"), max=1e30)
    n = b.function("n", "torch.Tensor.size", z, 0)  # a value output
    z = b.function("flat", "torch.Tensor.reshape", z, n, -1)
    lo = b.function("lo_flat", "torch.flatten", lo, 1)
    logits = b.function("logits", "torch.cat", [z, lo], dim=1)
    b.loss("loss", "torch.nn.CrossEntropyLoss", logits, y, label_smoothing=0.1, reduction="mean")  # module-type loss
    b.output("out", Ref("split", 1))
    example = {"x": torch.randn(3, 4, 6), "y": torch.tensor([0, 5, 7])}
    return b.build(example, seed=3), example


def _run(graph, params, feeds):
    part = TorchPart(graph, subgraph(graph, graph.nodes), params)
    outs = {}
    part.forward("k", {}, feeds, record=lambda name, v: outs.__setitem__(name, v))
    return outs


def test_json_round_trip_is_exact_and_runs_the_same():
    model, example = _rich_model()
    g = model.graph
    text = json.dumps(graph_to_dict(g))
    assert "Infinity" not in text and "NaN" not in text
    g2 = graph_from_dict(_strict_loads(text), "test").validate()
    assert graph_to_dict(g2) == graph_to_dict(g)
    assert list(g2.nodes) == list(g.nodes)
    for name, node in g.nodes.items():
        assert g2[name] == node, name  # dataclass equality: args, kwargs, attrs, params, meta
    assert g2["proj_h"].args[1:] == (ParamRef("proj"), None)
    assert g2["perm"].args[1] == (0, 2, 1) and isinstance(g2["perm"].args[1], tuple)
    assert isinstance(g2["split"].args[1], list)
    assert g2["ones"].kwargs["dtype"] is torch.bool
    assert g2["masked"].args[2] == float("-inf")
    assert g2["tail"].args[1] == (slice(None), slice(1, None, 2), Ellipsis)
    assert g2["lo_flat"].args[0] == Ref("split", 0)
    assert g2["loss"].attrs == {"label_smoothing": 0.1, "reduction": "mean"}
    assert g2["split"].meta.multi and len(g2["split"].meta.outputs) == 2
    assert g2.params == g.params and g2.plugins == g.plugins

    a, b = _run(g, model.params, example), _run(g2, model.params, example)
    assert set(a) == set(b) == set(g.nodes)
    for name in a:
        va, vb = a[name], b[name]
        if isinstance(va, torch.Tensor):
            assert torch.equal(va, vb), name
        elif isinstance(va, tuple) and isinstance(va[0], torch.Tensor):
            assert all(torch.equal(p, q) for p, q in zip(va, vb)), name
        else:
            assert va == vb, name
    assert math.isfinite(float(a["loss"].detach()))


def test_save_and_load_file(tmp_path):
    model, _ = _rich_model()
    path = tmp_path / "g.json"
    save_graph(model.graph, path)
    _strict_loads(path.read_text())
    assert graph_to_dict(load_graph(path)) == graph_to_dict(model.graph)


def test_literal_dicts_with_dollar_keys_and_special_values_round_trip():
    values = [
        {"$ref": 1, "$$x": [1, 2], "plain": (1, 2.5)},
        [None, True, 0, -3, "s", float("inf"), -float("inf")],
        slice(None, 5, None), Ellipsis, (Ref("a"), Ref("b", 2), ParamRef("p")),
        torch.float16, torch.device("cpu"), torch.Size([2, 3]), torch.channels_last,
    ]
    for v in values:
        back = decode_value(_strict_loads(json.dumps(encode_value(v))))
        if isinstance(v, torch.Size):
            assert back == tuple(v) and isinstance(back, tuple)
        else:
            assert back == v and type(back) is type(v), v
    nan = decode_value(_strict_loads(json.dumps(encode_value(float("nan")))))
    assert math.isnan(nan)


def test_unsavable_argument_is_rejected_naming_the_node():
    g = OpGraph()
    g.add(OpNode("x", NodeKind.INPUT))
    g.add(OpNode("bad", NodeKind.FUNCTION, "torch.mul", (Ref("x"), object())))
    with pytest.raises(GraphError, match="node 'bad': argument of type object cannot be saved"):
        graph_to_dict(g)
    g.nodes["bad"].args = (Ref("x"), {1: 2})
    with pytest.raises(GraphError, match="node 'bad': dict argument with non-string keys"):
        graph_to_dict(g)


def _graph_dict():
    b = GraphBuilder()
    x = b.input("x")
    b.loss("loss", "torch.sum", b.module("fc", "torch.nn.Linear", x, in_features=2, out_features=2))
    return graph_to_dict(b.build({"x": torch.zeros(1, 2)}, device="meta").graph)


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(format="onnx"), r"not a fusion OpGraph \(field 'format'"),
    (lambda d: d.pop("format"), r"not a fusion OpGraph"),
    (lambda d: d.update(version=99), r"unsupported OpGraph version 99"),
    (lambda d: d["nodes"][1].pop("kind"), r"nodes\[1\] \(fc\) is malformed"),
    (lambda d: d["nodes"][1].update(kind="magic"), r"nodes\[1\] \(fc\) is malformed"),
    (lambda d: d["nodes"][1].update(args=[{"$ref": ["x"]}]), r"nodes\[1\] \(fc\) is malformed"),
    (lambda d: d["nodes"][1].update(args=[{"$ref": "xy"}]), r"nodes\[1\] \(fc\) is malformed"),
    (lambda d: d["nodes"][1].update(args=[{"$slice": [1]}]), r"nodes\[1\] \(fc\) is malformed"),
    (lambda d: d["nodes"][1].update(args=[{"$float": "lots"}]), r"nodes\[1\] \(fc\) is malformed"),
    (lambda d: d["nodes"][1].update(args=[{"$dtype": "float99"}]), r"nodes\[1\] \(fc\) is malformed.*float99"),
    (lambda d: d["nodes"][1].update(kwargs=[1, 2]), r"nodes\[1\] \(fc\) is malformed"),
    (lambda d: d["nodes"][1]["meta"]["outputs"][0].update(shape="abc"), r"nodes\[1\] \(fc\) is malformed"),
    (lambda d: d["nodes"].__setitem__(2, "loss"), r"nodes\[2\] \(#2\) is malformed"),
    (lambda d: d["nodes"].append(dict(d["nodes"][0])), r"nodes\[3\] \(x\) repeats the node name"),
    (lambda d: d["params"][0].update(shape=None), r"params\[0\] is malformed"),
    (lambda d: d["params"][0].pop("name"), r"params\[0\] is malformed"),
    (lambda d: d["nodes"][1]["args"][0].update({"$ref": ["ghost", None]}), r"node 'fc': argument refers to missing node 'ghost'"),
])
def test_malformed_files_raise_graph_error_naming_the_source(tmp_path, mutate, message):
    d = _graph_dict()
    assert [n["name"] for n in d["nodes"]] == ["x", "fc", "loss"]
    mutate(d)
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(d))
    with pytest.raises(GraphError, match=message) as info:
        load_graph(path)
    assert str(path) in str(info.value)


def test_unreadable_files_name_the_path(tmp_path):
    path = tmp_path / "garbage.json"
    path.write_text("{not json")
    with pytest.raises(GraphError, match="garbage.json: cannot read graph"):
        load_graph(path)
    with pytest.raises(GraphError, match="missing.json: cannot read graph"):
        load_graph(tmp_path / "missing.json")
    with pytest.raises(GraphError, match="inline: not a fusion OpGraph"):
        graph_from_dict([1, 2], "inline")

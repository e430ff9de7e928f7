"""OpGraph: validation errors name the node; topological order; users; output metadata."""
import re

import pytest
import torch

from fusion.ir.builder import GraphBuilder
from fusion.ir.errors import FusionError, GraphError
from fusion.ir.graph import OpGraph, ParamSpec
from fusion.ir.node import NodeKind, OpNode, ParamRef, Ref, TensorMeta, ValueMeta
from tests.examples import load_example



def _mlp_graph() -> OpGraph:
    """x -> fc -> act -> loss(y), built by hand (no builder)."""
    g = OpGraph()
    g.add_param(ParamSpec("fc.weight", (3, 4)))
    g.add_param(ParamSpec("fc.bias", (3,)))
    g.add(OpNode("x", NodeKind.INPUT))
    g.add(OpNode("y", NodeKind.LABEL))
    g.add(OpNode("fc", NodeKind.MODULE, "torch.nn.Linear", (Ref("x"),), attrs={"in_features": 4, "out_features": 3},
                 params={"weight": "fc.weight", "bias": "fc.bias"}))
    g.add(OpNode("act", NodeKind.FUNCTION, "torch.tanh", (Ref("fc"),)))
    g.add(OpNode("loss", NodeKind.LOSS, "torch.nn.functional.cross_entropy", (Ref("act"), Ref("y"))))
    return g


def _raises_naming(node: str, pattern: str, fn, *args, **kwargs) -> GraphError:
    with pytest.raises(GraphError) as info:
        fn(*args, **kwargs)
    err = info.value
    assert isinstance(err, FusionError)
    assert err.node == node, f"error names {err.node!r}, expected {node!r}: {err}"
    assert f"node {node!r}" in str(err)
    assert re.search(pattern, str(err)), str(err)
    return err


def test_valid_graph_passes_and_keeps_insertion_order():
    g = _mlp_graph().validate()
    assert list(g.nodes) == ["x", "y", "fc", "act", "loss"]


def test_duplicate_name_is_rejected_naming_the_node():
    g = _mlp_graph()
    _raises_naming("act", "duplicate node name", g.add, OpNode("act", NodeKind.FUNCTION, "torch.relu", (Ref("fc"),)))
    b = GraphBuilder()
    b.input("x")
    _raises_naming("x", "duplicate", b.input, "x")


def test_parameter_declared_twice_with_different_shapes_is_rejected():
    g = _mlp_graph()
    with pytest.raises(GraphError, match="fc.weight.*declared twice"):
        g.add_param(ParamSpec("fc.weight", (4, 4)))
    g.add_param(ParamSpec("fc.weight", (3, 4)))  # the same spec again is fine (a tied parameter)


def test_unknown_op_type_is_rejected_naming_the_node():
    g = _mlp_graph()
    g.nodes["act"].target = "torch.nn.functional.no_such_function"
    _raises_naming("act", "unknown op type 'torch.nn.functional.no_such_function'", g.validate)
    g.nodes["act"].target = "mypackage.secret_function"  # outside the safe roots: never imported
    _raises_naming("act", "unknown op type 'mypackage.secret_function'.*register", g.validate)


def test_dangling_argument_is_rejected_naming_the_consumer():
    g = _mlp_graph()
    g.nodes["act"].args = (Ref("ghost"),)
    _raises_naming("act", "missing node 'ghost'", g.validate)
    g = _mlp_graph()  # nested inside a list argument too
    g.add(OpNode("cat", NodeKind.FUNCTION, "torch.cat", ([Ref("fc"), Ref("phantom")],), {"dim": 1}))
    _raises_naming("cat", "missing node 'phantom'", g.validate)


def test_cycle_is_rejected_naming_a_node_on_it():
    g = _mlp_graph()
    g.add(OpNode("a", NodeKind.FUNCTION, "torch.tanh", (Ref("b"),)))
    g.add(OpNode("b", NodeKind.FUNCTION, "torch.tanh", (Ref("a"),)))
    err = _raises_naming("a", "cycle", g.validate)
    assert "'b'" in str(err)  # the message lists the nodes caught in the cycle
    g = _mlp_graph()
    g.nodes["act"].args = (Ref("act"),)
    _raises_naming("act", "own output", g.validate)


def test_wrong_arity_is_rejected_naming_the_node():
    g = _mlp_graph()
    g.nodes["fc"].args = (Ref("x"), Ref("x"))  # Linear.forward takes one input
    _raises_naming("fc", r"wrong arity.*torch.nn.Linear.*at most 1.*got 2", g.validate)
    g = _mlp_graph()
    g.nodes["loss"].args = (Ref("act"),)  # cross_entropy needs input and target
    _raises_naming("loss", r"wrong arity.*at least 2.*got 1", g.validate)
    # the builder reports the same at build time
    b = GraphBuilder()
    x = b.input("x")
    b.module("fc", "torch.nn.Linear", x, x, in_features=4, out_features=3)
    _raises_naming("fc", "wrong arity", b.build, {"x": torch.zeros(2, 4)})


def test_placeholder_with_arguments_is_rejected():
    g = _mlp_graph()
    g.nodes["x"].args = (Ref("y"),)
    _raises_naming("x", "placeholder takes no target or arguments", g.validate)
    g = _mlp_graph()
    g.nodes["y"].target = "torch.zeros"
    _raises_naming("y", "label placeholder takes no target", g.validate)


def test_unknown_parameter_is_rejected_naming_the_node():
    g = _mlp_graph()
    g.nodes["fc"].params["bias"] = "fc.no_such_bias"
    _raises_naming("fc", "unknown parameter 'fc.no_such_bias'", g.validate)
    g = _mlp_graph()
    g.nodes["act"].target = "torch.mul"
    g.nodes["act"].args = (Ref("fc"), ParamRef("scale"))
    _raises_naming("act", "unknown parameter 'scale'", g.validate)


def test_kind_and_target_mismatches_are_rejected():
    g = _mlp_graph()
    g.nodes["act"].target = "torch.nn.Tanh"  # a module type on a function node
    _raises_naming("act", "is a module type; use a module node", g.validate)
    g = _mlp_graph()
    g.nodes["fc"].target = "torch.tanh"  # a function on a module node
    _raises_naming("fc", "is a function, not a module type", g.validate)
    g = _mlp_graph()
    g.nodes["act"].params = {"weight": "fc.weight"}  # function nodes own no parameters
    _raises_naming("act", "only module nodes own parameters", g.validate)
    g = _mlp_graph()
    g.nodes["act"].target = ""
    _raises_naming("act", "has no target op", g.validate)
    g = _mlp_graph()
    g.add(OpNode("out", NodeKind.OUTPUT, args=(Ref("fc"), Ref("act"))))
    _raises_naming("out", "exactly one argument", g.validate)


def test_lookup_of_missing_node_names_it():
    _raises_naming("nope", "no such node", _mlp_graph().__getitem__, "nope")


def test_topological_order_is_restored_and_stable():
    g = OpGraph()
    g.add(OpNode("loss", NodeKind.LOSS, "torch.sum", (Ref("mul"),)))
    g.add(OpNode("mul", NodeKind.FUNCTION, "torch.mul", (Ref("b"), Ref("a"))))
    g.add(OpNode("b", NodeKind.FUNCTION, "torch.cos", (Ref("x"),)))
    g.add(OpNode("a", NodeKind.FUNCTION, "torch.sin", (Ref("x"),)))
    g.add(OpNode("x", NodeKind.INPUT))
    order = g.topo_order()
    pos = {n: i for i, n in enumerate(order)}
    for node in g:
        for p in node.producers():
            assert pos[p] < pos[node.name]
    assert order == ["x", "b", "a", "mul", "loss"]  # ties broken by insertion order
    g.validate()
    assert list(g.nodes) == order


def test_users_and_param_users():
    g = _mlp_graph()
    g.add(OpNode("skip", NodeKind.FUNCTION, "operator.add", (Ref("fc"), Ref("fc"))))
    users = g.users()
    assert users["x"] == ["fc"]
    assert users["fc"] == ["act", "skip"]  # a node using fc twice is one user
    assert users["loss"] == [] and users["skip"] == []
    assert users["y"] == ["loss"]
    g.add(OpNode("scaled", NodeKind.FUNCTION, "torch.nn.functional.linear", (Ref("x"), ParamRef("fc.weight"))))
    pu = g.param_users()
    assert pu["fc.weight"] == ["fc", "scaled"] and pu["fc.bias"] == ["fc"]


def test_output_shapes_dtypes_and_requires_grad_after_build():
    fig7 = load_example("cnn_fig7")
    g = fig7.build(channels=8, batch=4).graph
    expect = {
        "x": ((4, 3, 8, 8), "float32", False),
        "y": ((4,), "int64", False),
        "conv1": ((4, 8, 8, 8), "float32", True),
        "myrelu": ((4, 8, 8, 8), "float32", True),
        "conv2": ((4, 8, 8, 8), "float32", True),
        "relu2": ((4, 8, 8, 8), "float32", True),
        "pool": ((4, 8, 4, 4), "float32", True),
        "flat": ((4, 128), "float32", True),
        "fc": ((4, 10), "float32", True),
        "loss": ((), "float32", True),
    }
    assert set(g.nodes) == set(expect)
    for name, (shape, dtype, rg) in expect.items():
        meta = g[name].meta
        assert meta.outputs == (TensorMeta(shape, dtype, rg),), name
        assert meta.multi is False
    assert g["fc"].meta.output_bytes == 4 * 10 * 4
    assert g.params["conv1.weight"] == ParamSpec("conv1.weight", (8, 3, 3, 3), "float32", True)


def test_multi_output_value_outputs_and_non_grad_paths():
    b = GraphBuilder()
    x, y = b.input("x"), b.label("y")
    h = b.module("fc", "torch.nn.Linear", x, in_features=4, out_features=6)
    halves = b.function("halves", "torch.chunk", h, 2, 1)  # a tuple of two tensors
    n = b.function("n", "torch.Tensor.size", x, 0)  # an int known at build time
    shape = b.function("shape", "torch.Tensor.size", h)  # a torch.Size
    xs = b.function("xs", "torch.mul", x, 2.0)  # depends on data only: no gradient
    lo = b.function("lo", "operator.add", Ref("halves", 0), Ref("halves", 1))
    lo = b.function("view", "torch.Tensor.reshape", lo, n, -1)
    lo = b.function("plus", "operator.add", lo, b.function("xs3", "torch.Tensor.__getitem__", xs, (slice(None), slice(0, 3))))
    b.loss("loss", "torch.nn.functional.cross_entropy", lo, y)
    g = b.build({"x": torch.zeros(5, 4), "y": torch.zeros(5, dtype=torch.long)}, device="meta").graph
    assert g["halves"].meta.multi is True
    assert g["halves"].meta.outputs == (TensorMeta((5, 3), "float32", True), TensorMeta((5, 3), "float32", True))
    assert g["n"].meta.outputs == (ValueMeta(5),)
    assert g["shape"].meta.outputs == (ValueMeta((5, 6)),)
    assert g["xs"].meta.outputs == (TensorMeta((5, 4), "float32", False),)
    assert g["xs3"].meta.outputs == (TensorMeta((5, 3), "float32", False),)
    assert g["plus"].meta.outputs == (TensorMeta((5, 3), "float32", True),)
    assert g["n"].meta.output_bytes == 0

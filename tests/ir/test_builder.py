"""The op-node API (FusionLLM Figure 7): GraphBuilder."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fusion
from fusion.executors.reference import ReferenceExecutor
from fusion.executors.engines.torch.engine import TorchPart
from fusion.ir.boundary import subgraph
from fusion.ir.builder import GraphBuilder
from fusion.ir.errors import GraphError
from fusion.ir.graph import ParamSpec
from fusion.ir.model import Model
from fusion.ir.node import NodeKind, ParamRef, Ref, TensorMeta
from fusion.ir.serialize import graph_from_dict, graph_to_dict


@fusion.register_module("test_builder.Scale")
class Scale(nn.Module):
    """A user module with a parameter and a call keyword."""

    def __init__(self, dim: int):
        super().__init__()
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, dim))

    def forward(self, x, power: float = 1.0):
        return x * self.gain ** power


@fusion.register_function("test_builder.swish")
def swish(x, beta: float = 1.0):
    return x * torch.sigmoid(beta * x)


def _feeds(n=3, d=4, classes=5):
    g = torch.Generator().manual_seed(0)
    return {"x": torch.randn(n, d, generator=g), "y": torch.randint(0, classes, (n,), generator=g)}


def _build(device="cpu", seed=0):
    b = GraphBuilder()
    x, y = b.input("x", label="features"), b.label("y", label="targets")
    h = b.module("fc", nn.Linear, x, in_features=4, out_features=4, label="first layer")  # a class, not a name
    h = b.module("scale", Scale, h, dim=4, call_kwargs={"power": 2.0})  # user module by class
    h = b.function("act", swish, h, beta=2.0, label="user function")  # user function by object
    h = b.module("scale2", "test_builder.Scale", h, dim=4)  # user module by name
    o = b.module("head", "torch.nn.Linear", h, in_features=4, out_features=5, bias=False)
    b.loss("loss", "torch.nn.functional.cross_entropy", o, y, label="CE")
    return b.build(_feeds(), seed=seed, device=device)


def test_nodes_targets_params_labels_and_plugins():
    m = _build()
    assert isinstance(m, Model)
    g = m.graph
    assert [(n.name, n.kind, n.target) for n in g] == [
        ("x", NodeKind.INPUT, ""), ("y", NodeKind.LABEL, ""), ("fc", NodeKind.MODULE, "torch.nn.Linear"),
        ("scale", NodeKind.MODULE, "test_builder.Scale"), ("act", NodeKind.FUNCTION, "test_builder.swish"),
        ("scale2", NodeKind.MODULE, "test_builder.Scale"), ("head", NodeKind.MODULE, "torch.nn.Linear"),
        ("loss", NodeKind.LOSS, "torch.nn.functional.cross_entropy")]
    assert g["fc"].args == (Ref("x"),) and g["fc"].attrs == {"in_features": 4, "out_features": 4}
    assert g["fc"].params == {"weight": "fc.weight", "bias": "fc.bias"}
    assert g["scale"].kwargs == {"power": 2.0} and g["scale"].params == {"gain": "scale.gain"}
    assert g["act"].kwargs == {"beta": 2.0}
    assert g["head"].params == {"weight": "head.weight"}  # bias=False: no bias parameter
    assert {n.name: n.label for n in g if n.label} == {
        "x": "features", "y": "targets", "fc": "first layer", "act": "user function", "loss": "CE"}
    assert list(g.params) == ["fc.weight", "fc.bias", "scale.gain", "scale2.gain", "head.weight"]
    assert set(m.params) == set(g.params)
    assert g.plugins == [__name__]  # where the user ops live, for executors to import
    assert graph_to_dict(graph_from_dict(graph_to_dict(g))) == graph_to_dict(g)  # labels etc. survive saving


def test_forward_uses_the_registered_ops():
    m = _build()
    p = {k: torch.as_tensor(v) for k, v in m.params.items()}
    f = _feeds()
    h = F.linear(f["x"], p["fc.weight"], p["fc.bias"]) * p["scale.gain"] ** 2
    h = h * torch.sigmoid(2.0 * h) * p["scale2.gain"]
    want = F.cross_entropy(h @ p["head.weight"].T, f["y"])
    part = TorchPart(m.graph, subgraph(m.graph, m.graph.nodes), m.params)
    _, loss = part.forward(0, {}, f)
    np.testing.assert_allclose(loss, want.item(), rtol=1e-6)


def test_seeded_initialisation_is_deterministic_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a, b, c = _build(seed=0), _build(seed=0), _build(seed=1)
    assert torch.equal(torch.random.get_rng_state(), before)
    for k in a.params:
        assert torch.equal(a.params[k], b.params[k]), k
    assert not torch.equal(a.params["fc.weight"], c.params["fc.weight"])
    torch.manual_seed(0)
    assert torch.equal(a.params["fc.weight"], nn.Linear(4, 4).weight.detach())  # the module's own init, seeded


def test_tied_parameter_via_params_is_one_graph_parameter():
    b = GraphBuilder()
    tok, y = b.input("tok"), b.label("y")
    e = b.module("emb", "torch.nn.Embedding", tok, num_embeddings=7, embedding_dim=4)
    h = b.function("mean", "torch.mean", e, 1)
    o = b.module("out", "torch.nn.Linear", h, in_features=4, out_features=7, bias=False, params={"weight": "emb.weight"})
    b.loss("loss", "torch.nn.functional.cross_entropy", o, y)
    m = b.build({"tok": torch.tensor([[1, 2], [3, 4]]), "y": torch.tensor([0, 6])})
    g = m.graph
    assert list(g.params) == ["emb.weight"]
    assert g["out"].params == {"weight": "emb.weight"}
    assert g.param_users()["emb.weight"] == ["emb", "out"]
    # the two nodes share one nn.Parameter inside a part, so its gradient is the sum of both uses
    part = TorchPart(g, subgraph(g, g.nodes), m.params)
    assert part.modules["emb"].weight is part.modules["out"].weight
    part.forward(0, {}, {"tok": torch.tensor([[1, 2], [3, 4]]), "y": torch.tensor([0, 6])})
    part.backward(0, {})
    w = torch.as_tensor(m.params["emb.weight"]).clone().requires_grad_(True)
    F.cross_entropy(F.embedding(torch.tensor([[1, 2], [3, 4]]), w).mean(1) @ w.T, torch.tensor([0, 6])).backward()
    np.testing.assert_allclose(part.grads()["emb.weight"], w.grad.numpy(), rtol=1e-5, atol=1e-7)
    # a tie between tensors of different shapes is refused
    b2 = GraphBuilder()
    x = b2.input("x")
    b2.module("emb", "torch.nn.Embedding", x, num_embeddings=7, embedding_dim=4)
    with pytest.raises(GraphError, match="emb.weight.*declared twice with different specs"):
        b2.module("out", "torch.nn.Linear", x, in_features=4, out_features=3, params={"weight": "emb.weight"})


def test_free_parameters_and_buffers():
    b = GraphBuilder()
    x = b.input("x")
    w = b.parameter("w", torch.full((4,), 2.0))
    c = b.parameter("shift", torch.ones(4), trainable=False)
    h = b.function("mul", "torch.mul", x, w)
    h = b.function("add", "torch.add", h, c)
    h = b.module("bn", "torch.nn.BatchNorm1d", h, num_features=4)
    b.loss("loss", "torch.sum", h)
    m = b.build({"x": torch.randn(3, 4)})
    g = m.graph
    assert g["mul"].args == (Ref("x"), ParamRef("w"))
    assert g.params["w"] == ParamSpec("w", (4,), "float32", True)
    assert g.params["shift"] == ParamSpec("shift", (4,), "float32", False)
    assert g.params["bn.running_mean"].trainable is False
    assert g.params["bn.num_batches_tracked"] == ParamSpec("bn.num_batches_tracked", (), "int64", False)
    assert torch.equal(m.params["w"], torch.full((4,), 2.0))
    part = TorchPart(g, subgraph(g, g.nodes), m.params)
    assert set(part.trainable()) == {"w", "bn.weight", "bn.bias"}


def test_meta_device_build_has_shapes_but_no_weights():
    m = _build(device="meta")
    assert m.params == {}
    assert m.graph["head"].meta.outputs == (TensorMeta((3, 5), "float32", True),)
    assert m.graph["loss"].meta.outputs == (TensorMeta((), "float32", True),)
    with pytest.raises(GraphError, match="node 'fc': no initial value for parameter 'fc.weight'"):
        ReferenceExecutor(m)


def test_builder_errors_name_the_node_or_the_op():
    b = GraphBuilder()
    x = b.input("x")
    with pytest.raises(GraphError, match="node 'm': unknown module type 'torch.nn.NoSuchLayer'"):
        b.module("m", "torch.nn.NoSuchLayer", x)
    with pytest.raises(GraphError, match="node 'f': unknown module type 'torch.tanh'"):
        b.module("f", "torch.tanh", x)
    with pytest.raises(GraphError, match="node 'lin': cannot build torch.nn.Linear"):
        b.module("lin", "torch.nn.Linear", x, in_features=4)  # out_features missing
    with pytest.raises(GraphError, match="node 'g': .*lambda.* is not a registered op"):
        b.function("g", lambda t: t * 2, x)
    with pytest.raises(GraphError, match="node 'h': .*Unregistered.* is not a registered op"):
        b.module("h", type("Unregistered", (nn.Module,), {}), x)
    with pytest.raises(GraphError, match="node 'l': .*is not a registered op"):
        b.loss("l", lambda a: a.sum(), x)
    b.function("u", "torch.no_such_function", x)
    with pytest.raises(GraphError, match="node 'u': unknown op type"):
        b.build({"x": torch.zeros(2, 4)})


def test_module_type_loss_and_output_nodes():
    b = GraphBuilder()
    x, y = b.input("x"), b.label("y")
    o = b.module("fc", "torch.nn.Linear", x, in_features=4, out_features=5)
    b.output("logits", o)
    b.loss("loss", nn.CrossEntropyLoss, o, y, label_smoothing=0.2)
    m = b.build(_feeds())
    assert m.graph["loss"].attrs == {"label_smoothing": 0.2} and m.graph["loss"].kwargs == {}
    assert m.graph["logits"].kind == NodeKind.OUTPUT and m.graph["logits"].meta.outputs[0].shape == (3, 5)
    part = TorchPart(m.graph, subgraph(m.graph, m.graph.nodes), m.params)
    _, loss = part.forward(0, {}, _feeds())
    f = _feeds()
    want = F.cross_entropy(F.linear(f["x"], m.params["fc.weight"], m.params["fc.bias"]), f["y"], label_smoothing=0.2)
    np.testing.assert_allclose(loss, want.item(), rtol=1e-6)


def test_library_function_objects_resolve_to_their_public_names():
    import operator

    b = GraphBuilder()
    x = b.input("x")
    h = b.function("t", torch.tanh, x)
    h = b.function("g", F.gelu, h)
    b.function("a", operator.add, h, x)
    assert [n.target for n in b.graph][1:] == ["torch.tanh", "torch.nn.functional.gelu", "operator.add"]
    with pytest.raises(GraphError, match="not a registered op"):
        b.function("bad", lambda v: v, x)

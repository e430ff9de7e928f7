"""The PyTorch tracing front end: structure of traced graphs, both methods, errors, serialisation."""
import logging

import numpy as np
import pytest
import torch
from torch import nn

from tests.ir._trace_models import AttnNet, HFStyle, TiedLM, contiguous_parts, load_gpt, plain_step
from fusion.plan import OptimizerConfig
from fusion.executors.reference import ReferenceExecutor
from fusion.ir.boundary import subgraph
from fusion.ir import GraphError, NodeKind, Ref, register_module
from fusion.ir.serialize import graph_to_dict, load_graph, save_graph
from fusion.ir.model import Model
from fusion.ir.trace import trace

gpt = load_gpt()


@pytest.fixture(scope="module")
def tiny():
    return gpt.tiny()


@pytest.fixture(scope="module")
def fx_model(tiny):
    return trace(*tiny, method="fx")


def _kinds(g):
    out = {}
    for n in g:
        out.setdefault(n.kind, []).append(n)
    return out


def test_gpt_fx_module_granularity(fx_model):
    g = fx_model.graph
    kinds = _kinds(g)
    assert [n.name for n in kinds[NodeKind.INPUT]] == ["idx"]
    assert [n.name for n in kinds[NodeKind.LABEL]] == ["targets"]  # GPT.fusion_labels
    (loss,) = kinds[NodeKind.LOSS]
    assert loss.target == "torch.nn.functional.cross_entropy" and loss.meta.outputs[0].shape == ()
    targets = {n.target for n in kinds[NodeKind.MODULE]}
    assert {"torch.nn.Embedding", "torch.nn.Linear", "torch.nn.LayerNorm", "torch.nn.Dropout"} <= targets
    c_attn = g["transformer_h_0_attn_c_attn"]
    assert c_attn.attrs == {"in_features": 32, "out_features": 96, "bias": True}
    assert c_attn.params == {"weight": "transformer.h.0.attn.c_attn.weight", "bias": "transformer.h.0.attn.c_attn.bias"}
    assert c_attn.meta.outputs[0].shape == (2, 16, 96) and c_attn.meta.outputs[0].requires_grad
    funcs = {n.target for n in kinds[NodeKind.FUNCTION]}
    assert {"torch.nn.functional.gelu", "operator.add", "torch.Tensor.view", "torch.Tensor.split"} <= funcs
    # shapes are static: x.size() and its arithmetic are folded away, so are getitems on split
    assert "torch.Tensor.size" not in funcs and "operator.floordiv" not in funcs and "operator.getitem" not in funcs
    # idx.device folds to a device literal, which an engine reads as "the device this part runs on"
    assert "builtins.getattr" not in funcs and g["arange"].kwargs["device"] == torch.device("cpu")
    views = [n for n in g if n.target == "torch.Tensor.view" and isinstance(n.args[0], Ref) and n.args[0].node == "split"]
    assert sorted(n.args[0].index for n in views) == [0, 1, 2]
    assert g["split"].meta.multi and len(g["split"].meta.outputs) == 3
    # every trainable tensor of the module is a graph parameter under its state_dict name
    module = gpt.tiny()[0]
    assert set(g.params) == {n for n, _ in module.named_parameters()}
    assert set(fx_model.params) == set(g.params)
    for name, t in module.state_dict().items():
        if name in fx_model.params:
            assert torch.equal(torch.as_tensor(fx_model.params[name]), t)
    assert set(fx_model.example) == {"idx", "targets"}


def test_tied_embedding_is_one_parameter_used_twice(fx_model):
    g = fx_model.graph
    assert "transformer.wte.weight" in g.params and "lm_head.weight" not in g.params
    users = g.param_users()["transformer.wte.weight"]
    assert users == ["transformer_wte", "lm_head"]
    assert g["lm_head"].params == {"weight": "transformer.wte.weight"}


@pytest.mark.parametrize("method", ["fx", "export"])
def test_tied_through_functional_linear(method):
    m = TiedLM()
    ex = {"x": torch.randint(0, 16, (2, 5)), "y": torch.randint(0, 16, (2, 5))}
    model = trace(m, ex, method=method)
    g = model.graph
    assert [p for p in g.params if "wte" in p] == ["wte.weight"]
    users = g.param_users()["wte.weight"]
    assert len(users) == 2
    linear = g[users[1]]
    assert linear.kind == NodeKind.FUNCTION and linear.target in ("torch.nn.functional.linear", "aten.linear.default")
    assert g.nodes[users[0]].kind == NodeKind.MODULE and g.nodes[users[0]].target == "torch.nn.Embedding"
    # split the two users of the tied weight over two parts: the executor sums their gradients
    assign = {n: ("a" if n in ("x", users[0]) else "b") for n in g.nodes}
    ex_ = ReferenceExecutor(model, assign, OptimizerConfig("sgd", lr=0.5))
    assert ex_.shared == {"wte.weight": ["a", "b"]}
    ref = TiedLM()
    ref.load_state_dict(m.state_dict())
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for _ in range(3):
        r = ex_.step(ex)
        loss, grads = plain_step(ref, opt, ex, 1)
        np.testing.assert_allclose(r.loss, loss, rtol=1e-5)
        for n, gr in grads.items():
            np.testing.assert_allclose(r.grads[n], gr.numpy(), rtol=1e-4, atol=1e-7)
    for n, p in ref.named_parameters():
        np.testing.assert_allclose(ex_.state()[n], p.detach().numpy(), rtol=1e-4, atol=1e-7)


def test_export_op_and_module_granularity(tiny):
    op = trace(*tiny, granularity="op").graph
    mod = trace(*tiny, method="export").graph
    assert all(n.target.startswith("aten.") for n in op if n.kind in (NodeKind.FUNCTION, NodeKind.LOSS))
    assert not _kinds(op).get(NodeKind.MODULE)
    assert {"aten.linear.default", "aten.layer_norm.default", "aten.embedding.default",
            "aten.scaled_dot_product_attention.default"} <= {n.target for n in op}
    # op-level parameters are ParamRefs with their original names; the tied one is shared
    assert set(op.params) == set(mod.params) == {n for n, _ in tiny[0].named_parameters()}
    assert len(op.param_users()["transformer.wte.weight"]) == 2
    # module granularity regroups the aten nodes of each leaf module into one MODULE node
    modules = {n.name: n for n in mod if n.kind == NodeKind.MODULE}
    assert modules["transformer_h_1_mlp_c_fc"].target == "torch.nn.Linear"
    assert modules["transformer_h_1_mlp_c_fc"].params["weight"] == "transformer.h.1.mlp.c_fc.weight"
    assert modules["lm_head"].params == {"weight": "transformer.wte.weight"}
    assert len(modules) == len([n for n in _kinds(trace(*tiny, method="fx").graph)[NodeKind.MODULE]])
    # indexed outputs of the multi-output split, no getitem left
    assert "operator.getitem" not in {n.target for n in op}
    assert any(isinstance(a, Ref) and a.index == 2 for n in op for a in n.args)


def test_auto_falls_back_to_export_for_hf_style_model(caplog):
    m = HFStyle()
    ex = {"input_ids": torch.randint(0, 16, (4, 6)), "labels": torch.randint(0, 16, (4, 6)), "use_cache": True}
    with pytest.raises(GraphError, match="torch.fx cannot trace HFStyle: TraceError"):
        trace(m, ex, labels=("labels",), loss_index="loss", method="fx")
    with caplog.at_level(logging.INFO, logger="fusion.ir.trace"):
        model = trace(m, ex, labels=("labels",), loss_index="loss")
    assert "falling back to torch.export" in caplog.text
    g = model.graph
    assert g["labels"].kind == NodeKind.LABEL and g["input_ids"].kind == NodeKind.INPUT
    assert [n.kind for n in g if n.name.startswith("output_")] == [NodeKind.OUTPUT] * 3  # cache (2) + logits
    assert _kinds(g)[NodeKind.LOSS][0].target == "aten.cross_entropy_loss.default"
    assert {n.target for n in _kinds(g)[NodeKind.MODULE]} == {"torch.nn.Embedding", "torch.nn.Linear"}
    # the exported graph trains like the module, split in two parts
    ex_ = ReferenceExecutor(model, contiguous_parts(g, 2), OptimizerConfig("adamw", lr=1e-2), micro_batches=2,
                            schedule="1f1b")
    ref = HFStyle()
    ref.load_state_dict(m.state_dict())
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    batch = {"input_ids": ex["input_ids"], "labels": ex["labels"]}
    for _ in range(3):
        r = ex_.step(batch)
        loss, grads = plain_step(ref, opt, batch, 2, loss_of=lambda out: out["loss"])
        np.testing.assert_allclose(r.loss, loss, rtol=1e-5)
        for n, gr in grads.items():
            np.testing.assert_allclose(r.grads[n], gr.numpy(), rtol=1e-4, atol=1e-6)
    dropped = trace(m, ex, labels=("labels",), loss_index="loss", keep_outputs=False).graph
    assert not _kinds(dropped).get(NodeKind.OUTPUT)


def test_inference_graph_has_outputs_and_no_loss():
    m = HFStyle()
    model = trace(m, {"input_ids": torch.randint(0, 16, (2, 6))}, method="export")
    kinds = _kinds(model.graph)
    assert NodeKind.LOSS not in kinds
    assert [n.name for n in kinds[NodeKind.OUTPUT]] == ["output_logits"]
    assert kinds[NodeKind.OUTPUT][0].meta.outputs[0].shape == (2, 6, 16)
    ex_ = ReferenceExecutor(model)
    out = {}
    part = ex_.engines["p0"]
    part.forward(0, {}, {"input_ids": model.example["input_ids"]}, record=lambda n, v: out.setdefault(n, v))
    with torch.no_grad():
        want = m(model.example["input_ids"])["logits"]
    torch.testing.assert_close(out["output_logits"], want, rtol=1e-6, atol=1e-6)


def test_leaf_with_tuple_output_crosses_parts_indexed():
    m = AttnNet()
    ex = {"x": torch.randn(4, 5, 8), "y": torch.randn(4, 5)}
    model = trace(m, ex, method="fx")
    g = model.graph
    assert g["attn"].target == "torch.nn.MultiheadAttention" and g["attn"].meta.multi
    assert g["attn"].kwargs == {"need_weights": False}
    assign = {n: ("a" if n in ("x", "attn") else "b") for n in g.nodes}
    sub = subgraph(g, [n for n, p in assign.items() if p == "b"])
    assert {(e.producer, e.index) for e in sub.boundary.required_acts} == {("attn", 0), ("x", None)}
    ex_ = ReferenceExecutor(model, assign, OptimizerConfig("sgd", lr=0.1), micro_batches=2)
    ref = AttnNet()
    ref.load_state_dict(m.state_dict())
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(2):
        r = ex_.step(ex)
        loss, grads = plain_step(ref, opt, ex, 2)
        np.testing.assert_allclose(r.loss, loss, rtol=1e-5)
        for n, gr in grads.items():
            np.testing.assert_allclose(r.grads[n], gr.numpy(), rtol=1e-4, atol=1e-6)


class _Scale(nn.Module):
    def __init__(self, d: int, init: float = 1.0):
        super().__init__()
        self.d, self.init = d, init
        self.w = nn.Parameter(torch.full((d,), init))

    def forward(self, x):
        return x * self.w


class _UsesScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.s = _Scale(4, 2.0)

    def forward(self, x):
        return self.s(x).pow(2).mean()


def test_registered_module_type_is_a_leaf():
    plain = trace(_UsesScale(), {"x": torch.randn(3, 4)})  # unregistered: traced through
    assert "s" not in plain.graph.nodes and "s.w" in plain.graph.params
    register_module("tests.ir.test_trace.Scale", _Scale)
    model = trace(_UsesScale(), {"x": torch.randn(3, 4)})
    node = model.graph["s"]
    assert (node.kind, node.target, node.attrs, node.params) == (
        NodeKind.MODULE, "tests.ir.test_trace.Scale", {"d": 4, "init": 2.0}, {"w": "s.w"})
    assert ReferenceExecutor(model).step(model.example).loss == pytest.approx(_UsesScale()(model.example["x"]).item())


def test_meta_module_traces_without_memory(fx_model):
    module, example = gpt.gpt_model(gpt.TINY, batch=2, device="meta")
    model = trace(module, example)
    assert model.params == {}
    assert list(model.graph.nodes) == list(fx_model.graph.nodes)
    assert model.graph.params == fx_model.graph.params
    for a, b in zip(model.graph, fx_model.graph):
        assert a.meta.outputs == b.meta.outputs, a.name


def test_serialisation_round_trip_reruns_same_loss(fx_model, tmp_path):
    path = tmp_path / "gpt.json"
    save_graph(fx_model.graph, path)
    g2 = load_graph(path)
    assert graph_to_dict(g2) == graph_to_dict(fx_model.graph)
    batch = {k: torch.cat([v, v.flip(0)]) for k, v in fx_model.example.items()}
    losses = []
    for g in (fx_model.graph, g2):
        ex_ = ReferenceExecutor(Model(g, fx_model.params, fx_model.example), contiguous_parts(g, 2),
                                OptimizerConfig("sgd", lr=0.1), micro_batches=2)
        losses.append([ex_.step(batch).loss for _ in range(2)])
    assert losses[0] == losses[1]


class _InPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        h = self.fc(x)
        h.mul_(2)  # read below through h: later readers must see the doubled value
        h += 1.0
        h = self.act(h)
        return (h * x).sum() + h.pow(2).sum()


class _ThroughView(nn.Module):
    def forward(self, x):
        h = x * 2
        v = h.view(-1)
        v.add_(1)  # also changes h, which is read below
        return (h * x).sum()


@pytest.mark.parametrize("method", ["fx", "export"])
def test_in_place_ops_are_rewritten_out_of_place(method):
    m = _InPlace()
    x = torch.randn(3, 4)
    model = trace(m, {"x": x}, method=method)
    targets = [n.target for n in model.graph]
    assert not any(t.endswith("_") or t.startswith("operator.i") for t in targets), targets
    assert all(n.attrs.get("inplace") in (None, False) for n in model.graph)
    r = ReferenceExecutor(model, optimizer=OptimizerConfig("sgd", lr=0.1)).step({"x": x})
    want = m(x)
    want.backward()
    np.testing.assert_allclose(r.loss, want.item(), rtol=1e-6)
    np.testing.assert_allclose(r.grads["fc.weight"], m.fc.weight.grad.numpy(), rtol=1e-5)


def test_mutation_through_a_view_is_refused():
    with pytest.raises(GraphError, match="changes view 'view' of a value read later"):
        trace(_ThroughView(), {"x": torch.randn(3)}, method="fx")


class _DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        if h.sum() > 0:  # depends on values: neither fx nor export can trace it
            h = h * 2
        return h.sum()


def test_untraceable_module_names_one_reason():
    """One line, export's reason (it follows more than fx): the construct and where it is."""
    with pytest.raises(GraphError, match=r"^cannot trace _DataDependent: Python control flow on a tensor value .*forward, "
                                         r"in the top-level forward$"):
        trace(_DataDependent(), {"x": torch.randn(2, 4)})


@pytest.mark.parametrize("kwargs, match", [
    (dict(example={"x": torch.zeros(1), "z": torch.zeros(1)}), "names 'z', which is not an argument"),
    (dict(example={}), "lacks required forward argument 'x'"),
    (dict(example={"x": torch.zeros(2, 4)}, labels=("y",)), "label 'y' is not a tensor"),
    (dict(example={"x": torch.zeros(2, 4)}, granularity="op", method="fx"), "needs method 'export'"),
    (dict(example={"x": torch.zeros(2, 4)}, granularity="layer"), "granularity must be one of"),
])
def test_bad_arguments_are_clear_errors(kwargs, match):
    with pytest.raises(GraphError, match=match):
        trace(_DataDependent(), **kwargs)


def test_loss_must_be_scalar():
    class Vec(nn.Module):
        def forward(self, x):
            return x * 2, x.sum()

    with pytest.raises(GraphError, match="loss must be a floating-point scalar"):
        trace(Vec(), {"x": torch.randn(3)}, loss_index=0)
    with pytest.raises(GraphError, match="loss_index 2 is out of range: forward returns 2 values"):
        trace(Vec(), {"x": torch.randn(3)}, loss_index=2)
    with pytest.raises(GraphError, match="loss_index=0 given but forward returns a single value"):
        trace(_UsesScale(), {"x": torch.randn(3, 4)}, loss_index=0)
    g = trace(Vec(), {"x": torch.randn(3)}, loss_index=1).graph
    assert [n.kind for n in g if n.kind != NodeKind.INPUT] == [NodeKind.FUNCTION, NodeKind.LOSS, NodeKind.OUTPUT]

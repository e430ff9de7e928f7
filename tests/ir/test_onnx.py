"""ONNX front end: torch module -> torch.onnx.export -> load_onnx -> fusion training == the torch module.

Initializer names are the module's ``state_dict`` names (the dynamo exporter
keeps them), so the imported model's initial weights load straight into a
fresh copy of the module and every gradient is compared by parameter name.
"""
import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper

from fusion.cli import main as cli_main
from fusion.plan import OptimizerConfig
from fusion.executors.engines.numpy.engine import supports as numpy_supports
from fusion.executors.reference import ReferenceExecutor
from fusion.ir.errors import GraphError
from fusion.ir.node import NodeKind
from fusion.ir.onnx.importer import load_onnx
from fusion.loader import load_model
from fusion.ir.serialize import copy_graph, graph_from_dict, graph_to_dict

from tests.ir.onnx_models import MLP, BranchCNN, assert_trains_like, export, tiny_transformer_module, two_part_assignment


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    d = tmp_path_factory.mktemp("onnx")
    torch.manual_seed(0)
    mlp, cnn = MLP(), BranchCNN()
    with torch.no_grad():  # non-trivial BatchNorm statistics, so eval mode is really tested
        cnn.bn.running_mean.uniform_(-0.5, 0.5)
        cnn.bn.running_var.uniform_(0.5, 2.0)
    tt = tiny_transformer_module()
    gpt, gpt_args = tt.model()
    return {
        "mlp": (mlp, export(mlp, (torch.randn(2, 8),), d / "mlp.onnx")),
        "cnn": (cnn, export(cnn, (torch.randn(2, 3, 8, 8),), d / "cnn.onnx")),
        "gpt": (gpt, export(gpt, gpt_args, d / "gpt.onnx")),
        "tt": tt,
    }


def _fresh(exported, name, model):
    """A copy of the original module holding the imported model's initial weights (eval mode)."""
    orig = exported[name][0]
    m = type(orig)() if name != "gpt" else exported["tt"].TinyTransformer()
    state = {k: torch.as_tensor(np.array(v)) for k, v in model.params.items() if k in orig.state_dict()}
    buffers = {k: v for k, v in orig.state_dict().items() if k not in state}
    m.load_state_dict({**state, **buffers})
    return m.eval()


def _batches(name, n):
    g = torch.Generator().manual_seed(7)
    if name == "mlp":
        return [(torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)) for _ in range(2)]
    if name == "cnn":
        return [(torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 5, (n,), generator=g)) for _ in range(2)]
    return [(torch.randint(0, 13, (n, 8), generator=g), torch.randint(0, 13, (n, 8), generator=g)) for _ in range(2)]


CASES = [("mlp", 1, "sgd", "torch"), ("mlp", 2, "adamw", "torch"), ("cnn", 1, "sgd", "torch"), ("cnn", 2, "adamw", "torch"),
         ("gpt", 1, "adamw", "torch"), ("gpt", 2, "sgd", "torch"),
         # the NumPy engine on some or all parts (SGD for the GPT: see the AdamW note in docs/engines.md)
         ("mlp", 1, "adamw", "numpy"), ("mlp", 2, "sgd", "torch+numpy"), ("gpt", 1, "sgd", "numpy"), ("gpt", 2, "sgd", "numpy+torch")]


@pytest.mark.parametrize("name,n_parts,opt_name,engines", CASES)
def test_exported_model_trains_like_the_torch_module(exported, name, n_parts, opt_name, engines):
    path = exported[name][1]
    model = load_onnx(path, loss=None if name == "gpt" else "cross_entropy")
    module = _fresh(exported, name, model)
    trainable = {n for n, p in model.graph.params.items() if p.trainable}
    assert trainable == set(dict(module.named_parameters())), "initializers map 1:1 to the module's parameters"
    cfg = OptimizerConfig(opt_name, lr=0.05, momentum=0.9 if opt_name == "sgd" else 0.0, weight_decay=0.01)
    opt = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01) if opt_name == "sgd" else \
        torch.optim.AdamW(module.parameters(), lr=0.05, weight_decay=0.01)
    assign = two_part_assignment(model.graph) if n_parts == 2 else None
    parts = ["a", "b"] if n_parts == 2 else ["p0"]
    per_part = dict(zip(parts, (engines.split("+") * 2)[:len(parts)]))  # "torch+numpy": a on torch, b on numpy
    ex = ReferenceExecutor(model, assign, cfg, micro_batches=2, schedule="1f1b" if n_parts == 2 else "gpipe", engines=per_part)
    assert {p: e.engine for p, e in ex.engines.items()} == per_part
    inputs = [n.name for n in model.graph.placeholders()]
    if name == "gpt":
        loss_fn = module
    else:
        def loss_fn(x, y):
            return F.cross_entropy(module(x), y)
    assert_trains_like(ex, module, _batches(name, 4), lambda b: dict(zip(inputs, b)), loss_fn, 2, opt)


def test_graph_structure_of_imported_transformer(exported):
    model = load_onnx(exported["gpt"][1])
    g = model.graph
    kinds = {n.name: n.kind for n in g.nodes.values()}
    assert kinds["idx"] == NodeKind.INPUT and kinds["targets"] == NodeKind.LABEL  # targets reach only the loss's label input
    assert [n.target for n in g.loss_nodes()] == ["onnx.SoftmaxCrossEntropyLoss"]
    onnx_nodes = [n for n in onnx.load(str(exported["gpt"][1])).graph.node]
    runtime = [n for n in g.nodes.values() if n.target.startswith("onnx.")]
    assert {n.name for n in runtime} <= {n.name for n in onnx_nodes}  # one OpNode per (non-constant) ONNX node
    assert {n.op_type for n in onnx_nodes if n.name not in g.nodes} <= {"Constant", "Cast", "Concat", "Reshape", "Identity", "Equal", "CastLike"}
    frozen = {n for n, p in g.params.items() if not p.trainable}
    assert frozen and all(not n.startswith(("blocks.", "wte", "wpe", "ln_f", "head")) for n in frozen)  # masks and scalars
    for n in runtime:  # shapes from ONNX shape inference
        assert n.meta.outputs and all(o.shape is not None for o in n.meta.outputs), n.name
    reshape = next(n for n in runtime if n.target == "onnx.Reshape" and n.args[1] == [2, 8, 2, 8])
    assert reshape.meta.outputs[0].shape == (2, 8, 2, 8)
    g2 = graph_from_dict(graph_to_dict(g)).validate()  # serialisable without pickle
    assert list(g2.nodes) == list(g.nodes)


def test_batchnorm_training_mode_matches_torch_train_mode(tmp_path):
    """A hand-written ONNX graph with BatchNormalization(training_mode=1) == torch BatchNorm in train mode."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32) * 0.3
    fc = rng.standard_normal((5, 4 * 6 * 6)).astype(np.float32) * 0.1
    inits = [numpy_init("conv.weight", w), numpy_init("bn.weight", np.ones(4, np.float32) * 1.5),
             numpy_init("bn.bias", np.full(4, 0.1, np.float32)), numpy_init("bn.running_mean", np.zeros(4, np.float32)),
             numpy_init("bn.running_var", np.ones(4, np.float32)), numpy_init("fc.weight", fc)]
    nodes = [helper.make_node("Conv", ["x", "conv.weight"], ["c"], name="conv", kernel_shape=[3, 3]),
             helper.make_node("BatchNormalization", ["c", "bn.weight", "bn.bias", "bn.running_mean", "bn.running_var"],
                              ["b", "rm", "rv"], name="bn", training_mode=1, epsilon=1e-5, momentum=0.9),
             helper.make_node("Relu", ["b"], ["r"], name="relu"), helper.make_node("Flatten", ["r"], ["f"], name="flat"),
             helper.make_node("Gemm", ["f", "fc.weight"], ["out"], name="fc", transB=1)]
    graph = helper.make_graph(nodes, "bn_train", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3, 8, 8])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [4, 5])], inits)
    path = tmp_path / "bn_train.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    model = load_onnx(path, loss="cross_entropy")
    assert not model.graph.params["bn.running_mean"].trainable

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn = torch.nn.Conv2d(3, 4, 3, bias=False), torch.nn.BatchNorm2d(4)
            self.fc = torch.nn.Linear(4 * 6 * 6, 5, bias=False)

        def forward(self, x):
            return self.fc(torch.flatten(F.relu(self.bn(self.conv(x))), 1))

    net = Net()
    net.load_state_dict({k: torch.as_tensor(v) for k, v in model.params.items()}, strict=False)
    net.train()
    ex = ReferenceExecutor(model, None, OptimizerConfig("sgd", lr=0.1), micro_batches=1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 5, (4,), generator=g))]
    assert_trains_like(ex, net, batches, lambda b: {"x": b[0], "y": b[1]}, lambda x, y: F.cross_entropy(net(x), y), 1, opt)


def numpy_init(name, value):
    return onnx.numpy_helper.from_array(value, name)


# -- bad input ------------------------------------------------------------------------------------

def test_corrupt_file_is_named(tmp_path):
    bad = tmp_path / "garbage.onnx"
    bad.write_bytes(np.random.default_rng(0).bytes(300))
    with pytest.raises(GraphError, match="garbage.onnx"):
        load_onnx(bad)


def test_truncated_file_is_named(exported, tmp_path):
    data = exported["cnn"][1].read_bytes()
    cut = tmp_path / "truncated.onnx"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(GraphError, match="truncated.onnx.*not a valid ONNX model"):
        load_onnx(cut)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(GraphError, match="nothere.onnx: no such ONNX file"):
        load_onnx(tmp_path / "nothere.onnx")


def test_unsupported_ops_are_all_reported_at_load_time(tmp_path):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="ok_relu"),
             helper.make_node("Bernoulli", ["a"], ["b"], name="my_bernoulli"),
             helper.make_node("Sinh", ["b"], ["c"], name="my_sinh"),
             helper.make_node("Relu", ["c"], ["out"], name="last")]
    graph = helper.make_graph(nodes, "g", [x], [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, 4])])
    path = tmp_path / "unsupported.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    with pytest.raises(GraphError) as e:
        load_onnx(path)
    msg = str(e.value)
    assert "2 unsupported ONNX op(s)" in msg and "'my_bernoulli' (Bernoulli)" in msg and "'my_sinh' (Sinh)" in msg
    assert "unsupported.onnx" in msg and "ok_relu" not in msg


def test_load_time_check_for_the_numpy_engine_names_every_missing_op(exported):
    with pytest.raises(GraphError) as e:
        load_onnx(exported["cnn"][1], loss="cross_entropy", engine="numpy", supports=numpy_supports)
    msg = str(e.value)
    assert "for the numpy engine" in msg and "(Conv)" in msg and "(MaxPool)" in msg and "(AveragePool)" in msg
    assert "(BatchNormalization)" not in msg  # the numpy engine runs inference-mode BatchNorm


def test_another_engine_needs_its_support_predicate(exported):
    with pytest.raises(GraphError, match=r"engine='numpy'\) needs supports="):
        load_onnx(exported["cnn"][1], loss="cross_entropy", engine="numpy")


def test_op_placed_on_an_engine_that_lacks_it(exported):
    model = load_onnx(exported["cnn"][1], loss="cross_entropy")
    assign = two_part_assignment(model.graph)
    with pytest.raises(GraphError) as e:
        ReferenceExecutor(model, assign, engines={"a": "numpy", "b": "torch"})
    msg = str(e.value)
    assert "op onnx.Conv on numpy (part 'a'): node 'node_conv2d'" in msg and "onnx.MaxPool on numpy" in msg
    ReferenceExecutor(model, assign, engines={"a": "torch", "b": "torch"})  # fine on torch


def test_unknown_loss_and_labels_are_rejected(exported):
    with pytest.raises(GraphError, match="unknown loss 'hinge'"):
        load_onnx(exported["mlp"][1], loss="hinge")
    with pytest.raises(GraphError, match=r"labels \['nope'\] are not inputs"):
        load_onnx(exported["gpt"][1], labels=["nope"])
    with pytest.raises(GraphError, match="trainable names"):
        load_onnx(exported["mlp"][1], trainable=["fc9.weight"])


# -- loader / CLI ---------------------------------------------------------------------------------

def test_loader_and_cli_accept_onnx_files(exported, tmp_path, capsys):
    model = load_model(f"{exported['mlp'][1]}:cross_entropy")
    assert [n.name for n in model.graph.loss_nodes()] == ["loss"]
    assert load_model(str(exported["gpt"][1])).graph.loss_nodes()
    assert cli_main(["graph", str(exported["gpt"][1])]) == 0
    assert "onnx.SoftmaxCrossEntropyLoss" in capsys.readouterr().out
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x08\x07garbage")
    assert cli_main(["graph", str(bad)]) == 2
    assert "bad.onnx" in capsys.readouterr().err


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_legacy_torchscript_export_of_the_cnn_trains_like_the_module(exported, tmp_path):
    """The deprecated TorchScript exporter computes Slice bounds with Unsqueeze/Constant nodes, which ONNX
    shape inference cannot see through; the importer folds them and infers shapes again."""
    import contextlib
    import io

    cnn = exported["cnn"][0]
    path = tmp_path / "legacy.onnx"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        torch.onnx.export(cnn, (torch.randn(2, 3, 8, 8),), str(path), dynamo=False, do_constant_folding=False, input_names=["x"])
    model = load_onnx(path, loss="cross_entropy")
    assert "onnx.Slice" in {n.target for n in model.graph.nodes.values()}
    module = _fresh(exported, "cnn", model)
    ex = ReferenceExecutor(model, two_part_assignment(model.graph), OptimizerConfig("sgd", lr=0.05), micro_batches=2)
    opt = torch.optim.SGD(module.parameters(), lr=0.05)
    assert_trains_like(ex, module, _batches("cnn", 4), lambda b: {"x": b[0], "y": b[1]},
                       lambda x, y: F.cross_entropy(module(x), y), 2, opt)


@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt"])
def test_torch_ops_agree_with_onnx_shape_inference(exported, name):
    """Running the imported graph on torch's meta device gives the shapes ONNX shape inference gave."""
    from fusion.ir.shapes import infer_meta

    model = load_onnx(exported[name][1], loss=None if name == "gpt" else "cross_entropy")
    onnx_shapes = {n.name: [(o.shape, o.dtype, o.requires_grad) for o in n.meta.outputs] for n in model.graph.nodes.values()}
    g = copy_graph(model.graph)
    infer_meta(g, model.example)
    torch_shapes = {n.name: [(o.shape, o.dtype, o.requires_grad) for o in n.meta.outputs] for n in g.nodes.values()}
    assert torch_shapes == onnx_shapes

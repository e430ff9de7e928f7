"""A run that would train nothing is refused; ``--loss NAME`` makes a scalar output the loss (issue 26).

Before: a model whose forward returns no single scalar (a dict of logits and loss) traced into an inference
graph, and ``fusion run`` trained it with loss 0.0 every step and exit 0; so did an ONNX file without ``:loss``.
"""
import numpy as np
import pytest
import torch

from fusion.cli import main
from tests.fusion.cli_helpers import one_line

CLUSTER = "examples/clusters/local-4-one-site.yaml"

NET_SRC = '''
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x, y):
        out = self.fc(x)
        return {"logits": out, "loss": nn.functional.cross_entropy(out, y)}

def net():
    torch.manual_seed(0)
    return Net(), {"x": torch.randn(2, 4), "y": torch.randint(0, 3, (2,))}, {"labels": ("y",)}
'''


@pytest.fixture
def net(tmp_path):
    (tmp_path / "net.py").write_text(NET_SRC)
    return f"{tmp_path / 'net.py'}:net"


def test_a_model_without_a_loss_is_refused_before_training(net, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["run", net, "--cluster", CLUSTER, "--steps", "2", "--out", str(out), "--no-progress"]) == 2
    err = one_line(capsys)
    assert "has no loss" in err and "--loss NAME" in err and "logits float32[2, 3]" in err and "loss float32[]" in err, err
    assert not out.exists()
    assert main(["compile", net, "--cluster", CLUSTER, "-o", str(tmp_path / "plan")]) == 2
    assert "--loss NAME" in one_line(capsys)


@pytest.mark.parametrize("name, words", [("logits", "float32[2, 3]; the loss must be a floating-point scalar"),
                                         ("los", "has no output 'los'; its outputs: logits float32[2, 3], loss")])
def test_loss_must_name_a_scalar_output(net, tmp_path, capsys, name, words):
    assert main(["run", net, "--cluster", CLUSTER, "--out", str(tmp_path / "r"), "--loss", name]) == 2
    assert words in one_line(capsys)


def test_named_loss_trains_the_same_values_as_the_traced_loss(net):
    """``--loss loss`` on the dict output gives the graph ``loss_index="loss"`` gives: same loss and gradients
    as plain PyTorch."""
    from fusion.executors.reference import ReferenceExecutor
    from fusion.loader import load_function, load_model
    from fusion.loss import choose_loss
    from fusion.plan import OptimizerConfig

    model = choose_loss(load_model(net), "loss", net)
    assert [n.name for n in model.graph.loss_nodes()] and "output_loss" not in model.graph.nodes
    assert "output_logits" in model.graph.nodes  # the other outputs stay
    module, example, _ = load_function(net)()
    g = torch.Generator().manual_seed(3)
    batch = {"x": torch.randn(2, 4, generator=g), "y": torch.randint(0, 3, (2,), generator=g)}
    ref = ReferenceExecutor(model, None, OptimizerConfig(name="sgd", lr=0.1))
    got = ref.step({k: v.numpy() for k, v in batch.items()}).loss
    want = module(**batch)["loss"]
    want.backward()
    np.testing.assert_allclose(got, want.item(), rtol=1e-6)
    with torch.no_grad():  # one SGD step: the next loss matches too
        for p in module.parameters():
            p -= 0.1 * p.grad
    np.testing.assert_allclose(ref.step({k: v.numpy() for k, v in batch.items()}).loss,
                               module(**batch)["loss"].item(), rtol=1e-5)


def test_onnx_without_a_loss_says_how_to_add_one(tmp_path, capsys):
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.ones((8, 5), np.float32), "w")  # one MatMul: no torch.onnx export (slow)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["logits"])], "mlp",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [4, 5])], [w])
    path = tmp_path / "mlp.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    assert main(["run", str(path), "--cluster", CLUSTER, "--out", str(tmp_path / "r")]) == 2
    err = one_line(capsys)
    assert "has no loss" in err and "mlp.onnx:cross_entropy" in err and "--loss NAME" in err, err


def test_a_plan_without_a_loss_is_refused(tmp_path, capsys):
    """A plan compiled before this check (or by the API) from an inference graph is refused too."""
    from fusion.ir.builder import GraphBuilder
    from fusion.plan import save_plan
    from fusion.compile import compile_model
    from fusion.cluster import load_cluster

    b = GraphBuilder()
    x = b.input("x")
    h = b.module("fc", "torch.nn.Linear", x, in_features=4, out_features=3)
    b.output("out", h)
    model = b.build(example={"x": torch.randn(2, 4)}, seed=0)
    plan = compile_model(model, load_cluster(CLUSTER))
    save_plan(plan, tmp_path / "plan", params=model.params)
    assert main(["run", str(tmp_path / "plan"), "--out", str(tmp_path / "r")]) == 2
    assert "has no loss" in one_line(capsys)

"""A plan is data (issue 15): node targets come from an allow-list, plugins run only when trusted."""
import json
import subprocess
import sys

import pytest

from tests.executors.dist_models import CNN_SPLITS, branching_cnn, save_hand_plan, tied_transformer
from fusion.ir.errors import FusionError, GraphError
from fusion.ir.registry import REGISTRY, check_targets, import_plugins
from fusion.plan import PlanError, load_plan

#: every built-in target the tracer, the builder and the ONNX importer produce on the test models (collected by
#: recording REGISTRY.resolve over tests/ir, tests/fusion and tests/executors); all must keep resolving
TRACED_TARGETS = """
aten.add.Tensor aten.add_.Tensor aten.arange.start aten.cross_entropy_loss.default aten.dropout.default
aten.embedding.default aten.flatten.using_ints aten.gelu.default aten.layer_norm.default aten.linear.default
aten.mul.Tensor aten.mul_.Tensor aten.pow.Tensor_Scalar aten.relu.default aten.reshape.default
aten.scaled_dot_product_attention.default aten.split.Tensor aten.sum.default aten.tanh.default aten.transpose.int
aten.view.default aten.__and__.Tensor builtins.getattr onnx.Add onnx.AveragePool onnx.BatchNormalization onnx.Concat onnx.Conv onnx.Div
onnx.Flatten onnx.Gather onnx.Gelu onnx.Gemm onnx.Identity onnx.LayerNormalization onnx.MatMul onnx.MaxPool onnx.Relu
onnx.Reshape onnx.SequenceAt onnx.Slice onnx.Softmax onnx.SoftmaxCrossEntropyLoss onnx.SplitToSequence onnx.Tanh
onnx.Transpose onnx.Where operator.add operator.floordiv operator.getitem operator.matmul operator.mul operator.sub
operator.truediv torch.Tensor.__getitem__ torch.Tensor.add torch.Tensor.contiguous torch.Tensor.flatten
torch.Tensor.float torch.Tensor.masked_fill torch.Tensor.mean torch.Tensor.mul torch.Tensor.numpy torch.Tensor.permute
torch.Tensor.pow torch.Tensor.reshape torch.Tensor.size torch.Tensor.split torch.Tensor.squeeze torch.Tensor.sum
torch.Tensor.transpose torch.Tensor.view torch.add torch.arange torch.cat torch.chunk torch.clamp torch.cos
torch.flatten torch.matmul torch.mean torch.mul torch.narrow torch.ones torch.relu torch.sigmoid torch.sin
torch.softmax torch.split torch.sum torch.tanh torch.triu torch.nn.BatchNorm1d torch.nn.Conv2d torch.nn.CrossEntropyLoss
torch.nn.Dropout torch.nn.Embedding torch.nn.GELU torch.nn.LayerNorm torch.nn.Linear torch.nn.MultiheadAttention
torch.nn.ReLU torch.nn.Tanh torch.nn.functional.adaptive_avg_pool2d torch.nn.functional.avg_pool2d
torch.nn.functional.cross_entropy torch.nn.functional.embedding torch.nn.functional.gelu torch.nn.functional.layer_norm
torch.nn.functional.linear torch.nn.functional.log_softmax torch.nn.functional.max_pool2d torch.nn.functional.mse_loss
torch.nn.functional.relu torch.nn.functional.scaled_dot_product_attention torch.nn.functional.softmax
torch.nn.functional.tanh
""".split()

DENIED = ["builtins.eval", "builtins.exec", "builtins.open", "builtins.__import__", "operator.call", "operator.attrgetter",
          "operator.methodcaller", "operator.itemgetter", "torch.load", "torch.save", "torch.hub.load", "torch.from_file",
          "torch.compile", "torch.vmap", "torch.set_num_threads", "torch._C.import_ir_module", "torch.jit.load",
          "torch.utils.cpp_extension.load_inline", "aten.from_file", "aten.add.Tensor.__globals__", "aten.__class__", "aten.__and__.__globals__",
          "torch.Tensor.__reduce_ex__", "torch.Tensor.__getattribute__", "torch.Tensor.apply_", "torch.Tensor.register_hook",
          "torch.nn.functional.handle_torch_function", "torch.nn.Module.__init__", "math.__loader__", "operator.__dict__"]


def test_every_traced_target_still_resolves():
    missing = [t for t in TRACED_TARGETS if REGISTRY.resolve(t) is None]
    assert not missing


@pytest.mark.parametrize("target", DENIED)
def test_code_reaching_targets_do_not_resolve(target):
    assert REGISTRY.resolve(target) is None


def test_the_test_models_pass_the_check():
    check_targets(branching_cnn().graph)
    check_targets(tied_transformer().graph)


def _edit(plan_dir, fn) -> None:
    f = plan_dir / "plan.json"
    d = json.loads(f.read_text())
    fn(d["graph"])
    f.write_text(json.dumps(d))


def _getattr_chain(g):
    """relu_a := getattr(conv_a, '__class__'), and so on towards __globals__['__builtins__']['exec']."""
    n = next(n for n in g["nodes"] if n["name"] == "relu_a")
    n["target"], n["args"] = "builtins.getattr", [n["args"][0], "__class__"]


def _fusion(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "fusion.cli", *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def test_a_plan_walking_getattr_to_exec_is_refused_at_load_with_one_line(tmp_path):
    plan_dir = save_hand_plan(tmp_path, branching_cnn(), CNN_SPLITS[2])
    _edit(plan_dir, _getattr_chain)
    with pytest.raises(PlanError, match=r"node 'relu_a': builtins.getattr may only read a literal attribute"):
        load_plan(plan_dir)
    r = _fusion("run", str(plan_dir), "--out", str(tmp_path / "run"), "--steps", "1", "--no-progress")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "relu_a" in r.stderr and "getattr" in r.stderr
    for target in ("operator.call", "torch.hub.load", "builtins.exec"):
        _edit(plan_dir, lambda g: next(n for n in g["nodes"] if n["name"] == "relu_a").update(target=target))
        with pytest.raises(PlanError, match=f"node 'relu_a': target '{target}' is not an allowed op"):
            load_plan(plan_dir)


def test_graph_check_refuses_getattr_of_a_computed_name():
    g = branching_cnn().graph
    node = g["relu_a"]
    node.target, node.args = "builtins.getattr", (node.args[0], "shape")
    check_targets(g)  # a literal metadata attribute is fine
    node.args = (node.args[0], "__dict__")
    with pytest.raises(GraphError, match="literal attribute"):
        check_targets(g)


PLUGIN = "import fusion.ir.registry as r\nr.PLUGIN_RAN = True\n"


def test_plugins_need_trust_and_stay_inside_the_plan_folder(tmp_path):
    plan_dir = save_hand_plan(tmp_path, branching_cnn(), CNN_SPLITS[2])
    (plan_dir / "plugins").mkdir()
    (plan_dir / "plugins" / "ops15.py").write_text(PLUGIN)
    (tmp_path / "evil15.py").write_text(PLUGIN)
    _edit(plan_dir, lambda g: g.update(plugins=["plugins/ops15.py"]))
    # fusion run and fusion executor refuse with one line that says what the flag means
    r = _fusion("run", str(plan_dir), "--out", str(tmp_path / "run"), "--steps", "1", "--no-progress")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "--trust-plugins" in r.stderr, r.stderr
    assert "Python files" in r.stderr
    r = _fusion("executor", str(plan_dir), "--node", "p0", "--coordinator", "tcp://127.0.0.1:9", "--bind", "tcp://127.0.0.1:*",
                "--insecure")
    assert r.returncode == 2 and "--trust-plugins" in r.stderr.strip().splitlines()[-1], r.stderr
    # outside the folder: refused even when trusted; relative paths resolve against the plan folder, not the cwd
    for bad in ("../evil15.py", str(tmp_path / "evil15.py"), "evil15_module"):
        with pytest.raises(FusionError, match="inside the plan folder|not module names"):
            import_plugins([bad], base=str(plan_dir), trusted=True)
    with pytest.raises(FusionError, match="--trust-plugins"):
        import_plugins(["plugins/ops15.py"], base=str(plan_dir))
    code = (f"import os; from fusion.ir.registry import import_plugins; import fusion.ir.registry as r; os.chdir({str(tmp_path)!r});"
            f"import_plugins(['plugins/ops15.py'], base={str(plan_dir)!r}, trusted=True); print(r.PLUGIN_RAN)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "True", out.stderr

"""Model-zoo CNN operators through the ONNX importer train like plain PyTorch (issue 18).

The graphs are built by hand with ``onnx.helper`` in the form the public zoo
models have them (LRN as in AlexNet/CaffeNet/GoogLeNet, ConvTranspose and
Resize/Upsample as in FCN/U-Net/YOLOv3 heads, GlobalMaxPool, Gemm with
``transB``), at the opsets they were exported with; the reference is the same
network written with ``torch.nn.functional``. The last part runs on the NumPy
engine where it can (everything after the transposed convolution).
"""
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from fusion.executors.reference import ReferenceExecutor  # noqa: E402
from fusion.ir.model import Model  # noqa: E402
from fusion.ir.onnx.importer import load_onnx  # noqa: E402
from fusion.ir.serialize import graph_from_dict, graph_to_dict  # noqa: E402
from fusion.plan import OptimizerConfig  # noqa: E402

from tests.ir.onnx_models import assert_trains_like  # noqa: E402

N, C, H = 4, 3, 6


def _weights():
    g = torch.Generator().manual_seed(3)
    return {"c1.weight": torch.randn(4, C, 3, 3, generator=g) * 0.3, "c1.bias": torch.randn(4, generator=g) * 0.1,
            "up.weight": torch.randn(4, 2, 3, 3, generator=g) * 0.3, "up.bias": torch.randn(2, generator=g) * 0.1,
            "fc.weight": torch.randn(5, 2, generator=g), "fc.bias": torch.randn(5, generator=g) * 0.1}


def _model(path, opset: int, resize: str):
    """Conv -> LRN -> Relu -> ConvTranspose(stride 2, output_padding 1) -> resample -> GlobalMaxPool -> Flatten -> Gemm."""
    w = _weights()
    inits = [numpy_helper.from_array(v.numpy(), k) for k, v in w.items()]
    nodes = [helper.make_node("Conv", ["x", "c1.weight", "c1.bias"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("LRN", ["c"], ["n"], size=3, alpha=0.05, beta=0.75, bias=1.0),
             helper.make_node("Relu", ["n"], ["r"]),
             helper.make_node("ConvTranspose", ["r", "up.weight", "up.bias"], ["u"], strides=[2, 2], pads=[1, 1, 1, 1],
                              output_padding=[1, 1])]
    scales = np.array([1, 1, 2, 2], np.float32)
    if resize == "upsample":  # Upsample-9: scales as an input
        inits.append(numpy_helper.from_array(scales, "scales"))
        nodes.append(helper.make_node("Upsample", ["u", "scales"], ["s"], mode="nearest"))
    elif resize == "resize10":  # Resize-10: (X, scales), asymmetric nearest
        inits.append(numpy_helper.from_array(scales, "scales"))
        nodes.append(helper.make_node("Resize", ["u", "scales"], ["s"], mode="nearest"))
    else:  # Resize-13: linear, half_pixel (torch's bilinear with align_corners=False)
        inits.append(numpy_helper.from_array(scales, "scales"))
        nodes.append(helper.make_node("Resize", ["u", "", "scales"], ["s"], mode="linear"))
    nodes += [helper.make_node("GlobalMaxPool", ["s"], ["p"]), helper.make_node("Flatten", ["p"], ["f"]),
              helper.make_node("Gemm", ["f", "fc.weight", "fc.bias"], ["logits"], transB=1)]
    graph = helper.make_graph(nodes, "zoo", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [N // 2, C, H, H])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [N // 2, 5])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), str(path))
    return path


class Reference(torch.nn.Module):
    def __init__(self, resize: str):
        super().__init__()
        self.resize = resize
        for k, v in _weights().items():
            self.register_parameter(k.replace(".", "_"), torch.nn.Parameter(v.clone()))

    def named_parameters(self, *a, **k):  # the ONNX names
        for n, p in super().named_parameters(*a, **k):
            yield n.replace("_", "."), p

    def forward(self, x):
        h = F.relu(F.local_response_norm(F.conv2d(x, self.c1_weight, self.c1_bias, padding=1), 3, 0.05, 0.75, 1.0))
        h = F.conv_transpose2d(h, self.up_weight, self.up_bias, stride=2, padding=1, output_padding=1)
        if self.resize == "resize13":
            h = F.interpolate(h, scale_factor=2, mode="bilinear", align_corners=False)
        else:
            h = F.interpolate(h, scale_factor=2, mode="nearest")
        return F.linear(h.amax(dim=(2, 3)), self.fc_weight, self.fc_bias)


@pytest.mark.parametrize("opset,resize,engines", [(13, "resize13", "torch"), (9, "upsample", "torch"),
                                                  (10, "resize10", "torch"), (13, "resize13", "torch+numpy"),
                                                  (9, "upsample", "torch+numpy")])
def test_zoo_cnn_ops_train_like_torch(tmp_path, opset, resize, engines):
    model = load_onnx(_model(tmp_path / "zoo.onnx", opset, resize), loss="cross_entropy")
    saved = json.loads(json.dumps(graph_to_dict(model.graph)))  # through the plan encoding and back
    model = Model(graph_from_dict(saved), model.params, model.example)
    assert graph_to_dict(model.graph) == saved
    targets = [n.target for n in model.graph.nodes.values()]
    assert {"onnx.LRN", "onnx.ConvTranspose", "onnx.GlobalMaxPool"} <= set(targets)
    assert ("onnx.Upsample" if resize == "upsample" else "onnx.Resize") in targets
    names = list(model.graph.nodes)
    cut = next(i for i, n in enumerate(names) if model.graph.nodes[n].target == "onnx.ConvTranspose") + 1
    assign = {n: "a" if i < cut else "b" for i, n in enumerate(names)}
    per_part = dict(zip("ab", (engines.split("+") * 2)[:2]))
    ex = ReferenceExecutor(model, assign, OptimizerConfig("sgd", lr=0.05, momentum=0.9), micro_batches=2,
                           schedule="1f1b", engines=per_part)
    assert {p: e.engine for p, e in ex.engines.items()} == per_part
    module = Reference(resize)
    opt = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randn(N, C, H, H, generator=g), torch.randint(0, 5, (N,), generator=g)) for _ in range(2)]
    assert_trains_like(ex, module, batches, lambda b: {"x": b[0], "y": b[1]},
                       lambda x, y: F.cross_entropy(module(x), y), 2, opt)


def test_argmax_head_returns_class_indices(tmp_path):
    """A zoo classifier's post-processing head (Softmax-11 over axis 1, ArgMax keepdims=0) as forward outputs."""
    x = np.random.default_rng(1).standard_normal((3, 7, 1, 1)).astype(np.float32)
    nodes = [helper.make_node("Softmax", ["x"], ["p"]), helper.make_node("ArgMax", ["p"], ["k"], axis=1, keepdims=0)]
    graph = helper.make_graph(nodes, "head", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
                              [helper.make_tensor_value_info("p", TensorProto.FLOAT, x.shape),
                               helper.make_tensor_value_info("k", TensorProto.INT64, [3, 1, 1])])
    path = tmp_path / "head.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)]), str(path))
    out = ReferenceExecutor(load_onnx(path, example={"x": x})).forward_outputs({"x": x})
    np.testing.assert_array_equal(out["output:k"], x.reshape(3, 7).argmax(1).reshape(3, 1, 1))
    e = np.exp(x - x.max(1, keepdims=True))
    np.testing.assert_allclose(out["output:p"], e / e.sum(1, keepdims=True), rtol=1e-6)


class LegacyZoo(torch.nn.Module):
    """Zoo-era layers as torch's legacy TorchScript exporter writes them (as the model-zoo files were made):
    LocalResponseNorm (decomposed, with an If on a static shape at opset 11), MaxPool with ceil_mode,
    Dropout, ConvTranspose, Upsample (opset 9) / Resize (opset 11), GlobalMaxPool, Gemm."""

    def __init__(self, mode: str):
        super().__init__()
        self.c1, self.lrn = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.LocalResponseNorm(3, alpha=1e-2)
        self.pool, self.drop = torch.nn.MaxPool2d(3, 2, ceil_mode=True), torch.nn.Dropout(0.5)
        self.up = torch.nn.ConvTranspose2d(8, 4, 3, stride=2, padding=1, output_padding=1)
        self.us = torch.nn.Upsample(scale_factor=2, mode=mode)
        self.fc = torch.nn.Linear(4, 5)

    def forward(self, x):
        h = self.pool(self.lrn(F.relu(self.c1(x))))
        h = self.us(self.up(self.drop(h)))
        return self.fc(F.adaptive_max_pool2d(h, 1).flatten(1))


@pytest.mark.parametrize("opset,mode", [(9, "nearest"), (11, "bilinear")])
def test_legacy_export_of_a_zoo_cnn_trains_like_the_module(tmp_path, opset, mode):
    import contextlib
    import io
    import warnings

    torch.manual_seed(0)
    module = LegacyZoo(mode).eval()  # eval: Dropout is the identity on both sides
    path = tmp_path / "legacy.onnx"
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (torch.randn(N // 2, C, 9, 9),), str(path), dynamo=False, opset_version=opset,
                          do_constant_folding=False, input_names=["x"])
    ops = {n.op_type for n in onnx.load(str(path)).graph.node}
    assert {"ConvTranspose", "Upsample" if opset == 9 else "Resize"} <= ops and (opset == 9 or "If" in ops)
    model = load_onnx(path, loss="cross_entropy")
    assert set(model.params) >= {n for n, _ in module.named_parameters()}
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(N, C, 9, 9, generator=g), torch.randint(0, 5, (N,), generator=g)) for _ in range(2)]
    names = list(model.graph.nodes)
    ex = ReferenceExecutor(model, {n: "a" if i < len(names) // 2 else "b" for i, n in enumerate(names)},
                           OptimizerConfig("sgd", lr=0.05), micro_batches=2)
    opt = torch.optim.SGD(module.parameters(), lr=0.05)
    assert_trains_like(ex, module, batches, lambda b: {"x": b[0], "y": b[1]},
                       lambda x, y: F.cross_entropy(module(x), y), 2, opt)

"""ONNX operator semantics follow the model's opset version (issue 18)."""
import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper  # noqa: E402

from fusion.executors.reference import ReferenceExecutor  # noqa: E402
from fusion.ir.errors import GraphError  # noqa: E402
from fusion.ir.onnx.importer import load_onnx  # noqa: E402


def _run(tmp_path, node, opset, x, out_shape=None, out_type=TensorProto.FLOAT, extra_outputs=()):
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
                              [helper.make_tensor_value_info("y", out_type, out_shape or x.shape), *extra_outputs])
    path = tmp_path / f"m{opset}.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), str(path))
    model = load_onnx(path, example={"x": x})
    return ReferenceExecutor(model).forward_outputs({"x": x})["output:y"]


def _softmax(a, axis):
    e = np.exp(a - a.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


X = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)


@pytest.mark.parametrize("opset", [11, 13])
@pytest.mark.parametrize("axis", [None, 1, 2])
def test_softmax_before_opset_13_flattens_to_2d_around_axis(tmp_path, opset, axis):
    attrs = {} if axis is None else {"axis": axis}
    got = _run(tmp_path, helper.make_node("Softmax", ["x"], ["y"], **attrs), opset, X)
    if opset < 13:
        a = 1 if axis is None else axis
        want = _softmax(X.reshape(int(np.prod(X.shape[:a])), -1), 1).reshape(X.shape)
    else:
        want = _softmax(X, -1 if axis is None else axis)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("opset", [11, 13])
def test_logsoftmax_and_hardmax_follow_the_opset(tmp_path, opset):
    got = _run(tmp_path, helper.make_node("LogSoftmax", ["x"], ["y"]), opset, X)
    want2d = np.log(_softmax(X.reshape(2, -1), 1)).reshape(X.shape) if opset < 13 else np.log(_softmax(X, -1))
    np.testing.assert_allclose(got, want2d, rtol=1e-5, atol=1e-5)
    hard = _run(tmp_path, helper.make_node("Hardmax", ["x"], ["y"]), opset, X)
    flat = X.reshape(2, -1) if opset < 13 else X.reshape(-1, X.shape[-1])
    want = np.zeros_like(flat)
    want[np.arange(flat.shape[0]), flat.argmax(1)] = 1
    np.testing.assert_array_equal(hard, want.reshape(X.shape))


@pytest.mark.parametrize("opset", [6, 11])
def test_clip_bounds_are_attributes_before_opset_11(tmp_path, opset):
    if opset < 11:
        node = helper.make_node("Clip", ["x"], ["y"], min=-0.5, max=0.25)
        got = _run(tmp_path, node, opset, X)
        np.testing.assert_allclose(got, np.clip(X, -0.5, 0.25))
    else:  # no bounds: the identity
        np.testing.assert_allclose(_run(tmp_path, helper.make_node("Clip", ["x"], ["y"]), opset, X), X)


def test_slice_bounds_are_attributes_before_opset_10(tmp_path):
    """Slice-1/9 (opset 9): starts/ends/axes are attributes; since opset 10 inputs (the backend tests cover those)."""
    opset = 9
    node = helper.make_node("Slice", ["x"], ["y"], starts=[1], ends=[3], axes=[2])
    np.testing.assert_allclose(_run(tmp_path, node, opset, X, (2, 3, 2)), X[:, :, 1:3])


def test_old_dropout_with_an_unused_mask_output_imports(tmp_path):
    """Opset 10 Dropout: ratio attribute, a mask output nobody reads and shape inference leaves unshaped."""
    node = helper.make_node("Dropout", ["x"], ["y", "mask"], ratio=0.3)
    np.testing.assert_allclose(_run(tmp_path, node, 10, X), X)


def test_pad_modes_and_old_pad_attributes(tmp_path):
    x = X[0]
    for mode, np_mode in [("edge", "edge"), ("reflect", "reflect"), ("wrap", "wrap"), ("constant", "constant")]:
        node = helper.make_node("Pad", ["x"], ["y"], mode=mode, pads=[0, 1, 0, 2], value=0.0)
        got = _run(tmp_path, node, 10, x, (3, 7))
        np.testing.assert_allclose(got, np.pad(x, [(0, 0), (1, 2)], mode=np_mode))


def test_unsupported_dtype_is_refused_at_load_in_one_line(tmp_path):
    node = helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT8E4M3FN)
    with pytest.raises(GraphError) as e:
        _run(tmp_path, node, 19, X, out_type=TensorProto.FLOAT8E4M3FN)
    assert "\n" not in str(e.value) and "Cast" in str(e.value) and "float8_e4m3fn" in str(e.value)


IMG = np.arange(2 * 3 * 3, dtype=np.float32).reshape(1, 2, 3, 3)


def _resample(tmp_path, node, opset, inits=()):
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, IMG.shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 6, 6])], list(inits))
    path = tmp_path / f"r{opset}.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), str(path))
    return ReferenceExecutor(load_onnx(path)).forward_outputs({"x": IMG})["output:y"]


def _scales():
    return onnx.numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales")


@pytest.mark.parametrize("opset", [7, 9])
def test_upsample_scales_are_an_attribute_before_opset_9(tmp_path, opset):
    if opset < 9:
        node, inits = helper.make_node("Upsample", ["x"], ["y"], scales=[1.0, 1.0, 2.0, 2.0]), ()
    else:
        node, inits = helper.make_node("Upsample", ["x", "scales"], ["y"]), (_scales(),)
    np.testing.assert_array_equal(_resample(tmp_path, node, opset, inits), IMG.repeat(2, 2).repeat(2, 3))


@pytest.mark.parametrize("opset", [10, 13])
def test_linear_resize_is_asymmetric_at_opset_10_and_half_pixel_after(tmp_path, opset):
    """Resize-10 has two inputs and Upsample's asymmetric coordinates; Resize-11+ defaults to half_pixel."""
    inputs = ["x", "scales"] if opset == 10 else ["x", "", "scales"]
    got = _resample(tmp_path, helper.make_node("Resize", inputs, ["y"], mode="linear"), opset, (_scales(),))
    src = np.arange(6) / 2.0 if opset == 10 else np.clip((np.arange(6) + 0.5) / 2 - 0.5, 0, 2)
    lo = np.floor(src).astype(int)
    hi, w = np.minimum(lo + 1, 2), src - np.floor(src)
    rows = IMG[:, :, lo, :] * (1 - w)[:, None] + IMG[:, :, hi, :] * w[:, None]
    want = rows[:, :, :, lo] * (1 - w) + rows[:, :, :, hi] * w
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)

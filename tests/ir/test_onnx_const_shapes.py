"""Shapes that follow from constants when ONNX's shape inference leaves them symbolic (issue 18).

Older exporters compute Resize sizes and Reshape targets from the input's
shape at run time (Shape -> Slice -> Cast -> Mul -> Floor -> Cast -> Concat,
or ReduceProd of a shape slice): ONNX's data propagation stops at the float
arithmetic and at ReduceProd, so the outputs keep symbolic dims. The importer
folds that arithmetic (the input's shape is static once the example pins it)
and infers shapes again on the folded graph.
"""
import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from fusion.executors.reference import ReferenceExecutor  # noqa: E402
from fusion.ir.onnx.importer import load_onnx  # noqa: E402


def _model(batch):
    c = numpy_helper.from_array
    nodes = [
        helper.make_node("Shape", ["x"], ["sh"]),
        helper.make_node("Slice", ["sh", "i2", "i4"], ["hw"]),
        helper.make_node("Cast", ["hw"], ["hwf"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["hwf", "two"], ["hw2f"]),
        helper.make_node("Floor", ["hw2f"], ["hw2ff"]),
        helper.make_node("Cast", ["hw2ff"], ["hw2"], to=TensorProto.INT64),
        helper.make_node("Slice", ["sh", "i0", "i2"], ["nc"]),
        helper.make_node("Concat", ["nc", "hw2"], ["sizes"], axis=0),
        helper.make_node("Resize", ["x", "", "", "sizes"], ["up"], mode="nearest"),
        helper.make_node("Dropout", ["up"], ["y", "mask"]),  # its mask output is unused (and has no shape)
        helper.make_node("ReduceProd", ["hw"], ["area"], keepdims=1),
        helper.make_node("Concat", ["nc", "area"], ["flat"], axis=0),
        helper.make_node("Reshape", ["x", "flat"], ["z"]),
    ]
    inits = [c(np.array([0]), "i0"), c(np.array([2]), "i2"), c(np.array([4]), "i4"), c(np.array(2.0, np.float32), "two")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, 4, 5])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", "c", "h", "w"]),
                               helper.make_tensor_value_info("z", TensorProto.FLOAT, ["n", "c", "hw"])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def _inferred(model, name):
    m = onnx.shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)
    for v in list(m.graph.value_info) + list(m.graph.output):
        if v.name == name:
            return [d.dim_value if d.HasField("dim_value") else None for d in v.type.tensor_type.shape.dim]
    return None


@pytest.mark.parametrize("batch", [2, "N"])
def test_shapes_computed_from_constants_are_resolved_at_import(tmp_path, batch):
    model = _model(batch)
    pinned = _model(2)
    # ONNX alone leaves them symbolic, even with a static input shape: the test is meaningful
    assert None in _inferred(pinned, "y") and None in _inferred(pinned, "up")
    assert _inferred(pinned, "z") in (None, [None, None, None])
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    x = np.random.default_rng(0).standard_normal((2, 3, 4, 5)).astype(np.float32)
    imported = load_onnx(path, example={"x": x} if batch == "N" else None)
    shapes = {n.target: n.meta.outputs[0].shape for n in imported.graph.nodes.values() if n.target.startswith("onnx.")}
    assert shapes["onnx.Resize"] == (2, 3, 8, 10) and shapes["onnx.Reshape"] == (2, 3, 20)
    resize = next(n for n in imported.graph.nodes.values() if n.target == "onnx.Resize")
    assert resize.args[3] == [2, 3, 8, 10], "the folded sizes are a literal"
    out = ReferenceExecutor(imported).forward_outputs({"x": x})
    np.testing.assert_array_equal(out["output:y"], x.repeat(2, axis=2).repeat(2, axis=3))
    np.testing.assert_array_equal(out["output:z"], x.reshape(2, 3, 20))


def test_a_symbolic_batch_without_an_example_is_named(tmp_path):
    """Without an example nothing pins the batch: the import stops with one line naming the node."""
    from fusion.ir.errors import GraphError

    path = tmp_path / "m.onnx"
    onnx.save(_model("N"), str(path))
    with pytest.raises(GraphError) as e:
        load_onnx(path)
    msg = str(e.value)
    assert "\n" not in msg and "without a static shape" in msg and "node '" in msg

"""The NumPy engine's model-zoo ONNX ops against the torch engine's (forward, and the VJP against autograd)."""
import numpy as np
import pytest
import torch

from fusion.executors.engines.numpy.engine import OPS
from fusion.ir.onnx.semantics import ONNX_OPS

R = np.random.default_rng(0)


def _x(*shape):
    return R.standard_normal(shape)


IMG = _x(2, 5, 4, 6)
CASES = [
    ("LeakyRelu", (IMG,), {"alpha": 0.1}),
    ("HardSigmoid", (IMG * 4,), {}),
    ("HardSwish", (IMG * 4,), {}),
    ("Abs", (IMG,), {}),
    ("Softplus", (IMG * 10,), {}),
    ("Mish", (IMG * 3,), {}),
    ("PRelu", (IMG, _x(5, 1, 1)), {}),
    ("Clip", (IMG, np.asarray(-0.5), np.asarray(0.7)), {}),
    ("Sum", (IMG, _x(6), _x(4, 6)), {}),
    ("Mean", (IMG, _x(6)), {}),
    ("Max", (IMG, _x(6), _x(1, 5, 1, 1)), {}),
    ("Min", (IMG, _x(4, 6)), {}),
    ("GlobalAveragePool", (IMG,), {}),
    ("GlobalMaxPool", (IMG,), {}),
    ("LRN", (IMG,), {"size": 3, "alpha": 0.01, "beta": 0.75, "bias": 1.5}),
    ("LRN", (IMG,), {"size": 4}),
    ("Resize", (IMG, None, [1, 1, 2.0, 1.5]), {"mode": "nearest"}),
    ("Resize", (IMG, None, None, [2, 5, 7, 3]), {"mode": "linear"}),
    ("Resize", (IMG, None, None, [2, 5, 7, 13]), {"mode": "linear", "coordinate_transformation_mode": "align_corners"}),
    ("Resize", (IMG, None, [1, 1, 0.6, 0.5]), {"mode": "cubic", "antialias": 1}),
    ("Resize", (IMG, [0.1, 0.2, 0.8, 0.9], None, [3, 4]), {"mode": "linear", "axes": [2, 3], "extrapolation_value": 2.0,
                                                          "coordinate_transformation_mode": "tf_crop_and_resize"}),
    ("Upsample", (IMG, [1, 1, 2, 3]), {"mode": "nearest"}),
    ("Upsample", (IMG, [1, 1, 2, 1.5]), {"mode": "linear"}),
    ("DepthToSpace", (_x(2, 8, 3, 2),), {"blocksize": 2}),
    ("DepthToSpace", (_x(2, 8, 3, 2),), {"blocksize": 2, "mode": "CRD"}),
    ("SpaceToDepth", (IMG[:, :, :, :4],), {"blocksize": 2}),
    ("Trilu", (_x(3, 4, 5), 1), {"upper": 0}),
    ("CumSum", (IMG, 2), {"exclusive": 1, "reverse": 1}),
    ("CumSum", (IMG, -1), {}),
    ("Einsum", (_x(3, 4, 5), _x(3, 5, 2)), {"equation": "bij,bjk->bik"}),
    ("Einsum", (_x(3, 4), _x(4, 6)), {"equation": "ij,jk"}),
    ("Einsum", (_x(3, 4, 5),), {"equation": "abc->ca"}),
    ("Elu", (IMG,), {"alpha": 0.7}),
    ("Selu", (IMG,), {}),
    ("Reciprocal", (IMG + 5,), {}),
    ("Sin", (IMG,), {}),
    ("Cos", (IMG,), {}),
    ("Floor", (IMG,), {}),
    ("Sign", (IMG,), {}),
    ("InstanceNormalization", (IMG, _x(5), _x(5)), {"epsilon": 1e-3}),
    ("BatchNormalization", (IMG, _x(5), _x(5), _x(5), np.abs(_x(5)) + 0.5), {}),
    ("Pad", (IMG, [0, 1, 2, -1, 0, 0, 1, 3], np.asarray(1.5)), {}),
    ("Pad", (IMG, [1, 2, 3, 1]), {"mode": "reflect", "axes": [2, 3]}),
    ("Pad", (IMG, [0, 0, 2, 1, 0, 0, 1, 4]), {"mode": "edge"}),
    ("Pad", (IMG, [3, 7, 2, 5]), {"mode": "wrap", "axes": [-2, -1]}),
    ("Tile", (_x(2, 3, 1), [2, 1, 4]), {}),
    ("ReduceMax", (IMG, [1, 3]), {"keepdims": 0}),
    ("ReduceMin", (IMG, [2]), {}),
    ("ReduceMax", (IMG,), {}),
]


@pytest.mark.parametrize("op,args,kwargs", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_numpy_op_matches_torch_forward_and_gradient(op, args, kwargs):
    tins = [torch.tensor(a, requires_grad=True) if isinstance(a, np.ndarray) else a for a in args]
    ty = ONNX_OPS[op](*tins, **kwargs)
    y, ctx = OPS[f"onnx.{op}"].fwd(*args, **kwargs)
    np.testing.assert_allclose(y, ty.detach().numpy(), rtol=1e-10, atol=1e-12)
    g = R.standard_normal(y.shape)
    diff = [(i, t) for i, t in enumerate(tins) if torch.is_tensor(t)]
    want = torch.autograd.grad(ty, [t for _, t in diff], torch.tensor(g), allow_unused=True)
    got = OPS[f"onnx.{op}"].vjp(ctx, g)
    for (i, _), w in zip(diff, want):
        if w is None:  # torch gives none (BatchNorm statistics, Pad's constant value): neither may numpy
            assert i not in got or not np.any(got[i]), f"{op}: a gradient for input {i}"
            continue
        assert i in got, f"{op}: no gradient for input {i}"
        np.testing.assert_allclose(got[i], w.numpy(), rtol=1e-9, atol=1e-12, err_msg=f"{op} input {i}")


@pytest.mark.parametrize("op", ["ArgMax", "ArgMin"])
@pytest.mark.parametrize("last", [0, 1])
def test_arg_ops_pick_the_first_or_last_extreme(op, last):
    x = np.array([[1.0, 3.0, 3.0, 0.0], [0.0, 0.0, -1.0, -1.0]])
    y, _ = OPS[f"onnx.{op}"].fwd(x, axis=1, keepdims=0, select_last_index=last)
    np.testing.assert_array_equal(y, ONNX_OPS[op](torch.tensor(x), axis=1, keepdims=0, select_last_index=last).numpy())
    want = {("ArgMax", 0): [1, 0], ("ArgMax", 1): [2, 1], ("ArgMin", 0): [3, 2], ("ArgMin", 1): [3, 3]}[op, last]
    assert y.tolist() == want and y.dtype == np.int64


def test_resize_of_integers_rounds_and_saturates_like_onnx():
    x = np.array([[[[0, 255], [255, 0]]]], dtype=np.uint8)
    y, _ = OPS["onnx.Resize"].fwd(x, None, [1, 1, 2, 2], mode="linear")
    t = ONNX_OPS["Resize"](torch.tensor(x), None, [1, 1, 2, 2], mode="linear")
    assert y.dtype == np.uint8
    np.testing.assert_array_equal(y, t.numpy())

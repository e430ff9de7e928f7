"""The ``onnx.<OpType>`` targets of the NumPy engine.

Arguments follow the ONNX importer's convention (``fusion.ir.onnx.importer``):
inputs positionally (static ones such as Reshape's shape as int lists, a
missing optional input as None), attributes as keywords with ONNX defaults.
The importer also uses the forward functions to fold constant sub-graphs
(shape arithmetic), so this module must stay importable without torch.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from fusion.ir.onnx.ops import normalize_slice, reduce_axes, reshape_target, split_sizes
from fusion.executors.engines.numpy.onnx_zoo_ops import ONNX_ZOO_NUMPY
from fusion.executors.engines.numpy.ops import (
    ADD, ERF, EXP, GATHER, IDENTITY, LOG, LOG_SOFTMAX, MATMUL, MUL, NEG, RELU, SIGMOID, SOFTMAX, SQRT, SUB,
    TANH, WHERE, NpOp, _grad_like, _out, cross_entropy_fwd, cross_entropy_vjp, gelu_fwd, gelu_vjp,
    layer_norm_fwd, layer_norm_vjp, permute_fwd, permute_vjp, reshape_op, unbroadcast,
)

#: ONNX TensorProto element type -> NumPy dtype
NP_DTYPES = {
    1: np.float32, 2: np.uint8, 3: np.int8, 5: np.int16, 6: np.int32, 7: np.int64,
    9: np.bool_, 10: np.float16, 11: np.float64,
}


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _no_grad(f) -> NpOp:
    return NpOp(lambda *a, **k: (f(*a, **k), None), None)


def _div_fwd(a, b):
    if not np.issubdtype(np.asarray(a).dtype, np.floating) and not np.issubdtype(np.asarray(b).dtype, np.floating):
        return np.trunc(np.divide(a, b)).astype(np.result_type(a, b)), (a, b)
    return np.divide(a, b), (a, b)


def _div_vjp(ctx, g):
    a, b = ctx
    out = {}
    if (ga := _grad_like(g / b, a)) is not None:
        out[0] = ga
    if (gb := _grad_like(-g * a / (b * b), b)) is not None:
        out[1] = gb
    return out


def _pow_fwd(a, b):
    return np.power(a, b), (a, b)


def _pow_vjp(ctx, g):
    a, b = ctx
    out = {}
    if (ga := _grad_like(g * b * np.power(a, b - 1), a)) is not None:
        out[0] = ga
    if (gb := _grad_like(g * np.log(np.where(a > 0, a, 1)) * np.power(a, b), b)) is not None:
        out[1] = gb
    return out


def _cast_fwd(x, *, to, saturate=1):
    return np.asarray(x).astype(NP_DTYPES[int(to)]), np.asarray(x).dtype


def _cast_vjp(dtype, g):
    return {0: g.astype(dtype)} if np.issubdtype(dtype, np.floating) else {}


def _castlike_fwd(x, like, *, saturate=1):
    return np.asarray(x).astype(np.asarray(like).dtype), np.asarray(x).dtype


def _gemm_fwd(a, b, c=None, *, alpha=1.0, beta=1.0, transA=0, transB=0):
    a2, b2 = (a.T if transA else a), (b.T if transB else b)
    y = np.matmul(a2, b2)
    if alpha != 1.0:
        y = y * np.asarray(alpha, dtype=y.dtype)
    if c is not None:
        y = y + (c * np.asarray(beta, dtype=c.dtype) if beta != 1.0 else c)
    return y, (a2, b2, c, alpha, beta, transA, transB)


def _gemm_vjp(ctx, g):
    a2, b2, c, alpha, beta, transA, transB = ctx
    ga_, gb_ = np.matmul(g, b2.T) * alpha, np.matmul(a2.T, g) * alpha
    out = {0: _out(ga_.T if transA else ga_, a2), 1: _out(gb_.T if transB else gb_, b2)}
    if c is not None:
        out[2] = _out(unbroadcast(g * beta, c.shape), c)
    return out


def _ln_fwd(x, scale, bias=None, *, axis=-1, epsilon=1e-5, stash_type=1, outputs=1):
    if outputs != 1:
        raise ValueError("the numpy engine computes only LayerNormalization's first output")
    return layer_norm_fwd(x, x.ndim - axis % x.ndim, scale, bias, float(epsilon))


def _ln_vjp(ctx, g):
    return {{0: 0, 2: 1, 3: 2}[k]: v for k, v in layer_norm_vjp(ctx, g).items()}


def _gather_fwd(data, indices, *, axis=0):
    return GATHER.fwd(data, indices, axis)


def _reshape_shape(x, shape, *, allowzero=0):
    return tuple(reshape_target(x.shape, shape, allowzero))


def _flatten_shape(x, *, axis=1):
    axis = axis % x.ndim if x.ndim else 0
    return (int(np.prod(x.shape[:axis])), -1)


def _unsqueeze_shape(x, axes):
    rank = x.ndim + len(axes)
    shape = list(x.shape)
    for a in sorted(a % rank for a in axes):
        shape.insert(a, 1)
    return tuple(shape)


def _squeeze_shape(x, axes=None):
    if axes is None:
        return tuple(s for s in x.shape if s != 1)
    drop = {a % x.ndim for a in axes}
    return tuple(s for i, s in enumerate(x.shape) if i not in drop)


def _transpose_fwd(x, *, perm=None):
    return permute_fwd(x, list(perm) if perm is not None else list(reversed(range(x.ndim))))


def _expand_fwd(x, shape):
    return np.broadcast_to(x, np.broadcast_shapes(x.shape, tuple(shape))).copy(), x.shape


def _concat_fwd(*xs, axis):
    xs = [np.asarray(x) for x in xs]
    axis = axis % xs[0].ndim
    return np.concatenate(xs, axis=axis), ([x.shape[axis] for x in xs], axis, [x.dtype for x in xs])


def _concat_vjp(ctx, g):
    sizes, axis, dtypes = ctx
    parts = np.split(g, np.cumsum(sizes)[:-1], axis=axis)
    return {i: p for i, (p, dt) in enumerate(zip(parts, dtypes)) if np.issubdtype(dt, np.floating)}


def _split_common(x, sizes, axis):
    axis = axis % x.ndim
    return tuple(np.split(x, np.cumsum(sizes)[:-1], axis=axis)), (x.shape, x.dtype, sizes, axis)


def _split_fwd(x, split=None, *, axis=0, num_outputs=None):
    return _split_common(x, split_sizes(x.shape[axis], split, num_outputs), axis)


def _split_to_sequence_fwd(x, split=None, *, axis=0, keepdims=1):
    if split is None:
        if not keepdims:
            raise ValueError("SplitToSequence without split and keepdims=0 is not supported by the numpy engine")
        split = 1
    return _split_common(x, split_sizes(x.shape[axis], split), axis)


def _split_vjp(ctx, gs):
    shape, dtype, sizes, axis = ctx
    parts = []
    for g, n in zip(gs, sizes):
        if g is None:
            s = list(shape)
            s[axis] = n
            g = np.zeros(s, dtype=dtype)
        parts.append(g)
    return {0: np.concatenate(parts, axis=axis)}


def _slice_fwd(x, starts, ends, axes=None, steps=None):
    sel = normalize_slice(x.shape, starts, ends, axes, steps)
    out = x
    for axis, r in sel:
        out = np.take(out, np.arange(r.start, r.stop, r.step, dtype=np.int64), axis=axis)
    return out, (x.shape, x.dtype, sel)


def _slice_vjp(ctx, g):
    shape, dtype, sel = ctx
    # undo the per-axis takes in reverse order
    shapes = [tuple(shape)]
    for axis, r in sel[:-1]:
        s = list(shapes[-1])
        s[axis] = len(r)
        shapes.append(tuple(s))
    for (axis, r), before in zip(reversed(sel), reversed(shapes)):
        full = np.zeros(before, dtype=dtype)
        index = [slice(None)] * len(before)
        index[axis] = np.arange(r.start, r.stop, r.step, dtype=np.int64)
        full[tuple(index)] = g
        g = full
    return {0: g}


def _reduce_fwd(kind: str):
    def fwd(x, axes=None, *, keepdims=1, noop_with_empty_axes=0):
        dims = reduce_axes(x.ndim, axes, noop_with_empty_axes)
        if dims is None:
            return x, (x.shape, None, keepdims)
        y = x.mean(axis=dims, keepdims=bool(keepdims)) if kind == "mean" else x.sum(axis=dims, keepdims=bool(keepdims))
        return _out(y, x), (x.shape, dims, keepdims)

    def vjp(ctx, g):
        shape, dims, keepdims = ctx
        if dims is None:
            return {0: g}
        if not keepdims:
            g = np.expand_dims(g, dims)
        if kind == "mean":
            n = int(np.prod([shape[d] for d in dims]))
            g = g / np.asarray(n, dtype=g.dtype)
        return {0: np.broadcast_to(g, shape).copy()}

    return NpOp(fwd, vjp)


def _sce_fwd(scores, labels, weights=None, *, ignore_index=None, reduction="mean", outputs=1):
    if weights is not None or outputs != 1:
        raise ValueError("the numpy engine supports SoftmaxCrossEntropyLoss without weights, one output")
    return cross_entropy_fwd(scores, labels, -100 if ignore_index is None else int(ignore_index), _s(reduction))


def _constant_of_shape(shape, *, value=0.0, dtype=1):
    return np.full(tuple(int(s) for s in shape), value, dtype=NP_DTYPES[int(dtype)])


def _range(start, limit, delta):
    return np.arange(start, limit, delta, dtype=np.result_type(np.asarray(start), np.asarray(limit), np.asarray(delta)))


def _shape(x, *, start=0, end=None):
    return np.asarray(np.asarray(x).shape[start:end], dtype=np.int64)


#: ``onnx.<OpType>`` targets the NumPy engine implements (see docs/engines.md).
def _coerced(op: NpOp) -> NpOp:
    """Softmax/LogSoftmax; ``coerce_2d=1`` (opset < 13): on the input viewed as 2-D around ``axis``."""
    def fwd(x, *, axis=-1, coerce_2d=0):
        if not coerce_2d:
            y, ctx = op.fwd(x, axis)
            return y, (ctx, None)
        axis = axis % x.ndim if x.ndim else 0
        y, ctx = op.fwd(x.reshape(int(np.prod(x.shape[:axis], dtype=np.int64)), -1), 1)
        return y.reshape(x.shape), (ctx, x.shape)

    def vjp(ctx, g):
        inner, shape = ctx
        if shape is None:
            return op.vjp(inner, g)
        return {0: op.vjp(inner, g.reshape(inner[0].shape))[0].reshape(shape)}

    return NpOp(fwd, vjp)


ONNX_NUMPY: dict[str, NpOp] = {
    "onnx.Add": ADD, "onnx.Sub": SUB, "onnx.Mul": MUL, "onnx.Div": NpOp(_div_fwd, _div_vjp),
    "onnx.Pow": NpOp(_pow_fwd, _pow_vjp), "onnx.Neg": NEG,
    "onnx.Relu": RELU, "onnx.Tanh": TANH, "onnx.Sigmoid": SIGMOID, "onnx.Exp": EXP, "onnx.Log": LOG,
    "onnx.Sqrt": SQRT, "onnx.Erf": ERF,
    "onnx.Gelu": NpOp(lambda x, *, approximate="none": gelu_fwd(x, _s(approximate)), gelu_vjp),
    "onnx.Softmax": _coerced(SOFTMAX),
    "onnx.LogSoftmax": _coerced(LOG_SOFTMAX),
    "onnx.Identity": IDENTITY, "onnx.Dropout": NpOp(lambda x, ratio=None, training_mode=None, *, seed=None, outputs=1:
                                                    (x, None), lambda ctx, g: {0: g}),
    "onnx.Where": WHERE,
    "onnx.Cast": NpOp(_cast_fwd, _cast_vjp), "onnx.CastLike": NpOp(_castlike_fwd, _cast_vjp),
    "onnx.MatMul": MATMUL, "onnx.Gemm": NpOp(_gemm_fwd, _gemm_vjp),
    "onnx.LayerNormalization": NpOp(_ln_fwd, _ln_vjp),
    "onnx.Gather": NpOp(_gather_fwd, GATHER.vjp),
    "onnx.Reshape": reshape_op(_reshape_shape), "onnx.Flatten": reshape_op(_flatten_shape),
    "onnx.Unsqueeze": reshape_op(_unsqueeze_shape), "onnx.Squeeze": reshape_op(_squeeze_shape),
    "onnx.Transpose": NpOp(_transpose_fwd, permute_vjp),
    "onnx.Expand": NpOp(_expand_fwd, lambda shape, g: {0: unbroadcast(g, shape)}),
    "onnx.Concat": NpOp(_concat_fwd, _concat_vjp),
    "onnx.Split": NpOp(_split_fwd, _split_vjp), "onnx.SplitToSequence": NpOp(_split_to_sequence_fwd, _split_vjp),
    "onnx.SequenceAt": NpOp(lambda x, position=None: (x, None), lambda ctx, g: {0: g}),
    "onnx.Slice": NpOp(_slice_fwd, _slice_vjp),
    "onnx.ReduceMean": _reduce_fwd("mean"), "onnx.ReduceSum": _reduce_fwd("sum"),
    "onnx.SoftmaxCrossEntropyLoss": NpOp(_sce_fwd, cross_entropy_vjp),
    # not differentiable: comparisons and shape arithmetic (also used for constant folding)
    "onnx.Equal": _no_grad(np.equal), "onnx.Less": _no_grad(np.less), "onnx.Greater": _no_grad(np.greater),
    "onnx.LessOrEqual": _no_grad(np.less_equal), "onnx.GreaterOrEqual": _no_grad(np.greater_equal),
    "onnx.Not": _no_grad(np.logical_not), "onnx.And": _no_grad(np.logical_and), "onnx.Or": _no_grad(np.logical_or),
    "onnx.Shape": _no_grad(_shape), "onnx.ConstantOfShape": _no_grad(_constant_of_shape),
    "onnx.Range": _no_grad(_range),
    **ONNX_ZOO_NUMPY,  # activations, heads and resamplers of the model-zoo CNNs and Transformers
}

"""Torch implementations of ONNX ops: the ``onnx.<OpType>`` targets of the torch engine.

Each function takes the ONNX node's inputs positionally (a missing optional
input is None; static inputs such as Reshape's shape arrive as int lists) and
its attributes as keyword arguments with the ONNX defaults. Forward runs in
torch, so autograd supplies the backward. The op registry resolves
``onnx.<OpType>`` to :data:`ONNX_OPS` (``fusion.ir.registry``).

Semantics follow the ONNX operator specification (opset 13-21); deviations
are named in each docstring.
"""
from __future__ import annotations

import functools
import operator

import math
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ..ir.onnx_ops import normalize_slice, reduce_axes, reshape_target, split_sizes

#: ONNX TensorProto element type -> torch dtype
ONNX_DTYPES = {
    1: torch.float32, 2: torch.uint8, 3: torch.int8, 5: torch.int16, 6: torch.int32, 7: torch.int64,
    9: torch.bool, 10: torch.float16, 11: torch.float64, 16: torch.bfloat16,
}

ONNX_OPS: dict[str, Callable[..., Any]] = {}


def _op(fn: Callable[..., Any]) -> Callable[..., Any]:
    ONNX_OPS[fn.__name__] = fn
    return fn


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


# -- element-wise -------------------------------------------------------------------------

@_op
def Add(a, b):
    return a + b


@_op
def Sub(a, b):
    return a - b


@_op
def Mul(a, b):
    return a * b


@_op
def Div(a, b):
    """Integer division truncates toward zero, as ONNX says."""
    if not a.is_floating_point() and not b.is_floating_point():
        return torch.div(a, b, rounding_mode="trunc")
    return a / b


@_op
def Pow(a, b):
    return torch.pow(a, b)


for _name, _fn in {
    "Neg": torch.neg, "Abs": torch.abs, "Sqrt": torch.sqrt, "Exp": torch.exp, "Log": torch.log,
    "Reciprocal": torch.reciprocal, "Erf": torch.erf, "Tanh": torch.tanh, "Sigmoid": torch.sigmoid,
    "Relu": torch.relu, "Floor": torch.floor, "Ceil": torch.ceil, "Sin": torch.sin, "Cos": torch.cos,
    "Not": torch.logical_not, "Softplus": F.softplus,
}.items():
    ONNX_OPS[_name] = (lambda f: (lambda x: f(x)))(_fn)

for _name, _fn in {
    "Equal": torch.eq, "Less": torch.lt, "LessOrEqual": torch.le, "Greater": torch.gt,
    "GreaterOrEqual": torch.ge, "And": torch.logical_and, "Or": torch.logical_or, "Xor": torch.logical_xor,
}.items():
    ONNX_OPS[_name] = (lambda f: (lambda a, b: f(a, b)))(_fn)


@_op
def Gelu(x, *, approximate="none"):
    return F.gelu(x, approximate=_s(approximate))


@_op
def LeakyRelu(x, *, alpha=0.01):
    return F.leaky_relu(x, alpha)


@_op
def Clip(x, min=None, max=None):
    return torch.clamp(x, min, max)


@_op
def Where(cond, a, b):
    return torch.where(cond, a, b)


@_op
def Max(*xs):
    return functools.reduce(torch.maximum, xs)


@_op
def Min(*xs):
    return functools.reduce(torch.minimum, xs)


@_op
def Sum(*xs):
    return functools.reduce(operator.add, xs)


@_op
def Cast(x, *, to, saturate=1):
    return x.to(ONNX_DTYPES[int(to)])


@_op
def CastLike(x, like, *, saturate=1):
    return x.to(like.dtype)


@_op
def Identity(x):
    return x


@_op
def Dropout(x, ratio=None, training_mode=None, *, seed=None, outputs=1):
    """Inference semantics only (identity); the importer rejects training-mode dropout."""
    if outputs > 1:
        return x, torch.ones_like(x, dtype=torch.bool)
    return x


# -- linear algebra ---------------------------------------------------------------------

@_op
def MatMul(a, b):
    return torch.matmul(a, b)


@_op
def Gemm(a, b, c=None, *, alpha=1.0, beta=1.0, transA=0, transB=0):
    """``alpha * A' @ B' + beta * C``; the common Linear case runs ``F.linear`` (same kernel as nn.Linear)."""
    if transA:
        a = a.t()
    if transB and alpha == 1.0 and beta == 1.0:
        return F.linear(a, b, c)
    y = a @ (b.t() if transB else b)
    if alpha != 1.0:
        y = y * alpha
    if c is not None:
        y = y + (c * beta if beta != 1.0 else c)
    return y


# -- normalisation, activation with axes ------------------------------------------------------

@_op
def Softmax(x, *, axis=-1):
    return torch.softmax(x, dim=axis)


@_op
def LogSoftmax(x, *, axis=-1):
    return torch.log_softmax(x, dim=axis)


@_op
def LayerNormalization(x, scale, bias=None, *, axis=-1, epsilon=1e-5, stash_type=1, outputs=1):
    axis = axis % x.dim()
    y = F.layer_norm(x, tuple(x.shape[axis:]), scale, bias, epsilon)
    if outputs == 1:
        return y
    dims = tuple(range(axis, x.dim()))
    mean = x.mean(dim=dims, keepdim=True)
    inv = torch.rsqrt(x.var(dim=dims, unbiased=False, keepdim=True) + epsilon)
    return (y, mean, inv)[:outputs]


@_op
def BatchNormalization(x, scale, bias, mean, var, *, epsilon=1e-5, momentum=0.9, training_mode=0, outputs=1):
    """Eval mode normalises with the running statistics; training mode with the
    batch's (running statistics are returned as outputs 1-2, not written back).
    No gradient flows into the statistics (as in torch, where they are buffers)."""
    mean, var = mean.detach(), var.detach()
    if not training_mode:
        return F.batch_norm(x, mean, var, scale, bias, False, 0.0, epsilon)
    rm, rv = mean.detach().clone(), var.detach().clone()
    y = F.batch_norm(x, rm, rv, scale, bias, True, 1.0 - momentum, epsilon)
    return (y, rm, rv)[:outputs] if outputs > 1 else y


# -- convolution and pooling ---------------------------------------------------------------

def _pads(x, kernel, strides, dilations, pads, auto_pad) -> list[int]:
    nd = len(kernel)
    auto_pad = _s(auto_pad)
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        out = []
        for i in range(nd):
            size = x.shape[2 + i]
            total = max(0, (math.ceil(size / strides[i]) - 1) * strides[i] + (kernel[i] - 1) * dilations[i] + 1 - size)
            small, big = total // 2, total - total // 2
            out.append((small, big) if auto_pad == "SAME_UPPER" else (big, small))
        return [p[0] for p in out] + [p[1] for p in out]
    if auto_pad == "VALID":
        return [0] * (2 * nd)
    return list(pads) if pads else [0] * (2 * nd)


def _symmetric(x, pads, fill: float):
    """Pad so that the remaining padding is symmetric; returns (x, per-dim padding)."""
    nd = len(pads) // 2
    begin, end = pads[:nd], pads[nd:]
    if begin == end:
        return x, begin
    extra = []
    for i in reversed(range(nd)):
        extra += [0, end[i] - begin[i]] if end[i] >= begin[i] else [begin[i] - end[i], 0]
    return F.pad(x, extra, value=fill), [min(b, e) for b, e in zip(begin, end)]


@_op
def Conv(x, w, b=None, *, auto_pad="NOTSET", dilations=None, group=1, kernel_shape=None, pads=None, strides=None):
    nd = w.dim() - 2
    kernel = list(kernel_shape or w.shape[2:])
    strides = list(strides or [1] * nd)
    dilations = list(dilations or [1] * nd)
    x, pad = _symmetric(x, _pads(x, kernel, strides, dilations, pads, auto_pad), 0.0)
    conv = (F.conv1d, F.conv2d, F.conv3d)[nd - 1]
    return conv(x, w, b, strides, pad, dilations, group)


@_op
def MaxPool(x, *, auto_pad="NOTSET", ceil_mode=0, dilations=None, kernel_shape, pads=None, storage_order=0, strides=None, outputs=1):
    nd = len(kernel_shape)
    strides = list(strides or [1] * nd)
    dilations = list(dilations or [1] * nd)
    x, pad = _symmetric(x, _pads(x, kernel_shape, strides, dilations, pads, auto_pad), -math.inf)
    pool = (F.max_pool1d, F.max_pool2d, F.max_pool3d)[nd - 1]
    return pool(x, kernel_shape, strides, pad, dilations, bool(ceil_mode))


@_op
def AveragePool(x, *, auto_pad="NOTSET", ceil_mode=0, count_include_pad=0, dilations=None, kernel_shape, pads=None, strides=None):
    nd = len(kernel_shape)
    strides = list(strides or [1] * nd)
    pad = _pads(x, kernel_shape, strides, [1] * nd, pads, auto_pad)
    if pad[:nd] != pad[nd:]:
        raise ValueError(f"AveragePool with asymmetric pads {pad} is not supported")
    pool = (F.avg_pool1d, F.avg_pool2d, F.avg_pool3d)[nd - 1]
    return pool(x, kernel_shape, strides, pad[:nd], bool(ceil_mode), bool(count_include_pad))


@_op
def GlobalAveragePool(x):
    return x.mean(dim=tuple(range(2, x.dim())), keepdim=True)


@_op
def GlobalMaxPool(x):
    return x.amax(dim=tuple(range(2, x.dim())), keepdim=True)


# -- shape manipulation --------------------------------------------------------------------

@_op
def Reshape(x, shape, *, allowzero=0):
    return x.reshape(reshape_target(x.shape, shape, allowzero))


@_op
def Flatten(x, *, axis=1):
    axis = axis % x.dim() if x.dim() else 0
    return x.reshape(math.prod(x.shape[:axis]), -1)


@_op
def Transpose(x, *, perm=None):
    return x.permute(*(perm if perm is not None else reversed(range(x.dim()))))


@_op
def Concat(*xs, axis):
    return torch.cat(xs, dim=axis)


@_op
def Split(x, split=None, *, axis=0, num_outputs=None):
    return tuple(torch.split(x, split_sizes(x.shape[axis], split, num_outputs), dim=axis))


@_op
def SplitToSequence(x, split=None, *, axis=0, keepdims=1):
    """The sequence is a tuple of tensors; SequenceAt nodes pick elements by output index."""
    if split is None:
        parts = torch.split(x, 1, dim=axis)
        return tuple(p.squeeze(axis) for p in parts) if not keepdims else tuple(parts)
    return tuple(torch.split(x, split_sizes(x.shape[axis], split), dim=axis))


@_op
def SequenceAt(x, position=None):
    """Identity: the importer already wires the chosen element of the sequence."""
    return x


@_op
def Slice(x, starts, ends, axes=None, steps=None):
    index: list[Any] = [slice(None)] * x.dim()
    gathers = []
    for axis, r in normalize_slice(x.shape, starts, ends, axes, steps):
        if r.step > 0:
            index[axis] = slice(r.start, max(r.start, r.stop), r.step)
        else:
            gathers.append((axis, list(r)))
    out = x[tuple(index)]
    for axis, idx in gathers:
        out = out.index_select(axis, torch.tensor(idx, dtype=torch.long, device=x.device))
    return out


@_op
def Gather(data, indices, *, axis=0):
    axis = axis % data.dim()
    idx = torch.where(indices < 0, indices + data.shape[axis], indices).long()
    flat = data.index_select(axis, idx.reshape(-1))
    return flat.reshape(tuple(data.shape[:axis]) + tuple(idx.shape) + tuple(data.shape[axis + 1:]))


@_op
def Unsqueeze(x, axes):
    rank = x.dim() + len(axes)
    for a in sorted(a % rank for a in axes):
        x = x.unsqueeze(a)
    return x


@_op
def Squeeze(x, axes=None):
    if axes is None:
        return x.squeeze()
    for a in sorted((a % x.dim() for a in axes), reverse=True):
        x = x.squeeze(a)
    return x


@_op
def Expand(x, shape):
    return x.expand(torch.broadcast_shapes(tuple(x.shape), tuple(shape)))


@_op
def Tile(x, repeats):
    return x.repeat(*repeats)


@_op
def Shape(x, *, start=0, end=None):
    return torch.tensor(list(x.shape)[start:end], dtype=torch.int64)


@_op
def ConstantOfShape(shape, *, value=0.0, dtype=1):
    return torch.full(tuple(shape), value, dtype=ONNX_DTYPES[int(dtype)])


@_op
def Range(start, limit, delta):
    return torch.arange(start, limit, delta)


@_op
def Pad(x, pads, constant_value=None, axes=None, *, mode="constant"):
    rank = x.dim()
    axes = list(range(rank)) if axes is None else [a % rank for a in axes]
    n = len(axes)
    spec = [0] * (2 * rank)
    for i, a in enumerate(axes):
        spec[2 * (rank - 1 - a)] = pads[i]
        spec[2 * (rank - 1 - a) + 1] = pads[i + n]
    value = 0.0 if constant_value is None else float(constant_value)
    return F.pad(x, spec, mode=_s(mode), value=value) if _s(mode) == "constant" else F.pad(x, spec, mode=_s(mode))


def _reduce(fn):
    def op(x, axes=None, *, keepdims=1, noop_with_empty_axes=0):
        dims = reduce_axes(x.dim(), axes, noop_with_empty_axes)
        return x if dims is None else fn(x, dims, bool(keepdims))
    return op


ONNX_OPS["ReduceMean"] = _reduce(lambda x, d, k: x.mean(dim=d, keepdim=k))
ONNX_OPS["ReduceSum"] = _reduce(lambda x, d, k: x.sum(dim=d, keepdim=k))
ONNX_OPS["ReduceMax"] = _reduce(lambda x, d, k: x.amax(dim=d, keepdim=k))
ONNX_OPS["ReduceMin"] = _reduce(lambda x, d, k: x.amin(dim=d, keepdim=k))


# -- losses -------------------------------------------------------------------------------

@_op
def SoftmaxCrossEntropyLoss(scores, labels, weights=None, *, ignore_index=None, reduction="mean", outputs=1):
    ii = -100 if ignore_index is None else int(ignore_index)
    loss = F.cross_entropy(scores, labels.long(), weights, ignore_index=ii, reduction=_s(reduction))
    return (loss, torch.log_softmax(scores, dim=1)) if outputs > 1 else loss


@_op
def NegativeLogLikelihoodLoss(x, target, weight=None, *, ignore_index=None, reduction="mean", outputs=1):
    ii = -100 if ignore_index is None else int(ignore_index)
    return F.nll_loss(x, target.long(), weight, ignore_index=ii, reduction=_s(reduction))


def supported() -> frozenset[str]:
    """ONNX op types the torch engine implements."""
    return frozenset(ONNX_OPS)


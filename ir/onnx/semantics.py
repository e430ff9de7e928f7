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

from fusion.ir.onnx.ops import normalize_slice, pad_source, reduce_axes, reshape_target, split_sizes
from fusion.ir.onnx.resize import resize_plan, upsample_attrs

#: ONNX TensorProto element type -> torch dtype
ONNX_DTYPES = {
    1: torch.float32, 2: torch.uint8, 3: torch.int8, 5: torch.int16, 6: torch.int32, 7: torch.int64,
    9: torch.bool, 10: torch.float16, 11: torch.float64, 16: torch.bfloat16,
}

#: dtypes (NumPy names) the torch engine's ONNX ops run on; the importer refuses others at load
TORCH_OK_DTYPES = frozenset({"float32", "float64", "float16", "int8", "int16", "int32", "int64", "uint8", "bool"})

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
    """The result has the base's type (an int base with a float exponent stays int)."""
    y = torch.pow(a, b)
    return y if y.dtype == a.dtype else y.to(a.dtype)


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
def Elu(x, *, alpha=1.0):
    return F.elu(x, alpha)


@_op
def Selu(x, *, alpha=1.67326319217681884765625, gamma=1.05070102214813232421875):
    return gamma * torch.where(x > 0, x, alpha * (torch.exp(x) - 1))


@_op
def HardSigmoid(x, *, alpha=0.2, beta=0.5):
    return torch.clamp(alpha * x + beta, 0.0, 1.0)


@_op
def HardSwish(x):
    return F.hardswish(x)


@_op
def PRelu(x, slope):
    return torch.where(x < 0, x * slope, x)


@_op
def Sign(x):
    return torch.sign(x)


@_op
def Mean(*xs):
    return functools.reduce(operator.add, xs) / len(xs)


@_op
def LRN(x, *, size, alpha=0.0001, beta=0.75, bias=1.0):
    """ONNX: the square sum over ``size`` channels centred on c (floor((size-1)/2) before, ceil after)."""
    sq = (x * x).unsqueeze(1)
    before, after = (size - 1) // 2, size - 1 - (size - 1) // 2
    sq = F.pad(sq, [0, 0] * (x.dim() - 2) + [before, after])
    total = F.avg_pool2d(sq.flatten(3), (size, 1), stride=1).reshape(x.shape) * size
    return x / (bias + alpha / size * total) ** beta


@_op
def InstanceNormalization(x, scale, bias, *, epsilon=1e-5):
    return F.instance_norm(x, None, None, scale, bias, True, 0.0, epsilon)


@_op
def Gelu(x, *, approximate="none"):
    return F.gelu(x, approximate=_s(approximate))


@_op
def Mish(x):
    return x * torch.tanh(F.softplus(x))


@_op
def LeakyRelu(x, *, alpha=0.01):
    return F.leaky_relu(x, alpha)


@_op
def Clip(x, min=None, max=None):
    """Without bounds Clip is the identity (torch.clamp needs at least one)."""
    if min is None and max is None:
        return x.clone()
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

def _coerced(fn, x, axis: int, coerce_2d: int):
    """Opset < 13: the input is viewed as 2-D (dims before ``axis`` | from ``axis``) and ``fn`` runs on dim 1."""
    if not coerce_2d:
        return fn(x, axis)
    axis = axis % x.dim() if x.dim() else 0
    y = fn(x.reshape(math.prod(x.shape[:axis]), -1), 1)
    return y.reshape(x.shape)


def _hardmax(x, dim):
    idx = x.argmax(dim=dim, keepdim=True)
    return torch.zeros_like(x).scatter_(dim, idx, 1.0)


@_op
def Softmax(x, *, axis=-1, coerce_2d=0):
    """``coerce_2d=1``: Softmax-1/11 semantics (the importer sets it, with axis default 1, for opset < 13)."""
    return _coerced(lambda t, d: torch.softmax(t, dim=d), x, axis, coerce_2d)


@_op
def LogSoftmax(x, *, axis=-1, coerce_2d=0):
    return _coerced(lambda t, d: torch.log_softmax(t, dim=d), x, axis, coerce_2d)


@_op
def Hardmax(x, *, axis=-1, coerce_2d=0):
    """One-hot of the first maximum along ``axis`` (no gradient)."""
    return _coerced(_hardmax, x.detach(), axis, coerce_2d)


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
    y = F.batch_norm(x, None, None, scale, bias, True, 0.0, epsilon)
    if outputs == 1:
        return y
    dims = [0] + list(range(2, x.dim()))
    with torch.no_grad():  # ONNX: running = running * momentum + batch * (1 - momentum), batch variance biased
        bm, bv = x.mean(dim=dims), x.var(dim=dims, unbiased=False)
        rm, rv = mean * momentum + bm * (1 - momentum), var * momentum + bv * (1 - momentum)
    return (y, rm, rv)[:outputs]


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


def _pool_geometry(x, kernel, strides, dilations, pads, auto_pad, ceil_mode):
    """Per spatial dim: (begin pad, end pad, output size) by the ONNX pooling rules."""
    nd = len(kernel)
    pad = _pads(x, kernel, strides, dilations, pads, auto_pad)
    out = []
    for i in range(nd):
        size, dk = x.shape[2 + i], (kernel[i] - 1) * dilations[i] + 1
        span = size + pad[i] + pad[nd + i] - dk
        n = (-(-span // strides[i]) if ceil_mode else span // strides[i]) + 1
        if ceil_mode and (n - 1) * strides[i] >= size + pad[i]:
            n -= 1  # the last window must start inside the input or its left padding
        out.append((pad[i], pad[nd + i], n))
    return out


def _explicit_pad(x, geometry, kernel, strides, dilations, fill: float):
    """Pad every spatial dim so that a padding-free pool yields the ONNX output size; returns (x, extra end pads)."""
    spec, extra = [], []
    for i in reversed(range(len(geometry))):
        b, e, n = geometry[i]
        need = (n - 1) * strides[i] + (kernel[i] - 1) * dilations[i] + 1
        e2 = need - (x.shape[2 + i] + b)  # may exceed e (ceil mode) or cut it (windows that never start)
        spec += [b, e2]
        extra.insert(0, e2 - e)
    return F.pad(x, spec, value=fill), extra


@_op
def MaxPool(x, *, auto_pad="NOTSET", ceil_mode=0, dilations=None, kernel_shape, pads=None, storage_order=0, strides=None,
            outputs=1):
    """Any pads (beyond torch's half-kernel limit: padded with -inf explicitly); ``outputs=2`` adds ONNX's
    flat Indices (row-major, or column-major with ``storage_order=1``) into the unpadded input."""
    nd = len(kernel_shape)
    strides = list(strides or [1] * nd)
    dilations = list(dilations or [1] * nd)
    geometry = _pool_geometry(x, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode)
    pool = (F.max_pool1d, F.max_pool2d, F.max_pool3d)[nd - 1]
    fits = all(b == e and 2 * b <= (k - 1) * d + 1 for (b, e, _), k, d in zip(geometry, kernel_shape, dilations))
    if fits:
        y = pool(x, kernel_shape, strides, [g[0] for g in geometry], dilations, bool(ceil_mode), return_indices=outputs > 1)
        if outputs == 1:
            return y
        y, idx = y
    else:
        if outputs > 1:
            raise ValueError("MaxPool Indices with asymmetric or large pads are not supported")  # refused at load
        xp, _ = _explicit_pad(x, geometry, kernel_shape, strides, dilations, -math.inf)
        return pool(xp, kernel_shape, strides, 0, dilations, False)
    spatial = x.shape[2:]
    plane = math.prod(spatial)
    if storage_order:
        coords, rest = [], idx
        for sdim in reversed(spatial):
            coords.insert(0, rest % sdim)
            rest = rest // sdim
        idx, mult = torch.zeros_like(idx), 1
        for c, sdim in zip(coords, spatial):
            idx, mult = idx + c * mult, mult * sdim
    base = torch.arange(x.shape[0] * x.shape[1], device=x.device).reshape(x.shape[0], x.shape[1], *([1] * nd)) * plane
    return y, idx + base


@_op
def AveragePool(x, *, auto_pad="NOTSET", ceil_mode=0, count_include_pad=0, dilations=None, kernel_shape, pads=None,
                strides=None):
    """Any pads, dilations, SAME padding and ceil mode: window sums by a depthwise convolution with ones,
    divided by the number of counted elements (explicit pads count with ``count_include_pad``, the
    ceil-mode overhang never does)."""
    nd = len(kernel_shape)
    strides = list(strides or [1] * nd)
    dilations = list(dilations or [1] * nd)
    geometry = _pool_geometry(x, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode)
    xp, extra = _explicit_pad(x, geometry, kernel_shape, strides, dilations, 0.0)
    ones = torch.ones((1, 1, *x.shape[2:]), dtype=x.dtype, device=x.device)
    if count_include_pad:  # pads count, the ceil-mode overhang does not
        ones = F.pad(ones, [p for (b, e, _) in reversed(geometry) for p in (b, e)], value=1.0)
        mask = F.pad(ones, [p for e2 in reversed(extra) for p in (0, e2)], value=0.0)
    else:
        mask, _ = _explicit_pad(ones, geometry, kernel_shape, strides, dilations, 0.0)
    conv = (F.conv1d, F.conv2d, F.conv3d)[nd - 1]
    c = x.shape[1]
    kernel = torch.ones((c, 1, *kernel_shape), dtype=x.dtype, device=x.device)
    total = conv(xp, kernel, None, strides, 0, dilations, c)
    count = conv(mask, kernel[:1], None, strides, 0, dilations, 1)
    return total / count


@_op
def GlobalAveragePool(x):
    return x.mean(dim=tuple(range(2, x.dim())), keepdim=True)


@_op
def GlobalMaxPool(x):
    return x.amax(dim=tuple(range(2, x.dim())), keepdim=True)


@_op
def ConvTranspose(x, w, b=None, *, auto_pad="NOTSET", dilations=None, group=1, kernel_shape=None, output_padding=None,
                  output_shape=None, pads=None, strides=None):
    """The full transposed convolution (no padding), then each spatial dim cut to ``[begin, begin + out)``
    (zeros past the end: ``output_padding``), then the bias. Pads and output size follow the ONNX reference:
    explicit ``pads`` (and ``output_shape`` if given), or SAME pads derived from ``output_shape``
    (default input * stride), SAME_UPPER putting the smaller half first."""
    nd = w.dim() - 2
    kernel = list(kernel_shape or w.shape[2:])
    strides = list(strides or [1] * nd)
    dilations = list(dilations or [1] * nd)
    opad = list(output_padding or [0] * nd)
    auto_pad = _s(auto_pad)
    full = [strides[i] * (x.shape[2 + i] - 1) + (kernel[i] - 1) * dilations[i] + 1 for i in range(nd)]
    if pads is None and auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        out = list(output_shape) if output_shape is not None else [x.shape[2 + i] * strides[i] for i in range(nd)]
        total = [full[i] + opad[i] - out[i] for i in range(nd)]
        begin = [t // 2 if auto_pad == "SAME_UPPER" else t - t // 2 for t in total]
    else:
        pads = list(pads or [0] * (2 * nd))
        begin = pads[:nd]
        out = (list(output_shape)[-nd:] if output_shape is not None
               else [full[i] + opad[i] - pads[i] - pads[nd + i] for i in range(nd)])
    conv = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[nd - 1]
    y = conv(x, w, None, strides, 0, 0, group, dilations)
    spec = []
    for i in reversed(range(nd)):  # negative F.pad amounts crop
        spec += [-begin[i], begin[i] + out[i] - full[i]]
    if any(spec):
        y = F.pad(y, spec)
    if b is not None:
        y = y + b.reshape(1, -1, *([1] * nd))
    return y


# -- resampling ------------------------------------------------------------------------------

def _resize_apply(x, plan, extrapolation_value: float):
    """Gather each axis's taps, weight and sum them (``fusion.ir.onnx.resize``); autograd gives the VJP."""
    y = x if x.is_floating_point() else x.double()
    for ax in plan:
        n = ax.index.shape[1]
        idx = torch.as_tensor(ax.index.reshape(-1), dtype=torch.long, device=x.device)
        tail = (1,) * (y.dim() - ax.axis - 1)
        taps = y.index_select(ax.axis, idx).reshape(*y.shape[:ax.axis], ax.size, n, *y.shape[ax.axis + 1:])
        w = torch.as_tensor(ax.weight, dtype=y.dtype, device=x.device).reshape(ax.size, n, *tail)
        y = (taps * w).sum(dim=ax.axis + 1)
        if ax.outside is not None:
            mask = torch.as_tensor(ax.outside, device=x.device).reshape(ax.size, *tail)
            y = torch.where(mask, torch.tensor(float(extrapolation_value), dtype=y.dtype, device=x.device), y)
    if not x.is_floating_point():  # ONNX saturates: round, clamp to the type's range
        info = torch.iinfo(x.dtype)
        y = y.round().clamp(info.min, info.max).to(x.dtype)
    return y if plan else x.clone()


@_op
def Resize(x, roi=None, scales=None, sizes=None, *, antialias=0, axes=None, coordinate_transformation_mode="half_pixel",
           cubic_coeff_a=-0.75, exclude_outside=0, extrapolation_value=0.0, keep_aspect_ratio_policy="stretch",
           mode="nearest", nearest_mode="round_prefer_floor"):
    """Every mode of Resize-19 (nearest / linear / cubic, antialias, every coordinate transformation,
    ``axes``, ``keep_aspect_ratio_policy``); roi/scales/sizes are static."""
    _, plan = resize_plan(tuple(x.shape), roi, scales, sizes, axes=axes, mode=_s(mode),
                          coordinate_transformation_mode=_s(coordinate_transformation_mode),
                          nearest_mode=_s(nearest_mode), cubic_coeff_a=float(cubic_coeff_a),
                          exclude_outside=int(exclude_outside), antialias=int(antialias),
                          keep_aspect_ratio_policy=_s(keep_aspect_ratio_policy))
    return _resize_apply(x, plan, extrapolation_value)


@_op
def Upsample(x, scales, *, mode="nearest"):
    """Upsample-7/9 (and Resize-10, which the importer maps here): asymmetric coordinates, nearest rounds down."""
    _, plan = resize_plan(tuple(x.shape), None, scales, None, **upsample_attrs(_s(mode)))
    return _resize_apply(x, plan, 0.0)


@_op
def DepthToSpace(x, *, blocksize, mode="DCR"):
    n, c, h, w = x.shape
    b = int(blocksize)
    if _s(mode) == "DCR":
        y = x.reshape(n, b, b, c // (b * b), h, w).permute(0, 3, 4, 1, 5, 2)
    else:
        y = x.reshape(n, c // (b * b), b, b, h, w).permute(0, 1, 4, 2, 5, 3)
    return y.reshape(n, c // (b * b), h * b, w * b)


@_op
def SpaceToDepth(x, *, blocksize, mode="DCR"):
    """The inverse of DepthToSpace with the same ``mode`` (DCR: block offsets, then channels; CRD: channels first)."""
    n, c, h, w = x.shape
    b = int(blocksize)
    y = x.reshape(n, c, h // b, b, w // b, b)
    y = y.permute(0, 3, 5, 1, 2, 4) if _s(mode) == "DCR" else y.permute(0, 1, 3, 5, 2, 4)
    return y.reshape(n, c * b * b, h // b, w // b)


# -- indices -----------------------------------------------------------------------------------

def _arg(fn, x, axis, keepdims, select_last_index):
    axis = axis % x.dim()
    if select_last_index:
        return x.shape[axis] - 1 - fn(x.flip(axis), dim=axis, keepdim=bool(keepdims))
    return fn(x, dim=axis, keepdim=bool(keepdims))


@_op
def ArgMax(x, *, axis=0, keepdims=1, select_last_index=0):
    """int64 indices of the first (or, with ``select_last_index``, last) maximum; no gradient."""
    return _arg(torch.argmax, x.detach(), axis, keepdims, select_last_index)


@_op
def ArgMin(x, *, axis=0, keepdims=1, select_last_index=0):
    return _arg(torch.argmin, x.detach(), axis, keepdims, select_last_index)


@_op
def TopK(x, k, *, axis=-1, largest=1, sorted=1, outputs=1):
    """Values (and int64 indices with ``outputs=2``) of the k largest/smallest along ``axis``; ties keep the
    lower index first (a stable sort), as ONNX requires."""
    kk = int(k[0] if isinstance(k, (list, tuple)) else k)
    vals, idx = torch.sort(x, dim=axis, descending=bool(largest), stable=True)
    vals, idx = vals.narrow(axis, 0, kk), idx.narrow(axis, 0, kk)
    return (vals, idx) if outputs > 1 else vals


@_op
def GatherElements(data, indices, *, axis=0):
    axis = axis % data.dim()
    return torch.gather(data, axis, torch.where(indices < 0, indices + data.shape[axis], indices).long())


@_op
def OneHot(indices, depth, values, *, axis=-1):
    """``values[1]`` where the (wrapped) index equals the position along the new axis, else ``values[0]``."""
    d = int(depth[0] if isinstance(depth, (list, tuple)) else depth)
    idx = indices.long()
    idx = torch.where(idx < 0, idx + d, idx)
    rank = idx.dim() + 1
    axis = axis % rank
    pos = torch.arange(d, device=idx.device).reshape(d, *([1] * (rank - axis - 1)))
    hit = idx.unsqueeze(axis) == pos
    return torch.where(hit, values[1], values[0])


@_op
def CumSum(x, axis, *, exclusive=0, reverse=0):
    a = int(axis[0] if isinstance(axis, (list, tuple)) else axis) % x.dim()
    y = x.flip(a) if reverse else x
    c = torch.cumsum(y, dim=a).to(x.dtype)  # torch accumulates ints in int64
    if exclusive:
        c = c - y
    return c.flip(a) if reverse else c


@_op
def Trilu(x, k=None, *, upper=1):
    kk = 0 if k is None else int(k[0] if isinstance(k, (list, tuple)) else k)
    return torch.triu(x, kk) if upper else torch.tril(x, kk)


@_op
def Einsum(*xs, equation):
    return torch.einsum(_s(equation).replace(" ", ""), *xs)


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
    mode = _s(mode)
    if mode == "constant":
        value = 0 if constant_value is None else (constant_value.item() if torch.is_tensor(constant_value) else constant_value)
        return F.pad(x, spec, value=value)
    y = x  # edge / reflect / wrap, any pad size (torch's own modes refuse pads wider than the input)
    for i, a in enumerate(axes):
        if pads[i] or pads[i + n]:
            src, _ = pad_source(y.shape[a], int(pads[i]), int(pads[i + n]), mode)
            y = y.index_select(a, torch.as_tensor(src, dtype=torch.long, device=x.device))
    return y if y is not x else x.clone()


def _reduce(fn):
    def op(x, axes=None, *, keepdims=1, noop_with_empty_axes=0):
        dims = reduce_axes(x.dim(), axes, noop_with_empty_axes)
        return x if dims is None else fn(x, dims, bool(keepdims))
    return op


ONNX_OPS["ReduceMean"] = _reduce(lambda x, d, k: x.mean(dim=d, keepdim=k))
ONNX_OPS["ReduceSum"] = _reduce(lambda x, d, k: x.sum(dim=d, keepdim=k).to(x.dtype))
def _extreme(fn, largest: bool):
    """amax/amin; over an empty set ONNX gives the identity element (-inf / +inf, the int range end, False / True)."""
    def op(x, d, k):
        if all(x.shape[i] for i in d):
            return fn(x, dim=d, keepdim=k)
        shape = [1 if i in d else s for i, s in enumerate(x.shape) if k or i not in d]
        if x.dtype == torch.bool:
            fill: Any = not largest
        elif x.is_floating_point():
            fill = -math.inf if largest else math.inf
        else:
            fill = torch.iinfo(x.dtype).min if largest else torch.iinfo(x.dtype).max
        return torch.full(shape, fill, dtype=x.dtype, device=x.device)
    return op


def _prod(x, d, k):
    for a in sorted(d, reverse=True):
        x = x.prod(dim=a, keepdim=k)
    return x


def _same_dtype(fn):
    """torch accumulates integer sums/products in int64; ONNX keeps the input's type."""
    return lambda x, d, k: fn(x, d, k).to(x.dtype)


ONNX_OPS["ReduceProd"] = _reduce(_same_dtype(_prod))
ONNX_OPS["ReduceSumSquare"] = _reduce(_same_dtype(lambda x, d, k: (x * x).sum(dim=d, keepdim=k)))
ONNX_OPS["ReduceL1"] = _reduce(_same_dtype(lambda x, d, k: x.abs().sum(dim=d, keepdim=k)))
ONNX_OPS["ReduceL2"] = _reduce(_same_dtype(lambda x, d, k: (x * x).sum(dim=d, keepdim=k).sqrt()))
ONNX_OPS["ReduceLogSum"] = _reduce(lambda x, d, k: x.sum(dim=d, keepdim=k).log())
ONNX_OPS["ReduceLogSumExp"] = _reduce(lambda x, d, k: torch.logsumexp(x, dim=d, keepdim=k))
ONNX_OPS["ReduceMax"] = _reduce(_extreme(torch.amax, True))
ONNX_OPS["ReduceMin"] = _reduce(_extreme(torch.amin, False))


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


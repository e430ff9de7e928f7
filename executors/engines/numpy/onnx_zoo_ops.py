"""More ``onnx.<OpType>`` targets of the NumPy engine: the activations, heads and resamplers of the
model-zoo CNNs and Transformers (Resize/Upsample, LRN, global pools, ArgMax/ArgMin, variadic
Sum/Mean/Max/Min, Clip, the ReLU family, Einsum, DepthToSpace/SpaceToDepth, Trilu, CumSum).

Same conventions as :mod:`fusion.executors.engines.numpy.onnx_ops`: static inputs arrive as
int/float lists, attributes as keywords with ONNX defaults, and every differentiable op has a
hand-written VJP whose tie-breaking follows torch's autograd (``amax`` splits the gradient evenly
between equal maxima, ``clamp`` passes it at the bounds), so a NumPy part and a torch part of one
model compute the same gradients. Convolutions are not here: the NumPy engine has no Conv, so CNN
bodies run on the torch engine. No torch import.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from fusion.executors.engines.numpy.ops import NpOp, _grad_like, _out, unbroadcast
from fusion.ir.onnx.ops import pad_source
from fusion.ir.onnx.resize import resize_plan, upsample_attrs


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _grads(*pairs) -> dict:
    """{slot: grad} for the (slot, grad, input) triples whose input is a float array."""
    out = {}
    for slot, g, x in pairs:
        if (gx := _grad_like(g, x)) is not None:
            out[slot] = gx
    return out


# -- element-wise ---------------------------------------------------------------------------------

def _unary(fwd, dfdx) -> NpOp:
    return NpOp(lambda x, **k: (_out(fwd(x, **k), x), (x, k)), lambda ctx, g: {0: _out(g * dfdx(ctx[0], **ctx[1]), ctx[0])})


LEAKY_RELU = _unary(lambda x, alpha=0.01: np.where(x > 0, x, x * alpha), lambda x, alpha=0.01: np.where(x > 0, 1.0, alpha))
HARD_SIGMOID = _unary(lambda x, alpha=0.2, beta=0.5: np.clip(alpha * x + beta, 0.0, 1.0),
                      lambda x, alpha=0.2, beta=0.5: np.where((alpha * x + beta >= 0) & (alpha * x + beta <= 1), alpha, 0.0))
HARD_SWISH = _unary(lambda x: x * np.clip(x + 3, 0, 6) / 6,
                    lambda x: np.where(x < -3, 0.0, np.where(x <= 3, x / 3 + 0.5, 1.0)))
ABS = _unary(np.abs, lambda x: np.sign(x))


def _softplus(x):
    return np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20))))  # torch's threshold


def _sigmoid(x):
    return 1 / (1 + np.exp(-x))


SOFTPLUS = _unary(_softplus, lambda x: np.where(x > 20, 1.0, _sigmoid(x)))
MISH = _unary(lambda x: x * np.tanh(_softplus(x)),
              lambda x: np.tanh(_softplus(x)) + x * (1 - np.tanh(_softplus(x)) ** 2) * _sigmoid(x))


def _prelu_fwd(x, slope):
    return np.where(x < 0, x * slope, x).astype(x.dtype), (x, slope)


def _prelu_vjp(ctx, g):
    x, slope = ctx
    return _grads((0, np.where(x < 0, g * slope, g), x), (1, np.where(x < 0, g * x, 0), slope))


def _clip_fwd(x, lo=None, hi=None):
    y = x
    if lo is not None:
        y = np.maximum(y, lo)
    if hi is not None:
        y = np.minimum(y, hi)
    return np.asarray(y, dtype=x.dtype), (x, lo, hi)


def _clip_vjp(ctx, g):
    """torch.clamp: the gradient passes where lo <= x <= hi; a tensor bound gets it where x is beyond it."""
    x, lo, hi = ctx
    inside = np.ones(x.shape, dtype=bool)
    if lo is not None:
        inside &= x >= lo
    if hi is not None:
        inside &= x <= hi
    pairs = [(0, np.where(inside, g, 0), x)]
    if lo is not None:
        pairs.append((1, np.where(x < lo, g, 0), lo))
    if hi is not None:
        pairs.append((2, np.where(x > hi, g, 0), hi))
    return _grads(*pairs)


def _variadic_sum(*xs):
    y = xs[0]
    for x in xs[1:]:
        y = y + x
    return y, [x for x in xs]


def _mean_fwd(*xs):
    y, ctx = _variadic_sum(*xs)
    return _out(y / len(xs), xs[0]), ctx


def _extreme_fwd(largest: bool):
    def fwd(*xs):
        ys = [xs[0]]
        for x in xs[1:]:
            ys.append(np.maximum(ys[-1], x) if largest else np.minimum(ys[-1], x))
        return ys[-1], list(zip(xs, ys))

    return fwd


def _extreme_vjp(largest: bool):
    def vjp(ctx, g):
        """Back through the chain of pairwise maxima; a tie splits the gradient in halves (torch.maximum)."""
        out: dict = {}
        for i in range(len(ctx) - 1, 0, -1):
            x, _ = ctx[i]
            acc = ctx[i - 1][1]
            win_x = x > acc if largest else x < acc
            tie = x == acc
            gx = np.where(win_x, g, 0) + np.where(tie, g / 2, 0)
            if (r := _grad_like(gx, x)) is not None:
                out[i] = r
            g = np.where(win_x, 0, g) - np.where(tie, g / 2, 0)
            g = unbroadcast(g, np.shape(acc))
        if (r := _grad_like(g, ctx[0][0])) is not None:
            out[0] = r
        return out

    return vjp


# -- pooling and normalisation ----------------------------------------------------------------------

def _global_fwd(kind: str):
    def fwd(x):
        axes = tuple(range(2, x.ndim))
        y = x.mean(axis=axes, keepdims=True) if kind == "avg" else x.max(axis=axes, keepdims=True)
        return _out(y, x), (x, y, axes)

    def vjp(ctx, g):
        x, y, axes = ctx
        if kind == "avg":
            n = int(np.prod([x.shape[a] for a in axes]))
            return {0: _out(np.broadcast_to(g / n, x.shape), x)}
        hit = x == y  # torch's amax: equal maxima share the gradient evenly
        return {0: _out(hit * g / hit.sum(axis=axes, keepdims=True), x)}

    return NpOp(fwd, vjp)


def _channel_window(a: np.ndarray, before: int, after: int) -> np.ndarray:
    """Sum over channels c-before .. c+after (zero outside), for every c (axis 1)."""
    pad = [(0, 0)] * a.ndim
    pad[1] = (before + 1, after)
    cs = np.cumsum(np.pad(a, pad), axis=1)
    c = a.shape[1]
    return np.take(cs, np.arange(before + after + 1, before + after + 1 + c), axis=1) - np.take(cs, np.arange(c), axis=1)


def _lrn_fwd(x, *, size, alpha=0.0001, beta=0.75, bias=1.0):
    before, after = (size - 1) // 2, size - 1 - (size - 1) // 2
    d = bias + alpha / size * _channel_window(x * x, before, after)
    return _out(x * d ** -beta, x), (x, d, size, alpha, beta, before, after)


def _lrn_vjp(ctx, g):
    """y_c = x_c d_c^-beta, d_c = bias + alpha/size * sum of x^2 over c's window: the window sum
    of the backward runs over the transposed window (before and after swapped)."""
    x, d, size, alpha, beta, before, after = ctx
    t = g * x * d ** (-beta - 1)
    gx = g * d ** -beta - (2 * alpha * beta / size) * x * _channel_window(t, after, before)
    return {0: _out(gx, x)}


# -- resampling ---------------------------------------------------------------------------------------

def _resize_run(x, plan, extrapolation_value):
    y = x if np.issubdtype(x.dtype, np.floating) else x.astype(np.float64)
    steps = []
    for ax in plan:
        n = ax.index.shape[1]
        tail = (1,) * (y.ndim - ax.axis - 1)
        taps = np.take(y, ax.index, axis=ax.axis)  # shape[:axis] + (size, n) + shape[axis+1:]
        steps.append((ax, y.shape))
        y = (taps * ax.weight.astype(y.dtype).reshape(ax.size, n, *tail)).sum(axis=ax.axis + 1)
        if ax.outside is not None:
            y = np.where(ax.outside.reshape(ax.size, *tail), np.asarray(extrapolation_value, dtype=y.dtype), y)
    if not np.issubdtype(x.dtype, np.floating):
        info = np.iinfo(x.dtype)
        y = np.clip(np.round(y), info.min, info.max)
    return np.asarray(y, dtype=x.dtype).copy(), (steps, x.dtype)


def _resize_vjp(ctx, g):
    """Scatter each axis's weighted taps back (reverse order)."""
    steps, dtype = ctx
    if not np.issubdtype(dtype, np.floating):
        return {}
    for ax, shape in reversed(steps):
        tail = (1,) * (len(shape) - ax.axis - 1)
        if ax.outside is not None:
            g = np.where(ax.outside.reshape(ax.size, *tail), 0, g)
        n = ax.index.shape[1]
        contrib = np.expand_dims(g, ax.axis + 1) * ax.weight.astype(g.dtype).reshape(ax.size, n, *tail)
        gin = np.zeros(shape, dtype=g.dtype)
        np.add.at(np.moveaxis(gin, ax.axis, 0), ax.index, np.moveaxis(contrib, (ax.axis, ax.axis + 1), (0, 1)))
        g = gin
    return {0: g.astype(dtype, copy=False)}


def _resize_fwd(x, roi=None, scales=None, sizes=None, *, antialias=0, axes=None,
                coordinate_transformation_mode="half_pixel", cubic_coeff_a=-0.75, exclude_outside=0,
                extrapolation_value=0.0, keep_aspect_ratio_policy="stretch", mode="nearest",
                nearest_mode="round_prefer_floor"):
    _, plan = resize_plan(x.shape, roi, scales, sizes, axes=axes, mode=_s(mode),
                          coordinate_transformation_mode=_s(coordinate_transformation_mode),
                          nearest_mode=_s(nearest_mode), cubic_coeff_a=float(cubic_coeff_a),
                          exclude_outside=int(exclude_outside), antialias=int(antialias),
                          keep_aspect_ratio_policy=_s(keep_aspect_ratio_policy))
    return _resize_run(x, plan, extrapolation_value)


def _upsample_fwd(x, scales, *, mode="nearest"):
    _, plan = resize_plan(x.shape, None, scales, None, **upsample_attrs(_s(mode)))
    return _resize_run(x, plan, 0.0)


def _d2s_perm(mode: str):
    return (0, 3, 4, 1, 5, 2) if mode == "DCR" else (0, 1, 4, 2, 5, 3)


def _depth_to_space_fwd(x, *, blocksize, mode="DCR"):
    n, c, h, w = x.shape
    b = int(blocksize)
    split = (n, b, b, c // (b * b), h, w) if _s(mode) == "DCR" else (n, c // (b * b), b, b, h, w)
    y = np.transpose(x.reshape(split), _d2s_perm(_s(mode))).reshape(n, c // (b * b), h * b, w * b)
    return y, (x.shape, split, _d2s_perm(_s(mode)))


def _space_to_depth_fwd(x, *, blocksize, mode="DCR"):
    n, c, h, w = x.shape
    b = int(blocksize)
    perm = (0, 3, 5, 1, 2, 4) if _s(mode) == "DCR" else (0, 1, 3, 5, 2, 4)
    y = np.transpose(x.reshape(n, c, h // b, b, w // b, b), perm).reshape(n, c * b * b, h // b, w // b)
    return y, (x.shape, (n, c, h // b, b, w // b, b), perm)


def _rearrange_vjp(ctx, g):
    shape, split, perm = ctx
    permuted = tuple(split[p] for p in perm)
    return {0: np.transpose(g.reshape(permuted), np.argsort(perm)).reshape(shape)}


# -- indices, masks, scans ------------------------------------------------------------------------------

def _arg_fwd(fn):
    def fwd(x, *, axis=0, keepdims=1, select_last_index=0):
        axis = axis % x.ndim
        if select_last_index:
            i = x.shape[axis] - 1 - fn(np.flip(x, axis), axis=axis)
        else:
            i = fn(x, axis=axis)
        i = np.asarray(i, dtype=np.int64)
        return (np.expand_dims(i, axis) if keepdims else i), None

    return NpOp(fwd, None)


def _trilu_fwd(x, k=None, *, upper=1):
    kk = 0 if k is None else int(k[0] if isinstance(k, (list, tuple)) else k)
    y = np.triu(x, kk) if upper else np.tril(x, kk)
    return y, (kk, upper)


def _trilu_vjp(ctx, g):
    kk, upper = ctx
    return {0: np.triu(g, kk) if upper else np.tril(g, kk)}


def _cumsum_fwd(x, axis, *, exclusive=0, reverse=0):
    a = int(axis[0] if isinstance(axis, (list, tuple)) else axis) % x.ndim
    y = np.flip(x, a) if reverse else x
    c = np.cumsum(y, axis=a, dtype=x.dtype)
    if exclusive:
        c = c - y
    return (np.flip(c, a) if reverse else c).copy(), (a, exclusive, reverse)


def _cumsum_vjp(ctx, g):
    """The adjoint of a (reverse, exclusive) prefix sum is the prefix sum the other way round."""
    a, exclusive, reverse = ctx
    y, _ = _cumsum_fwd(g, a, exclusive=exclusive, reverse=1 - reverse)
    return {0: y}


# -- Einsum -------------------------------------------------------------------------------------------

def _einsum_parts(equation: str, n: int) -> tuple[list[str], str]:
    eq = _s(equation).replace(" ", "")
    if "." in eq:
        raise ValueError(f"the numpy engine's Einsum does not support ellipses ({eq!r}); run this part on torch")
    lhs, _, out = eq.partition("->")
    subs = lhs.split(",")
    if len(subs) != n:
        raise ValueError(f"Einsum {eq!r} names {len(subs)} operands, got {n}")
    if "->" not in eq:
        letters = "".join(subs)
        out = "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    return subs, out


def _einsum_fwd(*xs, equation):
    subs, out = _einsum_parts(equation, len(xs))
    return np.einsum(f"{','.join(subs)}->{out}", *xs), (xs, subs, out)


def _einsum_vjp(ctx, g):
    """The gradient of operand i contracts the output gradient with the other operands into i's
    subscripts; letters only operand i has (summed in the forward) come back by broadcasting."""
    xs, subs, out = ctx
    grads = {}
    for i, (x, sub) in enumerate(zip(xs, subs)):
        if not (isinstance(x, np.ndarray) and np.issubdtype(x.dtype, np.floating)):
            continue
        if len(set(sub)) != len(sub):
            raise ValueError(f"the numpy engine's Einsum VJP does not support repeated subscripts ({sub!r})")
        others = [(s, y) for j, (s, y) in enumerate(zip(subs, xs)) if j != i]
        avail = set(out).union(*[set(s) for s, _ in others])
        keep = "".join(c for c in sub if c in avail)
        r = np.einsum(",".join([out] + [s for s, _ in others]) + "->" + keep, g, *[y for _, y in others])
        r = r.reshape([x.shape[k] if c in avail else 1 for k, c in enumerate(sub)])
        grads[i] = np.broadcast_to(r, x.shape).astype(x.dtype)
    return grads


# -- more element-wise, normalisation, Pad and Tile ------------------------------------------------------

ELU = _unary(lambda x, alpha=1.0: np.where(x > 0, x, alpha * np.expm1(np.minimum(x, 0))),
             lambda x, alpha=1.0: np.where(x > 0, 1.0, alpha * np.exp(np.minimum(x, 0))))
_SELU_A, _SELU_G = 1.67326319217681884765625, 1.05070102214813232421875
SELU = _unary(lambda x, alpha=_SELU_A, gamma=_SELU_G: gamma * np.where(x > 0, x, alpha * np.expm1(np.minimum(x, 0))),
              lambda x, alpha=_SELU_A, gamma=_SELU_G: gamma * np.where(x > 0, 1.0, alpha * np.exp(np.minimum(x, 0))))
RECIPROCAL = _unary(lambda x: 1 / x, lambda x: -1 / (x * x))
SIN = _unary(np.sin, np.cos)
COS = _unary(np.cos, lambda x: -np.sin(x))
FLOOR = _unary(np.floor, lambda x: np.zeros_like(x))
CEIL = _unary(np.ceil, lambda x: np.zeros_like(x))
SIGN = _unary(np.sign, lambda x: np.zeros_like(x))


def _instance_norm_fwd(x, scale, bias, *, epsilon=1e-5):
    axes = tuple(range(2, x.ndim))
    mean = x.mean(axis=axes, keepdims=True)
    xc = x - mean
    inv = 1 / np.sqrt((xc * xc).mean(axis=axes, keepdims=True) + np.asarray(epsilon, dtype=x.dtype))
    xhat = xc * inv
    shape = (1, -1) + (1,) * len(axes)
    return _out(xhat * scale.reshape(shape) + bias.reshape(shape), x), (xhat, inv, scale, bias, axes)


def _instance_norm_vjp(ctx, g):
    """Per (sample, channel), the layer-norm VJP over the spatial axes."""
    xhat, inv, scale, bias, axes = ctx
    gx = g * scale.reshape((1, -1) + (1,) * len(axes))
    dx = inv * (gx - gx.mean(axis=axes, keepdims=True) - xhat * (gx * xhat).mean(axis=axes, keepdims=True))
    red = (0,) + axes
    return _grads((0, dx, xhat), (1, (g * xhat).sum(axis=red), scale), (2, g.sum(axis=red), bias))


def _batch_norm_fwd(x, scale, bias, mean, var, *, epsilon=1e-5, momentum=0.9, training_mode=0, outputs=1):
    if training_mode or outputs != 1:
        raise ValueError("the numpy engine runs BatchNormalization in inference mode only; run this part on torch")
    shape = (1, -1) + (1,) * (x.ndim - 2)
    inv = 1 / np.sqrt(var.reshape(shape) + np.asarray(epsilon, dtype=x.dtype))
    xhat = (x - mean.reshape(shape)) * inv
    return _out(xhat * scale.reshape(shape) + bias.reshape(shape), x), (xhat, inv, scale, bias, shape)


def _batch_norm_vjp(ctx, g):
    """Inference mode: an affine map per channel; no gradient into the running statistics."""
    xhat, inv, scale, bias, shape = ctx
    red = (0,) + tuple(range(2, xhat.ndim))
    return _grads((0, g * scale.reshape(shape) * inv, xhat), (1, (g * xhat).sum(axis=red), scale), (2, g.sum(axis=red), bias))


def _pad_fwd(x, pads, constant_value=None, axes=None, *, mode="constant"):
    """Every mode and negative (cropping) pads: per padded axis, a gather from an index map."""
    mode, rank = _s(mode), x.ndim
    axes = list(range(rank)) if axes is None else [a % rank for a in axes]
    value = 0 if constant_value is None else np.asarray(constant_value).reshape(-1)[0] if np.size(constant_value) else 0
    y, steps = x, []
    for k, a in enumerate(axes):
        b, e = int(pads[k]), int(pads[k + len(axes)])
        if b == 0 and e == 0:
            continue
        src, valid = pad_source(y.shape[a], b, e, mode)
        steps.append((a, y.shape, src, valid))
        y = np.take(y, src, axis=a)
        if mode == "constant" and not valid.all():
            y = np.where(valid.reshape((-1,) + (1,) * (rank - a - 1)), y, np.asarray(value, dtype=y.dtype))
    return np.array(y, copy=True), (steps, x.dtype)


def _pad_vjp(ctx, g):
    steps, dtype = ctx
    if not np.issubdtype(dtype, np.floating):
        return {}
    for a, shape, src, valid in reversed(steps):
        gm = np.where(valid.reshape((-1,) + (1,) * (len(shape) - a - 1)), g, 0)
        gin = np.zeros(shape, dtype=g.dtype)
        np.add.at(np.moveaxis(gin, a, 0), src, np.moveaxis(gm, a, 0))
        g = gin
    return {0: g}


def _tile_fwd(x, repeats):
    reps = [int(r) for r in repeats]
    return np.tile(x, reps), (x.shape, reps)


def _tile_vjp(ctx, g):
    shape, reps = ctx
    split = [d for r, n in zip(reps, shape) for d in (r, n)]
    return {0: g.reshape(split).sum(axis=tuple(range(0, 2 * len(shape), 2)))}


def _reduce_extreme(largest: bool) -> NpOp:
    def fwd(x, axes=None, *, keepdims=1, noop_with_empty_axes=0):
        from fusion.ir.onnx.ops import reduce_axes

        dims = reduce_axes(x.ndim, axes, noop_with_empty_axes)
        if dims is None:
            return x, (x, None, None, keepdims)
        y = x.max(axis=dims, keepdims=True) if largest else x.min(axis=dims, keepdims=True)
        return (y if keepdims else np.squeeze(y, dims)), (x, y, dims, keepdims)

    def vjp(ctx, g):
        """torch's amax/amin: equal extremes share the gradient evenly."""
        x, y, dims, keepdims = ctx
        if dims is None:
            return {0: g}
        if not keepdims:
            g = np.expand_dims(g, dims)
        hit = x == y
        return _grads((0, hit * g / hit.sum(axis=dims, keepdims=True), x))

    return NpOp(fwd, vjp)


ONNX_ZOO_NUMPY: dict[str, NpOp] = {
    "onnx.LeakyRelu": LEAKY_RELU, "onnx.HardSigmoid": HARD_SIGMOID, "onnx.HardSwish": HARD_SWISH,
    "onnx.Abs": ABS, "onnx.Softplus": SOFTPLUS, "onnx.Mish": MISH,
    "onnx.PRelu": NpOp(_prelu_fwd, _prelu_vjp), "onnx.Clip": NpOp(_clip_fwd, _clip_vjp),
    "onnx.Sum": NpOp(_variadic_sum, lambda xs, g: _grads(*[(i, g, x) for i, x in enumerate(xs)])),
    "onnx.Mean": NpOp(_mean_fwd, lambda xs, g: _grads(*[(i, g / len(xs), x) for i, x in enumerate(xs)])),
    "onnx.Max": NpOp(_extreme_fwd(True), _extreme_vjp(True)),
    "onnx.Min": NpOp(_extreme_fwd(False), _extreme_vjp(False)),
    "onnx.GlobalAveragePool": _global_fwd("avg"), "onnx.GlobalMaxPool": _global_fwd("max"),
    "onnx.LRN": NpOp(_lrn_fwd, _lrn_vjp),
    "onnx.Resize": NpOp(_resize_fwd, _resize_vjp), "onnx.Upsample": NpOp(_upsample_fwd, _resize_vjp),
    "onnx.DepthToSpace": NpOp(_depth_to_space_fwd, _rearrange_vjp),
    "onnx.SpaceToDepth": NpOp(_space_to_depth_fwd, _rearrange_vjp),
    "onnx.ArgMax": _arg_fwd(np.argmax), "onnx.ArgMin": _arg_fwd(np.argmin),
    "onnx.Trilu": NpOp(_trilu_fwd, _trilu_vjp), "onnx.CumSum": NpOp(_cumsum_fwd, _cumsum_vjp),
    "onnx.Einsum": NpOp(_einsum_fwd, _einsum_vjp),
    "onnx.Elu": ELU, "onnx.Selu": SELU, "onnx.Reciprocal": RECIPROCAL, "onnx.Sin": SIN, "onnx.Cos": COS,
    "onnx.Floor": FLOOR, "onnx.Ceil": CEIL, "onnx.Sign": SIGN,
    "onnx.InstanceNormalization": NpOp(_instance_norm_fwd, _instance_norm_vjp),
    "onnx.BatchNormalization": NpOp(_batch_norm_fwd, _batch_norm_vjp),
    "onnx.Pad": NpOp(_pad_fwd, _pad_vjp), "onnx.Tile": NpOp(_tile_fwd, _tile_vjp),
    "onnx.ReduceMax": _reduce_extreme(True), "onnx.ReduceMin": _reduce_extreme(False),
}

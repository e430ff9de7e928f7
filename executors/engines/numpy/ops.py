"""NumPy kernels with hand-written vector-Jacobian products (the NumPy engine's ops).

An op is an :class:`NpOp`: ``fwd(*args, **kwargs) -> (out, ctx)`` computes the
output and keeps what the backward needs; ``vjp(ctx, grad_out) -> {slot:
grad}`` returns the gradient of every differentiable input, keyed by
positional index (int) or, for module ops, by parameter path (str). A
missing key means "no gradient" (integer inputs, masks). Module ops
(``module=True``) are called as ``fwd(params, attrs, *args, **kwargs)``.

Formulas follow PyTorch's definitions (same reductions, same defaults) so
that a NumPy part and a torch part compute the same numbers up to float32
rounding. No torch import anywhere in this module.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

_SQRT2 = math.sqrt(2.0)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)

try:  # scipy is optional: use its vectorised erf when present
    from scipy.special import erf as _erf  # type: ignore
except ImportError:  # pragma: no cover - depends on the environment
    _erf_scalar = np.frompyfunc(math.erf, 1, 1)

    def _erf(x: np.ndarray) -> np.ndarray:
        return _erf_scalar(np.asarray(x, dtype=np.float64)).astype(np.float64)


@dataclass(frozen=True)
class NpOp:
    """One NumPy op: forward with context, and its vector-Jacobian product (None: not differentiable)."""

    fwd: Callable[..., tuple[Any, Any]]
    vjp: Callable[[Any, Any], dict] | None = None
    module: bool = False


# -- helpers -------------------------------------------------------------------------------

def unbroadcast(g: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Sum ``g`` down to ``shape`` (the inverse of NumPy/torch broadcasting)."""
    g = np.asarray(g)
    while g.ndim > len(shape):
        g = g.sum(axis=0)
    for i, s in enumerate(shape):
        if s == 1 and g.shape[i] != 1:
            g = g.sum(axis=i, keepdims=True)
    return g.reshape(shape)


def _grad_like(g: np.ndarray, x: Any) -> np.ndarray | None:
    """``g`` summed to ``x``'s shape when ``x`` is a float array (else no gradient)."""
    if not isinstance(x, np.ndarray) or not np.issubdtype(x.dtype, np.floating):
        return None
    return unbroadcast(g, x.shape).astype(x.dtype, copy=False)


def _out(x: np.ndarray, like: Any) -> np.ndarray:
    """Keep the working dtype of ``like`` (avoid float64 creeping in from NumPy scalars)."""
    if isinstance(like, np.ndarray) and np.issubdtype(like.dtype, np.floating):
        return np.asarray(x, dtype=like.dtype)
    return np.asarray(x)


# -- element-wise arithmetic -----------------------------------------------------------------

def _binary(f, dfa, dfb) -> NpOp:
    def fwd(a, b):
        return f(a, b), (a, b)

    def vjp(ctx, g):
        a, b = ctx
        out = {}
        ga, gb = _grad_like(dfa(g, a, b), a), _grad_like(dfb(g, a, b), b)
        if ga is not None:
            out[0] = ga
        if gb is not None:
            out[1] = gb
        return out

    return NpOp(fwd, vjp)


ADD = _binary(lambda a, b: np.add(a, b), lambda g, a, b: g, lambda g, a, b: g)
SUB = _binary(lambda a, b: np.subtract(a, b), lambda g, a, b: g, lambda g, a, b: -g)
MUL = _binary(lambda a, b: np.multiply(a, b), lambda g, a, b: g * b, lambda g, a, b: g * a)
DIV = _binary(lambda a, b: np.divide(a, b), lambda g, a, b: g / b, lambda g, a, b: -g * a / (b * b))
NEG = NpOp(lambda x: (np.negative(x), None), lambda ctx, g: {0: -g})


def _unary(f, df_from_xy) -> NpOp:
    def fwd(x):
        y = f(x)
        return y, (x, y)

    def vjp(ctx, g):
        x, y = ctx
        return {0: _out(df_from_xy(g, x, y), x)}

    return NpOp(fwd, vjp)


RELU = _unary(lambda x: np.maximum(x, 0).astype(x.dtype), lambda g, x, y: g * (x > 0))
TANH = _unary(np.tanh, lambda g, x, y: g * (1 - y * y))
SIGMOID = _unary(lambda x: _out(1 / (1 + np.exp(-x)), x), lambda g, x, y: g * y * (1 - y))
EXP = _unary(np.exp, lambda g, x, y: g * y)
LOG = _unary(np.log, lambda g, x, y: g / x)
SQRT = _unary(np.sqrt, lambda g, x, y: g / (2 * y))
ERF = _unary(lambda x: _out(_erf(x), x), lambda g, x, y: g * (2 / math.sqrt(math.pi)) * np.exp(-x * x))


def gelu_fwd(x, approximate: str = "none"):
    x64 = x.astype(np.float64)
    if approximate == "tanh":
        t = np.tanh(_SQRT_2_OVER_PI * (x64 + 0.044715 * x64 ** 3))
        return _out(0.5 * x64 * (1 + t), x), (x, t, approximate)
    cdf = 0.5 * (1 + _erf(x64 / _SQRT2))
    return _out(x64 * cdf, x), (x, cdf, approximate)


def gelu_vjp(ctx, g):
    x, aux, approximate = ctx
    x64 = x.astype(np.float64)
    if approximate == "tanh":
        t = aux
        inner_d = _SQRT_2_OVER_PI * (1 + 3 * 0.044715 * x64 ** 2)
        d = 0.5 * (1 + t) + 0.5 * x64 * (1 - t * t) * inner_d
    else:
        d = aux + x64 * _INV_SQRT_2PI * np.exp(-0.5 * x64 * x64)
    return {0: _out(g * d, x)}


GELU = NpOp(gelu_fwd, gelu_vjp)


def where_fwd(cond, a, b):
    return np.where(cond, a, b), (cond, a, b)


def where_vjp(ctx, g):
    cond, a, b = ctx
    out = {}
    ga, gb = _grad_like(np.where(cond, g, 0), a), _grad_like(np.where(cond, 0, g), b)
    if ga is not None:
        out[1] = ga
    if gb is not None:
        out[2] = gb
    return out


WHERE = NpOp(where_fwd, where_vjp)


# -- linear algebra ------------------------------------------------------------------------------

def matmul_fwd(a, b):
    return np.matmul(a, b), (a, b)


def matmul_vjp(ctx, g):
    a, b = ctx
    a2 = a[None, :] if a.ndim == 1 else a
    b2 = b[:, None] if b.ndim == 1 else b
    g2 = np.asarray(g).reshape(np.matmul(a2, b2).shape)
    ga = unbroadcast(np.matmul(g2, np.swapaxes(b2, -1, -2)), a2.shape).reshape(a.shape)
    gb = unbroadcast(np.matmul(np.swapaxes(a2, -1, -2), g2), b2.shape).reshape(b.shape)
    return {0: ga, 1: gb}


MATMUL = NpOp(matmul_fwd, matmul_vjp)


def linear_fwd(x, w, b=None):
    y = np.matmul(x, w.T)
    if b is not None:
        y = y + b
    return y, (x, w, b)


def linear_vjp(ctx, g):
    x, w, b = ctx
    out = {0: np.matmul(g, w)}
    g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
    out[1] = np.matmul(g2.T, x2)
    if b is not None:
        out[2] = g2.sum(axis=0)
    return out


LINEAR = NpOp(linear_fwd, linear_vjp)


# -- normalisation and softmax ----------------------------------------------------------------------

def layer_norm_fwd(x, n_dims: int, w=None, b=None, eps: float = 1e-5):
    axes = tuple(range(x.ndim - n_dims, x.ndim))
    mean = x.mean(axis=axes, keepdims=True)
    xc = x - mean
    var = (xc * xc).mean(axis=axes, keepdims=True)
    inv = 1.0 / np.sqrt(var + np.asarray(eps, dtype=x.dtype))
    xhat = xc * inv
    y = xhat
    if w is not None:
        y = y * w
    if b is not None:
        y = y + b
    return _out(y, x), (xhat, inv, w, b, axes)


def layer_norm_vjp(ctx, g):
    xhat, inv, w, b, axes = ctx
    lead = tuple(range(xhat.ndim - len(axes)))
    out = {}
    if w is not None:
        out[2] = (g * xhat).sum(axis=lead)
    if b is not None:
        out[3] = g.sum(axis=lead)
    gx = g * w if w is not None else g
    n = 1
    for a in axes:
        n *= xhat.shape[a]
    dx = inv * (gx - gx.mean(axis=axes, keepdims=True) - xhat * (gx * xhat).mean(axis=axes, keepdims=True))
    out[0] = _out(dx, xhat)
    return out


LAYER_NORM = NpOp(layer_norm_fwd, layer_norm_vjp)


def softmax_fwd(x, axis: int = -1):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    y = e / e.sum(axis=axis, keepdims=True)
    return y, (y, axis)


def softmax_vjp(ctx, g):
    y, axis = ctx
    return {0: y * (g - (g * y).sum(axis=axis, keepdims=True))}


SOFTMAX = NpOp(softmax_fwd, softmax_vjp)


def log_softmax_fwd(x, axis: int = -1):
    m = x.max(axis=axis, keepdims=True)
    lse = np.log(np.exp(x - m).sum(axis=axis, keepdims=True)) + m
    y = x - lse
    return y, (y, axis)


def log_softmax_vjp(ctx, g):
    y, axis = ctx
    return {0: g - np.exp(y) * g.sum(axis=axis, keepdims=True)}


LOG_SOFTMAX = NpOp(log_softmax_fwd, log_softmax_vjp)


def cross_entropy_fwd(logits, target, ignore_index: int = -100, reduction: str = "mean"):
    """torch.nn.functional.cross_entropy with class indices, classes on axis 1."""
    logp, _ = log_softmax_fwd(logits, 1)
    t = np.asarray(target).astype(np.int64)
    valid = t != ignore_index
    safe = np.where(valid, t, 0)
    picked = np.take_along_axis(logp, np.expand_dims(safe, 1), axis=1).squeeze(1)
    losses = np.where(valid, -picked, 0).astype(logits.dtype)
    if reduction == "none":
        out = losses
    elif reduction == "sum":
        out = losses.sum(dtype=logits.dtype)
    else:
        out = (losses.sum(dtype=logits.dtype) / logits.dtype.type(max(int(valid.sum()), 1))).astype(logits.dtype)
        if not valid.any():
            out = np.asarray(np.nan, dtype=logits.dtype)
    return np.asarray(out), (logp, safe, valid, reduction)


def cross_entropy_vjp(ctx, g):
    logp, safe, valid, reduction = ctx
    p = np.exp(logp)
    onehot = np.zeros_like(p)
    np.put_along_axis(onehot, np.expand_dims(safe, 1), 1.0, axis=1)
    d = (p - onehot) * np.expand_dims(valid, 1)
    if reduction == "mean":
        d = d * (np.asarray(g) / max(int(valid.sum()), 1))
    elif reduction == "sum":
        d = d * np.asarray(g)
    else:
        d = d * np.expand_dims(g, 1)
    return {0: _out(d, logp)}


CROSS_ENTROPY = NpOp(cross_entropy_fwd, cross_entropy_vjp)


def mse_fwd(a, b, reduction: str = "mean"):
    d = a - b
    sq = d * d
    out = sq.mean() if reduction == "mean" else (sq.sum() if reduction == "sum" else sq)
    return _out(out, a), (d, reduction)


def mse_vjp(ctx, g):
    d, reduction = ctx
    gd = 2 * d * (g / d.size if reduction == "mean" else g)
    return {0: gd, 1: -gd}


MSE = NpOp(mse_fwd, mse_vjp)


# -- indexing and shapes ----------------------------------------------------------------------------

def gather_fwd(data, indices, axis: int = 0):
    idx = np.asarray(indices).astype(np.int64)
    axis = axis % data.ndim
    idx = np.where(idx < 0, idx + data.shape[axis], idx)
    return np.take(data, idx, axis=axis), (data.shape, data.dtype, idx, axis)


def gather_vjp(ctx, g):
    shape, dtype, idx, axis = ctx
    if not np.issubdtype(dtype, np.floating):
        return {}
    gd = np.zeros(shape, dtype=dtype)
    moved = np.moveaxis(gd, axis, 0)
    gm = np.moveaxis(np.asarray(g), list(range(axis, axis + idx.ndim)), list(range(idx.ndim)))
    np.add.at(moved, idx, gm)
    return {0: gd}


GATHER = NpOp(gather_fwd, gather_vjp)


def reshape_op(compute_shape: Callable[..., tuple[int, ...]]) -> NpOp:
    def fwd(x, *args, **kwargs):
        return np.reshape(x, compute_shape(x, *args, **kwargs)), x.shape

    return NpOp(fwd, lambda shape, g: {0: np.reshape(g, shape)})


def permute_fwd(x, perm):
    perm = tuple(int(p) % x.ndim for p in perm)
    return np.transpose(x, perm), perm


def permute_vjp(perm, g):
    return {0: np.transpose(g, np.argsort(perm))}


PERMUTE = NpOp(permute_fwd, permute_vjp)
IDENTITY = NpOp(lambda x, *a, **k: (x, None), lambda ctx, g: {0: g})

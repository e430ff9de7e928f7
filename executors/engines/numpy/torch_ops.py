"""The torch-style targets of the NumPy engine (``torch.nn.Linear``,
``torch.nn.functional.gelu``, ``operator.add``, ``torch.Tensor.view``, ...):
adapters from torch's call conventions to the kernels of ``numpy_ops``.
Module targets take ``(params, attrs, *args)``; their VJPs key parameter
gradients by module attribute path. No torch import.
"""
from __future__ import annotations

import numpy as np

from fusion.executors.engines.numpy.ops import (
    ADD, DIV, EXP, IDENTITY, LINEAR, LOG, MATMUL, MUL, NEG, RELU, SIGMOID, SQRT, SUB, TANH, WHERE, GELU,
    NpOp, cross_entropy_fwd, cross_entropy_vjp, gather_fwd, gather_vjp, gelu_fwd, gelu_vjp, layer_norm_fwd,
    layer_norm_vjp, log_softmax_fwd, log_softmax_vjp, mse_fwd, mse_vjp, permute_fwd, permute_vjp, reshape_op,
    softmax_fwd, softmax_vjp,
)


def _module_from(op: NpOp, names: tuple[str, ...]) -> NpOp:
    """A module op whose parameters ``names`` are the trailing positional inputs of ``op``."""

    def fwd(params, attrs, x):
        return op.fwd(x, *(params.get(n) for n in names))

    def vjp(ctx, g):
        gs = op.vjp(ctx, g)
        out = {0: gs[0]} if 0 in gs else {}
        for i, n in enumerate(names, start=1):
            if i in gs:
                out[n] = gs[i]
        return out

    return NpOp(fwd, vjp, module=True)


def _view_shape(x, *shape):
    if len(shape) == 1 and isinstance(shape[0], (list, tuple)):
        shape = tuple(shape[0])
    return tuple(int(s) for s in shape)


def _flatten_shape(x, start_dim=0, end_dim=-1):
    if x.ndim == 0:
        return (1,)
    s, e = start_dim % x.ndim, end_dim % x.ndim
    return x.shape[:s] + (int(np.prod(x.shape[s:e + 1])),) + x.shape[e + 1:]


def _transpose_fwd(x, dim0, dim1):
    perm = list(range(x.ndim))
    perm[dim0 % x.ndim], perm[dim1 % x.ndim] = perm[dim1 % x.ndim], perm[dim0 % x.ndim]
    return permute_fwd(x, perm)


def _permute_args(x, *dims):
    if len(dims) == 1 and isinstance(dims[0], (list, tuple)):
        dims = tuple(dims[0])
    return permute_fwd(x, dims)


def _softmax_t(x, dim=None, _stacklevel=3, dtype=None):
    return softmax_fwd(x, -1 if dim is None else dim)


def _log_softmax_t(x, dim=None, _stacklevel=3, dtype=None):
    return log_softmax_fwd(x, -1 if dim is None else dim)


def _ce_t(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None, reduction="mean", label_smoothing=0.0):
    if weight is not None or label_smoothing or size_average is not None or reduce is not None:
        raise ValueError("the numpy engine supports cross_entropy with class indices and no weight/label_smoothing")
    return cross_entropy_fwd(input, target, ignore_index, reduction)


def _mse_t(input, target, size_average=None, reduce=None, reduction="mean"):
    return mse_fwd(input, target, reduction)


def _layer_norm_t(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    return layer_norm_fwd(x, len(normalized_shape), weight, bias, eps)


def _gelu_t(x, approximate="none"):
    return gelu_fwd(x, approximate)


# -- modules ------------------------------------------------------------------------------------

def _ln_module_fwd(params, attrs, x):
    shape = attrs.get("normalized_shape", ())
    n = 1 if isinstance(shape, int) else len(shape)
    return layer_norm_fwd(x, n, params.get("weight"), params.get("bias"), float(attrs.get("eps", 1e-5)))


def _ln_module_vjp(ctx, g):
    out = layer_norm_vjp(ctx, g)
    return {k if k == 0 else {2: "weight", 3: "bias"}[k]: v for k, v in out.items()}


def _emb_module_fwd(params, attrs, idx):
    y, ctx = gather_fwd(params["weight"], idx, 0)
    return y, (ctx, attrs.get("padding_idx"))


def _emb_module_vjp(ctx, g):
    inner, padding_idx = ctx
    gw = gather_vjp(inner, g)[0]
    if padding_idx is not None:
        gw[padding_idx] = 0
    return {"weight": gw}


def _ce_module_fwd(params, attrs, input, target):
    return _ce_t(input, target, ignore_index=attrs.get("ignore_index", -100), reduction=attrs.get("reduction", "mean"),
                 label_smoothing=attrs.get("label_smoothing", 0.0))


def _noparam_module(op: NpOp) -> NpOp:
    return NpOp(lambda params, attrs, *a: op.fwd(*a, **({"approximate": attrs["approximate"]} if "approximate" in attrs else {})),
                op.vjp, module=True)


#: torch-style targets the NumPy engine implements (see docs/engines.md).
TORCH_STYLE: dict[str, NpOp] = {
    # modules
    "torch.nn.Linear": _module_from(LINEAR, ("weight", "bias")),
    "torch.nn.Embedding": NpOp(_emb_module_fwd, _emb_module_vjp, module=True),
    "torch.nn.LayerNorm": NpOp(_ln_module_fwd, _ln_module_vjp, module=True),
    "torch.nn.ReLU": _noparam_module(RELU),
    "torch.nn.GELU": _noparam_module(GELU),
    "torch.nn.Tanh": _noparam_module(TANH),
    "torch.nn.Sigmoid": _noparam_module(SIGMOID),
    "torch.nn.CrossEntropyLoss": NpOp(_ce_module_fwd, cross_entropy_vjp, module=True),
    # functions
    "torch.nn.functional.linear": LINEAR,
    "torch.nn.functional.embedding": NpOp(lambda idx, w: gather_fwd(w, idx, 0),
                                          lambda ctx, g: {1: gi} if (gi := gather_vjp(ctx, g).get(0)) is not None else {}),
    "torch.nn.functional.relu": RELU, "torch.relu": RELU,
    "torch.nn.functional.gelu": NpOp(_gelu_t, gelu_vjp),
    "torch.tanh": TANH, "torch.nn.functional.tanh": TANH,
    "torch.sigmoid": SIGMOID, "torch.nn.functional.sigmoid": SIGMOID,
    "torch.exp": EXP, "torch.log": LOG, "torch.sqrt": SQRT,
    "torch.nn.functional.softmax": NpOp(_softmax_t, softmax_vjp), "torch.softmax": NpOp(_softmax_t, softmax_vjp),
    "torch.nn.functional.log_softmax": NpOp(_log_softmax_t, log_softmax_vjp),
    "torch.nn.functional.layer_norm": NpOp(_layer_norm_t, layer_norm_vjp),
    "torch.nn.functional.cross_entropy": NpOp(_ce_t, cross_entropy_vjp),
    "torch.nn.functional.mse_loss": NpOp(_mse_t, mse_vjp),
    "operator.add": ADD, "torch.add": ADD, "operator.sub": SUB, "torch.sub": SUB,
    "operator.mul": MUL, "torch.mul": MUL, "operator.truediv": DIV, "torch.div": DIV,
    "operator.neg": NEG, "torch.neg": NEG,
    "operator.matmul": MATMUL, "torch.matmul": MATMUL,
    "torch.where": WHERE,
    "torch.Tensor.view": reshape_op(_view_shape), "torch.Tensor.reshape": reshape_op(_view_shape),
    "torch.reshape": reshape_op(_view_shape),
    "torch.flatten": reshape_op(_flatten_shape), "torch.Tensor.flatten": reshape_op(_flatten_shape),
    "torch.Tensor.transpose": NpOp(_transpose_fwd, permute_vjp), "torch.transpose": NpOp(_transpose_fwd, permute_vjp),
    "torch.Tensor.permute": NpOp(_permute_args, permute_vjp), "torch.permute": NpOp(_permute_args, permute_vjp),
    "torch.Tensor.contiguous": IDENTITY,
}

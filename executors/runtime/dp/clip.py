"""Global-norm gradient clipping across parts, with the arithmetic of ``torch.nn.utils.clip_grad_norm_``.

The norm spans every part of a pipeline: each part sends the sum of squares of its gradients (after the tied
sum and the data-parallel average; a tied parameter counted once) to the coordinator, which answers each part
with ``norm = sqrt(sum over the pipeline's parts)``; every part then scales its gradients by
:func:`clip_coef`. torch computes ``total_norm`` as the 2-norm of the per-tensor 2-norms and
``clip_coef = max_norm / (total_norm + 1e-6)`` clamped to 1, in float32, and multiplies every gradient by it
(also when it is 1); the same here, with the sums of squares in float64.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

import numpy as np

#: the eps torch adds to the norm before dividing (``torch/nn/utils/clip_grad.py``)
EPS = 1e-6


def _values(a: np.ndarray, dtype: str | None) -> np.ndarray:
    """A gradient's values as floats: bfloat16 ones arrive from the engines as their raw bits (uint16)."""
    if dtype == "bfloat16" and a.dtype == np.uint16:
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a


def _to_bfloat16_bits(f: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, rounding to nearest even (torch's rounding of a bfloat16 result)."""
    u = np.ascontiguousarray(f, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(f), np.uint16(0x7FC0), rounded).astype(np.uint16)


def part_sq_norm(grads: Mapping[str, Any], skip: Iterable[str] = (), dtypes: Mapping[str, str] | None = None) -> float:
    """Sum over this part's gradients (None: no gradient, as torch skips it) of their squared 2-norms.

    dtypes: parameter name -> its graph dtype (bfloat16 gradients come as bits)."""
    skip, dtypes = set(skip), dtypes or {}
    total = 0.0
    for name, g in grads.items():
        if g is None or name in skip:
            continue
        a = _values(np.asarray(g), dtypes.get(name))
        total += float(np.sum(np.square(a.astype(np.float64, copy=False))))
    return total


def total_norm(sqs: Iterable[float]) -> float:
    """The global 2-norm from each part's sum of squares (in the order given: plan part order)."""
    return float(np.sqrt(sum(float(s) for s in sqs)))


def clip_coef(max_norm: float, norm: float) -> np.float32:
    """``min(1, max_norm / (norm + 1e-6))`` in float32, as torch's clamped ``clip_coef``."""
    coef = np.float32(max_norm) / (np.float32(norm) + np.float32(EPS))
    return np.float32(min(coef, np.float32(1.0))) if not np.isnan(coef) else coef


def scale_grads(engine: Any, coef: np.float32, dtypes: Mapping[str, str] | None = None) -> None:
    """Multiply every gradient of ``engine`` by ``coef`` (in the gradient's dtype), as ``grad.mul_(coef)``."""
    dtypes = dtypes or {}
    for name, g in engine.grads().items():
        if g is None:
            continue
        a = np.asarray(g)
        if dtypes.get(name) == "bfloat16" and a.dtype == np.uint16:
            engine.set_grad(name, _to_bfloat16_bits(_values(a, "bfloat16") * np.float32(coef)))
        elif a.dtype.kind == "f":
            engine.set_grad(name, a * a.dtype.type(coef))

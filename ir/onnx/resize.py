"""Geometry of ONNX ``Resize`` (opset 11-19) and ``Upsample`` (opset 7-9), shared by the engines.

Resize is separable: every resized axis maps each output position to ``n``
input positions (edge-clamped) and ``n`` weights, and the output is the
weighted sum of those taps (nearest: one non-zero weight of two; linear: two;
cubic: four; antialiased linear/cubic when downsampling: a wider, normalised
footprint). :func:`resize_plan` computes, per axis, those index and weight
tables with the arithmetic of the ONNX reference implementation
(``onnx.reference.ops.op_resize``, vectorised form), so an engine only has
to gather along an axis, multiply and sum (and its VJP scatters the same
taps back). Pure NumPy: no torch, no onnx import.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class ResizeAxis:
    """How one axis is resized.

    axis:    the tensor axis.
    size:    output length along it.
    index:   (size, n) int64 input positions of each output position's taps, in ``[0, in_len)``.
    weight:  (size, n) float64 weights of those taps.
    outside: (size,) bool, True where ``tf_crop_and_resize`` samples outside the input
             (the output there is ``extrapolation_value``), or None.
    """

    axis: int
    size: int
    index: np.ndarray
    weight: np.ndarray
    outside: np.ndarray | None


def _nearest(ratio: float, mode: str) -> list[float]:
    if float(ratio).is_integer():
        return [0.0, 1.0]
    if mode == "round_prefer_floor":
        return [float(ratio <= 0.5), float(ratio > 0.5)]
    if mode == "round_prefer_ceil":
        return [float(ratio < 0.5), float(ratio >= 0.5)]
    if mode == "floor":
        return [1.0, 0.0]
    if mode == "ceil":
        return [0.0, 1.0]
    raise ValueError(f"Resize nearest_mode {mode!r} is not an ONNX mode")


def _cubic(ratio: float, a: float) -> list[float]:
    r, s = ratio, 1 - ratio
    return [((a * (r + 1) - 5 * a) * (r + 1) + 8 * a) * (r + 1) - 4 * a,
            ((a + 2) * r - (a + 3)) * r * r + 1,
            ((a + 2) * s - (a + 3)) * s * s + 1,
            ((a * (s + 1) - 5 * a) * (s + 1) + 8 * a) * (s + 1) - 4 * a]


def _cubic_antialias(ratio: float, scale: float, a: float) -> list[float]:
    scale = min(scale, 1.0)

    def k(x: float) -> float:
        x = abs(x)
        if x <= 1:
            return (a + 2) * x ** 3 - (a + 3) * x * x + 1
        return a * x ** 3 - 5 * a * x * x + 8 * a * x - 4 * a if x < 2 else 0.0

    start = int(np.floor(-2 / scale) + 1)
    c = [k(scale * (i - ratio)) for i in range(start, 2 - start)]
    return [v / sum(c) for v in c]


def _linear_antialias(ratio: float, scale: float) -> list[float]:
    scale = min(scale, 1.0)
    start = int(np.floor(-1 / scale) + 1)
    args = (np.arange(start, start + 2 - 2 * start) - ratio) * scale
    c = np.clip(1 - np.abs(args), 0, 1)
    return list(c / c.sum())


def _source(mode: str, y: np.ndarray, scale: float, n_in: int, n_out: int, roi) -> tuple[np.ndarray, np.ndarray | None]:
    """Input coordinate of each output position ``y`` (the coordinate_transformation_mode)."""
    out_w = scale * n_in
    if mode == "align_corners":
        return (np.zeros(n_out) if out_w == 1 else y * (n_in - 1) / (out_w - 1)), None
    if mode == "asymmetric":
        return y / scale, None
    if mode == "tf_crop_and_resize":
        x = np.full(n_out, (roi[1] - roi[0]) * (n_in - 1) / 2) if out_w == 1 else y * (roi[1] - roi[0]) * (n_in - 1) / (out_w - 1)
        x = x + roi[0] * (n_in - 1)
        return x, (x < 0) | (x > n_in - 1)
    if mode == "pytorch_half_pixel":
        return (np.full(n_out, -0.5) if out_w == 1 else (y + 0.5) / scale - 0.5), None
    if mode == "half_pixel":
        return (y + 0.5) / scale - 0.5, None
    if mode == "half_pixel_symmetric":
        offset = n_in / 2 * (1 - n_out / out_w)
        return offset + (y + 0.5) / scale - 0.5, None
    raise ValueError(f"Resize coordinate_transformation_mode {mode!r} is not an ONNX mode")


def _axis_taps(n_in: int, n_out: int, scale: float, roi, *, mode: str, ctm: str, nearest_mode: str,
               cubic_coeff_a: float, exclude_outside: int, antialias: int):
    x, outside = _source(ctm, np.arange(n_out, dtype=np.float64), scale, n_in, n_out, roi)
    xi = np.floor(x).astype(np.int64)
    ratios = np.where(x == xi, 1.0, x - xi)  # the reference prefers the pixel left of x: ratio in (0, 1]
    if mode == "nearest":
        coeffs = [_nearest(r, nearest_mode) for r in ratios]
    elif mode == "linear":
        coeffs = [_linear_antialias(r, scale) if antialias else [1 - r, r] for r in ratios]
    elif mode == "cubic":
        coeffs = [_cubic_antialias(r, scale, cubic_coeff_a) if antialias else _cubic(r, cubic_coeff_a) for r in ratios]
    else:
        raise ValueError(f"Resize mode {mode!r} is not an ONNX mode")
    weight = np.asarray(coeffs, dtype=np.float64).reshape(n_out, -1)
    n = weight.shape[1]
    pad = int(math.ceil(n / 2))
    xp = x + pad
    p = np.floor(xp).astype(np.int64)
    frac = xp - p
    if n % 2 == 0:
        off = np.where(frac == 0, -(n // 2), -(n // 2) + 1)
    else:
        base = -((n - 1) // 2)
        off = np.where(frac <= 0.5, base, base + 1)
    idx = (p + off)[:, None] + np.arange(n)[None, :] - pad
    if exclude_outside:
        weight = np.where((idx < 0) | (idx >= n_in), 0.0, weight)
        total = weight.sum(axis=1, keepdims=True)
        weight = weight / np.where(total == 0, 1.0, total)
    return np.clip(idx, 0, n_in - 1), weight, (outside if outside is not None and outside.any() else None)


def resize_plan(shape: Sequence[int], roi=None, scales=None, sizes=None, *, axes=None, mode: str = "nearest",
                coordinate_transformation_mode: str = "half_pixel", nearest_mode: str = "round_prefer_floor",
                cubic_coeff_a: float = -0.75, exclude_outside: int = 0, antialias: int = 0,
                keep_aspect_ratio_policy: str = "stretch") -> tuple[tuple[int, ...], list[ResizeAxis]]:
    """Output shape and per-axis taps of ``Resize(X of shape, roi, scales, sizes)`` (ONNX Resize-19 rules).

    ``roi``/``scales``/``sizes`` are number lists or None (an empty list is None); ``axes`` (Resize-18)
    names the axes they refer to. Axes that stay the same size with scale 1 are skipped.
    """
    rank = len(shape)
    roi = None if roi is None or len(roi) == 0 else [float(v) for v in roi]
    scales = None if scales is None or len(scales) == 0 else [float(v) for v in scales]
    sizes = None if sizes is None or len(sizes) == 0 else [int(v) for v in sizes]
    if (scales is None) == (sizes is None):
        raise ValueError("Resize needs exactly one of scales and sizes")
    axes = list(range(rank)) if axes is None else [a % rank for a in axes]
    if scales is not None:
        full_scales = [1.0] * rank
        for a, s in zip(axes, scales):
            full_scales[a] = s
        out = [int(math.floor(s * d)) for s, d in zip(full_scales, shape)]
    else:
        out = list(shape)
        for a, s in zip(axes, sizes):
            out[a] = s
        full_scales = [o / d for o, d in zip(out, shape)]
        if keep_aspect_ratio_policy != "stretch":
            pick = {"not_larger": min, "not_smaller": max}.get(keep_aspect_ratio_policy)
            if pick is None:
                raise ValueError(f"Resize keep_aspect_ratio_policy {keep_aspect_ratio_policy!r} is not an ONNX policy")
            s = pick(full_scales[a] for a in axes)
            full_scales = [s if i in axes else 1.0 for i in range(rank)]
            out = [int(s * shape[i] + 0.5) if i in axes else shape[i] for i in range(rank)]
    full_roi = None
    if roi is not None:
        full_roi = [0.0] * rank + [1.0] * rank
        for i, a in enumerate(axes):
            full_roi[a], full_roi[rank + a] = roi[i], roi[len(axes) + i]
    plan = []
    for a in axes:
        r = None if full_roi is None else (full_roi[a], full_roi[rank + a])
        if math.isclose(full_scales[a], 1.0) and out[a] == shape[a] and (r is None or (math.isclose(r[0], 0.0) and math.isclose(r[1], 1.0))):
            continue
        if out[a] == 0:
            plan.append(ResizeAxis(a, 0, np.zeros((0, 1), np.int64), np.zeros((0, 1)), None))
            continue
        idx, w, outside = _axis_taps(shape[a], out[a], full_scales[a], r, mode=mode, ctm=coordinate_transformation_mode,
                                     nearest_mode=nearest_mode, cubic_coeff_a=cubic_coeff_a,
                                     exclude_outside=exclude_outside, antialias=antialias)
        plan.append(ResizeAxis(a, out[a], idx, w, outside))
    return tuple(out), plan


def upsample_attrs(mode: str = "nearest") -> dict:
    """The Resize attributes that give Upsample-7/9 semantics (asymmetric coordinates, nearest rounds down)."""
    m = str(mode)
    return {"mode": "linear" if m in ("linear", "bilinear") else m,
            "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"}

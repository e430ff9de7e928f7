"""Top-K selection and the sparse codec in plain torch (CPU, and CUDA tensors).

Selection rule (shared with the CuPy path, so both pick the same set):

* rank elements by magnitude ``|x|``, largest first;
* among equal magnitudes the lower flat (row-major) index wins, so
  ``+v`` and ``-v`` tie, and ``0.0`` ties ``-0.0``;
* NaN ranks below every number (it is only sent when fewer than k elements
  are not NaN); ``inf`` ranks above every finite number.

Indices come out ascending. CPU tensors are selected by ``topk_host`` in
single-threaded NumPy (zero-copy); tensors on other devices by the torch code
below. Both are *threshold select*, not a sort:

1. estimate the k-th magnitude from a fixed-seed random sample of n/32
   elements (4Ki..32Ki), erring low by ~4 standard deviations;
2. one chunked pass collects candidates ``|x| > thr`` (about 1.2k of them);
3. if there are at least k candidates, the exact k-th magnitude ``v`` is
   ``kthvalue`` over the candidates, and the result is every candidate with
   ``|x| > v`` plus the lowest-index candidates with ``|x| == v``.
   The candidate set holds every element with ``|x| >= v``, so this is exact;
4. if there are fewer, and enough elements have ``|x| == thr``, then
   ``v == thr``: take all candidates plus the lowest-index ties, found by a
   chunked scan that stops early (all-equal and mostly-zero tensors);
5. otherwise (unlucky sample) do step 3 over all elements.

The sample only decides speed; the result never depends on it.
"""
from __future__ import annotations

import logging
import math

import numpy as np
import torch

from fusion.ir.errors import FusionError

from fusion.kernels.dtypes import (VALUE_DTYPES, dtype_name, index_dtype_for, torch_dtype, values_from_numpy,
                     values_to_numpy)
from fusion.kernels.sparse import SparsePayload
from fusion.kernels.staging import HostStaging, staging_for
from fusion.kernels.topk_host import EXACT_BELOW, MARGIN_SIGMAS, SAMPLE_MAX, SAMPLE_MIN, SAMPLE_SEED, Wide
from fusion.kernels.topk_host import select as host_select

log = logging.getLogger(__name__)

#: Elements per chunk when the torch code runs on a CPU tensor (tests); on an
#: accelerator the candidate pass is one chunk, since every chunk would sync.
CHUNK = 1 << 20


def _key_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype in which magnitudes are compared exactly (float64 stays float64)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_input(t: torch.Tensor, k: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise FusionError(f"topk: expected a torch.Tensor, got {type(t).__name__}")
    if dtype_name(t.dtype) not in VALUE_DTYPES:
        raise FusionError(f"topk: dtype {dtype_name(t.dtype)} is not supported; "
                          f"floating dtypes only: {sorted(VALUE_DTYPES)}")
    if not 0 <= k <= t.numel():
        raise FusionError(f"topk: k={k} must be in [0, numel={t.numel()}]")


def _exact_among(keys: torch.Tensor, k: int) -> torch.Tensor:
    """Positions (ascending) of the k largest keys, ties to the lower position.

    ``keys`` holds no NaN. ``k`` must be in [1, len(keys)].
    """
    c = keys.numel()
    if k == c:
        return torch.arange(c, device=keys.device)
    v = torch.kthvalue(keys, c - k + 1).values
    gt = keys > v
    need = k - int(gt.sum())
    eq = keys == v
    take = gt | (eq & (torch.cumsum(eq, 0) <= need))
    return torch.nonzero(take).squeeze(1)


def _exact(flat: torch.Tensor, k: int) -> torch.Tensor:
    """Exact selection over every element (NaN mapped below zero)."""
    keys = flat.abs().to(_key_dtype(flat.dtype))
    keys = torch.where(torch.isnan(keys), torch.full_like(keys, -1.0), keys)
    return _exact_among(keys, k)


def _estimate_threshold(flat: torch.Tensor, k: int) -> float | None:
    """A magnitude a little below the estimated k-th largest, or None if the sample is useless."""
    n = flat.numel()
    s = min(n, SAMPLE_MAX, max(SAMPLE_MIN, n // 32))
    gen = torch.Generator().manual_seed(SAMPLE_SEED)
    pos = torch.randint(n, (s,), generator=gen).to(flat.device)
    sample = flat[pos].abs().to(_key_dtype(flat.dtype))
    sample = torch.where(torch.isnan(sample), torch.full_like(sample, -1.0), sample)
    m = k * s / n  # expected sample elements above the true k-th magnitude
    rank = min(s, math.ceil(m + MARGIN_SIGMAS * math.sqrt(m) + 4))
    thr = float(torch.kthvalue(sample, s - rank + 1).values)
    return thr if thr >= 0 else None


def _above(flat: torch.Tensor, thr: float) -> torch.Tensor:
    """Ascending int64 positions with ``|x| > thr`` (never NaN), one chunked pass."""
    n = flat.numel()
    step = CHUNK if flat.device.type == "cpu" else n
    buf = torch.empty(min(step, n), dtype=flat.dtype, device=flat.device)
    out = []
    for start in range(0, n, step):
        chunk = flat[start:start + step]
        hit = torch.nonzero(torch.abs(chunk, out=buf[:chunk.numel()]) > thr).squeeze(1)
        out.append(hit + start if start else hit)
    return out[0] if len(out) == 1 else torch.cat(out)


def _first_equal(flat: torch.Tensor, thr: float, need: int) -> torch.Tensor | None:
    """The ``need`` lowest positions with ``|x| == thr``, stopping early; None if fewer exist."""
    n = flat.numel()
    step = CHUNK if flat.device.type == "cpu" else n
    got, found = [], 0
    for start in range(0, n, step):
        hit = torch.nonzero(flat[start:start + step].abs() == thr).squeeze(1)
        got.append(hit + start)
        found += hit.numel()
        if found >= need:
            return torch.cat(got)[:need]
    return None


def _host_view(flat: torch.Tensor) -> Wide:
    """Zero-copy NumPy view of a contiguous CPU tensor (bfloat16 as uint16 bits)."""
    flat = flat.contiguous()
    if flat.dtype == torch.bfloat16:
        return Wide(flat.view(torch.int16).numpy().view(np.uint16), bf16=True)
    return Wide(flat.numpy())


def select_device(flat: torch.Tensor, k: int) -> torch.Tensor:
    """The torch implementation on a flat tensor of any device (0 < k < numel)."""
    n = flat.numel()
    if n < EXACT_BELOW:
        return _exact(flat, k)
    thr = _estimate_threshold(flat, k)
    if thr is not None:
        idx = _above(flat, thr)
        if idx.numel() >= k:  # the k-th magnitude v > thr: exact select among candidates
            keys = flat[idx].abs().to(_key_dtype(flat.dtype))
            return idx[_exact_among(keys, k)]
        # fewer than k above thr: if enough elements equal thr, v == thr and the
        # lowest-index ties fill the rest (all-equal or mostly-zero tensors land here)
        ties = _first_equal(flat, thr, k - idx.numel())
        if ties is not None:
            return torch.sort(torch.cat([idx, ties])).values
        log.debug("topk: fewer than k=%d elements >= sampled threshold %g; exact fallback", k, thr)
    return _exact(flat, k)


def select(t: torch.Tensor, k: int) -> torch.Tensor:
    """Flat indices (int64, ascending, on ``t.device``) of the k largest ``|t|``.

    Ties go to the lower flat index; NaN ranks lowest (see module docstring).
    """
    _check_input(t, k)
    flat = t.detach().reshape(-1)
    n = flat.numel()
    if k == 0:
        return torch.empty(0, dtype=torch.int64, device=flat.device)
    if k == n:
        return torch.arange(n, device=flat.device)
    if flat.device.type == "cpu":
        return torch.from_numpy(host_select(_host_view(flat), k))
    return select_device(flat, k)


def compress(t: torch.Tensor, k: int, value_dtype: str | None = None) -> SparsePayload:
    """Keep the k largest-magnitude elements of ``t`` as a :class:`SparsePayload`.

    ``value_dtype`` (default: ``t``'s dtype) is the dtype of the values on the
    wire, e.g. ``"float16"`` or ``"bfloat16"``.
    """
    _check_input(t, k)
    dtype = dtype_name(t.dtype)
    vdt = dtype if value_dtype is None else value_dtype
    if vdt not in VALUE_DTYPES:
        raise FusionError(f"topk: unknown value_dtype {vdt!r}; known: {sorted(VALUE_DTYPES)}")
    index_np_dt = np.int32 if index_dtype_for(t.numel()) == "int32" else np.int64
    flat = t.detach().reshape(-1)
    if flat.device.type == "cpu":  # gather and cast in NumPy: no multi-threaded torch ops
        w = _host_view(flat)
        idx = host_select(w, k)
        values = w.raw[idx]  # the tensor's own dtype (bfloat16 as uint16 bits)
        if vdt != dtype:  # rounding by torch, as on the device path
            values = values_to_numpy(values_from_numpy(values, dtype), vdt)
        return SparsePayload(values, idx.astype(index_np_dt), tuple(t.shape), dtype, vdt)
    return compress_device(t, k, value_dtype)


def compress_device(t: torch.Tensor, k: int, value_dtype: str | None = None,
                    staging: HostStaging | None = None) -> SparsePayload:
    """The device encode path (CUDA tensors without CuPy); runs on any device, CPU in the tests.

    Selection (:func:`select_device`), the value gather, the cast to
    ``value_dtype`` and the index cast to the wire dtype all run on ``t``'s
    device; only the payload (k values + k indices) is copied to the host,
    through ``staging`` (default: the device's reusable buffer, pinned on CUDA)
    with one synchronisation of the current stream. The selection itself
    synchronises a few times on a GPU (``nonzero`` sizes, the tie count).
    """
    _check_input(t, k)
    dtype = dtype_name(t.dtype)
    vdt = dtype if value_dtype is None else value_dtype
    if vdt not in VALUE_DTYPES:
        raise FusionError(f"topk: unknown value_dtype {vdt!r}; known: {sorted(VALUE_DTYPES)}")
    flat = t.detach().reshape(-1)
    n = flat.numel()
    if k == 0:
        idx = torch.empty(0, dtype=torch.int64, device=flat.device)
    elif k == n:
        idx = torch.arange(n, device=flat.device)
    else:
        idx = select_device(flat, k)
    values = flat[idx]
    if vdt != dtype:  # torch's rounding on the device, as the host path
        values = values.to(torch_dtype(vdt))
    index = idx.to(torch.int32 if index_dtype_for(n) == "int32" else torch.int64)
    stream = torch.cuda.current_stream(flat.device) if flat.device.type == "cuda" else None
    values_np, index_np = (staging or staging_for(flat.device)).to_host([values, index], stream)
    return SparsePayload(values_np, index_np, tuple(t.shape), dtype, vdt)


def decompress(p: SparsePayload, device=None) -> torch.Tensor:
    """The dense tensor of a payload (zeros where nothing was sent), on ``device`` (default CPU).

    Validates the payload first; raises :class:`fusion.ir.errors.WireError`.
    """
    p.validate()
    dense_dt = torch_dtype(p.dtype)
    if device is None or torch.device(device).type == "cpu":  # scatter in NumPy on the host
        values = p.values
        if p.value_dtype != p.dtype:
            values = values_to_numpy(values_from_numpy(values, p.value_dtype).to(dense_dt), p.dtype)
        out_np = np.zeros(p.numel, dtype=values.dtype)
        out_np[p.indices] = values
        out = torch.from_numpy(out_np)
        return (out.view(torch.bfloat16) if p.dtype == "bfloat16" else out).reshape(p.shape)
    out = torch.zeros(p.numel, dtype=dense_dt, device=device)
    if p.k:
        idx = torch.from_numpy(p.indices.astype(np.int64, copy=False)).to(out.device)
        out[idx] = values_from_numpy(p.values, p.value_dtype, out.device).to(dense_dt)
    return out.reshape(p.shape)


"""Top-K selection for host (CPU) memory, in single-threaded NumPy.

``topk_torch.select`` sends CPU tensors here (zero-copy through
``Tensor.numpy()``). NumPy's vectorised loops run the streaming passes at
memory speed on one thread, so, unlike torch's multi-threaded CPU kernels,
they do not stall when the machine is oversubscribed and the OS deschedules
an OpenMP worker between parallel regions.

Same algorithm and the same selection rule as ``topk_torch`` (see there):
sampled threshold, one chunked candidate pass, exact ``k``-th magnitude among
the candidates (``np.partition``), ties cut by lowest index; a tie scan and an
exact pass cover the cases the sample gets wrong.
"""
from __future__ import annotations

import logging
import math

import numpy as np

log = logging.getLogger(__name__)

#: Elements sampled to estimate the threshold: n/32, clamped to [SAMPLE_MIN, SAMPLE_MAX].
SAMPLE_MIN, SAMPLE_MAX = 1 << 12, 1 << 15
#: Below this many elements the exact path is cheaper than sampling.
EXACT_BELOW = 1 << 15
#: Elements per chunk of the candidate pass (fits in L2 with its temporaries).
CHUNK = 1 << 16
#: Safety margin of the threshold estimate, in standard deviations.
MARGIN_SIGMAS = 4.0
#: Fixed seed of the sampling generator (results never depend on it).
SAMPLE_SEED = 0x5EED


class Wide:
    """A flat host array read as float32/float64 magnitudes, chunk by chunk.

    ``raw`` is float16/float32/float64, or bfloat16 bits as ``uint16``
    (``bf16=True``); :meth:`get` widens a slice exactly (to float32, or keeps
    float64), so magnitudes compare exactly as in the tensor's own dtype.
    """

    def __init__(self, raw: np.ndarray, bf16: bool = False):
        self.raw, self.bf16 = raw, bf16
        self.dtype = np.dtype(np.float64 if raw.dtype == np.float64 else np.float32)
        self.size = raw.size

    def get(self, sel) -> np.ndarray:
        part = self.raw[sel]
        if self.bf16:
            return (part.astype(np.uint32) << 16).view(np.float32)
        return part if part.dtype == self.dtype else part.astype(self.dtype)


def _no_nan(keys: np.ndarray) -> np.ndarray:
    """Magnitudes with NaN mapped to -1, below every number."""
    return np.where(np.isnan(keys), keys.dtype.type(-1), keys)


def exact_among(keys: np.ndarray, k: int) -> np.ndarray:
    """Positions (ascending) of the k largest keys, ties to the lower position (keys: no NaN)."""
    c = keys.size
    if k == c:
        return np.arange(c)
    v = np.partition(keys, c - k)[c - k]  # the k-th largest
    gt = keys > v
    need = k - int(np.count_nonzero(gt))
    gt[np.flatnonzero(keys == v)[:need]] = True  # the ``need`` lowest positions equal to it (no int64 cumsum)
    return np.flatnonzero(gt)


def _exact(w: Wide, k: int) -> np.ndarray:
    return exact_among(_no_nan(np.abs(w.get(slice(None)))), k)


def _estimate_threshold(w: Wide, k: int):
    """A magnitude a little below the estimated k-th largest, or None if the sample is useless."""
    n = w.size
    s = min(n, SAMPLE_MAX, max(SAMPLE_MIN, n // 32))
    pos = np.random.default_rng(SAMPLE_SEED).integers(0, n, s)
    sample = _no_nan(np.abs(w.get(pos)))
    m = k * s / n  # expected sample elements above the true k-th magnitude
    rank = min(s, math.ceil(m + MARGIN_SIGMAS * math.sqrt(m) + 4))
    thr = np.partition(sample, s - rank)[s - rank]
    return thr if thr >= 0 else None


def _above(w: Wide, thr) -> np.ndarray:
    """Ascending int64 positions with ``|x| > thr`` (never NaN), one chunked pass."""
    n = w.size
    buf = np.empty(min(CHUNK, n), dtype=w.dtype)
    mask = np.empty(min(CHUNK, n), dtype=bool)
    out = []
    for start in range(0, n, CHUNK):
        part = w.get(slice(start, start + CHUNK))
        m = mask[:part.size]
        np.greater(np.abs(part, out=buf[:part.size]), thr, out=m)
        hit = np.flatnonzero(m)
        if start:
            hit += start
        out.append(hit)
    return out[0] if len(out) == 1 else np.concatenate(out)


def _first_equal(w: Wide, thr, need: int) -> np.ndarray | None:
    """The ``need`` lowest positions with ``|x| == thr``, stopping early; None if fewer exist."""
    got, found = [], 0
    for start in range(0, w.size, CHUNK):
        hit = np.flatnonzero(np.abs(w.get(slice(start, start + CHUNK))) == thr) + start
        got.append(hit)
        found += hit.size
        if found >= need:
            return np.concatenate(got)[:need]
    return None


def select(w: Wide, k: int) -> np.ndarray:
    """Ascending int64 flat indices of the k largest magnitudes of ``w`` (0 <= k <= size)."""
    n = w.size
    if k == 0:
        return np.empty(0, dtype=np.int64)
    if k == n:
        return np.arange(n, dtype=np.int64)
    if n < EXACT_BELOW:
        return _exact(w, k)
    thr = _estimate_threshold(w, k)
    if thr is not None:
        idx = _above(w, thr)
        if idx.size >= k:  # the k-th magnitude v > thr: exact select among candidates
            return idx[exact_among(np.abs(w.get(idx)), k)]
        ties = _first_equal(w, thr, k - idx.size)  # v == thr if enough elements equal it
        if ties is not None:
            return np.sort(np.concatenate([idx, ties]))
        log.debug("topk: fewer than k=%d elements >= sampled threshold %g; exact fallback", k, thr)
    return _exact(w, k).astype(np.int64, copy=False)

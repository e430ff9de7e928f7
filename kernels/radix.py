"""Radix select over order-preserving integer keys: the host-side driver.

The CUDA path (``topk_cupy``) turns each magnitude into an unsigned key whose
integer order is the selection order, then finds the k-th largest key one
8-bit digit at a time: a histogram of the digit among keys that match the
prefix found so far, then a scan from the top digit down. Only the histogram
runs on the device; this module is the part that needs no GPU, so it is unit
tested on CPU with a NumPy histogram.

Key of a float magnitude ``a = |x|``: its IEEE bits with the sign cleared,
plus one; NaN maps to 0. For non-negative floats the bit order is the value
order, so keys rank ``inf`` highest and NaN lowest, like ``topk_torch``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

#: Bits per radix digit; 256 bins fit a block's shared memory.
DIGIT_BITS = 8
BINS = 1 << DIGIT_BITS

#: ``hist(prefix, mask, shift)`` -> counts[BINS] of ``(key >> shift) & 0xff``
#: over keys with ``key & mask == prefix``.
HistFn = Callable[[int, int, int], np.ndarray]


@dataclass(frozen=True)
class RadixResult:
    """Outcome of :func:`radix_select`.

    kth_key:   the k-th largest key.
    take_ties: how many keys equal to ``kth_key`` to keep (the lowest-index
               ones); every key above ``kth_key`` is kept too, so
               ``count(key > kth_key) == k - take_ties``.
    all_ties:  True when every key equal to ``kth_key`` is kept, so the
               selection is simply ``key >= kth_key``.
    """

    kth_key: int
    take_ties: int
    all_ties: bool


def radix_select(hist: HistFn, k: int, key_bits: int) -> RadixResult:
    """Find the k-th largest of n keys (1 <= k <= n) with ``key_bits / 8`` histogram passes."""
    if key_bits % DIGIT_BITS:
        raise ValueError(f"key_bits must be a multiple of {DIGIT_BITS}, got {key_bits}")
    prefix = mask = 0
    remaining = k
    counts = np.zeros(BINS, dtype=np.int64)
    digit = 0
    for shift in range(key_bits - DIGIT_BITS, -1, -DIGIT_BITS):
        counts = np.asarray(hist(prefix, mask, shift), dtype=np.int64)
        from_top = np.cumsum(counts[::-1])  # from_top[j]: keys in digits >= BINS-1-j
        j = int(np.searchsorted(from_top, remaining))  # first j with from_top[j] >= remaining
        if j >= BINS:
            raise ValueError(f"radix select: only {int(from_top[-1])} keys match, k={k} left {remaining}")
        digit = BINS - 1 - j
        remaining -= int(from_top[j] - counts[digit])
        prefix |= digit << shift
        mask |= (BINS - 1) << shift
    return RadixResult(prefix, remaining, remaining == int(counts[digit]))


def float_keys_np(a: np.ndarray) -> np.ndarray:
    """NumPy reference of the CUDA key kernel: magnitude keys of a float array.

    float16/bfloat16 inputs must be widened to float32 first (exact);
    float32 gives uint32 keys, float64 uint64 keys.
    """
    if a.dtype == np.float64:
        bits = a.view(np.uint64) & np.uint64(0x7FFF_FFFF_FFFF_FFFF)
        return np.where(bits > np.uint64(0x7FF0_0000_0000_0000), np.uint64(0), bits + np.uint64(1))
    if a.dtype != np.float32:
        raise TypeError(f"float_keys_np: float32 or float64 expected, got {a.dtype}")
    bits = a.view(np.uint32) & np.uint32(0x7FFF_FFFF)
    return np.where(bits > np.uint32(0x7F80_0000), np.uint32(0), bits + np.uint32(1))


def numpy_hist(keys: np.ndarray) -> HistFn:
    """A :data:`HistFn` over a NumPy key array (reference for the CUDA kernel)."""
    kt = keys.dtype.type

    def hist(prefix: int, mask: int, shift: int) -> np.ndarray:
        sel = keys[(keys & kt(mask)) == kt(prefix)]
        return np.bincount(((sel >> kt(shift)) & kt(BINS - 1)).astype(np.int64), minlength=BINS)

    return hist


def select_np(a: np.ndarray, k: int) -> np.ndarray:
    """Radix-select reference in NumPy: ascending flat indices of the k largest ``|a|``.

    Mirrors ``topk_cupy.select`` step by step, on the host.
    """
    flat = np.ascontiguousarray(a).reshape(-1)
    if flat.dtype in (np.float16,):
        flat = flat.astype(np.float32)
    n = flat.size
    if k == 0:
        return np.empty(0, dtype=np.int64)
    keys = float_keys_np(flat)
    res = radix_select(numpy_hist(keys), k, keys.dtype.itemsize * 8)
    kth = keys.dtype.type(res.kth_key)
    if res.all_ties:
        return np.flatnonzero(keys >= kth)
    last_tie = np.flatnonzero(keys == kth)[res.take_ties - 1]
    pos = np.arange(n)
    return np.flatnonzero((keys > kth) | ((keys == kth) & (pos <= last_tie)))

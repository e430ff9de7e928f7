"""A dense tied gradient that is mostly exact zeros travels as its nonzero elements: lossless, the same bits.

An embedding's gradient touches only the rows of the tokens a step saw: GPT-2 small's tied ``wte`` (50,257 x 768,
154 MB in float32) gets 512 of its rows from a step of 4 x 128 tokens, so the embedding's owner would send 99 %
zeros to the output layer's owner every step (docs/testing.md "Real size"). Without a tied codec
(``Plan.tied_codec`` None), :func:`pack` turns such an array into a :class:`~fusion.kernels.sparse.SparsePayload`
of every element whose *bits* are not all zero (so ``-0.0`` is kept), and :func:`unpack` rebuilds the array: the
same bits as the dense one, so the owners' sums in plan part order are unchanged (``tests/executors/runtime/
test_exact_zeros.py``). A gradient with more nonzero elements than :data:`MAX_FRACTION` of its size goes dense
(a sparse element costs its value and a 4- or 8-byte index).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from fusion.ir.errors import WireError
from fusion.kernels.dtypes import index_dtype_for
from fusion.kernels.codecs.topk import densify
from fusion.kernels.sparse import EXACT_SPARSE_MAX_FRACTION, SparsePayload

#: the largest share of nonzero elements sent sparse (the compiler's price follows the same rule)
MAX_FRACTION = EXACT_SPARSE_MAX_FRACTION

_BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def nonzero_elements(flat: np.ndarray) -> np.ndarray:
    """Indices of the elements of the contiguous 1-D ``flat`` whose bits are not all zero (``-0.0`` counts as
    nonzero), ascending."""
    bits = _BITS.get(flat.dtype.itemsize)
    return np.flatnonzero(flat.view(bits) if bits is not None else flat)


def pack(arr: Any, dtype: str) -> Any:
    """``arr`` as a :class:`SparsePayload` of its nonzero elements when at most :data:`MAX_FRACTION` of them are
    nonzero, else ``arr`` itself (also for anything that is not a NumPy array). ``dtype``: the graph's dtype name
    (bfloat16 arrays hold uint16 bits)."""
    if not isinstance(arr, np.ndarray) or arr.size == 0:
        return arr
    flat = np.ascontiguousarray(arr).reshape(-1)  # (a copy only when arr is not contiguous: once)
    idx = nonzero_elements(flat)
    if idx.size > MAX_FRACTION * arr.size:
        return arr
    it = np.int32 if index_dtype_for(arr.size) == "int32" else np.int64
    return SparsePayload(flat[idx], idx.astype(it), tuple(arr.shape), dtype, dtype)


def unpack(payload: Any, shape: tuple[int, ...], dtype: str, what: str) -> Any:
    """The dense array of a payload :func:`pack` made (an array passes through); WireError naming ``what`` for a
    sparse payload of another shape or dtype, or one that compresses its values (``pack`` never does)."""
    if not isinstance(payload, SparsePayload):
        return payload
    if tuple(payload.shape) != tuple(shape) or payload.dtype != dtype or payload.value_dtype != dtype:
        raise WireError(f"{what}: sparse payload of {payload.value_dtype} values for {payload.dtype}"
                        f"{list(payload.shape)}, the parameter is {dtype}{list(shape)}")
    return densify(payload)

"""The sparse wire encoding of a Top-K compressed tensor, and its byte costs.

A payload is a flat list of (value, index) pairs into the row-major tensor:
values in the tensor's dtype (or float16/bfloat16 when asked), indices int32
when the tensor has fewer than 2**31 elements, else int64. Everything not
listed is zero. Encoders emit indices in ascending order; decoders accept any
order but reject duplicates.

:func:`topk_cost_factor` is the factor ``c`` that replaces the hard-coded 3 of
FusionLLM Eq. (7): the paper sends float32 values with int64 indices, so a
kept element costs 3x a dense float32 element; with int32 indices it is 2x.
"""
from __future__ import annotations

import math
from fractions import Fraction
from dataclasses import dataclass
from typing import Any

import numpy as np

from fusion.ir.errors import FusionError, WireError
from fusion.ir.wire import PayloadCodec, register_payload_codec
from fusion.kernels.dtypes import INDEX_DTYPES, VALUE_DTYPES, dtype_size, index_dtype_for

#: a dense gradient travels as its exact nonzero elements (``executors/runtime/exact_zeros.py``) only when at most
#: this share of it is nonzero: beyond, values and indices are barely smaller than dense. The compiler prices a tied
#: gradient by the same rule (``fusion/cost/grad_rows.py``)
EXACT_SPARSE_MAX_FRACTION = 0.25


@dataclass(frozen=True)
class SparsePayload:
    """k values of a tensor and where they go; every other element is zero.

    values:      1-D array of the kept values, dtype ``value_dtype`` (bfloat16 as
                 raw ``uint16`` bits, since NumPy has no bfloat16).
    indices:     1-D array of flat row-major indices, same length as ``values``;
                 int32 when ``numel < 2**31``, else int64. Encoders sort them
                 ascending; they must be unique.
    shape:       shape of the dense tensor.
    dtype:       dtype name of the dense tensor (``"float32"``, ...), restored by decode.
    value_dtype: dtype name of ``values`` on the wire; None at construction
                 means "same as ``dtype``".
    """

    values: np.ndarray
    indices: np.ndarray
    shape: tuple[int, ...]
    dtype: str
    value_dtype: str | None = None

    def __post_init__(self):
        if self.value_dtype is None:
            object.__setattr__(self, "value_dtype", self.dtype)
        object.__setattr__(self, "shape", tuple(self.shape))

    @property
    def k(self) -> int:
        """Number of elements kept."""
        return int(np.size(self.indices))

    @property
    def numel(self) -> int:
        """Number of elements of the dense tensor."""
        return math.prod(self.shape)

    @property
    def index_dtype(self) -> str:
        """Index dtype name the encoding requires for this shape."""
        return index_dtype_for(self.numel)

    @property
    def nbytes(self) -> int:
        """Bytes of the value and index buffers (the payload's share of the wire)."""
        return int(self.values.nbytes + self.indices.nbytes)

    def validate(self) -> "SparsePayload":
        """Check the payload is well formed; return it, or raise :class:`WireError`.

        Checks, in order: known dtypes, shape, 1-D arrays, array dtypes, equal
        lengths, k <= numel, indices in range, no duplicate indices. Costs
        O(k) (O(k log k) only when indices are not already ascending).
        """
        for field_name in ("dtype", "value_dtype"):
            name = getattr(self, field_name)
            if name not in VALUE_DTYPES:
                raise WireError(f"sparse payload: unknown {field_name} {name!r}; "
                                f"known: {sorted(VALUE_DTYPES)}")
        if not all(isinstance(s, (int, np.integer)) and s >= 0 for s in self.shape):
            raise WireError(f"sparse payload: bad shape {self.shape!r} (need non-negative ints)")
        for field_name in ("values", "indices"):
            arr = getattr(self, field_name)
            if not isinstance(arr, np.ndarray):
                raise WireError(f"sparse payload: {field_name} must be a numpy array, "
                                f"got {type(arr).__name__}")
            if arr.ndim != 1:
                raise WireError(f"sparse payload: {field_name} must be 1-D, got shape {arr.shape}")
        want_v = VALUE_DTYPES[self.value_dtype].numpy
        if self.values.dtype != want_v:
            raise WireError(f"sparse payload: values have dtype {self.values.dtype}, "
                            f"value_dtype {self.value_dtype!r} needs {want_v}")
        want_i = INDEX_DTYPES[self.index_dtype].numpy
        if self.indices.dtype != want_i:
            raise WireError(f"sparse payload: indices have dtype {self.indices.dtype}, "
                            f"a tensor of {self.numel} elements needs {want_i}")
        if self.values.shape[0] != self.indices.shape[0]:
            raise WireError(f"sparse payload: {self.values.shape[0]} values but "
                            f"{self.indices.shape[0]} indices")
        n, k = self.numel, self.k
        if k > n:
            raise WireError(f"sparse payload: k={k} exceeds numel={n} of shape {self.shape}")
        if k:
            lo, hi = int(self.indices.min()), int(self.indices.max())
            if lo < 0 or hi >= n:
                bad = lo if lo < 0 else hi
                raise WireError(f"sparse payload: index {bad} out of range [0, {n}) "
                                f"for shape {self.shape}")
            if k > 1 and not bool(np.all(self.indices[1:] > self.indices[:-1])):
                uniq, counts = np.unique(self.indices, return_counts=True)
                if uniq.size != k:
                    raise WireError(f"sparse payload: duplicate index {int(uniq[counts > 1][0])} "
                                    f"({k - uniq.size} duplicates)")
        return self

    def to_msg(self) -> tuple[dict[str, Any], list[bytes]]:
        """A msgpack-able header and the two raw frames ``[values, indices]``."""
        header = {"shape": list(self.shape), "dtype": self.dtype,
                  "value_dtype": self.value_dtype, "k": self.k}
        return header, [np.ascontiguousarray(self.values).tobytes(),
                        np.ascontiguousarray(self.indices).tobytes()]

    @classmethod
    def from_msg(cls, header: dict[str, Any], frames: list) -> "SparsePayload":
        """Rebuild a payload from :meth:`to_msg` output; validates, raises :class:`WireError`."""
        if not isinstance(header, dict):
            raise WireError(f"sparse payload: header must be a map, got {type(header).__name__}")
        for name in ("shape", "dtype", "value_dtype", "k"):
            if name not in header:
                raise WireError(f"sparse payload: malformed header: field {name!r} is missing")
        shape, dtype, value_dtype, k = header["shape"], header["dtype"], header["value_dtype"], header["k"]
        if not isinstance(dtype, str) or dtype not in VALUE_DTYPES:
            raise WireError(f"sparse payload: unknown dtype {_short(dtype)}")
        if not isinstance(value_dtype, str) or value_dtype not in VALUE_DTYPES:
            raise WireError(f"sparse payload: unknown value_dtype {_short(value_dtype)}")
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise WireError(f"sparse payload: k must be a non-negative int, got {_short(k)}")
        if not isinstance(shape, (list, tuple)) or len(shape) > 32 or \
                not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < 2**62 for s in shape):
            raise WireError(f"sparse payload: bad shape {_short(shape)} (need at most 32 non-negative ints)")
        shape = tuple(shape)
        if not isinstance(frames, (list, tuple)) or len(frames) != 2:
            raise WireError("sparse payload: needs exactly 2 frames (values, indices)")
        vbuf, ibuf = frames
        vdt = VALUE_DTYPES[value_dtype].numpy
        idt = INDEX_DTYPES[index_dtype_for(math.prod(shape))].numpy
        for name, buf, dt in (("values", vbuf, vdt), ("indices", ibuf, idt)):
            if len(buf) != k * dt.itemsize:
                raise WireError(f"sparse payload: {name} frame has {len(buf)} bytes, "
                                f"k={k} x {dt.itemsize} expected")
        payload = cls(np.frombuffer(vbuf, dtype=vdt), np.frombuffer(ibuf, dtype=idt),
                      shape, dtype, value_dtype)
        return payload.validate()


def _short(v: Any, n: int = 80) -> str:
    r = repr(v)
    return r if len(r) <= n else r[:n] + "..."


def sparse_nbytes(numel: int, k: int, value_dtype: str) -> int:
    """Wire bytes of the value and index buffers of a k-of-numel payload (header excluded)."""
    return k * (dtype_size(value_dtype) + dtype_size(index_dtype_for(numel)))


def dense_nbytes(numel: int, dtype: str) -> int:
    """Wire bytes of the same tensor sent dense (header excluded)."""
    return numel * dtype_size(dtype)


def topk_cost_factor(value_dtype: str = "float32", index_dtype: str = "int32",
                     dense_dtype: str | None = None) -> float:
    """Bytes per kept element over bytes per dense element: the ``c`` of Eq. (7).

    ``r_i = max(1, c * r * R_i / max_p R_p)``; the paper's ``c = 3`` is
    ``topk_cost_factor("float32", "int64")``. ``dense_dtype`` defaults to
    ``value_dtype``. For a tensor of ``numel`` elements use
    ``index_dtype_for(numel)`` as the index dtype.
    """
    dense = value_dtype if dense_dtype is None else dense_dtype
    return (dtype_size(value_dtype) + dtype_size(index_dtype)) / dtype_size(dense)


def ratio_to_k(numel: int, ratio: float) -> int:
    """Elements kept at compression ratio ``ratio``: ``max(1, ceil(numel / ratio))``.

    Computed exactly (no float rounding), capped at ``numel`` (so 0 for an
    empty tensor). ``ratio`` must be >= 1.
    """
    if not ratio >= 1:  # also rejects NaN
        raise FusionError(f"topk: compression ratio must be >= 1, got {ratio!r}")
    if numel == 0:
        return 0
    if math.isinf(ratio):
        return 1
    return min(numel, max(1, math.ceil(Fraction(numel) / Fraction(ratio))))


# -- the payload type on the wire (fusion.ir.wire) ----------------------------------------------

def _register_sparse() -> None:
    """Register ``"sparse"``: header ``{shape, dtype, value_dtype, k}``, frames ``[values, indices]``.

    Decoding rebuilds the payload with :meth:`SparsePayload.from_msg`, which checks
    the dtypes, the frame lengths against k, the shape, indices in range and
    unique, and raises WireError otherwise, so a malformed sparse OP-Data is
    rejected (and logged) by the receiving transport before any part sees it.
    """
    def enc(p: SparsePayload) -> tuple[dict, list[np.ndarray]]:
        head, _ = p.to_msg()
        return head, [np.ascontiguousarray(p.values), np.ascontiguousarray(p.indices)]

    def dec(meta: dict, arrays: list[np.ndarray]) -> SparsePayload:
        if len(arrays) != 2:
            raise WireError(f"sparse payload needs 2 tensor frames (values, indices), got {len(arrays)}")
        if any(a.ndim != 1 for a in arrays):
            raise WireError(f"sparse payload frames must be 1-D, got shapes {[list(a.shape) for a in arrays]}")
        return SparsePayload.from_msg(meta, [memoryview(np.ascontiguousarray(a)).cast("B") for a in arrays])

    register_payload_codec(PayloadCodec("sparse", lambda p: isinstance(p, SparsePayload), enc, dec))


_register_sparse()

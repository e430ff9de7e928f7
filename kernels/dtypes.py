"""Dtype tables shared by the Top-K codec: names, sizes, numpy and torch types.

Dtype names are torch-style without the prefix (``"float32"``), the same names
``fusion.ir`` uses in ``TensorMeta``. NumPy has no bfloat16, so bfloat16
values travel as their raw 16 bits in a ``uint16`` array; the conversions here
are the only place that knows this.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DtypeInfo:
    """One dtype the codec can carry.

    name:   torch-style name, e.g. ``"bfloat16"``.
    size:   bytes per element on the wire.
    numpy:  NumPy dtype of the array that holds it (``uint16`` for bfloat16).
    """

    name: str
    size: int
    numpy: np.dtype


#: Value dtypes a sparse payload may carry (and dense dtypes it may restore).
VALUE_DTYPES: dict[str, DtypeInfo] = {
    "float64": DtypeInfo("float64", 8, np.dtype(np.float64)),
    "float32": DtypeInfo("float32", 4, np.dtype(np.float32)),
    "float16": DtypeInfo("float16", 2, np.dtype(np.float16)),
    "bfloat16": DtypeInfo("bfloat16", 2, np.dtype(np.uint16)),
}

#: Index dtypes a sparse payload may carry.
INDEX_DTYPES: dict[str, DtypeInfo] = {
    "int32": DtypeInfo("int32", 4, np.dtype(np.int32)),
    "int64": DtypeInfo("int64", 8, np.dtype(np.int64)),
}

#: Tensors with at least this many elements need int64 flat indices.
INT32_INDEX_LIMIT = 2**31


def index_dtype_for(numel: int) -> str:
    """Index dtype name for a tensor of ``numel`` elements: int32 below 2**31, else int64."""
    return "int32" if numel < INT32_INDEX_LIMIT else "int64"


def dtype_size(name: str) -> int:
    """Bytes per element of a value or index dtype name; ValueError if unknown."""
    info = VALUE_DTYPES.get(name) or INDEX_DTYPES.get(name)
    if info is None:
        known = sorted(VALUE_DTYPES) + sorted(INDEX_DTYPES)
        raise ValueError(f"unknown dtype {name!r}; known: {known}")
    return info.size


def torch_dtype(name: str):
    """The ``torch.dtype`` for a value dtype name (imports torch lazily)."""
    import torch

    try:
        return {"float64": torch.float64, "float32": torch.float32,
                "float16": torch.float16, "bfloat16": torch.bfloat16}[name]
    except KeyError:
        raise ValueError(f"unknown value dtype {name!r}; known: {sorted(VALUE_DTYPES)}") from None


def dtype_name(dtype) -> str:
    """Torch-style name of a ``torch.dtype`` or NumPy dtype, e.g. ``torch.float32`` -> ``"float32"``."""
    if isinstance(dtype, np.dtype) or (isinstance(dtype, type) and issubclass(dtype, np.generic)):
        return np.dtype(dtype).name
    return str(dtype).removeprefix("torch.")


def values_to_numpy(values, value_dtype: str) -> np.ndarray:
    """Cast a 1-D torch tensor of values to ``value_dtype`` and return it as a host NumPy array.

    bfloat16 comes back as its raw bits in a ``uint16`` array. The cast uses
    torch's rounding (round to nearest even), on the tensor's own device, so
    the CPU and CUDA paths produce identical bytes.
    """
    import torch

    v = values.detach().to(torch_dtype(value_dtype))
    if value_dtype == "bfloat16":
        v = v.view(torch.int16)
    arr = v.cpu().numpy()
    return arr.view(np.uint16) if value_dtype == "bfloat16" else arr


def values_from_numpy(arr: np.ndarray, value_dtype: str, device=None):
    """Inverse of :func:`values_to_numpy`: a torch tensor of dtype ``value_dtype`` on ``device``."""
    import torch

    if not arr.flags.writeable or not arr.flags.c_contiguous:
        arr = np.array(arr, copy=True)  # torch refuses read-only buffers (msgpack frames are)
    if value_dtype == "bfloat16":
        t = torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    else:
        t = torch.from_numpy(arr)
    return t.to(device) if device is not None else t

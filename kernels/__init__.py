"""Top-K compression kernels: torch path (CPU/GPU) and CuPy CUDA path; sparse wire encoding.

The wire-level pieces (``sparse``, ``dtypes``) need only NumPy, so a
CompNode on a non-torch engine can decode payloads; the compressors (codec,
error feedback) import torch and are loaded on first use.
"""
from __future__ import annotations

import importlib

from .dtypes import INDEX_DTYPES, VALUE_DTYPES, index_dtype_for
from .sparse import SparsePayload, dense_nbytes, ratio_to_k, sparse_nbytes, topk_cost_factor

_LAZY = {
    "CODECS": "codec", "Codec": "codec", "CodecRegistry": "codec", "TopKCodec": "codec",
    "compress": "codec", "decompress": "codec",
    "ErrorFeedback": "error_feedback",
}

__all__ = [
    "CODECS", "Codec", "CodecRegistry", "TopKCodec", "compress", "decompress", "ratio_to_k",
    "INDEX_DTYPES", "VALUE_DTYPES", "index_dtype_for",
    "ErrorFeedback",
    "SparsePayload", "dense_nbytes", "sparse_nbytes", "topk_cost_factor",
    "cupy_available",
]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    if name == "cupy_available":
        return importlib.import_module(".topk_cupy", __name__).available
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

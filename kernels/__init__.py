"""Compression kernels: Top-K (torch, CuPy), block quantisation (``quant``, ``hadamard-quant``)
and AQ-SGD deltas (``delta``), with their wire encodings.

The wire-level pieces (``sparse``, ``dtypes``) and the NumPy paths of the
quantisers (``quant``, ``delta``) need only NumPy, so a CompNode on a
non-torch engine can encode and decode; importing this package registers the
``quant`` and ``delta`` payload types with ``fusion.ir.wire``. The torch
compressors (codec, ``quant_torch``, ``delta_torch``, error feedback) import
torch and are loaded on first use.
"""
from __future__ import annotations

import importlib

from fusion.kernels.dtypes import INDEX_DTYPES, VALUE_DTYPES, index_dtype_for
from fusion.kernels.sparse import SparsePayload, dense_nbytes, ratio_to_k, sparse_nbytes, topk_cost_factor
from fusion.kernels.quant import QuantConfig, QuantPayload, quant_nbytes
from fusion.kernels.delta import DeltaBuffer, DeltaConfig, DeltaPayload, delta_buffer_nbytes, delta_wire_nbytes

_LAZY = {
    "CODECS": "codec", "Codec": "codec", "CodecRegistry": "codec", "TopKCodec": "codec",
    "QuantCodec": "codec", "HadamardQuantCodec": "codec", "DeltaCodec": "codec",
    "TorchDeltaBuffer": "delta_torch",
    "compress": "codec", "decompress": "codec",
    "ErrorFeedback": "error_feedback",
}

__all__ = [
    "CODECS", "Codec", "CodecRegistry", "TopKCodec", "compress", "decompress", "ratio_to_k",
    "QuantCodec", "HadamardQuantCodec", "DeltaCodec", "TorchDeltaBuffer",
    "QuantConfig", "QuantPayload", "quant_nbytes",
    "DeltaBuffer", "DeltaConfig", "DeltaPayload", "delta_buffer_nbytes", "delta_wire_nbytes",
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

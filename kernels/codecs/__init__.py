"""Compression codecs, one file per algorithm (``topk``, ``quant`` with ``hadamard-quant``, ``delta``), the
unit's base class with its context (:mod:`.base`) and the registry (:mod:`.registry`). Adding a codec: one
file here with a ``BUILTINS`` tuple (or, outside fusion, a plugin file calling ``register_codec``) and its test.
"""
from __future__ import annotations

from fusion.kernels.codecs.base import ALL_ROLES, FLOAT_DTYPES, Codec, CodecContext, Counter, Role
from fusion.kernels.codecs.plain import CodecPayload, check_plain
from fusion.kernels.codecs.registry import (BUILTIN, CODECS, CodecRegistry, PluginCodec, is_unit, numpy_path,
                                            register_codec)

__all__ = ["ALL_ROLES", "FLOAT_DTYPES", "Codec", "CodecContext", "Counter", "Role", "CodecPayload", "check_plain",
           "BUILTIN", "CODECS", "CodecRegistry", "PluginCodec", "is_unit", "numpy_path", "register_codec"]

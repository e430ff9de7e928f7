"""The compression codec: device dispatch, ratio -> k, and a small codec registry.

``compress``/``decompress`` pick the CuPy kernel for CUDA tensors when CuPy is
usable and the torch path otherwise; both give the same payload bytes.

Codecs sit behind one small interface (:class:`Codec`) in a
:class:`CodecRegistry`, as in hivemind's compression registry. A plan's
per-edge ``compress_cfg`` such as ``{"algo": "topk", "ratio": 100}`` names
the codec by ``algo``; the codec reads the rest of the dict.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from fusion.ir.errors import FusionError

from . import topk_cupy, topk_torch
from .dtypes import VALUE_DTYPES
from .sparse import SparsePayload, ratio_to_k, sparse_nbytes




def _use_cupy(t: torch.Tensor) -> bool:
    return t.is_cuda and topk_cupy.available()


def compress(tensor, k: int, value_dtype: str | None = None) -> SparsePayload:
    """Top-k compress a torch tensor (or NumPy array) into a :class:`SparsePayload`.

    CUDA tensors go to the CuPy kernel when CuPy is usable, everything else to
    the torch path. ``value_dtype`` (e.g. ``"float16"``) casts the kept values.
    """
    if isinstance(tensor, np.ndarray):
        tensor = torch.from_numpy(np.ascontiguousarray(tensor))
    if not isinstance(tensor, torch.Tensor):
        raise FusionError(f"topk: expected a tensor, got {type(tensor).__name__}")
    if _use_cupy(tensor):
        return topk_cupy.compress(tensor, k, value_dtype)
    return topk_torch.compress(tensor, k, value_dtype)


def decompress(payload: SparsePayload, like: torch.Tensor | None = None) -> torch.Tensor:
    """Dense torch tensor of a payload, on ``like``'s device (CPU when ``like`` is None).

    Validates the payload (raises :class:`fusion.ir.errors.WireError`).
    """
    device = None if like is None else like.device
    if like is not None and _use_cupy(like):
        return topk_cupy.decompress(payload, device)
    return topk_torch.decompress(payload, device)


@runtime_checkable
class Codec(Protocol):
    """One compression algorithm.

    name:        the ``algo`` value in a ``compress_cfg``.
    encode:      tensor + cfg -> payload for the wire.
    decode:      payload -> dense torch tensor (on ``like``'s device).
    wire_nbytes: bytes the payload of a ``numel``-element ``dtype`` tensor
                 costs under ``cfg`` (what the compiler prices).
    """

    name: str

    def encode(self, tensor: torch.Tensor, cfg: Mapping[str, Any]) -> Any: ...

    def decode(self, payload: Any, like: torch.Tensor | None = None) -> torch.Tensor: ...

    def wire_nbytes(self, numel: int, dtype: str, cfg: Mapping[str, Any]) -> int: ...


@dataclass(frozen=True)
class TopKCodec:
    """Top-k sparsification. cfg keys: exactly one of ``ratio`` (>= 1, k from
    :func:`ratio_to_k`) or ``k``; optional ``value_dtype`` (default: the
    tensor's dtype). Other keys (``algo``, ...) are ignored.
    """

    name: str = "topk"

    @staticmethod
    def k_for(numel: int, cfg: Mapping[str, Any]) -> int:
        """Elements kept for a ``numel``-element tensor under ``cfg``."""
        if ("ratio" in cfg) == ("k" in cfg):
            raise FusionError(f"topk cfg needs exactly one of 'ratio' or 'k', got {dict(cfg)}")
        if "k" in cfg:
            k = cfg["k"]
            if not isinstance(k, int) or k < 0:
                raise FusionError(f"topk cfg: k must be a non-negative int, got {k!r}")
            return min(k, numel)
        return ratio_to_k(numel, cfg["ratio"])

    def encode(self, tensor, cfg: Mapping[str, Any]) -> SparsePayload:
        numel = tensor.numel() if isinstance(tensor, torch.Tensor) else int(np.size(tensor))
        return compress(tensor, self.k_for(numel, cfg), cfg.get("value_dtype"))

    def decode(self, payload: SparsePayload, like: torch.Tensor | None = None) -> torch.Tensor:
        if not isinstance(payload, SparsePayload):
            raise FusionError(f"topk: expected a SparsePayload, got {type(payload).__name__}")
        return decompress(payload, like)

    def wire_nbytes(self, numel: int, dtype: str, cfg: Mapping[str, Any]) -> int:
        vdt = cfg.get("value_dtype") or dtype
        if vdt not in VALUE_DTYPES:
            raise FusionError(f"topk cfg: unknown value_dtype {vdt!r}")
        return sparse_nbytes(numel, self.k_for(numel, cfg), vdt)


class CodecRegistry:
    """Codecs by name. Build your own or start from :meth:`with_defaults`;
    registries are plain objects, never shared mutable module state.
    """

    def __init__(self, codecs: Iterable[Codec] = ()):
        self._codecs: dict[str, Codec] = {}
        for c in codecs:
            self.register(c)

    @classmethod
    def with_defaults(cls) -> "CodecRegistry":
        """A new registry holding the built-in codecs (``"topk"``)."""
        return cls([TopKCodec()])

    def register(self, codec: Codec) -> Codec:
        """Add ``codec`` under ``codec.name``; a name may be registered once."""
        if not isinstance(codec, Codec):
            raise FusionError(f"codec {codec!r} does not implement encode/decode/wire_nbytes")
        if codec.name in self._codecs:
            raise FusionError(f"codec {codec.name!r} is already registered")
        self._codecs[codec.name] = codec
        return codec

    def get(self, name: str) -> Codec:
        """The codec called ``name``; FusionError naming the known ones otherwise."""
        try:
            return self._codecs[name]
        except KeyError:
            raise FusionError(f"unknown compression algo {name!r}; known: {sorted(self._codecs)}") from None

    def for_cfg(self, cfg: Mapping[str, Any]) -> Codec:
        """The codec a ``compress_cfg`` names in its ``algo`` key."""
        if "algo" not in cfg:
            raise FusionError(f"compress_cfg has no 'algo': {dict(cfg)}")
        return self.get(cfg["algo"])

    def names(self) -> list[str]:
        """Registered codec names, sorted."""
        return sorted(self._codecs)

    def __contains__(self, name: object) -> bool:
        return name in self._codecs


#: The built-in codecs. Read-only by convention: register extra codecs in a
#: registry of your own (``CodecRegistry.with_defaults()``), not here.
CODECS = CodecRegistry.with_defaults()

__all__ = ["Codec", "CodecRegistry", "CODECS", "TopKCodec", "compress", "decompress", "ratio_to_k"]

"""The compression codec: device dispatch, ratio -> k, and a small codec registry.

``compress``/``decompress`` pick the CuPy kernel for CUDA tensors when CuPy is
usable and the torch path otherwise; both give the same payload bytes.

Built-in codecs: ``topk`` (:class:`TopKCodec`), ``quant`` (:class:`QuantCodec`),
``hadamard-quant`` (:class:`HadamardQuantCodec`) and ``delta``
(:class:`DeltaCodec`, stateful: it prices payloads and makes per-edge
buffers, see there).

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

from fusion.kernels import topk_cupy, topk_torch
from fusion.kernels import quant as _quant
from fusion.kernels.delta import DeltaBuffer, DeltaConfig, delta_wire_nbytes
from fusion.kernels.dtypes import VALUE_DTYPES
from fusion.kernels.quant import QuantConfig, QuantPayload
from fusion.kernels.sparse import SparsePayload, ratio_to_k, sparse_nbytes




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


def _numel_of(tensor) -> int:
    return tensor.numel() if isinstance(tensor, torch.Tensor) else int(np.size(tensor))


def _check_dtype(algo: str, dtype: str) -> None:
    if dtype not in VALUE_DTYPES:
        raise FusionError(f"{algo}: cannot compress dtype {dtype!r}; floating dtypes only: {sorted(VALUE_DTYPES)}")


@dataclass(frozen=True)
class QuantCodec:
    """Block-wise uniform quantisation (``kernels.quant``). cfg keys: ``bits`` (2, 4, 8;
    default 8), ``block`` (default 64), ``rounding`` (``"nearest"``/``"stochastic"``),
    ``seed`` (stochastic rounding, default 0), ``algo``; other keys are refused.

    ``encode`` takes a torch tensor (any device: the torch path, CUDA included)
    or a NumPy array (the torch-free NumPy path; same bytes). ``decode``
    returns a torch tensor on ``like``'s device.
    """

    name: str = "quant"
    hadamard: bool = False

    def config(self, cfg: Mapping[str, Any]) -> QuantConfig:
        """The validated cfg (FusionError naming the bad key and value)."""
        return QuantConfig.from_cfg(cfg, self.hadamard)

    def encode(self, tensor, cfg: Mapping[str, Any]) -> QuantPayload:
        qc = self.config(cfg)
        if isinstance(tensor, np.ndarray):
            return _quant.quantize(tensor, qc)
        from fusion.kernels import quant_torch

        return quant_torch.quantize(tensor, qc)

    def decode(self, payload: QuantPayload, like: torch.Tensor | None = None) -> torch.Tensor:
        if not isinstance(payload, QuantPayload) or payload.hadamard != self.hadamard:
            raise FusionError(f"{self.name}: expected a {'hadamard ' if self.hadamard else ''}QuantPayload, "
                              f"got {type(payload).__name__}"
                              + (f" with hadamard={payload.hadamard}" if isinstance(payload, QuantPayload) else ""))
        from fusion.kernels import quant_torch

        return quant_torch.dequantize(payload, None if like is None else like.device)

    def wire_nbytes(self, numel: int, dtype: str, cfg: Mapping[str, Any]) -> int:
        """Exact frame bytes (scales, offsets, packed codes) plus ``quant.HEADER_NBYTES`` for the header."""
        qc = self.config(cfg)
        _check_dtype(self.name, dtype)
        return _quant.quant_nbytes(numel, qc) + _quant.HEADER_NBYTES


@dataclass(frozen=True)
class HadamardQuantCodec(QuantCodec):
    """``quant`` after an orthonormal block-wise Walsh-Hadamard rotation (TAH-Quant / QuIP# style
    outlier spreading). Same cfg keys; ``block`` must be a power of two."""

    name: str = "hadamard-quant"
    hadamard: bool = True


@dataclass(frozen=True)
class DeltaCodec:
    """AQ-SGD activation deltas (``kernels.delta``). Stateful, so it is a *factory*.

    A delta payload depends on what was sent before for the same samples on
    the same edge, which a stateless ``encode(tensor, cfg)`` cannot know. So
    this codec does what the registry needs statelessly (cfg validation and
    :meth:`wire_nbytes` for the compiler) and hands out per-edge buffer
    objects (:meth:`buffer`) whose ``encode(x, ids)`` / ``decode(payload)`` do
    the work; the runtime keeps one per edge and end. :meth:`encode` and
    :meth:`decode` raise FusionError saying so.

    cfg keys: ``bits`` (2, 4, 8; default 4), ``block`` (64), ``rounding``,
    ``seed``, ``first_visit`` (``"quant8"`` default, or ``"dense"``), ``algo``.
    """

    name: str = "delta"

    def config(self, cfg: Mapping[str, Any]) -> DeltaConfig:
        return DeltaConfig.from_cfg(cfg)

    def buffer(self, cfg: Mapping[str, Any], backend: str = "torch", device=None):
        """New per-edge buffers: ``"torch"`` (``TorchDeltaBuffer`` on ``device``) or ``"numpy"`` (``DeltaBuffer``)."""
        dc = self.config(cfg)
        if backend == "numpy":
            return DeltaBuffer(dc)
        if backend == "torch":
            from fusion.kernels.delta_torch import TorchDeltaBuffer

            return TorchDeltaBuffer(dc, device)
        raise FusionError(f"delta: backend must be 'torch' or 'numpy', got {backend!r}")

    def encode(self, tensor, cfg: Mapping[str, Any]):
        raise FusionError("delta is stateful: make per-edge buffers with DeltaCodec.buffer(cfg) "
                          "and call their encode(x, sample_ids)")

    def decode(self, payload, like: torch.Tensor | None = None):
        raise FusionError("delta is stateful: decode with the edge's buffers (DeltaCodec.buffer(cfg).decode)")

    def wire_nbytes(self, numel: int, dtype: str, cfg: Mapping[str, Any]) -> int:
        """Steady-state bytes (every row a delta) of a ``numel``-element message, ids of one row and
        two headers included. First visits cost more: see ``delta.delta_wire_nbytes``; each extra row
        of a micro-batch adds 9 bytes (id and flag)."""
        dc = self.config(cfg)
        _check_dtype(self.name, dtype)
        return delta_wire_nbytes(1, numel, dtype, dc) + 2 * _quant.HEADER_NBYTES


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
        """A new registry holding the built-in codecs (``topk``, ``quant``, ``hadamard-quant``, ``delta``)."""
        return cls([TopKCodec(), QuantCodec(), HadamardQuantCodec(), DeltaCodec()])

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

__all__ = ["Codec", "CodecRegistry", "CODECS", "TopKCodec", "QuantCodec", "HadamardQuantCodec", "DeltaCodec",
           "compress", "decompress", "ratio_to_k"]

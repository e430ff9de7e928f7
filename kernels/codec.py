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

from fusion.ir.errors import FusionError, WireError
from fusion.ir.wire import PayloadCodec, register_payload_codec

from fusion.kernels import topk_cupy
from fusion.kernels import quant as _quant
from fusion.kernels.delta import DeltaBuffer, DeltaConfig, delta_wire_nbytes
from fusion.kernels.dtypes import VALUE_DTYPES
from fusion.kernels.quant import QuantConfig, QuantPayload
from fusion.kernels.sparse import SparsePayload, ratio_to_k, sparse_nbytes




def _use_cupy(t) -> bool:
    return bool(getattr(t, "is_cuda", False)) and topk_cupy.available()


def _is_torch(t) -> bool:
    """Whether ``t`` is a torch tensor, without importing torch (a NumPy process never has one)."""
    import sys

    torch = sys.modules.get("torch")
    return torch is not None and isinstance(t, torch.Tensor)


def compress(tensor, k: int, value_dtype: str | None = None) -> SparsePayload:
    """Top-k compress a torch tensor (or NumPy array) into a :class:`SparsePayload`.

    CUDA tensors go to the CuPy kernel when CuPy is usable, everything else to
    the torch path. ``value_dtype`` (e.g. ``"float16"``) casts the kept values.
    """
    import torch

    from fusion.kernels import topk_torch

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
    from fusion.kernels import topk_torch

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

    A *user* codec (one registered with :func:`register_codec`, not built in) is
    run by the CompNodes through this interface, so its payloads must cross the
    wire without pickle: ``encode`` returns a *plain payload*, a dict of string
    keys to ``bytes``, ``int``, ``float``, ``str``, ``bool``, ``None`` or flat
    lists of those scalars (:func:`check_plain`); ``decode`` gets the same dict
    back (``bytes`` values as ``bytes``) and must raise on a malformed one
    (lengths, counts, ranges): a receiving CompNode then rejects the message
    and keeps serving. The payload must say everything decoding needs (shape,
    dtype); the runtime checks the decoded tensor against the graph.

    Optionally a codec also has a NumPy path, so that NumPy CompNodes (which
    never import torch) can run it: ``encode_numpy(array, cfg) -> payload`` and
    ``decode_numpy(payload) -> np.ndarray``, giving the same payloads as the
    torch path. The runtime uses the NumPy path wherever a codec has one (its
    messages are NumPy arrays), else the torch path, which a NumPy part refuses
    at load (:func:`numpy_path`).
    """

    name: str

    def encode(self, tensor: torch.Tensor, cfg: Mapping[str, Any]) -> Any: ...

    def decode(self, payload: Any, like: torch.Tensor | None = None) -> torch.Tensor: ...

    def wire_nbytes(self, numel: int, dtype: str, cfg: Mapping[str, Any]) -> int: ...


def numpy_path(codec: Codec) -> bool:
    """Whether ``codec`` declares a NumPy path (``encode_numpy`` and ``decode_numpy``)."""
    return callable(getattr(codec, "encode_numpy", None)) and callable(getattr(codec, "decode_numpy", None))


# -- user codecs' payloads on the wire ---------------------------------------------------------

#: limits of a plain payload (a hostile message cannot make a receiver build huge headers)
MAX_PLAIN_KEYS = 64
MAX_PLAIN_KEY = 64
MAX_PLAIN_LIST = 1 << 16
MAX_PLAIN_STR = 1024
_SCALARS = (bool, int, float, str, type(None))


def check_plain(payload: Any, algo: str, err: type[Exception] = FusionError) -> dict:
    """``payload`` itself when it is a plain payload (see :class:`Codec`), else ``err`` naming the codec and key."""
    if not isinstance(payload, dict):
        raise err(f"codec {algo!r}: a payload must be a dict of plain values, got {type(payload).__name__}")
    if len(payload) > MAX_PLAIN_KEYS:
        raise err(f"codec {algo!r}: payload has {len(payload)} keys (at most {MAX_PLAIN_KEYS})")
    for k, v in payload.items():
        if not isinstance(k, str) or not 0 < len(k) <= MAX_PLAIN_KEY:
            raise err(f"codec {algo!r}: payload key {k!r:.80} is not a string of 1..{MAX_PLAIN_KEY} characters")
        if isinstance(v, (bytes, bytearray, memoryview)):
            continue
        if isinstance(v, str) and len(v) > MAX_PLAIN_STR:
            raise err(f"codec {algo!r}: payload key {k!r}: string of {len(v)} characters (at most {MAX_PLAIN_STR})")
        if isinstance(v, (list, tuple)):
            if len(v) > MAX_PLAIN_LIST or not all(isinstance(x, _SCALARS) and not isinstance(x, str) or
                                                   isinstance(x, str) and len(x) <= MAX_PLAIN_STR for x in v):
                raise err(f"codec {algo!r}: payload key {k!r}: a list must hold at most {MAX_PLAIN_LIST} scalars")
            continue
        if not isinstance(v, _SCALARS):
            raise err(f"codec {algo!r}: payload key {k!r} has a {type(v).__name__}; plain payloads hold bytes, "
                      "int, float, str, bool, None and lists of those")
    return payload


@dataclass(frozen=True)
class CodecPayload:
    """A user codec's plain payload as it travels: ``algo`` names the codec, ``fields`` is what its
    ``encode`` returned (``bytes`` values become raw tensor frames, the rest msgpack; never pickle)."""

    algo: str
    fields: dict


def _wire_encode(p: CodecPayload) -> tuple[dict, list[np.ndarray]]:
    blobs = [k for k, v in p.fields.items() if isinstance(v, (bytes, bytearray, memoryview))]
    rest = {k: list(v) if isinstance(v, tuple) else v for k, v in p.fields.items() if k not in blobs}
    arrays = [np.frombuffer(bytes(p.fields[k]) if isinstance(p.fields[k], memoryview) else p.fields[k], np.uint8)
              for k in blobs]
    return {"algo": p.algo, "f": rest, "b": blobs}, arrays


def _wire_decode(meta: dict, arrays: list[np.ndarray]) -> CodecPayload:
    algo, rest, blobs = meta.get("algo"), meta.get("f"), meta.get("b")
    if not isinstance(algo, str) or not 0 < len(algo) <= MAX_PLAIN_KEY:
        raise WireError("codec payload: 'algo' must be a codec name")
    if not isinstance(rest, dict) or not isinstance(blobs, list) or not all(isinstance(k, str) for k in blobs):
        raise WireError(f"codec payload of {algo!r}: 'f' must be a map and 'b' a list of key names")
    if len(blobs) != len(arrays):
        raise WireError(f"codec payload of {algo!r}: {len(blobs)} byte fields named, {len(arrays)} frames sent")
    if len(set(blobs)) != len(blobs) or set(blobs) & set(rest):
        raise WireError(f"codec payload of {algo!r}: a key is named twice")
    fields = dict(rest)
    for k, a in zip(blobs, arrays):
        if a.dtype != np.uint8 or a.ndim != 1:
            raise WireError(f"codec payload of {algo!r}: byte field {k!r:.80} must be a 1-D uint8 frame, "
                            f"got {a.dtype}{list(a.shape)}")
        fields[k] = a.tobytes()
    check_plain(fields, algo, WireError)
    return CodecPayload(algo, fields)


WIRE_CODEC = register_payload_codec(PayloadCodec("codec", lambda p: isinstance(p, CodecPayload), _wire_encode,
                                                 _wire_decode))


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
        numel = tensor.numel() if _is_torch(tensor) else int(np.size(tensor))
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
    return tensor.numel() if _is_torch(tensor) else int(np.size(tensor))


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
        """Add ``codec`` under ``codec.name``; a name may be registered once (the same class imported
        again, e.g. a model file loaded twice in one process, replaces its earlier instance)."""
        if not isinstance(codec, Codec):
            raise FusionError(f"codec {codec!r} does not implement name/encode/decode/wire_nbytes")
        name = codec.name
        if not isinstance(name, str) or not 0 < len(name) <= MAX_PLAIN_KEY or name in ("none", "auto") \
                or any(c in name for c in ":,= "):
            raise FusionError(f"codec name {name!r}: 1..{MAX_PLAIN_KEY} characters without ':', ',', '=' or spaces, "
                              "not 'none' or 'auto'")
        old = self._codecs.get(name)
        if old is not None and (name in BUILTIN or _origin(old) != _origin(codec)):
            raise FusionError(f"codec {name!r} is already registered")
        self._codecs[name] = codec
        return codec

    def user_module(self, name: str) -> str | None:
        """The module that defines a user codec's class (None for a built-in codec)."""
        return None if name in BUILTIN else type(self.get(name)).__module__

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


def _origin(codec: Any) -> tuple[str, str]:
    return type(codec).__module__, type(codec).__qualname__


#: names of the built-in codecs (the runtime has fast NumPy paths for them)
BUILTIN = frozenset({"topk", "quant", "hadamard-quant", "delta"})

#: The process-wide registry: the built-in codecs plus those user plugin files register with
#: :func:`register_codec` (as user ops go into ``fusion.ir.registry.REGISTRY``). Compiling, the
#: estimator and every CompNode look codecs up here; a plan that names a user codec lists the file
#: that registers it as a plugin, which executors import under ``--trust-plugins``.
CODECS = CodecRegistry.with_defaults()


def register_codec(codec: Codec) -> Codec:
    """Register a user codec in :data:`CODECS` (call it at the top level of a model file)::

        from fusion.kernels.codec import register_codec
        register_codec(Int8Codec())        # fusion compile model.py:model ... --compress int8

    ``codec`` implements :class:`Codec` with plain payloads (and, for NumPy parts,
    ``encode_numpy``/``decode_numpy``). Returns it."""
    return CODECS.register(codec)

__all__ = ["Codec", "CodecRegistry", "CODECS", "BUILTIN", "CodecPayload", "check_plain", "numpy_path", "register_codec", "TopKCodec", "QuantCodec", "HadamardQuantCodec", "DeltaCodec",
           "compress", "decompress", "ratio_to_k"]

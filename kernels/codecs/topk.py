"""``topk``: Top-K sparsification (FusionLLM §5, AdaTopK), the codec and its kernels' dispatch.

cfg keys: exactly one of ``ratio`` (>= 1, k from :func:`~fusion.kernels.sparse.ratio_to_k`) or ``k``;
optional ``value_dtype`` (default: the tensor's dtype; honoured by :meth:`TopKCodec.encode`). A plan's edges
and tied gradients give ``ratio``. Host path: ``kernels.topk_host`` selection on a NumPy array (the same
selection the torch codec runs for CPU tensors, so the bytes are identical); device path: ``topk_torch``, or
the CuPy kernel for a CUDA tensor when CuPy is usable. Error feedback (``kernels.error_feedback``) adds each
stream's unsent residual to its next message, on the tensor's device.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

import numpy as np

from fusion.ir.errors import FusionError
from fusion.kernels import topk_cupy
from fusion.kernels.codecs.base import Codec, CodecContext, Role, as_torch, numel_of
from fusion.kernels.dtypes import VALUE_DTYPES, index_dtype_for
from fusion.kernels.sparse import SparsePayload, ratio_to_k, sparse_nbytes
from fusion.kernels.topk_host import Wide
from fusion.kernels.topk_host import select as host_select


def _use_cupy(t) -> bool:
    return bool(getattr(t, "is_cuda", False)) and topk_cupy.available()


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


def decompress(payload: SparsePayload, like=None):
    """Dense torch tensor of a payload, on ``like``'s device (CPU when ``like`` is None).

    Validates the payload (raises :class:`fusion.ir.errors.WireError`).
    """
    from fusion.kernels import topk_torch

    device = None if like is None else like.device
    if like is not None and _use_cupy(like):
        return topk_cupy.decompress(payload, device)
    return topk_torch.decompress(payload, device)


def topk_numpy(arr: np.ndarray, k: int, dtype: str | None = None) -> SparsePayload:
    """Top-k of a float NumPy array as a :class:`SparsePayload` (same bytes as :func:`compress`).

    ``dtype="bfloat16"``: ``arr`` holds bfloat16 bits (uint16); magnitudes are ranked on their
    exact float32 widening and the kept values stay bfloat16 bits.
    """
    a = np.ascontiguousarray(arr)
    flat = a.reshape(-1)
    name = dtype or a.dtype.name
    wide = (flat.astype(np.uint32) << 16).view(np.float32) if name == "bfloat16" else flat
    idx = host_select(Wide(wide), k)
    it = np.int32 if index_dtype_for(flat.size) == "int32" else np.int64
    return SparsePayload(flat[idx], idx.astype(it), tuple(a.shape), name, name)


def densify(p: SparsePayload) -> np.ndarray:
    """The dense NumPy array of a sparse payload (zeros where nothing was sent); validates first.

    bfloat16 values/tensors are handled as their uint16 bits, as everywhere in fusion.
    """
    p.validate()
    vals = p.values
    if p.value_dtype != p.dtype:
        if p.value_dtype == "bfloat16":
            vals = (vals.astype(np.uint32) << 16).view(np.float32)
        if p.dtype == "bfloat16":
            raise FusionError("sparse payload: a bfloat16 tensor must carry bfloat16 values")
        vals = vals.astype(VALUE_DTYPES[p.dtype].numpy)
    out = np.zeros(p.numel, dtype=VALUE_DTYPES[p.dtype].numpy)
    out[p.indices] = vals
    return out.reshape(p.shape)


@dataclass(frozen=True)
class TopKCodec(Codec):
    """Top-k sparsification. cfg keys: exactly one of ``ratio`` (>= 1, k from
    :func:`ratio_to_k`) or ``k``; optional ``value_dtype`` (default: the
    tensor's dtype). Other keys (``algo``, ...) are ignored.
    """

    name: str = "topk"
    roles: ClassVar[frozenset] = frozenset({Role.ACTIVATION, Role.GRADIENT, Role.TIED_GRADIENT, Role.PSEUDO_GRADIENT})
    error_feedback: ClassVar[bool] = True
    #: bench_codecs: torch encode + decode of 1M float32 in 1.6 ms (rounded down)
    rate: ClassVar[float] = 400e6
    host_on_cpu: ClassVar[bool] = False  # a CPU tensor's selection reads the tensor in place: no copy to make
    has_device: ClassVar[bool] = True
    payload_types: ClassVar[tuple] = (SparsePayload,)
    payload_word: ClassVar[str] = "sparse"
    order: ClassVar[int] = 0
    #: pseudo-gradients (the DiLoCo planner's list, most faithful first): these ratios, after quant's bits
    PSEUDO_RATIOS: ClassVar[tuple] = (10, 100, 1000)
    auto_order: ClassVar[Mapping] = {Role.PSEUDO_GRADIENT: 10}

    @property  # type: ignore[override]
    def auto(self) -> Mapping:
        """``auto`` candidates under this instance's name (a Top-K registered under another name keeps its own)."""
        return {Role.PSEUDO_GRADIENT: tuple({"algo": self.name, "ratio": r} for r in self.PSEUDO_RATIOS)}

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

    # -- the registry's protocol (any tensor, the cfg's own k) --------------------------------------
    def encode(self, tensor, cfg: Mapping[str, Any]) -> SparsePayload:
        return compress(tensor, self.k_for(numel_of(tensor), cfg), cfg.get("value_dtype"))

    def decode(self, payload: SparsePayload, like=None):
        if not isinstance(payload, SparsePayload):
            raise FusionError(f"topk: expected a SparsePayload, got {type(payload).__name__}")
        return decompress(payload, like)

    def wire_nbytes(self, numel: int, dtype: str, cfg: Mapping[str, Any]) -> int:
        vdt = cfg.get("value_dtype") or dtype
        if vdt not in VALUE_DTYPES:
            raise FusionError(f"topk cfg: unknown value_dtype {vdt!r}")
        return sparse_nbytes(numel, self.k_for(numel, cfg), vdt)

    # -- the runtime's (edges, tied gradients: k from the ratio) ------------------------------------
    def check_cfg(self, cfg: Mapping[str, Any]) -> None:
        if not float(cfg.get("ratio", 0)) >= 1:
            raise FusionError(f"ratio {cfg.get('ratio')!r} < 1")

    @staticmethod
    def is_dense(cfg: Mapping[str, Any]) -> bool:
        """Ratio 1 keeps every element: the edge is sent dense."""
        return float(cfg["ratio"]) == 1

    def message_cfg(self, cfg: Mapping[str, Any], payload: SparsePayload) -> dict:
        return {"algo": "topk", "ratio": float(cfg["ratio"]), "k": int(payload.k)}

    def encode_host(self, arr: np.ndarray, dtype: str, cfg: Mapping[str, Any], ctx: CodecContext) -> SparsePayload:
        k = ratio_to_k(arr.size, float(cfg["ratio"]))
        if ctx.feedback is not None:
            return ctx.feedback.compress(ctx.stream, as_torch(arr, dtype), k)
        return topk_numpy(arr, k, dtype)

    def decode_host(self, payload: SparsePayload, ctx: CodecContext | None = None) -> np.ndarray:
        return densify(payload)

    def encode_device(self, t, dtype: str, cfg: Mapping[str, Any], ctx: CodecContext) -> SparsePayload:
        k = ratio_to_k(t.numel(), float(cfg["ratio"]))
        if ctx.feedback is not None:
            return ctx.feedback.compress(ctx.stream, t, k)
        return compress(t, k)

    def decode_device(self, payload: SparsePayload, device, ctx: CodecContext | None = None):
        from fusion.kernels import topk_torch

        if getattr(device, "type", None) == "cuda" and topk_cupy.available():
            return topk_cupy.decompress(payload, device)
        return topk_torch.decompress(payload, device)


BUILTINS = (TopKCodec(),)

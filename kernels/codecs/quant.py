"""``quant`` and ``hadamard-quant``: block-wise uniform quantisation (``kernels.quant``), plain or after an
orthonormal block-wise Walsh-Hadamard rotation (TAH-Quant / QuIP# style outlier spreading).

cfg keys: ``bits`` (2, 4, 8; default 8), ``block`` (default 64; a power of two for hadamard-quant),
``rounding`` (``"nearest"``/``"stochastic"``), ``seed`` (stochastic rounding, default 0), ``algo``; other keys
are refused. In a table, stochastic rounding draws fresh noise per message from the context
(:meth:`~.base.CodecContext.rounding_seed`). Host path: the NumPy kernels (``kernels.quant_host``, in place); device path: ``kernels.quant_torch``
(the same bytes; frames cross through the device's staging buffer).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

import numpy as np

from fusion.ir.errors import FusionError
from fusion.kernels import quant as _quant, quant_host
from fusion.kernels.codecs.base import ALL_ROLES, Codec, CodecContext, Role, check_dtype
from fusion.kernels.quant import QuantConfig, QuantPayload

_Q8 = {"algo": "quant", "bits": 8, "block": 64}
_Q4 = {"algo": "quant", "bits": 4, "block": 64}
_H4 = {"algo": "hadamard-quant", "bits": 4, "block": 64}


@dataclass(frozen=True)
class QuantCodec(Codec):
    """Block-wise uniform quantisation (``kernels.quant``). cfg keys: ``bits`` (2, 4, 8;
    default 8), ``block`` (default 64), ``rounding`` (``"nearest"``/``"stochastic"``),
    ``seed`` (stochastic rounding, default 0), ``algo``; other keys are refused.

    ``encode`` takes a torch tensor (any device: the torch path, CUDA included)
    or a NumPy array (the torch-free NumPy path; same bytes). ``decode``
    returns a torch tensor on ``like``'s device.
    """

    name: str = "quant"
    hadamard: bool = False
    roles: ClassVar[frozenset] = ALL_ROLES
    #: benchmarks/bench_codecs.py, 1M float32 on one CPU thread, NumPy encode + decode 10-14 ms (rounded down)
    rate: ClassVar[float] = 300e6
    #: ``--compress auto``'s candidates: what the convergence study shows to converge (GPT, local-4-two-sites,
    #: 200 steps, final EMA loss vs dense at the same step; docs/compression.md). Activations: 8-bit +1.2 %,
    #: 4-bit +0.85 % (fresh random windows) and -3.6 % (512 samples in epochs; the study's best_codec, 0.26 of
    #: dense's time to dense's final loss). Gradients (milder than activations, Rudakov et al. 2024): 8-bit
    #: +1.2 %, 4-bit -3.6 % (every delta run's gradients). Left out: 2-bit (+11 % on activations with 4-bit
    #: gradients, not reaching dense's late target; +25 % and rising on gradients over 2-bit activations).
    #: ``--tied-codec auto``: 8-bit (SWARM: 8-bit gradients lose nothing). Pseudo-gradients (the DiLoCo planner's
    #: list, most faithful first): 8 and 4 bits, before Top-K's (:attr:`TopKCodec.auto_order`).
    auto: ClassVar[Mapping] = {Role.ACTIVATION: (_Q8, _Q4), Role.GRADIENT: (_Q8, _Q4),
                               Role.TIED_GRADIENT: ({"algo": "quant", "bits": 8},),
                               Role.PSEUDO_GRADIENT: ({"algo": "quant", "bits": 8}, {"algo": "quant", "bits": 4})}
    has_device: ClassVar[bool] = True
    payload_types: ClassVar[tuple] = (QuantPayload,)
    payload_word: ClassVar[str] = "quantised"
    order: ClassVar[int] = 1

    def config(self, cfg: Mapping[str, Any]) -> QuantConfig:
        """The validated cfg (FusionError naming the bad key and value)."""
        return QuantConfig.from_cfg(cfg, self.hadamard)

    # -- the registry's protocol ----------------------------------------------------------------------
    def encode(self, tensor, cfg: Mapping[str, Any]) -> QuantPayload:
        qc = self.config(cfg)
        if isinstance(tensor, np.ndarray):
            return quant_host.quantize(tensor, qc)
        from fusion.kernels import quant_torch

        return quant_torch.quantize(tensor, qc)

    def decode(self, payload: QuantPayload, like=None):
        if not self.owns(payload):
            raise FusionError(f"{self.name}: expected a {'hadamard ' if self.hadamard else ''}QuantPayload, "
                              f"got {type(payload).__name__}"
                              + (f" with hadamard={payload.hadamard}" if isinstance(payload, QuantPayload) else ""))
        from fusion.kernels import quant_torch

        return quant_torch.dequantize(payload, None if like is None else like.device)

    def wire_nbytes(self, numel: int, dtype: str, cfg: Mapping[str, Any]) -> int:
        """Exact frame bytes (scales, offsets, packed codes) plus ``quant.HEADER_NBYTES`` for the header."""
        qc = self.config(cfg)
        check_dtype(self.name, dtype)
        return _quant.quant_nbytes(numel, qc) + _quant.HEADER_NBYTES

    # -- the runtime's ---------------------------------------------------------------------------------
    def check_cfg(self, cfg: Mapping[str, Any]) -> None:
        self.config(cfg)

    def owns(self, payload: Any) -> bool:
        return isinstance(payload, QuantPayload) and payload.hadamard == self.hadamard

    def _seeded(self, cfg: Mapping[str, Any], ctx: CodecContext | None) -> QuantConfig:
        qc = self.config(cfg)
        if qc.rounding == "stochastic" and ctx is not None:  # fresh noise per message, the same on every run
            seed = ctx.rounding_seed()
            if seed is not None:
                qc = qc.with_seed(seed)
        return qc

    def encode_host(self, arr: np.ndarray, dtype: str, cfg: Mapping[str, Any], ctx: CodecContext) -> QuantPayload:
        return quant_host.quantize(arr, self._seeded(cfg, ctx), dtype=dtype)

    def decode_host(self, payload: QuantPayload, ctx: CodecContext | None = None) -> np.ndarray:
        return quant_host.dequantize(payload)

    def encode_device(self, t, dtype: str, cfg: Mapping[str, Any], ctx: CodecContext) -> QuantPayload:
        from fusion.kernels import quant_torch

        return quant_torch.quantize(t, self._seeded(cfg, ctx))

    def decode_device(self, payload: QuantPayload, device, ctx: CodecContext | None = None):
        from fusion.kernels import quant_torch

        return quant_torch.dequantize(payload, device)


@dataclass(frozen=True)
class HadamardQuantCodec(QuantCodec):
    """``quant`` after an orthonormal block-wise Walsh-Hadamard rotation (TAH-Quant / QuIP# style
    outlier spreading). Same cfg keys; ``block`` must be a power of two."""

    name: str = "hadamard-quant"
    hadamard: bool = True
    roles: ClassVar[frozenset] = ALL_ROLES - {Role.DP_GRADIENT}
    #: what a step pays in the convergence study's real runs (GPT, local-4-two-sites, 4 CompNodes on 2 shared
    #: cores, 1.84 MB of activations per step through its edges): 4-bit took 0.107 s/step more than quant 4-bit
    #: (66.4 vs 44.9 s per 200 steps). The kernel alone runs faster (bench_codecs: 48e6-76e6).
    rate: ClassVar[float] = 16e6
    #: ``--compress auto``: 4-bit, +0.42 % on activations and on gradients (fresh windows); 2 and 8 bits unrun
    auto: ClassVar[Mapping] = {Role.ACTIVATION: (_H4,), Role.GRADIENT: (_H4,)}
    order: ClassVar[int] = 2


BUILTINS = (QuantCodec(), HadamardQuantCodec())

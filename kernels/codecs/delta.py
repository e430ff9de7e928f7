"""``delta``: AQ-SGD activation deltas (Wang et al., NeurIPS 2022, Alg. 1; kernels in ``kernels.delta``).

For a training sample seen before only the quantised change of its activation since its previous visit is
sent, ``q(a_xi - m(xi))``, and both ends set ``m(xi) += dequant(q)``; a first visit goes with a
higher-precision codec. So the codec is *stateful*: each end of an edge keeps per-sample buffers
(:meth:`DeltaCodec.new_state`: ``DeltaBuffer`` in NumPy, ``TorchDeltaBuffer`` on a device), which the
runtime holds per edge (``executors/runtime/delta_edges.py``) and hands to each call as ``ctx.state``.

Rows: a buffer is per sample, so the tensor's leading dimension must be the micro-batch's samples, or a
multiple of them in sample-major order (a ``[mb*T, d]`` activation is buffered as ``[mb, T, d]``). A tensor
whose leading dimension is not is sent dense (the encode returns None); both ends agree because the receiver
decodes whatever payload arrives.

cfg keys: ``bits`` (2, 4, 8; default 4), ``block`` (64), ``rounding``, ``seed``, ``first_visit``
(``"quant8"`` default, or ``"dense"``), ``algo``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

import numpy as np

from fusion.ir.errors import FusionError
from fusion.kernels import quant as _quant
from fusion.kernels.codecs.base import Codec, CodecContext, Role, check_dtype
from fusion.kernels.delta import DeltaBuffer, DeltaConfig, DeltaPayload, delta_wire_nbytes


def rows_view(x: Any, n: int) -> Any:
    """``x`` (array or tensor) with ``n`` sample rows leading (``[B, ...]`` -> ``[n, B // n, ...]``), or None."""
    if x.ndim == 0 or n == 0 or x.shape[0] % n:
        return None
    return x if x.shape[0] == n else x.reshape(n, x.shape[0] // n, *x.shape[1:])


@dataclass(frozen=True)
class DeltaCodec(Codec):
    """AQ-SGD activation deltas (``kernels.delta``). Stateful: the registry's stateless
    ``encode(tensor, cfg)`` / ``decode(payload)`` raise FusionError saying so; the runtime encodes with
    :meth:`encode_host` / :meth:`encode_device` and the edge's buffers (:meth:`new_state`, :meth:`buffer`).
    """

    name: str = "delta"
    roles: ClassVar[frozenset] = frozenset({Role.ACTIVATION})
    stateful: ClassVar[bool] = True
    #: what a step pays in the convergence study's real runs (GPT, local-4-two-sites, 4 CompNodes on 2 shared
    #: cores): 4-bit 0.10 s/step more than quant 4-bit, 2-bit 0.07 s/step more than quant 2-bit over 1.84 MB of
    #: activations per step (bytes on the wire about equal; NumPy buffer work at both ends) -> 17e6 to 24e6,
    #: taken as 20e6. The kernel alone runs faster (bench_codecs: 52e6-75e6).
    rate: ClassVar[float] = 20e6
    #: ``--compress auto``: 4-bit -4.2 % and 2-bit -0.9 % (512 samples in epochs; 2-bit reaches dense's final
    #: loss in 0.45 of dense's time); only where the data gives sample ids and declares its size
    auto: ClassVar[Mapping] = {Role.ACTIVATION: ({"algo": "delta", "bits": 4, "block": 64},
                                                 {"algo": "delta", "bits": 2, "block": 64})}
    #: the gradients' codec when only delta is asked for: AQ-SGD sends gradients directly quantised (8 bits, SWARM)
    gradient_codec: ClassVar[Mapping] = {"algo": "quant", "bits": 8, "block": 64}
    has_device: ClassVar[bool] = True
    payload_types: ClassVar[tuple] = (DeltaPayload,)
    title: ClassVar[str] = "delta (AQ-SGD)"
    order: ClassVar[int] = 3

    def config(self, cfg: Mapping[str, Any]) -> DeltaConfig:
        return DeltaConfig.from_cfg(cfg)

    def check_cfg(self, cfg: Mapping[str, Any]) -> None:
        self.config(cfg)

    def check(self, cfg: Mapping[str, Any], role: Role, error_feedback: bool = False) -> None:
        if role is Role.GRADIENT:
            raise FusionError("delta (AQ-SGD) compresses activations only; give the gradients another codec "
                              "(--compress-bwd)")
        super().check(cfg, role, error_feedback)

    def check_payload(self, payload: DeltaPayload, shape: tuple, dtype: str) -> str | None:
        """Rows are samples: the tensor, its leading dimension split per sample if need be."""
        ms, p = tuple(shape), payload
        ok = bool(ms) and p.rows > 0 and ms[0] % p.rows == 0 and p.dtype == dtype and \
            p.shape == (ms if ms[0] == p.rows else (p.rows, ms[0] // p.rows, *ms[1:]))
        return None if ok else f"delta payload of {p.dtype}{list(p.shape)} does not match the graph's {dtype}{list(ms)}"

    def new_state(self, cfg: Mapping[str, Any], device: Any = None):
        """One end's buffers of one edge: ``DeltaBuffer`` (NumPy) when ``device`` is None, else
        ``TorchDeltaBuffer`` on ``device`` (same payloads, same checkpoint arrays)."""
        dc = self.config(cfg)
        if device is None:
            return DeltaBuffer(dc)
        from fusion.kernels.delta_torch import TorchDeltaBuffer

        return TorchDeltaBuffer(dc, device)

    def buffer(self, cfg: Mapping[str, Any], backend: str = "torch", device=None):
        """New per-edge buffers: ``"torch"`` (``TorchDeltaBuffer`` on ``device``) or ``"numpy"`` (``DeltaBuffer``)."""
        if backend == "numpy":
            return self.new_state(cfg)
        if backend == "torch":
            from fusion.kernels.delta_torch import TorchDeltaBuffer

            return TorchDeltaBuffer(self.config(cfg), device)
        raise FusionError(f"delta: backend must be 'torch' or 'numpy', got {backend!r}")

    def encode(self, tensor, cfg: Mapping[str, Any]):
        raise FusionError("delta is stateful: make per-edge buffers with DeltaCodec.buffer(cfg) "
                          "and call their encode(x, sample_ids)")

    def decode(self, payload, like=None):
        raise FusionError("delta is stateful: decode with the edge's buffers (DeltaCodec.buffer(cfg).decode)")

    def wire_nbytes(self, numel: int, dtype: str, cfg: Mapping[str, Any]) -> int:
        """Steady-state bytes (every row a delta) of a ``numel``-element message, ids of one row and
        two headers included. First visits cost more: see ``delta.delta_wire_nbytes``; each extra row
        of a micro-batch adds 9 bytes (id and flag)."""
        dc = self.config(cfg)
        check_dtype(self.name, dtype)
        return delta_wire_nbytes(1, numel, dtype, dc) + 2 * _quant.HEADER_NBYTES

    # -- the runtime's: ctx.state() is this end's buffers of the edge ---------------------------------
    def encode_host(self, x: Any, dtype: str, cfg: Mapping[str, Any], ctx: CodecContext) -> DeltaPayload | None:
        """The delta payload of activation ``x`` (a NumPy array, or a tensor on the buffers' device), or None
        when ``x`` has no sample rows (sent dense). FusionError when the micro-batch carries no ids."""
        if ctx.sample_ids is None:
            raise FusionError(f"{ctx.part}: edge {ctx.key[0]}[{ctx.key[1]}] -> {ctx.peer} is compressed with delta "
                              "(AQ-SGD), which needs each micro-batch's sample ids; the batches carry none (the "
                              "built-in text corpus gives them; a --data function returns them under '#sample_ids')")
        ids = np.asarray(ctx.sample_ids).reshape(-1)
        rows = rows_view(x, ids.size)
        if rows is None:
            return None
        seed = ctx.rounding_seed(per_sample=True) if self.config(cfg).rounding == "stochastic" else None
        return ctx.state().encode(rows, ids, dtype=dtype, seed=seed)

    encode_device = encode_host  # the buffers (TorchDeltaBuffer on the device) do the device work

    def decode_host(self, payload: DeltaPayload, ctx: CodecContext | None = None):
        """The rows ``payload`` carries, rebuilt from (and updating) this end's buffers ``ctx.state()``, on
        the buffers' device (a stateful codec decodes where its state lives)."""
        return ctx.state().decode(payload)


BUILTINS = (DeltaCodec(),)

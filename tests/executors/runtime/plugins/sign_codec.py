"""A new codec in one file: 1-bit signs and one scale per message (signSGD-style, Bernstein et al. 2018),
registered here and nothing else edited (issue 24's "Must show", ``test_codec_plugin.py``).

A message of ``n`` floats travels as ``ceil(n / 8)`` bytes of sign bits and the largest magnitude ``s``;
it decodes to ``-s`` where the bit is set, ``+s`` elsewhere. The scale is a maximum, exact in any order, so
the host path (NumPy) and the device path (torch, on the tensor's device) give the same bytes. It logs, once
per role and path, where it ran: the test reads the executors' logs to see every path taken.
"""
from __future__ import annotations

import logging
from typing import Any, Mapping

import numpy as np

from fusion.ir.errors import FusionError, WireError
from fusion.kernels.codecs import ALL_ROLES, Codec, CodecContext, CodecPayload, register_codec

log = logging.getLogger("fusion.plugins.sign_codec")

_FLOATS = {"float16": np.float16, "float32": np.float32, "float64": np.float64}
_MSB_FIRST = (128, 64, 32, 16, 8, 4, 2, 1)  # np.packbits' bit order


class SignCodec(Codec):
    """cfg: ``{"algo": "sign1"}`` (no other keys). Every role; no error feedback, no state."""

    name = "sign1"
    roles = ALL_ROLES
    rate = 200e6
    has_device = True
    payload_types = (CodecPayload,)

    def __init__(self) -> None:
        self._logged: set = set()

    def _ran(self, ctx: CodecContext | None, path: str) -> None:
        role = ctx.role.value if ctx is not None else "none"
        if (role, path) not in self._logged:
            self._logged.add((role, path))
            log.info("sign1 codec: %s on the %s path", role, path)

    def check_cfg(self, cfg: Mapping[str, Any]) -> None:
        if set(cfg) - {"algo"}:
            raise FusionError(f"sign1 cfg: unknown key(s) {sorted(set(cfg) - {'algo'})}")

    def owns(self, payload: Any) -> bool:
        return isinstance(payload, CodecPayload) and payload.algo == self.name

    def wire_nbytes(self, numel: int, dtype: str, cfg: Mapping[str, Any]) -> int:
        return -(-numel // 8) + 8

    def encode_host(self, arr: np.ndarray, dtype: str, cfg: Mapping[str, Any], ctx: CodecContext) -> CodecPayload:
        self._ran(ctx, "host")
        a = (arr.astype(np.uint32) << 16).view(np.float32) if dtype == "bfloat16" else arr
        scale = float(np.abs(a).max()) if a.size else 0.0
        bits = np.packbits(a.reshape(-1) < 0)
        return CodecPayload(self.name, {"shape": list(arr.shape), "dtype": dtype, "scale": scale,
                                        "bits": bits.tobytes()})

    def encode_device(self, t: Any, dtype: str, cfg: Mapping[str, Any], ctx: CodecContext) -> CodecPayload:
        import torch

        self._ran(ctx, "device")
        flat = t.reshape(-1)
        scale = float(flat.abs().max()) if flat.numel() else 0.0
        neg = torch.nn.functional.pad((flat < 0).to(torch.int32), (0, -flat.numel() % 8)).reshape(-1, 8)
        weights = torch.tensor(_MSB_FIRST, dtype=torch.int32, device=t.device)
        bits = (neg * weights).sum(1).to(torch.uint8).cpu().numpy()
        return CodecPayload(self.name, {"shape": list(t.shape), "dtype": dtype, "scale": scale,
                                        "bits": bits.tobytes()})

    def decode_host(self, payload: CodecPayload, ctx: CodecContext | None = None) -> np.ndarray:
        f = payload.fields
        shape, dtype, scale, bits = f.get("shape"), f.get("dtype"), f.get("scale"), f.get("bits")
        if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
            raise WireError(f"sign1 payload: bad shape {shape!r}")
        n = int(np.prod(shape, dtype=np.int64))
        if not isinstance(bits, bytes) or len(bits) != -(-n // 8):
            raise WireError(f"sign1 payload: {len(bits) if isinstance(bits, bytes) else bits!r} bit bytes for {n} values")
        if dtype not in (*_FLOATS, "bfloat16") or not isinstance(scale, float) or not np.isfinite(scale):
            raise WireError(f"sign1 payload: bad dtype {dtype!r} or scale {scale!r}")
        neg = np.unpackbits(np.frombuffer(bits, np.uint8), count=n).astype(bool)
        if dtype == "bfloat16":  # the scale is a bfloat16 value: its float32 holds it exactly, truncation is exact
            out = np.where(neg, -scale, scale).astype(np.float32)
            return (out.view(np.uint32) >> 16).astype(np.uint16).reshape(shape)
        return np.where(neg, -scale, scale).astype(_FLOATS[dtype]).reshape(shape)


register_codec(SignCodec())

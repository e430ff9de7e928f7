"""The torch path of ``quant`` / ``hadamard-quant`` (CPU and CUDA tensors).

Runs :func:`fusion.kernels.quant.encode_core` / ``decode_core`` with
:class:`TorchOps`, the torch twin of :class:`~fusion.kernels.quant.NumpyOps`:
the same float64 IEEE operations in the same order, so the payload bytes
equal the NumPy path's (tested). On a CUDA tensor everything runs on the
device; what crosses to the host is the compressed frames (float16 scales and
offsets, packed uint8 codes, through the device's reusable pinned staging
buffer, ``kernels.staging``) plus two scalars (the all-finite check and the
largest magnitude, which picks ``scale_exp``). There is no CuPy kernel: on a
CUDA tensor the torch ops *are* the device path.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch

from fusion.ir.errors import FusionError

from fusion.kernels.dtypes import VALUE_DTYPES, dtype_name
from fusion.kernels.quant import QuantConfig, QuantPayload, decode_core, encode_core
from fusion.kernels.staging import HostStaging, staging_for


class TorchOps:
    """Torch versions of :class:`fusion.kernels.quant.NumpyOps` (same semantics, same rounding)."""

    @staticmethod
    def isfinite_all(x) -> bool:
        return bool(torch.isfinite(x).all())

    @staticmethod
    def maxabs(x) -> float:
        return float(x.abs().max()) if x.numel() else 0.0

    @staticmethod
    def pad_edge(x, total: int):
        return torch.cat([x, x[-1:].expand(total - x.numel())]) if total > x.numel() else x

    @staticmethod
    def pad_zero(x, total: int):
        return torch.cat([x, x.new_zeros(total - x.numel())]) if total > x.numel() else x

    @staticmethod
    def stack2(a, b):
        return torch.stack((a, b), dim=2)

    @staticmethod
    def stack_cols(cols):
        return torch.stack(cols, dim=1)

    @staticmethod
    def row_min(x2):
        return x2.amin(dim=1)

    @staticmethod
    def row_max(x2):
        return x2.amax(dim=1)

    @staticmethod
    def floor(x):
        return torch.floor(x)

    @staticmethod
    def clip(x, lo: float, hi: float):
        return torch.clamp(x, lo, hi)

    @staticmethod
    def where(c, a, b):
        return torch.where(c, a, b)

    @staticmethod
    def f64_to_f16(x):
        return x.to(torch.float32).to(torch.float16)

    @staticmethod
    def f16_to_f64(h):
        return h.to(torch.float64)

    @staticmethod
    def f16_bits(h):
        return h.view(torch.int16).to(torch.int32) & 0xFFFF

    @staticmethod
    def f16_from_bits(u):
        return torch.where(u >= 0x8000, u - 0x10000, u).to(torch.int16).view(torch.float16)

    @staticmethod
    def arange_i64(start: int, n: int):  # device set by the caller through _Device
        raise NotImplementedError

    @staticmethod
    def i64_to_f64(x):
        return x.to(torch.float64)

    @staticmethod
    def f64_to_u8(x):
        return x.to(torch.uint8)

    @staticmethod
    def u8_to_f64(x):
        return x.to(torch.float64)

    @staticmethod
    def zeros_u8(n: int):
        raise NotImplementedError

    @staticmethod
    def cat(xs):
        return torch.cat(xs)

    @staticmethod
    def to_host(x) -> np.ndarray:
        return x.detach().cpu().numpy()

    @staticmethod
    def widen(t: torch.Tensor):
        return t.detach().reshape(-1).to(torch.float64)

    @staticmethod
    def narrow(y, dtype: str):
        """float64 -> ``dtype`` via float32 (round to nearest even), as ``NumpyOps.narrow``."""
        if dtype == "float64":
            return y
        f = y.to(torch.float32)
        if dtype == "float32":
            return f
        return f.to(torch.float16 if dtype == "float16" else torch.bfloat16)


def _ops(device: torch.device) -> type:
    """TorchOps whose constructors make tensors on ``device``."""

    class DeviceOps(TorchOps):
        @staticmethod
        def arange_i64(start: int, n: int):
            return torch.arange(start, start + n, dtype=torch.int64, device=device)

        @staticmethod
        def zeros_u8(n: int):
            return torch.zeros(n, dtype=torch.uint8, device=device)

    return DeviceOps


def quantize(t: torch.Tensor, cfg: QuantConfig | Mapping[str, Any], hadamard: bool | None = None,
             staging: HostStaging | None = None) -> QuantPayload:
    """Quantise a torch tensor (any device) into a :class:`QuantPayload` (same bytes as the NumPy path).

    ``cfg``: a :class:`QuantConfig`, or a cfg dict (``hadamard`` then picks the variant).
    ``staging``: the host buffer the frames are copied through; default: none for a CPU tensor
    (plain ``.numpy()``), the device's reusable (pinned) buffer for any other device, with one
    synchronisation of the current CUDA stream before the host reads the bytes.
    """
    if not isinstance(cfg, QuantConfig):
        cfg = QuantConfig.from_cfg(cfg, bool(hadamard))
    if isinstance(t, np.ndarray):
        t = torch.from_numpy(np.ascontiguousarray(t))
    if not isinstance(t, torch.Tensor):
        raise FusionError(f"{cfg.algo}: expected a tensor, got {type(t).__name__}")
    name = dtype_name(t.dtype)
    if name not in VALUE_DTYPES:
        raise FusionError(f"{cfg.algo}: dtype {name} is not supported; floating dtypes only: {sorted(VALUE_DTYPES)}")
    ops = _ops(t.device)
    flat = ops.widen(t)
    exp, s16, o16, packed = encode_core(ops, flat, flat.numel(), cfg)
    if staging is None and t.device.type != "cpu":
        staging = staging_for(t.device)
    if staging is None:
        frames = [ops.to_host(s16), ops.to_host(o16), ops.to_host(packed)]
    else:
        stream = torch.cuda.current_stream(t.device) if t.device.type == "cuda" else None
        flat_frames = staging.to_host([s16.reshape(-1), o16.reshape(-1), packed.reshape(-1)], stream)
        frames = [a.reshape(tuple(f.shape)) for a, f in zip(flat_frames, (s16, o16, packed))]
    return QuantPayload(tuple(t.shape), name, cfg.bits, cfg.block, cfg.rounding, cfg.hadamard, exp, *frames)


def _to_device(a: np.ndarray, dtype: torch.dtype | None, device) -> torch.Tensor:
    if not a.flags.writeable or not a.flags.c_contiguous:
        a = np.array(a, copy=True)  # torch refuses read-only buffers (wire frames are)
    t = torch.from_numpy(a)
    return t.to(device) if device is not None else t


def dequantize_f64(p: QuantPayload, device=None) -> torch.Tensor:
    """Flat float64 reconstruction on ``device`` (default CPU), before the cast; validates first."""
    p.validate()
    dev = torch.device(device) if device is not None else torch.device("cpu")
    return decode_core(_ops(dev), _to_device(p.scales, None, dev), _to_device(p.offsets, None, dev),
                       _to_device(p.codes, None, dev), p)


def dequantize(p: QuantPayload, device=None) -> torch.Tensor:
    """The dense tensor of a payload in ``p.dtype`` on ``device`` (default CPU); validates first."""
    return TorchOps.narrow(dequantize_f64(p, device), p.dtype).reshape(p.shape)


__all__ = ["TorchOps", "quantize", "dequantize", "dequantize_f64"]

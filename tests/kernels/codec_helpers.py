"""Shared helpers of the quant / hadamard-quant / delta tests."""
from __future__ import annotations

import numpy as np
import torch

from fusion.ir.opdata import OpData
from fusion.ir.wire import decode_opdata, encode_opdata

TORCH_DTYPES = {"float32": torch.float32, "float64": torch.float64,
                "float16": torch.float16, "bfloat16": torch.bfloat16}


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """Host array of a tensor, bfloat16 as uint16 bits (the NumPy path's convention)."""
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def widen(a: np.ndarray, dtype: str) -> np.ndarray:
    """float64 copy of a host array (bfloat16 bits widened)."""
    if dtype == "bfloat16":
        return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a.astype(np.float64)


def payload_bytes(p) -> tuple:
    """Everything a payload puts on the wire: header and frame bytes."""
    head, frames = p.to_msg()
    return head, frames


def ulp(y64: np.ndarray, dtype: str) -> np.ndarray:
    """One ulp of ``dtype`` at each value (the spacing above |y|)."""
    if dtype == "bfloat16":
        f = np.abs(y64).astype(np.float32)
        bits = f.view(np.uint32) & 0xFFFF0000
        lo = bits.view(np.float32).astype(np.float64)
        hi = (bits + 0x10000).view(np.float32).astype(np.float64)
        return np.maximum(hi - lo, 2.0 ** -133)
    dt = {"float64": np.float64, "float32": np.float32, "float16": np.float16}[dtype]
    a = np.abs(y64).astype(dt)
    with np.errstate(over="ignore"):
        s = np.spacing(a)  # inf at the largest finite value: use the spacing below it there
    return np.where(np.isfinite(s), s, np.spacing(np.nextafter(a, dt(0)))).astype(np.float64)


def opdata_round_trip(payload, cfg: dict):
    """Send ``payload`` as OP-Data through ``fusion.ir.wire`` (frames as bytes) and decode it."""
    od = OpData(name="h", index=None, op_users=("u",), actual_user=("u",), is_grad=False, local_iter=3,
                micro_batch=1, src="p0", dst="p1", payload=payload, compress_cfg=cfg)
    frames = [f if isinstance(f, bytes) else np.ascontiguousarray(f).tobytes() for f in encode_opdata(od)]
    back = decode_opdata(frames)
    assert back.compress_cfg == cfg
    return back.payload


def make_tensor(kind: str, n: int, dtype: str, seed: int = 0) -> torch.Tensor:
    """Test tensors: normal, heavy-tailed, special values (zeros, constant blocks, huge, denormal)."""
    g = torch.Generator().manual_seed(seed)
    tdt = TORCH_DTYPES[dtype]
    if kind == "normal":
        x = torch.randn(n, generator=g, dtype=torch.float64)
    elif kind == "heavy":  # magnitudes over many decades
        x = torch.randn(n, generator=g, dtype=torch.float64) * torch.exp(3 * torch.randn(n, generator=g,
                                                                                        dtype=torch.float64))
    elif kind == "zeros":
        x = torch.zeros(n, dtype=torch.float64)
        x[::3] = -0.0
    elif kind == "constant":  # constant blocks of several values, incl. ones not representable in float16
        x = torch.full((n,), 1.2345678, dtype=torch.float64)
        x[n // 2:] = -3.0e-3
    elif kind == "huge":  # near the dtype's largest finite values
        big = {"float16": 65504.0, "bfloat16": 3.38e38, "float32": 3.4e38, "float64": 1.79e308}[dtype]
        x = torch.randn(n, generator=g, dtype=torch.float64).clamp(-1, 1) * big
    elif kind == "denormal":
        tiny = {"float16": 6.0e-8, "bfloat16": 1.0e-39, "float32": 1.0e-40, "float64": 1.0e-310}[dtype]
        x = torch.randint(-30, 30, (n,), generator=g).to(torch.float64) * tiny
    else:
        raise ValueError(kind)
    return x.to(tdt)

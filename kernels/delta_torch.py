"""The torch twin of :class:`fusion.kernels.delta.DeltaBuffer` (AQ-SGD buffers as tensors).

Buffers live on the device of the activations (the first message's tensor,
or ``device`` given at construction); deltas are formed, quantised and
added there with :mod:`fusion.kernels.quant_torch`, so only compressed frames
and the ids cross to the host. Payloads are byte-identical to the NumPy
``DeltaBuffer``'s, and :meth:`state_dict` gives the same NumPy arrays, so the
two are interchangeable (a torch sender and a NumPy receiver stay in step).
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np
import torch

from fusion.ir.errors import FusionError

from fusion.kernels import quant_torch as QT
from fusion.kernels.delta import DeltaBufferBase, DeltaConfig
from fusion.kernels.dtypes import VALUE_DTYPES, dtype_name, torch_dtype, values_from_numpy, values_to_numpy
from fusion.kernels.quant import MAX_FINITE, QuantConfig, QuantPayload


class TorchDeltaBuffer(DeltaBufferBase):
    """AQ-SGD buffers of one edge as torch tensors; same API and bytes as ``DeltaBuffer``.

    ``encode`` takes a torch tensor (any device; NumPy arrays are wrapped);
    ``decode`` returns a tensor on ``device`` (default: where the buffers are, else CPU).
    """

    def __init__(self, cfg: DeltaConfig | Mapping[str, Any] = DeltaConfig(), device=None):
        super().__init__(cfg)
        self.device = torch.device(device) if device is not None else None

    def _dev(self):
        return self.device if self.device is not None else torch.device("cpu")

    def _prepare(self, x, dtype):
        if isinstance(x, np.ndarray):
            x = values_from_numpy(np.ascontiguousarray(x), dtype or x.dtype.name)
        if not isinstance(x, torch.Tensor):
            raise FusionError(f"delta: expected a tensor, got {type(x).__name__}")
        name = dtype_name(x.dtype)
        if name not in VALUE_DTYPES or (dtype is not None and dtype != name):
            raise FusionError(f"delta: cannot compress a {name} tensor as {dtype or name!r}")
        if self.device is None:
            self.device = x.device
        return x.detach().to(self._dev()), name

    def _widen_rows(self, rows, n):
        if not rows:
            return torch.zeros((0, math.prod(self.row_shape)), dtype=torch.float64, device=self._dev())
        return torch.stack(rows).reshape(n, math.prod(self.row_shape)).to(torch.float64)

    def _widen_x(self, x, sel):
        return self._select(x, sel, math.prod(x.shape[1:])).to(torch.float64)

    def _select(self, x, sel, row_numel):
        return x.reshape(x.shape[0], row_numel)[torch.from_numpy(sel).to(x.device)]

    def _quantize(self, x, cfg: QuantConfig, dtype: str) -> QuantPayload:
        return QT.quantize(x, cfg)

    def _dequantize_f64(self, p):
        return QT.dequantize_f64(p, self._dev())

    def _cast(self, y64, dtype):
        lim = MAX_FINITE[dtype]
        return QT.TorchOps.narrow(torch.clamp(y64, -lim, lim), dtype)

    def _dense_rows(self, x, sel):
        return values_to_numpy(self._select(x, sel, math.prod(x.shape[1:])), dtype_name(x.dtype))

    def _from_dense(self, a):
        return values_from_numpy(np.ascontiguousarray(a), self.dtype, self._dev())

    def _assemble(self, n_rows, row_numel, parts):
        out = torch.empty((n_rows, row_numel), dtype=torch_dtype(self.dtype), device=self._dev())
        for sel, vals in parts:
            if sel.size:
                out[torch.from_numpy(sel).to(out.device)] = vals
        return out

    def _to_numpy(self, row):
        return values_to_numpy(row.reshape(-1), self.dtype).reshape(tuple(row.shape)).copy()

    def _from_numpy(self, a):
        name = "bfloat16" if a.dtype == np.uint16 else a.dtype.name
        return values_from_numpy(a, name, self._dev())


__all__ = ["TorchDeltaBuffer"]

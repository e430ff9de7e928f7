"""Error feedback for Top-K: remember what was not sent and add it to the next message.

For one stream (one edge and micro-batch slot, say) the sender keeps a
residual ``e``. Each step it compresses ``x + e`` and keeps
``e' = (x + e) - sent``, so over a stream ``sum(sent) + e_final == sum(x)``:
nothing is lost, only delayed. Residuals are accumulated in float32 (float64
for float64 tensors) whatever the tensor dtype.

Off by default: with ``enabled=False`` :meth:`ErrorFeedback.compress` is plain
Top-K and stores nothing. The runtime opts in per edge by building an
``ErrorFeedback(enabled=True)`` for the edges whose plan asks for it.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

from fusion.ir.errors import FusionError

from fusion.kernels import codec
from fusion.kernels.dtypes import dtype_name
from fusion.kernels.sparse import SparsePayload

log = logging.getLogger(__name__)


@dataclass
class ErrorFeedback:
    """Residuals of Top-K compression, one per stream key.

    enabled:    False (default): no residuals, :meth:`compress` is plain Top-K.
    residuals:  stream key (any hashable, e.g. ``(edge, micro_batch_slot)``) ->
                what has not been sent yet, in the accumulation dtype, on the
                tensor's device, shaped like the tensor.
    """

    enabled: bool = False
    residuals: dict[Hashable, torch.Tensor] = field(default_factory=dict, repr=False)

    def compress(self, key: Hashable, tensor: torch.Tensor, k: int,
                 value_dtype: str | None = None) -> SparsePayload:
        """Top-k compress ``tensor`` plus the stream's residual; keep the new residual.

        The payload describes a tensor of ``tensor``'s dtype and shape. A residual
        of a different shape or device (a short last batch, a moved stream) is
        dropped with a warning rather than added.
        """
        if not isinstance(tensor, torch.Tensor):
            raise FusionError(f"error feedback: expected a torch.Tensor, got {type(tensor).__name__}")
        if not self.enabled:
            return codec.compress(tensor, k, value_dtype)
        acc_dt = torch.float64 if tensor.dtype == torch.float64 else torch.float32
        x = tensor.detach().to(acc_dt)
        r = self.residuals.get(key)
        if r is not None and (r.shape != x.shape or r.device != x.device):
            log.warning("error feedback %r: residual %s on %s does not fit tensor %s on %s; dropped",
                        key, tuple(r.shape), r.device, tuple(x.shape), x.device)
            r = None
        if r is not None:
            x = x + r
        vdt = value_dtype or dtype_name(tensor.dtype)
        payload = codec.compress(x, k, vdt)
        payload = dataclasses.replace(payload, dtype=dtype_name(tensor.dtype))
        sent = codec.decompress(payload, like=x).to(acc_dt)
        self.residuals[key] = x - sent
        return payload

    def residual(self, key: Hashable) -> torch.Tensor | None:
        """What stream ``key`` still owes the receiver (None before its first message)."""
        return self.residuals.get(key)

    def reset(self, key: Hashable | None = None) -> None:
        """Forget one stream's residual, or all of them when ``key`` is None."""
        if key is None:
            self.residuals.clear()
        else:
            self.residuals.pop(key, None)

    @property
    def nbytes(self) -> int:
        """Memory held by residuals, in bytes."""
        return sum(r.numel() * r.element_size() for r in self.residuals.values())

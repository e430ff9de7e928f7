"""Compression on the engine's device: encode where the tensor lives, decode into a device tensor.

A torch-engine part whose plan compresses some of its edges hands the runtime
the *tensors* of those edges (``TorchPart.compress_on_device``), not NumPy
copies, and :class:`DeviceCompression` encodes them with the torch codec path
on the tensor's own device, or the CuPy kernel when the tensor is on CUDA and
CuPy is usable (``kernels.codec.compress``):

* ``topk``: selection, gather and casts on the device; the k values and k
  indices are copied to the host through the device's reusable staging buffer
  (``kernels.staging``: pinned on CUDA, one stream synchronisation per message);
* ``quant`` / ``hadamard-quant``: ``kernels.quant_torch`` on the device; the
  packed codes, scales and offsets cross through the same staging buffer;
* ``delta`` (AQ-SGD): the edge's buffers are ``TorchDeltaBuffer`` on the part's
  device at both ends of the edge (:class:`DeviceDeltaEdges`); deltas are formed,
  quantised and added there;
* error feedback: ``kernels.error_feedback`` keeps its residuals on the device.

Only the payload crosses to the host: on a CUDA part the dense activation or
gradient of a compressed edge is never copied off the device.

On a CPU part the tensor already is on the host, so each codec runs where it
is fastest there (``benchmarks/bench_gpu.py``, per-message encode): Top-K through
``topk_torch.compress`` (the host selection reads the tensor in place), the
quantised codecs and delta in NumPy on a zero-copy view of the tensor (the
torch twins are 2-3x slower on a CPU for the same bytes). ``torch_on_cpu=True``
(engine option ``encode="torch"``) runs the torch codecs on CPU tensors too: the
CUDA code path, exercised where there is no GPU (tests, benchmarks).

Payload bytes equal the host NumPy path's (``executors.runtime.compression``)
for every codec: the torch codecs are the NumPy ones' twins (same IEEE
operations in the same order), and the decisions (rule, dtype, k, stochastic
rounding seeds, delta seeds) are the host table's own. Tested on CPU tensors in
``tests/executors/engines/test_device_codec.py``; on CUDA when a GPU is present.

Decoding: a received Top-K or quantised payload becomes a tensor on the part's
device (scatter / dequantise there; the payload's bytes go host -> device), and
gradients summed over consumer parts are summed as device tensors (the same
IEEE additions, in the same order, as the host's NumPy sum).

NumPy-engine parts never get here: their table stays the host one.
"""
from __future__ import annotations

import logging
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fusion.executors.runtime.compression import COMPRESSIBLE, CompressionTable, Key, dense_payload
from fusion.executors.runtime.delta_edges import DeltaEdges
from fusion.kernels import topk_cupy, topk_torch
from fusion.kernels import quant_torch
from fusion.kernels.codec import compress as topk_compress
from fusion.kernels.delta import DeltaConfig, DeltaPayload
from fusion.kernels.dtypes import dtype_name
from fusion.kernels.quant import QuantConfig, QuantPayload
from fusion.kernels.sparse import SparsePayload, ratio_to_k

log = logging.getLogger(__name__)

#: the codecs with a device implementation; any other (a user-registered codec) is encoded and decoded by the
#: host table from a NumPy copy, as on a NumPy part
DEVICE_ALGOS = frozenset({"topk", "quant", "hadamard-quant", "delta"})


@dataclass
class DeviceDeltaEdges(DeltaEdges):
    """:class:`DeltaEdges` whose buffers are ``TorchDeltaBuffer`` on ``device`` (same payloads, same
    checkpoint arrays as the NumPy buffers, so a NumPy peer and a resumed run stay in step)."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def buffer(self, role: str, key: Key, peer: str, cfg: dict):
        eid = (role, key, peer)
        b = self.buffers.get(eid)
        if b is None:
            from fusion.kernels.delta_torch import TorchDeltaBuffer

            b = self.buffers[eid] = TorchDeltaBuffer(DeltaConfig.from_cfg(cfg), self.device)
        return b


def to_array(t: torch.Tensor) -> np.ndarray:
    """A host NumPy array of a tensor sent dense (bfloat16 as uint16 bits), as the engine's ``to_array``."""
    from fusion.executors.engines.torch.engine import to_array as engine_to_array

    return engine_to_array(t)


class DeviceCompression:
    """A part's :class:`CompressionTable` whose codecs run on the engine's device.

    host:   the part's host table (rules, the stochastic-rounding counter, error-feedback
            residuals and delta buffers live there; its ``delta`` is replaced by
            :class:`DeviceDeltaEdges`). Everything not defined here is the host table's.
    device: the part's torch device.
    dtypes: tensor key -> the graph's dtype, for gradients that arrive dense (bfloat16 travels
            as uint16 bits and is viewed back by it).
    torch_on_cpu: run the torch codecs on a CPU device too (default: only Top-K there; the
            quantised codecs and delta run in NumPy on a CPU, faster, same bytes).

    ``encode`` takes a torch tensor (NumPy arrays go to the host path unchanged) and
    returns the payload to send; a tensor sent dense comes back as a NumPy array, since
    only arrays and payloads travel. ``decode`` / ``decode_grad`` return tensors on
    ``device`` for compressed payloads.
    """

    def __init__(self, host: CompressionTable, device: torch.device | str,
                 dtypes: dict[Key, str | None] | None = None, torch_on_cpu: bool = False):
        self.host = host
        self.device = torch.device(device)
        self.dtypes = dict(dtypes or {})
        #: the torch (CuPy) codecs run for every algo; False on a CPU device: NumPy but for Top-K
        self.torch_codecs = self.device.type != "cpu" or bool(torch_on_cpu)
        if self.torch_codecs and not isinstance(host.delta, DeviceDeltaEdges):
            host.delta = DeviceDeltaEdges(host.part, dict(host.delta.buffers), device=self.device)

    def __getattr__(self, name: str) -> Any:  # rules, delta_cfgs, check_incoming, residual, ...
        return getattr(self.__dict__["host"], name)

    def __bool__(self) -> bool:
        return bool(self.host)

    # -- which tensors the engine keeps on the device --------------------------------------
    def sent_keys(self) -> frozenset:
        """Activations this part sends compressed to at least one part (the engine returns them as tensors)."""
        return frozenset(k for k, _ in self.host.fwd)

    def grad_keys(self) -> frozenset:
        """Received activations whose gradient this part sends back compressed."""
        return frozenset(k for k, _ in self.host.bwd)

    # -- sending ----------------------------------------------------------------------------
    def encode(self, payload: Any, key: Key, peer: str, is_grad: bool, mb: int, ids: Any = None,
               it: int | None = None) -> tuple[Any, dict | None]:
        """(payload to send, compress_cfg) for one outgoing message, as ``CompressionTable.encode``;
        a tensor is encoded on its own device, and sent as a NumPy array when not compressed."""
        if not isinstance(payload, torch.Tensor):
            return self.host.encode(payload, key, peer, is_grad, mb, ids=ids, it=it)
        t = payload.detach()
        rule = (self.host.bwd if is_grad else self.host.fwd).get((key, peer))
        dtype = dtype_name(t.dtype)
        if rule is None or dtype not in COMPRESSIBLE:
            if rule is not None:
                log.debug("%s: %s to %s sent dense (tensor %s)", self.host.part, key, peer, dtype)
            return to_array(t), None
        if rule.algo not in DEVICE_ALGOS or (not self.torch_codecs and rule.algo != "topk"):
            # a codec without a device path, or a CPU part's quant/delta: the host table, on a NumPy view/copy
            return self.host.encode(to_array(t), key, peer, is_grad, mb, ids=ids, it=it)
        if rule.algo == "delta":
            p = self.host.delta.encode(t, dtype, key, peer, rule.codec, ids, it, mb)
            return (to_array(t), None) if p is None else (p, rule.cfg())
        if rule.algo != "topk":
            cfg = QuantConfig.from_cfg(rule.codec, rule.algo == "hadamard-quant")
            if cfg.rounding == "stochastic":  # the host table's seed: its counter, the same tuple
                self.host._sent += 1
                cfg = cfg.with_seed(zlib.crc32(repr((self.host.part, key, peer, is_grad, mb,
                                                     self.host._sent)).encode()))
            return quant_torch.quantize(t, cfg), rule.cfg()
        k = ratio_to_k(t.numel(), rule.ratio)
        if rule.error_feedback:
            sp = self.host._feedback().compress((key, peer, "bwd" if is_grad else "fwd", mb), t, k)
        else:
            sp = topk_compress(t, k)
        return sp, rule.cfg(k)

    # -- receiving --------------------------------------------------------------------------
    def decode_payload(self, payload: Any) -> Any:
        """A Top-K or quantised payload as a tensor on the device (NumPy arrays on a CPU part without
        ``torch_on_cpu``, where the NumPy decode is the fast one); other payloads unchanged."""
        if not self.torch_codecs:
            return dense_payload(payload)
        if isinstance(payload, SparsePayload):
            if self.device.type == "cuda" and topk_cupy.available():
                return topk_cupy.decompress(payload, self.device)
            return topk_torch.decompress(payload, self.device)
        if isinstance(payload, QuantPayload):
            return quant_torch.dequantize(payload, self.device)
        return dense_payload(payload)

    def decode(self, od: Any, shape: tuple[int, ...] | None = None) -> Any:
        """What the engine gets for a received activation (a device tensor when it was compressed).
        Delta payloads are rebuilt by the host table's (device) delta buffers; anything else the device
        has no decoder for goes to the host table."""
        if self.torch_codecs and isinstance(od.payload, (SparsePayload, QuantPayload)):
            return self.decode_payload(od.payload)
        return self.host.decode(od, shape)

    def decode_grad(self, od: Any) -> torch.Tensor:
        """A received gradient as a tensor on the device (dense ones too, so the sum over consumer
        parts is one torch sum in the host path's order)."""
        g = self.decode(od)
        if isinstance(g, torch.Tensor):
            return g
        from fusion.executors.engines.torch.engine import from_wire

        return from_wire(np.asarray(g), self.dtypes.get(od.key), self.device)


__all__ = ["DeviceCompression", "DeviceDeltaEdges", "to_array"]

"""Host staging for device -> host copies of compressed payloads.

A payload leaves the device as two small arrays (k values, k indices). Each
device keeps one host buffer, pinned (page-locked) when the device is CUDA, that
is reused across messages and only grows (geometrically) when a payload is
larger than any before. ``to_host`` enqueues every copy into it
(``non_blocking``), synchronises the producing stream once, and copies the
bytes out into fresh NumPy arrays the payload owns (the buffer is reused by the
next message, so it is never handed out).

CPU tensors (the tests) take the same code path with a pageable buffer: pinning
needs a CUDA driver, and a CPU copy is synchronous anyway.
"""
from __future__ import annotations

import threading

import numpy as np
import torch

#: Byte alignment of each array inside the staging buffer.
ALIGN = 64

_NUMPY = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16,
          torch.bfloat16: np.uint16, torch.int16: np.int16, torch.int32: np.int32,
          torch.int64: np.int64, torch.uint8: np.uint8}


class HostStaging:
    """A reusable (pinned for CUDA) host buffer; :meth:`to_host` copies device tensors through it."""

    def __init__(self, pin: bool):
        self.pin = pin
        self.buffer: torch.Tensor | None = None
        self.allocations = 0  # how many times the buffer was (re)allocated
        self._lock = threading.Lock()  # one message at a time per device

    def _reserve(self, nbytes: int) -> torch.Tensor:
        have = 0 if self.buffer is None else self.buffer.numel()
        if self.buffer is None or nbytes > have:
            self.buffer = torch.empty(max(nbytes, 2 * have, 4096), dtype=torch.uint8, pin_memory=self.pin)
            self.allocations += 1
        return self.buffer

    def to_host(self, tensors: list[torch.Tensor], stream=None) -> list[np.ndarray]:
        """Host NumPy copies (owning their memory) of 1-D ``tensors``; bfloat16 comes back as uint16 bits.

        ``stream``: the CUDA stream that produced the tensors (synchronised once
        after the copies are enqueued); None for CPU tensors.
        """
        spans, total = [], 0
        for t in tensors:
            nb = t.numel() * t.element_size()
            spans.append((total, nb))
            total += -(-nb // ALIGN) * ALIGN
        with self._lock:
            buf = self._reserve(total)
            for t, (off, nb) in zip(tensors, spans):
                if nb:
                    buf[off:off + nb].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8),
                                            non_blocking=self.pin)
            if stream is not None:
                stream.synchronize()
            host = buf.numpy()
            return [host[off:off + nb].view(_NUMPY[t.dtype]).copy() for t, (off, nb) in zip(tensors, spans)]


_STAGING: dict[str, HostStaging] = {}
_STAGING_LOCK = threading.Lock()


def staging_for(device) -> HostStaging:
    """The staging buffer of ``device`` (created on first use; pinned for CUDA devices)."""
    device = torch.device(device)
    key = str(device)
    with _STAGING_LOCK:
        if key not in _STAGING:
            _STAGING[key] = HostStaging(pin=device.type == "cuda")
        return _STAGING[key]

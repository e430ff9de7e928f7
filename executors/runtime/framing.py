"""One byte string for the frames of one wire message: how a message travels where it must be one piece.

:func:`fusion.ir.wire.encode` gives a message as frames (the msgpack header, then one frame per tensor). Sealed for
a relay (:mod:`fusion.executors.runtime.relay`) the frames must be one plaintext; the bytes of each frame are
unchanged (``tests/kernels/test_codec_golden.py``), only how they are put together differs::

    b"FZF1" | u32 frame count | u64 length of each frame | the frames' bytes, back to back     (little-endian)

:func:`unpack` checks the count and every length against the buffer before slicing, returns zero-copy views,
and raises :class:`~fusion.ir.errors.WireError` (one line) for anything malformed.
"""
from __future__ import annotations

import struct
from typing import Any, Sequence

import numpy as np

from fusion.ir.errors import WireError

MAGIC = b"FZF1"
_COUNT = struct.Struct("<I")
_LEN = 8


def _view(f: Any) -> memoryview:
    if isinstance(f, np.ndarray):
        return memoryview(np.require(f, requirements="C").reshape(-1).view(np.uint8))
    buf = getattr(f, "buffer", None)  # zmq.Frame
    return memoryview(buf if buf is not None else f).cast("B")


def packed_nbytes(frames: Sequence[Any]) -> int:
    """Bytes :func:`pack` makes of ``frames``."""
    return len(MAGIC) + _COUNT.size + _LEN * len(frames) + sum(_view(f).nbytes for f in frames)


def pack(frames: Sequence[Any], prefix: bytes = b"") -> bytearray:
    """``prefix`` then the frames as one buffer (one copy of each frame)."""
    views = [_view(f) for f in frames]
    out = bytearray(len(prefix) + len(MAGIC) + _COUNT.size + _LEN * len(views) + sum(v.nbytes for v in views))
    out[:len(prefix)] = prefix
    pos = len(prefix)
    out[pos:pos + 4] = MAGIC
    pos += 4
    _COUNT.pack_into(out, pos, len(views))
    pos += _COUNT.size
    for v in views:
        struct.pack_into("<Q", out, pos, v.nbytes)
        pos += _LEN
    for v in views:
        out[pos:pos + v.nbytes] = v
        pos += v.nbytes
    return out


def unpack(buf: Any, max_frames: int) -> list[memoryview]:
    """The frames of a :func:`pack` buffer as views into it; WireError when it is not one."""
    mv = memoryview(buf).cast("B")
    head = len(MAGIC) + _COUNT.size
    if mv.nbytes < head or bytes(mv[:4]) != MAGIC:
        raise WireError("not a framed message (no FZF1 magic)")
    (n,) = _COUNT.unpack_from(mv, 4)
    if n < 1 or n > max_frames:
        raise WireError(f"framed message of {n} frames (1 to {max_frames} allowed)")
    if mv.nbytes < head + _LEN * n:
        raise WireError(f"framed message of {mv.nbytes} bytes is too short for its {n} frame lengths")
    lengths = struct.unpack_from(f"<{n}Q", mv, head)
    pos = head + _LEN * n
    if sum(lengths) != mv.nbytes - pos:
        raise WireError(f"framed message: frame lengths add up to {sum(lengths)} bytes, {mv.nbytes - pos} follow")
    out = []
    for ln in lengths:
        out.append(mv[pos:pos + ln])
        pos += ln
    return out

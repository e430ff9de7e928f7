"""A user codec's payload on the wire: a *plain payload* (a dict of plain values and byte strings),
carried as :class:`CodecPayload` (msgpack fields and raw byte frames; never pickle)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from fusion.ir.errors import FusionError, WireError
from fusion.ir.wire import PayloadCodec, register_payload_codec

# -- user codecs' payloads on the wire ---------------------------------------------------------

#: limits of a plain payload (a hostile message cannot make a receiver build huge headers)
MAX_PLAIN_KEYS = 64
MAX_PLAIN_KEY = 64
MAX_PLAIN_LIST = 1 << 16
MAX_PLAIN_STR = 1024
_SCALARS = (bool, int, float, str, type(None))


def check_plain(payload: Any, algo: str, err: type[Exception] = FusionError) -> dict:
    """``payload`` itself when it is a plain payload (see :class:`Codec`), else ``err`` naming the codec and key."""
    if not isinstance(payload, dict):
        raise err(f"codec {algo!r}: a payload must be a dict of plain values, got {type(payload).__name__}")
    if len(payload) > MAX_PLAIN_KEYS:
        raise err(f"codec {algo!r}: payload has {len(payload)} keys (at most {MAX_PLAIN_KEYS})")
    for k, v in payload.items():
        if not isinstance(k, str) or not 0 < len(k) <= MAX_PLAIN_KEY:
            raise err(f"codec {algo!r}: payload key {k!r:.80} is not a string of 1..{MAX_PLAIN_KEY} characters")
        if isinstance(v, (bytes, bytearray, memoryview)):
            continue
        if isinstance(v, str) and len(v) > MAX_PLAIN_STR:
            raise err(f"codec {algo!r}: payload key {k!r}: string of {len(v)} characters (at most {MAX_PLAIN_STR})")
        if isinstance(v, (list, tuple)):
            if len(v) > MAX_PLAIN_LIST or not all(isinstance(x, _SCALARS) and not isinstance(x, str) or
                                                   isinstance(x, str) and len(x) <= MAX_PLAIN_STR for x in v):
                raise err(f"codec {algo!r}: payload key {k!r}: a list must hold at most {MAX_PLAIN_LIST} scalars")
            continue
        if not isinstance(v, _SCALARS):
            raise err(f"codec {algo!r}: payload key {k!r} has a {type(v).__name__}; plain payloads hold bytes, "
                      "int, float, str, bool, None and lists of those")
    return payload


@dataclass(frozen=True)
class CodecPayload:
    """A user codec's plain payload as it travels: ``algo`` names the codec, ``fields`` is what its
    ``encode`` returned (``bytes`` values become raw tensor frames, the rest msgpack; never pickle)."""

    algo: str
    fields: dict


def _wire_encode(p: CodecPayload) -> tuple[dict, list[np.ndarray]]:
    blobs = [k for k, v in p.fields.items() if isinstance(v, (bytes, bytearray, memoryview))]
    rest = {k: list(v) if isinstance(v, tuple) else v for k, v in p.fields.items() if k not in blobs}
    arrays = [np.frombuffer(bytes(p.fields[k]) if isinstance(p.fields[k], memoryview) else p.fields[k], np.uint8)
              for k in blobs]
    return {"algo": p.algo, "f": rest, "b": blobs}, arrays


def _wire_decode(meta: dict, arrays: list[np.ndarray]) -> CodecPayload:
    algo, rest, blobs = meta.get("algo"), meta.get("f"), meta.get("b")
    if not isinstance(algo, str) or not 0 < len(algo) <= MAX_PLAIN_KEY:
        raise WireError("codec payload: 'algo' must be a codec name")
    if not isinstance(rest, dict) or not isinstance(blobs, list) or not all(isinstance(k, str) for k in blobs):
        raise WireError(f"codec payload of {algo!r}: 'f' must be a map and 'b' a list of key names")
    if len(blobs) != len(arrays):
        raise WireError(f"codec payload of {algo!r}: {len(blobs)} byte fields named, {len(arrays)} frames sent")
    if len(set(blobs)) != len(blobs) or set(blobs) & set(rest):
        raise WireError(f"codec payload of {algo!r}: a key is named twice")
    fields = dict(rest)
    for k, a in zip(blobs, arrays):
        if a.dtype != np.uint8 or a.ndim != 1:
            raise WireError(f"codec payload of {algo!r}: byte field {k!r:.80} must be a 1-D uint8 frame, "
                            f"got {a.dtype}{list(a.shape)}")
        fields[k] = a.tobytes()
    check_plain(fields, algo, WireError)
    return CodecPayload(algo, fields)


WIRE_CODEC = register_payload_codec(PayloadCodec("codec", lambda p: isinstance(p, CodecPayload), _wire_encode,
                                                 _wire_decode))

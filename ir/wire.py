"""The wire codec: messages as one msgpack header frame plus raw tensor frames.

Every message between fusion processes (OP-Data between CompNodes, control
messages between the coordinator and the executors) has the same shape::

    frame 0   msgpack map {"v": PROTOCOL_VERSION, "k": kind, "h": header, "t": [tensor descriptors]}
    frame i   raw little-endian bytes of tensor i-1, exactly prod(shape) * itemsize long

A tensor descriptor is ``{"d": dtype name, "s": shape}``. Nothing is pickled
and nothing framework-specific crosses the wire: dtypes are NumPy names from a
closed list, shapes are lists of ints, headers are plain msgpack maps. Tensor
frames are handed to the transport as the arrays themselves (zero-copy send
where the transport allows) and decoded with ``np.frombuffer`` over the
received buffer (zero-copy receive; the arrays are read-only) when the frame
starts on a 64-byte boundary, else copied to one (kernels round differently
for different alignments, so the bits of a run would depend on the heap).

Decoding checks, in order, and raises :class:`~fusion.ir.errors.WireError`
with the reason: total size against a maximum, header size, msgpack
well-formedness, protocol version, kind, tensor count (truncated messages),
dtype, shape and frame size. :func:`decode_opdata` then checks every OP-Data
field's type. A receiver logs the reason and drops the message.

Payloads other than dense arrays and small values (e.g. the Top-K sparse
triple) are carried by a :class:`PayloadCodec` registered under a type name
with :func:`register_payload_codec`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import msgpack
import numpy as np

from fusion.ir.errors import WireError
from fusion.ir.opdata import OpData

PROTOCOL_VERSION = 1
#: default upper bound on one message (header + tensor frames), bytes
DEFAULT_MAX_MESSAGE_BYTES = 1 << 30
#: upper bound on the msgpack header frame, bytes
MAX_HEADER_BYTES = 1 << 20
#: upper bound on the number of tensor frames in one message
MAX_TENSORS = 1 << 16
#: dtypes allowed on the wire (NumPy names; bfloat16 travels as raw uint16 bits)
WIRE_DTYPES = frozenset({
    "float64", "float32", "float16", "int64", "int32", "int16", "int8",
    "uint64", "uint32", "uint16", "uint8", "bool", "complex64", "complex128",
})
MAX_NDIM = 32

#: message kinds: OP-Data between parts, several OP-Data of one action to one part in one message (``opbatch``,
#: :func:`encode_opbatch`), tied-parameter gradients between owners, control, and ring all-reduce chunks between a
#: stage's data-parallel replicas (``fusion.executors.runtime.dp.allreduce``)
KINDS = frozenset({"opdata", "opbatch", "pgrad", "ctrl", "allreduce"})
#: upper bound on the OP-Data in one ``opbatch`` message
MAX_BATCH_ITEMS = 1 << 10


@dataclass
class Message:
    """A decoded message: ``kind``, its msgpack ``header`` map and its tensors."""

    kind: str
    header: dict
    arrays: list[np.ndarray]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)


def _wire_array(a: Any) -> np.ndarray:
    arr = np.asarray(a)
    if arr.dtype.name not in WIRE_DTYPES:
        raise WireError(f"dtype {arr.dtype.name!r} cannot travel on the wire (allowed: {sorted(WIRE_DTYPES)})")
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return np.require(arr, requirements="C")  # unlike ascontiguousarray, keeps 0-d arrays 0-d


def encode(kind: str, header: dict, arrays: Sequence[Any] = ()) -> list[Any]:
    """Frames of one message: the msgpack header, then each array (contiguous, not copied when already so)."""
    if kind not in KINDS:
        raise WireError(f"unknown message kind {kind!r}")
    arrs = [_wire_array(a) for a in arrays]
    head = {"v": PROTOCOL_VERSION, "k": kind, "h": header,
            "t": [{"d": a.dtype.name, "s": list(a.shape)} for a in arrs]}
    try:
        raw = msgpack.packb(head, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise WireError(f"header cannot be encoded: {e}") from None
    return [raw, *arrs]


def frames_nbytes(frames: Sequence[Any]) -> int:
    """Bytes of a frame list as :func:`encode` returns it."""
    return sum(f.nbytes if isinstance(f, np.ndarray) else memoryview(f).nbytes for f in frames)


def _buffer(f: Any) -> memoryview:
    """A flat byte view of a frame (zmq.Frame, bytes, or an array as :func:`encode` returns it)."""
    if isinstance(f, np.ndarray):
        return memoryview(np.require(f, requirements="C").reshape(-1).view(np.uint8))
    buf = getattr(f, "buffer", None)  # zmq.Frame
    mv = memoryview(buf if buf is not None else f)
    if mv.nbytes == 0:
        return memoryview(b"")
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


def decode(frames: Sequence[Any], max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Message:
    """Check and decode one message. Raises WireError naming what is wrong."""
    if not frames:
        raise WireError("empty message")
    bufs = [_buffer(f) for f in frames]
    total = sum(b.nbytes for b in bufs)
    if total > max_bytes:
        raise WireError(f"message of {total} bytes exceeds the maximum of {max_bytes} bytes")
    if bufs[0].nbytes > MAX_HEADER_BYTES:
        raise WireError(f"header of {bufs[0].nbytes} bytes exceeds the maximum of {MAX_HEADER_BYTES} bytes")
    try:
        head = msgpack.unpackb(bufs[0], raw=False, strict_map_key=True, use_list=True,
                               max_array_len=MAX_TENSORS, max_map_len=1 << 16, max_ext_len=0)
    except Exception as e:  # msgpack raises several unrelated types
        raise WireError(f"malformed header ({type(e).__name__}: {e})") from None
    if not isinstance(head, dict):
        raise WireError(f"header is a {type(head).__name__}, not a map")
    v = head.get("v")
    if not isinstance(v, int) or isinstance(v, bool) or v != PROTOCOL_VERSION:
        raise WireError(f"protocol version {_short(v)} (this process speaks {PROTOCOL_VERSION})")
    kind = head.get("k")
    if not isinstance(kind, str) or kind not in KINDS:
        raise WireError(f"unknown message kind {_short(kind)}")
    header, descs = head.get("h"), head.get("t")
    if not isinstance(header, dict) or not all(isinstance(k, str) for k in header):
        raise WireError("field 'h' (header) must be a map with string keys")
    if not isinstance(descs, list):
        raise WireError("field 't' (tensor descriptors) must be a list")
    if len(descs) != len(bufs) - 1:
        raise WireError(f"header declares {len(descs)} tensor frames, message has {len(bufs) - 1} (truncated or padded)")
    arrays = []
    for i, (d, buf) in enumerate(zip(descs, bufs[1:])):
        arrays.append(_decode_tensor(i, d, buf, max_bytes))
    return Message(kind, header, arrays)


#: received tensors start at a multiple of this many bytes (a cache line; what vectorised kernels care about)
ALIGN = 64


def _aligned(a: np.ndarray) -> np.ndarray:
    """``a`` itself when it starts on an :data:`ALIGN` boundary, else an aligned copy.

    Where a received frame starts depends on the receiver's heap, and BLAS /
    oneDNN kernels round differently for different alignments: without this,
    a run's losses change in the last bit when unrelated traffic (even
    rejected messages) moves the heap. Aligned frames stay zero-copy.
    """
    if a.ctypes.data % ALIGN == 0 or a.nbytes == 0:
        return a
    raw = np.empty(a.nbytes + ALIGN, np.uint8)
    off = (-raw.ctypes.data) % ALIGN
    out = raw[off:off + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def _short(v: Any, n: int = 80) -> str:
    """``repr(v)`` cut to ``n`` characters (a hostile value may be large)."""
    r = repr(v)
    return r if len(r) <= n else r[:n] + "..."


def _decode_tensor(i: int, d: Any, buf: memoryview, max_bytes: int) -> np.ndarray:
    if not isinstance(d, dict) or not isinstance(d.get("d"), str) or not isinstance(d.get("s"), list):
        raise WireError(f"tensor {i}: descriptor must be a map with 'd' (dtype) and 's' (shape)")
    dtype, shape = d["d"], d["s"]
    if dtype not in WIRE_DTYPES:
        raise WireError(f"tensor {i}: dtype {_short(dtype)} is not allowed on the wire")
    if len(shape) > MAX_NDIM or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
        raise WireError(f"tensor {i}: shape {_short(shape)} is not a list of non-negative ints (at most {MAX_NDIM})")
    # every dimension is bounded by the message limit too: a zero-size tensor may not smuggle a huge dimension
    if any(s > max_bytes for s in shape):
        raise WireError(f"tensor {i}: shape {_short(shape)} has a dimension over the message limit of {max_bytes}")
    dt = np.dtype(dtype).newbyteorder("<") if np.dtype(dtype).itemsize > 1 else np.dtype(dtype)
    want = math.prod(shape) * dt.itemsize
    if want > max_bytes:
        raise WireError(f"tensor {i}: shape {_short(shape)} of {dtype} needs {want} bytes, over the limit of {max_bytes}")
    if want != buf.nbytes:
        raise WireError(f"tensor {i}: shape {shape} of {dtype} needs {want} bytes, frame has {buf.nbytes}")
    try:
        return _aligned(np.frombuffer(buf, dtype=dt).reshape(shape))
    except (ValueError, TypeError) as e:  # numpy's own limits (e.g. an index space over 2**63)
        raise WireError(f"tensor {i}: shape {_short(shape)} cannot be built: {e}") from None


# -- payload codecs ------------------------------------------------------------------------

@dataclass(frozen=True)
class PayloadCodec:
    """How a non-dense payload type travels.

    name:    the ``payload.type`` tag in the header.
    matches: whether a payload object is of this type.
    encode:  object -> (JSON-able meta map, list of arrays).
    decode:  (meta, arrays) -> object; raises WireError on bad input.
    """

    name: str
    matches: Callable[[Any], bool]
    encode: Callable[[Any], tuple[dict, list[np.ndarray]]]
    decode: Callable[[dict, list[np.ndarray]], Any]


_CODECS: dict[str, PayloadCodec] = {}


def register_payload_codec(codec: PayloadCodec) -> PayloadCodec:
    """Register a payload type (e.g. the Top-K sparse payload); ``dense`` and ``value`` are built in."""
    if codec.name in ("dense", "value"):
        raise ValueError(f"payload type {codec.name!r} is built in")
    _CODECS[codec.name] = codec
    return codec


def encode_payload(p: Any) -> tuple[dict, list[np.ndarray]]:
    """A payload as its header map (with its ``type`` tag) and tensor frames: registered payload types, dense
    arrays and small values (what OP-Data carries; other messages may carry one the same way)."""
    return _encode_payload(p)


def decode_payload(meta: Any, arrays: list[np.ndarray]) -> Any:
    """The payload of :func:`encode_payload`'s header and frames; WireError for a malformed one."""
    return _decode_payload(meta, list(arrays))


def _encode_payload(p: Any) -> tuple[dict, list[np.ndarray]]:
    for c in _CODECS.values():
        if c.matches(p):
            meta, arrays = c.encode(p)
            return {"type": c.name, **meta}, list(arrays)
    if isinstance(p, np.ndarray) or (hasattr(p, "__array__") and not isinstance(p, (int, float, bool))):
        return {"type": "dense"}, [np.asarray(p)]
    if isinstance(p, np.generic):
        return {"type": "value", "value": p.item(), "tuple": False}, []
    if p is None or isinstance(p, (bool, int, float, str, list, tuple)):
        return {"type": "value", "value": list(p) if isinstance(p, tuple) else p, "tuple": isinstance(p, tuple)}, []
    raise WireError(f"payload of type {type(p).__name__} cannot travel on the wire")


def _decode_payload(meta: Any, arrays: list[np.ndarray]) -> Any:
    if not isinstance(meta, dict) or not isinstance(meta.get("type"), str):
        raise WireError("field 'payload' must be a map with a 'type'")
    t = meta["type"]
    if t == "dense":
        if len(arrays) != 1:
            raise WireError(f"dense payload needs 1 tensor frame, got {len(arrays)}")
        return arrays[0]
    if t == "value":
        if arrays:
            raise WireError("value payload carries no tensor frames")
        v, tup = meta.get("value"), meta.get("tuple", False)
        if not isinstance(tup, bool):
            raise WireError(f"value payload: 'tuple' must be a bool, got {type(tup).__name__}")
        return tuple(v) if tup and isinstance(v, list) else v
    codec = _CODECS.get(t)
    if codec is None:
        raise WireError(f"unknown payload type {_short(t)}")
    try:
        return codec.decode(meta, arrays)
    except WireError:
        raise
    except Exception as e:  # a codec's own bug must read as a rejected message, not crash the receiver
        raise WireError(f"{t} payload: {type(e).__name__}: {_short(str(e), 200)}") from None


# -- OP-Data ------------------------------------------------------------------------------------

def _opdata_header(od: OpData, meta: Any) -> dict:
    return {
        "name": od.name, "index": od.index, "op_users": list(od.op_users), "actual_user": list(od.actual_user),
        "is_grad": bool(od.is_grad), "is_loss": bool(od.is_loss), "requires_grad": bool(od.requires_grad),
        "local_iter": int(od.local_iter), "micro_batch": int(od.micro_batch), "src": od.src, "dst": od.dst,
        "compress": od.compress_cfg, "payload": meta,
    }


def encode_opdata(od: OpData, kind: str = "opdata") -> list[Any]:
    """Frames of one OP-Data message (``kind`` ``"pgrad"`` for tied-parameter gradients)."""
    meta, arrays = _encode_payload(od.payload)
    return encode(kind, _opdata_header(od, meta), arrays)


def encode_opbatch(ods: Sequence[OpData]) -> list[Any]:
    """Frames of one ``opbatch`` message: several OP-Data from one part to one part (what one action sends there,
    e.g. a subspace cut's coordinates and the token ids, issue 35), so the link's latency is paid once. The header
    is ``{"items": [each OP-Data's header as encode_opdata writes it], "arrays": [how many tensor frames each
    has]}``, the tensor frames those of the items in order: each item's payload travels in exactly the bytes of its
    own ``opdata`` message."""
    if not ods:
        raise WireError("an OP-Data batch needs at least one OP-Data")
    if len({(od.src, od.dst) for od in ods}) != 1:
        raise WireError("an OP-Data batch goes from one part to one part")
    heads, counts, arrays = [], [], []
    for od in ods:
        meta, arrs = _encode_payload(od.payload)
        heads.append(_opdata_header(od, meta))
        counts.append(len(arrs))
        arrays += arrs
    return encode("opbatch", {"items": heads, "arrays": counts}, arrays)


def _field(h: dict, name: str, types: tuple, nullable: bool = False) -> Any:
    if name not in h:
        raise WireError(f"OP-Data field {name!r} is missing")
    v = h[name]
    if v is None and nullable:
        return v
    if not isinstance(v, types) or (bool not in types and isinstance(v, bool)):
        raise WireError(f"OP-Data field {name!r} has type {type(v).__name__}, expected {'/'.join(t.__name__ for t in types)}")
    return v


def _names(h: dict, name: str) -> tuple[str, ...]:
    v = _field(h, name, (list,))
    if not all(isinstance(x, str) for x in v):
        raise WireError(f"OP-Data field {name!r} must be a list of node names")
    return tuple(v)


def opdata_from_message(msg: Message) -> OpData:
    """The OP-Data of an ``opdata``/``pgrad`` message, every field type-checked."""
    if msg.kind not in ("opdata", "pgrad"):
        raise WireError(f"message kind {msg.kind!r} is not OP-Data")
    h = msg.header
    comp = _field(h, "compress", (dict,), nullable=True)
    return OpData(
        name=_field(h, "name", (str,)), index=_field(h, "index", (int,), nullable=True),
        op_users=_names(h, "op_users"), actual_user=_names(h, "actual_user"),
        is_grad=_field(h, "is_grad", (bool,)), is_loss=_field(h, "is_loss", (bool,)),
        requires_grad=_field(h, "requires_grad", (bool,)), local_iter=_field(h, "local_iter", (int,)),
        micro_batch=_field(h, "micro_batch", (int,)), src=_field(h, "src", (str,)), dst=_field(h, "dst", (str,)),
        payload=_decode_payload(h.get("payload"), msg.arrays), compress_cfg=comp,
    )


def opbatch_from_message(msg: Message) -> list[OpData]:
    """The OP-Data of an ``opbatch`` message (:func:`encode_opbatch`) in order, each checked as
    :func:`opdata_from_message` checks one; WireError when the batch is malformed, empty, or mixes senders or
    destinations."""
    if msg.kind != "opbatch":
        raise WireError(f"message kind {msg.kind!r} is not an OP-Data batch")
    items, counts = msg.header.get("items"), msg.header.get("arrays")
    if not isinstance(items, list) or not isinstance(counts, list) or len(items) != len(counts) or not items:
        raise WireError("OP-Data batch: 'items' and 'arrays' must be lists of one entry per OP-Data, not empty")
    if len(items) > MAX_BATCH_ITEMS:
        raise WireError(f"OP-Data batch of {len(items)} items exceeds the maximum of {MAX_BATCH_ITEMS}")
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts) \
            or sum(counts) != len(msg.arrays):
        raise WireError(f"OP-Data batch: 'arrays' {_short(counts)} must count its {len(msg.arrays)} tensor frames")
    out, at = [], 0
    for h, n in zip(items, counts):
        if not isinstance(h, dict):
            raise WireError(f"OP-Data batch: an item is a {type(h).__name__}, not a map")
        out.append(opdata_from_message(Message("opdata", h, msg.arrays[at:at + n])))
        at += n
    if len({(od.src, od.dst) for od in out}) != 1:
        raise WireError("OP-Data batch: its items name more than one sender or destination")
    return out


def decode_opdata(frames: Sequence[Any], max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> OpData:
    """:func:`decode` then :func:`opdata_from_message`."""
    return opdata_from_message(decode(frames, max_bytes))

"""The typed data-parallel headers (executors/runtime/dp/header.py) write the very bytes the wire carried as
dicts before them (the wire did not change), and a received header is routed by the class it says it is."""
from __future__ import annotations

import numpy as np

from fusion.executors.runtime.dp.allreduce import encode_chunk
from fusion.executors.runtime.dp.header import KIND, ChunkHeader, DelayedHeader, PseudoHeader, header_type
from fusion.ir.wire import decode, encode, encode_payload


def _raw(frames) -> list[bytes]:
    return [bytes(memoryview(f)) for f in frames]


def test_headers_write_the_dicts_of_before_byte_for_byte():
    meta, arrays = encode_payload(np.arange(6, dtype=np.float32))
    group = ["p0", "r1.p0", "r2.p0"]
    # the dicts exactly as allreduce.encode_chunk, OuterLoop.step and OuterLoop._send_round wrote them
    chunk = encode(KIND, {"it": 3, "bucket": 1, "step": 2, "chunk": 0, "src": "p0", "dst": "r1.p0",
                          "group": group, "payload": meta}, arrays)
    pseudo = encode(KIND, {"it": 3, "bucket": 1, "step": 0, "chunk": 0, "src": "p0", "dst": "r1.p0",
                           "group": group, "gather": True, "payload": meta}, arrays)
    delayed = encode(KIND, {"round": 4, "bucket": 1, "src": "p0", "dst": "r1.p0", "delayed": True,
                            "payload": meta}, arrays)
    assert _raw(ChunkHeader(3, 1, 2, 0, "p0", "r1.p0", tuple(group)).frames(meta, arrays)) == _raw(chunk)
    assert _raw(encode_chunk(3, 1, 2, 0, "p0", "r1.p0", np.arange(6, dtype=np.float32), group)) == _raw(chunk)
    assert _raw(PseudoHeader(3, 1, 0, 0, "p0", "r1.p0", tuple(group)).frames(meta, arrays)) == _raw(pseudo)
    assert _raw(DelayedHeader(4, 1, "p0", "r1.p0").frames(meta, arrays)) == _raw(delayed)
    assert _raw(chunk) != _raw(pseudo)  # (the comparison can fail: the flag is in the bytes)


def test_a_received_header_is_routed_by_its_type():
    meta, arrays = encode_payload(np.zeros(2, dtype=np.float32))
    sent = {ChunkHeader: ChunkHeader(0, 0, 0, 0, "a", "b", ("a", "b")),
            PseudoHeader: PseudoHeader(0, 0, 0, 0, "a", "b", ("a", "b")),
            DelayedHeader: DelayedHeader(2, 0, "a", "b")}
    for cls, h in sent.items():
        msg = decode([memoryview(f) for f in h.frames(meta, arrays)])
        assert msg.kind == KIND and header_type(msg.header) is cls
    # a flag that is not exactly true routes nowhere special: the ring's inbox checks (and refuses) it
    assert header_type({"gather": 1, "delayed": "yes"}) is ChunkHeader
    assert header_type(["not", "a", "dict"]) is ChunkHeader

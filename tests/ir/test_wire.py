"""The wire codec: round trips, zero-copy, and every rejection reason."""
import re
import time

import msgpack
import numpy as np
import pytest

from fusion.executors.runtime.control import Step, decode_ctrl
from fusion.executors.runtime.linkemu import EmulatedLink, LinkModel, TokenBucket, link_model
from fusion.executors.runtime.transport import Transport
from fusion.ir.errors import FusionError, WireError
from fusion.ir.opdata import OpData
from fusion.ir.wire import (PROTOCOL_VERSION, PayloadCodec, decode, decode_opdata, encode, encode_opdata,
                            register_payload_codec)


def _od(payload, **kw):
    base = dict(name="conv1", index=None, op_users=("add", "relu"), actual_user=("add",), is_grad=False, local_iter=3,
                micro_batch=1, src="p0", dst="p1", payload=payload)
    return OpData(**{**base, **kw})


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "int64", "int32", "int8", "uint8", "uint16", "bool"])
def test_dense_round_trip_every_dtype(dtype):
    a = (np.arange(24).reshape(2, 3, 4) % 3).astype(dtype)
    back = decode_opdata(encode_opdata(_od(a, index=1, is_grad=True, requires_grad=True)))
    assert back.payload.dtype == a.dtype and back.payload.shape == a.shape
    np.testing.assert_array_equal(back.payload, a)
    assert (back.name, back.index, back.op_users, back.actual_user) == ("conv1", 1, ("add", "relu"), ("add",))
    assert back.is_grad and back.requires_grad and back.local_iter == 3 and back.micro_batch == 1


def test_values_scalars_and_empty_tensors():
    assert decode_opdata(encode_opdata(_od((2, 3, 4)))).payload == (2, 3, 4)
    assert decode_opdata(encode_opdata(_od(7))).payload == 7
    assert decode_opdata(encode_opdata(_od(None))).payload is None
    assert decode_opdata(encode_opdata(_od(np.float32(2.5)))).payload == 2.5
    e = decode_opdata(encode_opdata(_od(np.zeros((0, 5), np.float32)))).payload
    assert e.shape == (0, 5)
    s = decode_opdata(encode_opdata(_od(np.array(1.5, np.float32)))).payload
    assert s.shape == () and s == 1.5


def test_non_contiguous_and_big_endian_are_sent_as_little_endian_contiguous():
    a = np.arange(12, dtype=np.float32).reshape(3, 4).T
    np.testing.assert_array_equal(decode_opdata(encode_opdata(_od(a))).payload, a)
    b = np.arange(4, dtype=">f4")
    out = decode_opdata(encode_opdata(_od(b))).payload
    assert out.dtype == np.dtype("<f4")
    np.testing.assert_array_equal(out, b)


def test_zero_copy_both_ways():
    a = np.arange(1 << 16, dtype=np.float32)
    frames = encode_opdata(_od(a))
    assert np.shares_memory(frames[1], a)  # the sender hands the array itself to the socket
    store = np.empty(a.nbytes + 128, np.uint8)
    off = (-store.ctypes.data) % 64
    raw = store[off:off + a.nbytes]
    raw[:] = frames[1].view(np.uint8)
    back = decode([frames[0], raw])
    assert np.shares_memory(back.arrays[0], raw)  # the receiver views an aligned frame
    shifted = store[off + 4:off + 4 + a.nbytes]
    shifted[:] = frames[1].view(np.uint8)
    back = decode([frames[0], shifted])  # a frame off the 64-byte grid is copied onto it (same bits whatever the heap)
    assert not np.shares_memory(back.arrays[0], shifted) and back.arrays[0].ctypes.data % 64 == 0
    np.testing.assert_array_equal(back.arrays[0], a)


def test_payload_codec_registry():
    class Sparse:
        def __init__(self, values, indices, shape):
            self.values, self.indices, self.shape = values, indices, shape

    def dec(meta, arrays):
        if len(arrays) != 2:
            raise WireError("sparse payload needs 2 frames")
        return Sparse(arrays[0], arrays[1], tuple(meta["shape"]))

    register_payload_codec(PayloadCodec("test-sparse", lambda p: isinstance(p, Sparse),
                                        lambda p: ({"shape": list(p.shape)}, [p.values, p.indices]), dec))
    sp = Sparse(np.ones(3, np.float32), np.array([0, 4, 9], np.int32), (2, 5))
    back = decode_opdata(encode_opdata(_od(sp, compress_cfg={"algo": "topk", "ratio": 3})))
    assert isinstance(back.payload, Sparse) and back.payload.shape == (2, 5) and back.compress_cfg["ratio"] == 3
    np.testing.assert_array_equal(back.payload.indices, [0, 4, 9])


def _head(frames):
    return msgpack.unpackb(frames[0])


def _pack(h):
    return msgpack.packb(h, use_bin_type=True)


def test_rejections_name_the_reason():
    a = np.ones((2, 3), np.float32)
    good = encode_opdata(_od(a))
    h = _head(good)
    cases = {
        "protocol version": [_pack({**h, "v": PROTOCOL_VERSION + 1}), good[1]],
        "not allowed on the wire": [_pack({**h, "t": [{"d": "object", "s": [2, 3]}]}), good[1]],
        "needs 24 bytes, frame has 20": [good[0], good[1].tobytes()[:20]],
        "shape [2, 4] of float32 needs 32 bytes": [_pack({**h, "t": [{"d": "float32", "s": [2, 4]}]}), good[1]],
        "declares 1 tensor frames, message has 0": [good[0]],
        "malformed header": [b"\xc1\x00garbage"],
        "unknown message kind": [_pack({**h, "k": "pickle"}), good[1]],
        "not a list of non-negative ints": [_pack({**h, "t": [{"d": "float32", "s": [-1, 3]}]}), good[1]],
        "empty message": [],
    }
    for reason, frames in cases.items():
        with pytest.raises(WireError, match=re.escape(reason)):
            decode_opdata(frames)
    with pytest.raises(WireError, match="exceeds the maximum of 100 bytes"):
        decode_opdata(good, max_bytes=100)
    bad = dict(h)
    bad["h"] = {**h["h"], "micro_batch": "1"}
    with pytest.raises(WireError, match="'micro_batch' has type str"):
        decode_opdata([_pack(bad), good[1]])
    bad["h"] = {**h["h"], "index": True}
    with pytest.raises(WireError, match="'index' has type bool"):
        decode_opdata([_pack(bad), good[1]])
    with pytest.raises(WireError, match="cannot travel"):
        encode_opdata(_od(object()))


def test_control_messages():
    c = decode_ctrl(decode(Step(arrays={"0/x": np.zeros(2, np.float32)}, it=4, want_grads=False, checkpoint=True).frames()))
    assert c.op == "step" and isinstance(c, Step) and c.it == 4 and list(c.arrays) == ["0/x"]
    with pytest.raises(WireError, match="lacks fields"):
        decode_ctrl(decode(encode("ctrl", {"op": "step", "names": []})))
    with pytest.raises(WireError, match="unknown control op"):
        decode_ctrl(decode(encode("ctrl", {"op": "exec", "names": []})))
    with pytest.raises(WireError, match="names 2 tensors but carries 1"):
        decode_ctrl(decode(encode("ctrl", {"op": "fetch", "names": ["a", "b"]}, [np.zeros(1)])))


def test_token_bucket_and_link_model():
    b = TokenBucket(1000.0)  # 1000 B/s, no burst
    assert b.reserve(500, 0.0) == (0.0, 0.5)
    assert b.reserve(500, 0.1) == (0.5, 1.0)  # queued behind the first
    assert b.reserve(100, 5.0) == (5.0, 5.1)  # idle time gives no credit without burst
    burst = TokenBucket(1000.0, burst_bytes=200)
    assert burst.reserve(100, 0.0) == (0.0, 0.0)
    link = EmulatedLink(LinkModel(0.03, 8 / 20e6))
    s, e, d = link.schedule(25_000, 1.0)
    assert (s, round(e - s, 6), round(d - e, 6)) == (1.0, 0.01, 0.03)
    cluster = {"devices": [{"name": "a"}, {"name": "b"}], "delay_s": [[0, 0.03], [0.03, 0]],
               "bandwidth_bps": [[0, 20e6], [10e6, 0]]}
    assert link_model(cluster, "b", "a") == LinkModel(0.03, 8 / 10e6)
    assert link_model(cluster, "a", "a") == LinkModel(0.0, 0.0)
    with pytest.raises(FusionError, match="no device named 'c'"):
        link_model(cluster, "a", "c")


def test_transport_rejects_unknown_senders_and_emulates_links():
    got, rejected = [], []
    rx = Transport("p1", "tcp://127.0.0.1:*", {"p0"}, lambda s, m: got.append((s, m)),
                   on_reject=lambda s, r: rejected.append((s, r)))
    tx = Transport("p0", "tcp://127.0.0.1:*", set(), lambda s, m: None)
    mallory = Transport("mallory", "tcp://127.0.0.1:*", set(), lambda s, m: None)
    try:
        addr = rx.start()
        tx.start()
        mallory.start()
        # 200 kB at 8 Mbit/s = 0.2 s on the wire, plus 0.05 s latency
        tx.connect("p1", addr, EmulatedLink(LinkModel(0.05, 8 / 8e6)))
        mallory.connect("p1", addr)
        t0 = time.monotonic()
        tx.send("p1", encode_opdata(_od(np.zeros(50_000, np.float32))), label="x")
        mallory.send("p1", encode_opdata(_od(np.zeros(2, np.float32), src="mallory")))
        deadline = time.monotonic() + 10
        while (not got or not rejected) and time.monotonic() < deadline:
            time.sleep(0.01)
        elapsed = time.monotonic() - t0
        assert [s for s, _ in got] == ["p0"] and got[0][1].arrays[0].shape == (50_000,)
        assert rejected and rejected[0][0] == "mallory" and "unknown sender" in rejected[0][1]
        assert elapsed >= 0.25  # the emulated link held the message for alpha + beta * M
        assert tx.stats()["p1"].bytes > 200_000
    finally:
        for t in (tx, mallory, rx):
            t.close(timeout_s=2)



def test_opdata_batch_round_trip_keeps_each_payload_bytes():
    """One action's OP-Data to one part travel in one ``opbatch`` message (issue 35: a subspace cut's coordinates and
    token ids); each item decodes as its own ``opdata`` message would, its tensor frames the same bytes."""
    from fusion.executors.runtime.packing import by_destination, message_frames
    from fusion.ir.wire import encode_opbatch, opbatch_from_message

    coords = _od(np.arange(12, dtype=np.float32).reshape(2, 2, 3), name="add_2_coords", requires_grad=True)
    ids = _od(np.arange(4, dtype=np.int64).reshape(2, 2), name="idx", op_users=("wte",), actual_user=("fixed",))
    other = _od(np.ones(3, np.float32), name="x", dst="p2")
    frames = encode_opbatch([coords, ids])
    msg = decode(frames)
    assert msg.kind == "opbatch"
    back = opbatch_from_message(msg)
    for sent, got in zip([coords, ids], back):
        alone = decode_opdata(encode_opdata(sent))
        assert (got.name, got.op_users, got.actual_user, got.requires_grad, got.src, got.dst) == \
            (alone.name, alone.op_users, alone.actual_user, alone.requires_grad, alone.src, alone.dst)
        assert got.payload.dtype == sent.payload.dtype
        np.testing.assert_array_equal(got.payload, sent.payload)
    # the items' tensor frames are their own messages' frames, in order
    assert [bytes(np.ascontiguousarray(f)) for f in frames[1:]] == \
        [bytes(np.ascontiguousarray(f)) for od in (coords, ids) for f in encode_opdata(od)[1:]]
    # grouping: one group per destination, a group of one is the plain opdata message byte for byte
    groups = by_destination([coords, other, ids])
    assert [[od.name for od in g] for g in groups] == [["add_2_coords", "idx"], ["x"]]
    assert decode(message_frames(groups[0])).kind == "opbatch"
    assert [bytes(np.ascontiguousarray(f)) if not isinstance(f, bytes) else f for f in message_frames(groups[1])] == \
        [bytes(np.ascontiguousarray(f)) if not isinstance(f, bytes) else f for f in encode_opdata(other)]
    # refused: empty, mixed destinations, counts that do not match the frames, an item that is not OP-Data
    with pytest.raises(WireError, match="at least one"):
        encode_opbatch([])
    with pytest.raises(WireError, match="one part to one part"):
        encode_opbatch([coords, other])
    head = msgpack.unpackb(frames[0], raw=False)
    for bad, reason in ((dict(arrays=[1, 0]), "must count its 2 tensor frames"),
                        (dict(items=[]), "one entry per OP-Data"),
                        (dict(items=[head["h"]["items"][0], 5]), "not a map"),
                        (dict(items=[head["h"]["items"][0], {**head["h"]["items"][1], "dst": "p9"}]),
                         "more than one sender or destination")):
        h = {**head["h"], **bad}
        with pytest.raises(WireError, match=reason):
            opbatch_from_message(decode(encode("opbatch", h, msg.arrays)))

"""Sparse OP-Data on the wire: round trip, and malformed payloads rejected by a CompNode with a logged reason."""
import logging
import re

import msgpack
import numpy as np
import pytest
import zmq

from tests.executors.dist_models import CNN_SPLITS, branching_cnn, save_hand_plan
from fusion.executors.runtime.compnode import CompNode, ExecutorConfig
from fusion.executors.runtime.compression import densify, topk_numpy
from fusion.executors.runtime.control import Setup
from fusion.ir.errors import WireError
from fusion.ir.opdata import OpData
from fusion.ir.wire import decode, decode_opdata, encode_opdata
from fusion.plan import EdgeCompression, load_plan

SHAPE = (2, 4, 6, 6)


def _sparse_msg(payload, **kw):
    base = dict(name="relu_a", index=None, op_users=("add_ab",), actual_user=("add_ab",), is_grad=False,
                local_iter=0, micro_batch=0, src="p0", dst="p1", payload=payload, requires_grad=True,
                compress_cfg={"algo": "topk", "ratio": 10.0, "k": payload.k})
    return encode_opdata(OpData(**{**base, **kw}))


def test_sparse_opdata_round_trips():
    x = np.random.default_rng(1).standard_normal(SHAPE).astype(np.float32)
    p = topk_numpy(x, 29)
    od = decode_opdata([bytes(f) if isinstance(f, bytes) else f.tobytes() for f in _sparse_msg(p)])
    assert od.compress_cfg == {"algo": "topk", "ratio": 10.0, "k": 29}
    np.testing.assert_array_equal(densify(od.payload), densify(p))


def _bad_cases(good):
    head = msgpack.unpackb(good[0])
    vals, idx = good[1], good[2]
    pack = lambda h: msgpack.packb(h, use_bin_type=True)  # noqa: E731
    pay = head["h"]["payload"]

    def with_payload(**kw):
        return pack({**head, "h": {**head["h"], "payload": {**pay, **kw}}})

    def with_idx(arr):
        return [good[0], vals, np.asarray(arr, np.int32)]

    k = pay["k"]
    out_of_range = idx.copy(); out_of_range[-1] = 288
    dup = idx.copy(); dup[1] = dup[0]
    return {
        "index 288 out of range [0, 288)": with_idx(out_of_range),
        "duplicate index": with_idx(dup),
        "unknown value_dtype 'float8'": [with_payload(value_dtype="float8"), vals, idx],
        f"values frame has {vals.nbytes} bytes, k={k + 1} x 4 expected": [with_payload(k=k + 1), vals, idx],
        "sparse payload needs 2 tensor frames": [pack({**head, "t": head["t"][:1]}), vals],
        "sparse payload of float32[2, 4, 6, 7] does not match the graph's float32[2, 4, 6, 6]":
            [with_payload(shape=[2, 4, 6, 7]), vals, idx],
    }


def test_a_compnode_rejects_malformed_sparse_opdata_with_a_logged_reason(tmp_path, caplog):
    model = branching_cnn(mb=2)
    from fusion.executors.runtime.launcher import hand_plan
    from fusion.plan import save_plan

    plan = hand_plan(model, CNN_SPLITS[2], micro_batches=1)
    plan.compression = [EdgeCompression("relu_a", None, "p0", "p1", 10.0, ("fwd", "bwd"))]
    plan_dir = save_plan(plan, tmp_path / "plan", params=model.params)
    node = CompNode(load_plan(plan_dir), plan_dir, ExecutorConfig("p1", "tcp://127.0.0.1:9"))
    node._setup(Setup(peers={"p0": "tcp://127.0.0.1:9"}, emulate_links=False,
                      resume_step=None, checkpoint_dir=None))
    try:
        assert node.runtime.compression is not None and node.runtime.compression.bwd
        x = np.random.default_rng(2).standard_normal(SHAPE).astype(np.float32)
        good = _sparse_msg(topk_numpy(x, 29))
        bad = _bad_cases(good)
        caplog.set_level(logging.WARNING)
        before = node.transport.rejected
        for reason, frames in bad.items():  # through the transport's receive path: decode, check, log
            node.transport._handle([zmq.Frame(b"p0"), *[zmq.Frame(bytes(memoryview(f))) for f in frames]])
        assert node.transport.rejected - before == len(bad)
        text = caplog.text
        for reason in bad:
            assert reason in text, f"no logged reason {reason!r} in\n{text[-3000:]}"
        node.transport._handle([zmq.Frame(b"p0"), *[zmq.Frame(bytes(memoryview(f))) for f in good]])
        assert node.transport.rejected - before == len(bad)  # the good one is accepted
        (od,) = node.inbox._data[(0, "F", 0)]  # conv1 (dense) has not arrived: forward is not ready yet
        np.testing.assert_array_equal(densify(od.payload), densify(topk_numpy(x, 29)))
        with pytest.raises(WireError, match=re.escape("duplicate activation")):
            node._on_message("p0", decode(good))
    finally:
        node.transport.close(timeout_s=1, linger_s=0)


def test_a_payload_of_another_codec_than_the_edge_s_is_refused(tmp_path, caplog):
    """Issue 28: an edge compiled for Top-K accepted a quantised payload from its producer (and a dense edge a Top-K
    one): the receiver decoded whatever codec made it. Now the payload's codec must be the one the plan compiled for
    that stream, the reason naming the tensor, the sender and both codecs."""
    from fusion.executors.runtime.launcher import hand_plan
    from fusion.kernels.codecs import CODECS
    from fusion.plan import save_plan

    model = branching_cnn(mb=2)
    plan = hand_plan(model, CNN_SPLITS[2], micro_batches=1)
    plan.compression = [EdgeCompression("relu_a", None, "p0", "p1", 10.0, ("fwd", "bwd"))]
    plan_dir = save_plan(plan, tmp_path / "plan", params=model.params)
    node = CompNode(load_plan(plan_dir), plan_dir, ExecutorConfig("p1", "tcp://127.0.0.1:9"))
    node._setup(Setup(peers={"p0": "tcp://127.0.0.1:9"}, emulate_links=False, resume_step=None, checkpoint_dir=None))
    try:
        x = np.random.default_rng(3).standard_normal(SHAPE).astype(np.float32)
        quant = CODECS.unit("quant").encode(x, {"algo": "quant", "bits": 8})
        with pytest.raises(WireError, match=re.escape("activation ('relu_a', None) from p0: a quant payload, but the "
                                                      "plan compresses it with topk towards p1")):
            node._on_message("p0", decode(encode_opdata(OpData(
                name="relu_a", index=None, op_users=("add_ab",), actual_user=("add_ab",), is_grad=False, local_iter=0,
                micro_batch=0, src="p0", dst="p1", payload=quant, requires_grad=True,
                compress_cfg={"algo": "quant", "bits": 8}))))
        conv = dict(name="conv1", op_users=("relu_a", "conv_b"), actual_user=("conv_b",))  # a dense edge into p1
        with pytest.raises(WireError, match=re.escape("activation ('conv1', None) from p0: a topk payload, but the "
                                                      "plan sends it dense towards p1")):
            node._on_message("p0", decode(_sparse_msg(topk_numpy(x, 29), **conv)))
        node._on_message("p0", decode(_sparse_msg(topk_numpy(x, 29))))  # the compiled codec: accepted
        assert len(node.inbox._data[(0, "F", 0)]) == 1
    finally:
        node.transport.close(timeout_s=1, linger_s=0)

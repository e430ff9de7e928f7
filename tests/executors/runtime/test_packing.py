"""One message per destination per action (issue 35, ``executors/runtime/packing.py``): a CompNode takes every
OP-Data of an ``opbatch`` message into its inbox as it takes one ``opdata`` message each, and refuses a malformed
batch with a logged reason (as two messages would: an item checked before the bad one is kept)."""
import logging

import msgpack
import numpy as np
import zmq

from fusion.executors.runtime.compnode import CompNode, ExecutorConfig
from fusion.executors.runtime.control import Setup
from fusion.ir.opdata import OpData
from fusion.ir.wire import encode, encode_opbatch
from fusion.plan import load_plan
from tests.executors.dist_models import CNN_SPLITS, branching_cnn

SHAPE = (2, 4, 6, 6)  # conv1's and relu_a's activations, both sent from p0 to p1 (the branching CNN's cut)


def _od(name, payload, src="p0"):
    return OpData(name, None, ("x",), ("x",), False, 0, 0, src, "p1", payload, requires_grad=True)


def test_a_compnode_takes_every_item_of_a_batch_and_refuses_a_bad_one_with_a_reason(tmp_path, caplog):
    from fusion.executors.runtime.launcher import hand_plan
    from fusion.plan import save_plan

    model = branching_cnn(mb=2)
    plan_dir = save_plan(hand_plan(model, CNN_SPLITS[2], micro_batches=1), tmp_path / "plan", params=model.params)
    node = CompNode(load_plan(plan_dir), plan_dir, ExecutorConfig("p1", "tcp://127.0.0.1:9"))
    node._setup(Setup(peers={"p0": "tcp://127.0.0.1:9"}, emulate_links=False, resume_step=None, checkpoint_dir=None))
    try:
        assert set(node.runtime.routes.recv_from) == {("conv1", None), ("relu_a", None)}
        rng = np.random.default_rng(0)
        a, b = (rng.standard_normal(SHAPE).astype(np.float32) for _ in range(2))
        good = encode_opbatch([_od("conv1", a), _od("relu_a", b)])
        head = msgpack.unpackb(good[0], raw=False)
        items = head["h"]["items"]

        def frames(h, arrays=(a, b)):
            return encode("opbatch", h, list(arrays))

        bad = {
            "must count its 2 tensor frames": frames({"items": items, "arrays": [2, 1]}),
            "more than one sender or destination": frames({"items": [items[0], {**items[1], "dst": "p2"}],
                                                            "arrays": [1, 1]}),
            "unexpected activation": frames({"items": [items[0], {**items[1], "name": "relu_b"}], "arrays": [1, 1]}),
        }
        caplog.set_level(logging.WARNING)
        before = node.transport.rejected
        for reason, f in bad.items():  # through the transport's receive path: decode, check, log
            node.transport._handle([zmq.Frame(b"p0"), *[zmq.Frame(bytes(memoryview(x))) for x in f]])
        assert node.transport.rejected - before == len(bad)
        for reason in bad:
            assert reason in caplog.text, reason
        node.inbox._data.clear()  # (the third batch's good first item was kept, as a message of its own would be)
        node.transport._handle([zmq.Frame(b"p0"), *[zmq.Frame(bytes(memoryview(x))) for x in good]])
        assert node.transport.rejected - before == len(bad)  # the good one is accepted, both OP-Data
        got = {od.name: od.payload for od in node.inbox._data[(0, "F", 0)]}
        np.testing.assert_array_equal(got["conv1"], a)
        np.testing.assert_array_equal(got["relu_a"], b)
    finally:
        node.transport.close(timeout_s=1, linger_s=0)

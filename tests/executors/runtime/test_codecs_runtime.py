"""Per-direction codecs at run time: quantised edges in the reference executor and on real processes."""
import logging

import msgpack
import numpy as np
import pytest
import zmq

from tests.executors.dist_models import CNN_SPLITS, branching_cnn, cnn_batch
from fusion.executors.reference import ReferenceExecutor
from fusion.executors.runtime.compression import CompressionTable, dense_payload
from fusion.ir.errors import FusionError
from fusion.ir.opdata import OpData
from fusion.ir.wire import encode_opdata
from fusion.kernels.quant import dequantize, quantize
from fusion.plan import EdgeCompression, OptimizerConfig

SPLIT = CNN_SPLITS[4]  # p0: conv1 -> p1: relu_a, p2: tanh_b -> p3: add, fc, loss
Q4 = {"algo": "quant", "bits": 4, "block": 32}
Q8 = {"algo": "quant", "bits": 8, "block": 64}
H4 = {"algo": "hadamard-quant", "bits": 4, "block": 16, "rounding": "stochastic"}
COMP = [EdgeCompression("relu_a", None, "p1", "p3", fwd_codec=Q4, bwd_codec=Q8),
        EdgeCompression("conv1", None, "p0", "p2", fwd_codec=H4)]


def test_a_direction_without_a_codec_falls_back_to_its_topk_ratio_or_dense():
    old = EdgeCompression("a", None, "p0", "p1", 10.0, ("fwd",))  # a plan written before codecs
    assert old.codec("fwd") == {"algo": "topk", "ratio": 10.0} and old.codec("bwd") is None
    new = EdgeCompression("a", None, "p0", "p1", fwd_codec=Q4)
    assert new.codec("fwd") == Q4 and new.codec("bwd") is None


def test_the_table_quantises_what_the_plan_says_and_the_receiver_decodes_it():
    t = CompressionTable.build("p1", COMP)
    x = np.random.default_rng(0).standard_normal((2, 4, 6, 6)).astype(np.float32)
    payload, cfg = t.encode(x, ("relu_a", None), "p3", False, 0)
    assert cfg == Q4 and payload.bits == 4
    assert payload.to_msg()[1] == quantize(x, Q4).to_msg()[1]  # the codec's own bytes
    np.testing.assert_array_equal(dense_payload(payload), dequantize(quantize(x, Q4)))
    dense, cfg = t.encode(x, ("relu_a", None), "p0", False, 0)  # no rule towards p0
    assert dense is x and cfg is None


@pytest.mark.parametrize("bad,match", [
    (EdgeCompression("relu_a", None, "p1", "p3", fwd_codec={"algo": "zip"}), r"p1->p3 \(fwd\): unknown codec 'zip'"),
    (EdgeCompression("relu_a", None, "p1", "p3", fwd_codec={"algo": "quant", "bits": 3}), "bits must be one of"),
    (EdgeCompression("relu_a", None, "p1", "p3", error_feedback=True, fwd_codec=Q4), "error feedback is for Top-K only"),
])
def test_bad_codecs_in_a_plan_are_refused_naming_the_edge(bad, match):
    with pytest.raises(FusionError, match=match):
        CompressionTable.build("p1", [bad])


def _train(compression, steps=3):
    ex = ReferenceExecutor(branching_cnn(mb=2), SPLIT, OptimizerConfig("sgd", lr=0.1), micro_batches=2,
                           compression=compression)
    return ex, [ex.step(cnn_batch(s, 4)).loss for s in range(steps)]


def test_quantised_training_stays_close_to_dense_and_differs_from_it():
    _, dense = _train([])
    _, quant = _train(COMP)
    assert quant != dense  # the codecs really ran
    np.testing.assert_allclose(quant, dense, rtol=0.05)


@pytest.mark.parametrize("compression", [[], COMP], ids=["dense", "codecs"])
def test_distributed_run_with_codecs_equals_the_reference(tmp_path, compression):
    """Real executor processes over loopback give the reference executor's losses and weights; the
    codecs' bytes are identical, so the only differences are those of the dense run (summation order)."""
    from tests.executors.dist_models import run_distributed
    from fusion.executors.runtime.launcher import hand_plan
    from fusion.plan import save_plan

    model = branching_cnn(mb=2)
    plan = hand_plan(model, SPLIT, micro_batches=2, optimizer=OptimizerConfig("sgd", lr=0.1))
    plan.compression = compression
    plan_dir = save_plan(plan, tmp_path / "plan", params=model.params)
    batches = [cnn_batch(s, 4) for s in range(3)]
    reports, state = run_distributed(plan_dir, tmp_path / "run", batches, want_grads=False)
    ref, losses = _train(compression)
    np.testing.assert_allclose([r.loss for r in reports], losses, rtol=1e-6)
    for n, v in ref.state().items():
        np.testing.assert_allclose(state[n], v, rtol=1e-5, atol=1e-7)


def test_a_compnode_rejects_a_malformed_quantised_payload_and_keeps_serving(tmp_path, caplog):
    from fusion.executors.runtime.compnode import CompNode, ExecutorConfig
    from fusion.executors.runtime.control import Setup
    from fusion.executors.runtime.launcher import hand_plan
    from fusion.plan import load_plan, save_plan

    model = branching_cnn(mb=2)
    plan = hand_plan(model, CNN_SPLITS[2], micro_batches=1)
    plan.compression = [EdgeCompression("relu_a", None, "p0", "p1", fwd_codec=Q4)]
    plan_dir = save_plan(plan, tmp_path / "plan", params=model.params)
    node = CompNode(load_plan(plan_dir), plan_dir, ExecutorConfig("p1", "tcp://127.0.0.1:9"))
    node._setup(Setup(peers={"p0": "tcp://127.0.0.1:9"}, emulate_links=False,
                      resume_step=None, checkpoint_dir=None))
    try:
        x = np.random.default_rng(2).standard_normal((2, 4, 6, 6)).astype(np.float32)
        good = encode_opdata(OpData("relu_a", None, ("add_ab",), ("add_ab",), False, 0, 0, src="p0", dst="p1",
                                    payload=quantize(x, Q4), requires_grad=True, compress_cfg=Q4))
        head = msgpack.unpackb(bytes(memoryview(good[0])), raw=False)

        def mutate(**fields):
            h = {**head, "h": {**head["h"], "payload": {**head["h"]["payload"], **fields}}}
            return [msgpack.packb(h), *good[1:]]

        bad = {"bits 3": mutate(bits=3), "scale count": good[:1] + [good[1][:-2]] + good[2:],
               "wrong shape": mutate(shape=[2, 4, 6, 7]), "block 0": mutate(block=0)}
        caplog.set_level(logging.WARNING)
        before = node.transport.rejected
        for frames in bad.values():
            node.transport._handle([zmq.Frame(b"p0"), *[zmq.Frame(bytes(memoryview(f))) for f in frames]])
        assert node.transport.rejected - before == len(bad)
        node.transport._handle([zmq.Frame(b"p0"), *[zmq.Frame(bytes(memoryview(f))) for f in good]])
        assert node.transport.rejected - before == len(bad)  # the good one is accepted
        (od,) = node.inbox._data[(0, "F", 0)]
        np.testing.assert_array_equal(dense_payload(od.payload), dequantize(quantize(x, Q4)))
    finally:
        node.transport.close(timeout_s=1, linger_s=0)

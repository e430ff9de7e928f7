"""AQ-SGD activation deltas at run time: sample ids through the pipeline, buffers at both ends, checkpoints."""
import logging

import msgpack
import numpy as np
import pytest
import zmq

from tests.executors.dist_models import CNN_SPLITS, branching_cnn, cnn_batch
from fusion.executors.reference import ReferenceExecutor
from fusion.executors.runtime.compression import CompressionTable
from fusion.executors.runtime.coordinator import CoordinatorConfig
from fusion.ir.errors import FusionError
from fusion.ir.opdata import SAMPLE_IDS, OpData
from fusion.ir.wire import encode_opdata
from fusion.kernels.delta import DeltaBuffer, DeltaPayload
from fusion.plan import EdgeCompression, OptimizerConfig

SPLIT = CNN_SPLITS[4]  # p0: conv1 -> p1: conv_a, relu_a; p2: conv_b, tanh_b -> p3: add, fc, loss
D4 = {"algo": "delta", "bits": 4, "block": 32}
D2 = {"algo": "delta", "bits": 2, "block": 16, "rounding": "stochastic"}
Q8 = {"algo": "quant", "bits": 8, "block": 64}
# p1 both receives over a delta edge and sends over one: its sample ids come with the coordinator's step
COMP = [EdgeCompression("conv1", None, "p0", "p1", fwd_codec=D4),
        EdgeCompression("relu_a", None, "p1", "p3", fwd_codec=D2, bwd_codec=Q8)]
EDGES = [(("conv1", None), "p0", "p1"), (("relu_a", None), "p1", "p3")]


def batch(step: int) -> dict:
    """A dataset of 12 samples (3 batches of 4) visited in turn: every sample comes back every 3 steps."""
    b = cnn_batch(step % 3, 4)
    b[SAMPLE_IDS] = np.arange(4, dtype=np.int64) + 4 * (step % 3)
    return b


def _reference(steps: int, compression=COMP):
    ex = ReferenceExecutor(branching_cnn(mb=2), SPLIT, OptimizerConfig("adamw", lr=0.01), micro_batches=2,
                           compression=compression)
    return ex, [ex.step(batch(s)).loss for s in range(steps)]


def _buffers(state: dict, role: str, key, peer: str) -> dict[int, np.ndarray]:
    import json

    name = json.dumps([role, key[0], key[1], peer])
    return {int(i): state[f"{name}#rows"][j] for j, i in enumerate(state[f"{name}#ids"].tolist())}


def test_a_delta_rule_is_for_activations_only_and_a_receiver_keeps_buffers_too():
    with pytest.raises(FusionError, match="activations only"):
        CompressionTable.build("p1", [EdgeCompression("relu_a", None, "p1", "p3", bwd_codec=D4)])
    t = CompressionTable.build("p3", COMP)
    assert set(t.recv) == {(("relu_a", None), "p1")} and not t.fwd and t  # a receive-only table is kept
    assert CompressionTable.build("p1", COMP).delta_cfgs() == {("recv", ("conv1", None), "p0"): D4,
                                                                ("send", ("relu_a", None), "p3"): D2}


def test_the_reference_executor_trains_through_delta_edges_close_to_dense():
    ex, delta = _reference(9)
    _, dense = _reference(9, [])
    assert delta != dense  # the codec really ran
    np.testing.assert_allclose(delta, dense, rtol=0.05)
    for key, src, dst in EDGES:  # sender and receiver hold the same bits for all 12 samples
        a = ex.parts[src].compression.delta.buffers[("send", key, dst)].state_dict()
        b = ex.parts[dst].compression.delta.buffers[("recv", key, src)].state_dict()
        assert sorted(a) == sorted(b) == list(range(12))
        for i in a:
            np.testing.assert_array_equal(a[i], b[i])


def test_a_missing_sample_id_is_refused_with_a_message():
    ex = ReferenceExecutor(branching_cnn(mb=2), SPLIT, OptimizerConfig("sgd", lr=0.1), micro_batches=2,
                           compression=COMP)
    with pytest.raises(FusionError, match="needs each micro-batch's sample ids"):
        ex.step(cnn_batch(0, 4))


def _plan_dir(tmp_path, compression=COMP):
    from fusion.executors.runtime.launcher import hand_plan
    from fusion.plan import save_plan

    model = branching_cnn(mb=2)
    plan = hand_plan(model, SPLIT, micro_batches=2, optimizer=OptimizerConfig("adamw", lr=0.01))
    plan.compression = compression
    return save_plan(plan, tmp_path / "plan", params=model.params)


def _run(plan_dir, run_dir, steps: range, every: int = 0, resume: bool = False, kill_after: bool = False):
    from fusion.executors.runtime.launcher import LocalCluster

    cfg = CoordinatorConfig(peer_timeout_s=20, checkpoint_dir=str(run_dir / "ckpt"), checkpoint_every=every)
    lc = LocalCluster(plan_dir, run_dir, cfg, threads=1, trace=False)
    try:
        first = lc.start(resume=resume)
        assert first == steps.start
        losses = [lc.coordinator.step(batch(s)).loss for s in steps]
    finally:
        lc.close(graceful=not kill_after)  # not graceful: SIGTERM/SIGKILL, as a crash would leave them
    return losses


def test_distributed_delta_run_equals_the_reference_and_both_ends_hold_the_same_buffers(tmp_path):
    """Four executor processes with delta edges give the reference executor's losses, and the buffers every
    sender and receiver saved with the last checkpoint are identical, and identical to the reference's."""
    from fusion.executors.runtime import checkpoint

    steps = 6
    losses = _run(_plan_dir(tmp_path), tmp_path / "run", range(steps), every=steps)
    ex, ref = _reference(steps)
    np.testing.assert_allclose(losses, ref, rtol=1e-6)
    root = tmp_path / "run" / "ckpt"
    for key, src, dst in EDGES:
        sent = _buffers(checkpoint.load_delta(root, steps, src), "send", key, dst)
        got = _buffers(checkpoint.load_delta(root, steps, dst), "recv", key, src)
        assert sorted(sent) == sorted(got) == list(range(12))
        ref_rows = ex.parts[src].compression.delta.buffers[("send", key, dst)].state_dict()
        for i in sent:
            np.testing.assert_array_equal(sent[i], got[i])
            np.testing.assert_allclose(sent[i], ref_rows[i], rtol=1e-5, atol=1e-6)
    assert checkpoint.load_delta(root, steps, "p2") is None  # a part without delta edges saves none


def test_resume_after_a_kill_continues_the_delta_run_bit_for_bit(tmp_path):
    plan_dir = _plan_dir(tmp_path)
    whole = _run(plan_dir, tmp_path / "a", range(7))
    run = tmp_path / "b"
    head = _run(plan_dir, run, range(5), every=2, kill_after=True)  # checkpoints at 2 and 4, killed after 5
    tail = _run(plan_dir, run, range(4, 7), every=2, resume=True)
    assert head == whole[:5]
    assert tail == whole[4:]  # step 4 replayed from the checkpoint's buffers: the same bits


def test_a_compnode_rejects_delta_payloads_it_cannot_decode_and_keeps_serving(tmp_path, caplog):
    from fusion.executors.runtime.compnode import CompNode, ExecutorConfig
    from fusion.executors.runtime.control import Setup
    from fusion.plan import load_plan

    plan_dir = _plan_dir(tmp_path)
    node = CompNode(load_plan(plan_dir), plan_dir, ExecutorConfig("p3", "tcp://127.0.0.1:9"))
    node._setup(Setup(peers={p: "tcp://127.0.0.1:9" for p in ("p0", "p1", "p2")},
                      emulate_links=False, resume_step=None, checkpoint_dir=None))
    try:
        x = np.random.default_rng(2).standard_normal((2, 4, 6, 6)).astype(np.float32)
        sender = DeltaBuffer(D2)
        first = sender.encode(x, [0, 1])  # both first visits
        again = sender.encode(x * 1.1, [0, 1])  # deltas against what the receiver has not got yet

        def frames(payload, mb=0, name="relu_a", src="p1", **kw):
            return encode_opdata(OpData(name, None, ("add_ab",), ("add_ab",), False, 0, mb, src=src, dst="p3",
                                        payload=payload, requires_grad=True, compress_cfg=D2, **kw))

        good = frames(first)
        head = msgpack.unpackb(bytes(memoryview(good[0])), raw=False)

        def mutate(**fields):
            h = {**head, "h": {**head["h"], "payload": {**head["h"]["payload"], **fields}}}
            return [msgpack.packb(h), *good[1:]]

        bad = {"cache miss": (b"p1", frames(again, mb=1)),
               "not a delta edge": (b"p2", frames(DeltaBuffer(D2).encode(x, [0, 1]), name="tanh_b", src="p2")),
               "wrong row shape": (b"p1", mutate(row_shape=[4, 6, 7])),
               "ids frame short": (b"p1", good[:1] + [bytes(memoryview(good[1]))[:-8]] + good[2:])}
        caplog.set_level(logging.WARNING)
        before = node.transport.rejected
        for sender, f in bad.values():
            node.transport._handle([zmq.Frame(sender), *[zmq.Frame(bytes(memoryview(b))) for b in f]])
        assert node.transport.rejected - before == len(bad)
        assert "sample id 0 is sent as a delta but p3 has no buffer for it (cache miss" in caplog.text
        assert node.transport.escaped == 0  # every refusal was a WireError, none a crash in a handler
        node.transport._handle([zmq.Frame(b"p1"), *[zmq.Frame(bytes(memoryview(b))) for b in good]])
        assert node.transport.rejected - before == len(bad)  # the good one is accepted
        (od,) = node.inbox._data[(0, "F", 0)]
        assert isinstance(od.payload, DeltaPayload)
        np.testing.assert_array_equal(node.runtime.compression.decode(od, (2, 4, 6, 6)), DeltaBuffer(D2).decode(first))
    finally:
        node.transport.close(timeout_s=1, linger_s=0)


def test_a_part_without_delta_edges_refuses_a_delta_payload(tmp_path, caplog):
    from fusion.executors.runtime.compnode import CompNode, ExecutorConfig
    from fusion.executors.runtime.control import Setup
    from fusion.plan import load_plan

    plan_dir = _plan_dir(tmp_path)
    node = CompNode(load_plan(plan_dir), plan_dir, ExecutorConfig("p2", "tcp://127.0.0.1:9"))  # conv1 comes dense
    node._setup(Setup(peers={p: "tcp://127.0.0.1:9" for p in ("p0", "p3")},
                      emulate_links=False, resume_step=None, checkpoint_dir=None))
    try:
        x = np.random.default_rng(2).standard_normal((2, 4, 6, 6)).astype(np.float32)
        f = encode_opdata(OpData("conv1", None, ("conv_a", "conv_b", "add_skip"), ("conv_b",), False, 0, 0, src="p0",
                                 dst="p2", payload=DeltaBuffer(D4).encode(x, [0, 1]), requires_grad=True, compress_cfg=D4))
        caplog.set_level(logging.WARNING)
        node.transport._handle([zmq.Frame(b"p0"), *[zmq.Frame(bytes(memoryview(b))) for b in f]])
        assert node.transport.rejected == 1 and node.transport.escaped == 0
        assert "delta payload, but p2 has no delta (AQ-SGD) edge" in caplog.text
        assert not node.inbox._data
    finally:
        node.transport.close(timeout_s=1, linger_s=0)


def test_batches_for_a_delta_plan_must_carry_sample_ids(tmp_path):
    from fusion.data.batches import make_batches
    from fusion.executors.runtime.delta_edges import batch_sample_ids
    from fusion.plan import load_plan

    plan = load_plan(_plan_dir(tmp_path))
    with pytest.raises(FusionError, match="synthetic batches never show a sample twice"):
        make_batches(plan, "synthetic")
    with pytest.raises(FusionError, match="has no field '#sample_ids'"):
        batch_sample_ids(plan, cnn_batch(0, 4))
    with pytest.raises(FusionError, match="a sample appears twice"):
        batch_sample_ids(plan, {**cnn_batch(0, 4), SAMPLE_IDS: np.array([1, 2, 2, 3])})
    np.testing.assert_array_equal(batch_sample_ids(plan, batch(1)), [4, 5, 6, 7])


def test_a_numpy_compnode_without_torch_runs_both_ends_of_delta_edges(tmp_path):
    """A torch CompNode sends AQ-SGD deltas to a NumPy CompNode whose process cannot import torch, which
    decodes them with its own buffers: the run equals the in-process reference executor with the same engines
    and codecs, and the NumPy process never loaded torch."""
    import json

    import tests.ir.onnx_models as onnx_models
    from tests.executors.test_mixed_engines import _blocked_env
    from fusion.executors.runtime.launcher import LocalCluster, hand_plan
    from fusion.ir.boundary import partition
    from fusion.ir.onnx.importer import load_onnx
    from fusion.plan import save_plan

    tt = onnx_models.tiny_transformer_module()
    module, args = tt.model()
    model = load_onnx(onnx_models.export(module, args, tmp_path / "tt.onnx"))
    assign = {n: ("A" if p == "a" else "B") for n, p in onnx_models.two_part_assignment(model.graph).items()}
    comp = [EdgeCompression(e.producer, e.index, "A", "B", fwd_codec=D4, bwd_codec=Q8)
            for e in {(e.producer, e.index): e for e in partition(model.graph, assign)["A"].boundary.sent_acts}.values()]
    assert comp
    g = np.random.default_rng(5)
    data = [(g.integers(0, 13, (4, 8)), g.integers(0, 13, (4, 8))) for _ in range(2)]
    batches = [{"idx": data[s % 2][0], "targets": data[s % 2][1], SAMPLE_IDS: np.arange(4) + 4 * (s % 2)}
               for s in range(5)]
    opt = OptimizerConfig("sgd", lr=0.1, momentum=0.9)
    ref = ReferenceExecutor(model, assign, opt, micro_batches=2, schedule="1f1b", engines={"A": "torch", "B": "numpy"},
                            compression=comp)
    expected = [ref.step(b).loss for b in batches]
    dense = ReferenceExecutor(model, assign, opt, micro_batches=2, schedule="1f1b", engines={"A": "torch", "B": "numpy"})
    assert [dense.step(b).loss for b in batches] != expected  # the deltas change the numbers: they really ran
    plan = hand_plan(model, assign, schedule="1f1b", micro_batches=2, optimizer=opt, engines={"A": "torch", "B": "numpy"})
    plan.compression = comp
    plan_dir = save_plan(plan, tmp_path / "plan", params=model.params)
    env_b, record = _blocked_env(tmp_path)
    with LocalCluster(plan_dir, tmp_path / "run", CoordinatorConfig(peer_timeout_s=30), threads=1, trace=False,
                      part_env={"B": env_b}) as lc:
        lc.start()
        losses = [lc.coordinator.step(b).loss for b in batches]
    np.testing.assert_allclose(losses, expected, rtol=1e-6)
    bufs = ref.parts["B"].compression.delta.buffers  # float cut tensors go as deltas (others dense)
    assert bufs and all(len(b) == 8 for b in bufs.values())  # every sample buffered at B
    rec = json.loads(record.read_text())
    assert rec["torch_blocked"] is True and rec["torch_modules"] == [] and rec["numpy_engine_loaded"]

"""Hostile messages (issue 15): whatever a process on the same host sends, executors and the coordinator keep
serving, count the message as rejected with the sender, and training is not changed by a bit."""
import re
import time

import msgpack
import numpy as np
import pytest
import zmq

from tests.executors.dist_models import CNN_SPLITS, branching_cnn, cnn_batch, save_hand_plan
from fusion.executors.runtime.compnode import CompNode, ExecutorConfig
from fusion.executors.runtime.control import decode_ctrl
from fusion.executors.runtime.coordinator import Coordinator, CoordinatorConfig
from fusion.executors.runtime.launcher import LocalCluster
from fusion.ir.errors import WireError
from fusion.ir.wire import decode, encode
from fusion.plan import OptimizerConfig, load_plan

#: the packet of the issue (13 bytes of msgpack; the issue says 14): a list as the message kind
LIST_KIND = [msgpack.packb({"v": 1, "k": [], "h": {}, "t": []})]
#: a zero-size tensor with a dimension numpy cannot index
HUGE_DIM = [msgpack.packb({"v": 1, "k": "opdata", "h": {}, "t": [{"d": "float32", "s": [0, 2**63 - 1]}]}), b""]
MAP_KIND = [msgpack.packb({"v": 1, "k": {"a": 1}, "h": {}, "t": []})]
HOSTILE = [LIST_KIND, HUGE_DIM, MAP_KIND]


def test_the_issue_packets_are_wire_errors():
    for frames in HOSTILE:
        with pytest.raises(WireError):
            decode(frames)


def _send(ctx, identity: bytes, address: str, messages) -> None:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.IDENTITY, identity)
    s.setsockopt(zmq.LINGER, 2000)
    s.connect(address)
    for frames in messages:
        s.send_multipart(frames)
    s.close()


def _train(plan_dir, run_dir, batches, attack=None):
    cfg = CoordinatorConfig(peer_timeout_s=20)
    with LocalCluster(plan_dir, run_dir, cfg, threads=1, trace=False) as lc:
        lc.start()
        reports = []
        for i, b in enumerate(batches):
            if attack is not None and i == 1:
                attack(lc)
            reports.append(lc.coordinator.step(b))
        coord = lc.coordinator.transport
        return reports, coord.rejected, getattr(coord, "escaped", 0), {p: pr.poll() for p, pr in lc.processes.items()}


def test_hostile_packets_to_a_live_executor_and_the_coordinator_change_nothing(tmp_path):
    model = branching_cnn(mb=2)
    plan_dir = save_hand_plan(tmp_path, model, CNN_SPLITS[2], micro_batches=2, optimizer=OptimizerConfig("sgd", lr=0.1))
    batches = [cnn_batch(s, 4) for s in range(4)]
    clean, *_ = _train(plan_dir, tmp_path / "clean", batches)
    ctx = zmq.Context()

    def attack(lc):
        for target in (lc.coordinator.addresses["p0"], lc.coordinator.addresses["p1"], lc.coordinator.address):
            _send(ctx, b"mallory", target, HOSTILE)
        log = tmp_path / "hit" / "logs" / "p1.log"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (lc.coordinator.transport.rejected < len(HOSTILE)
                                               or log.read_text().count("rejected message from 'mallory'") < len(HOSTILE)):
            time.sleep(0.02)

    hit, rejected, escaped, alive = _train(plan_dir, tmp_path / "hit", batches, attack)
    ctx.term()
    assert all(rc is None for rc in alive.values()), f"an executor exited: {alive}"
    assert rejected == len(HOSTILE) and escaped == 0
    for r in hit[1:]:
        assert r.parts["p0"]["rejected"] == r.parts["p1"]["rejected"] == len(HOSTILE)
        assert r.parts["p1"].get("escaped", 0) == 0
    assert [r.loss for r in hit] == [r.loss for r in clean]  # exactly: the run did not notice
    text = (tmp_path / "hit" / "logs" / "p1.log").read_text()
    # the sender is checked before a byte is decoded: a stranger's packets never reach the decoder (the same packets
    # under a valid key, which are decoded, are in test_curve.py)
    assert text.count("rejected message from 'mallory': unknown sender 'mallory'") >= len(HOSTILE)


def test_type_confused_control_fields_are_rejected_by_the_receivers(tmp_path):
    """Messages from an allowed sender (which only an identity squatter could send) are type-checked field by field."""
    model = branching_cnn(mb=2)
    plan_dir = save_hand_plan(tmp_path, model, CNN_SPLITS[2], micro_batches=2)
    plan = load_plan(plan_dir)
    node = CompNode(plan, plan_dir, ExecutorConfig("p1", "tcp://127.0.0.1:9"))
    coord = Coordinator(plan, CoordinatorConfig())
    ctrl = lambda **h: decode(encode("ctrl", {"names": [], **h}))  # noqa: E731
    try:
        to_node = [
            (ctrl(op=["step"]), "unknown control op ['step']"),
            (ctrl(op="step", it="0", want_grads=False, checkpoint=False), "field 'it' has a bad value '0'"),
            (ctrl(op="step", it=0, want_grads=1, checkpoint=False), "field 'want_grads'"),
            (ctrl(op="abort", reason={"x": 1}), "field 'reason'"),
            (ctrl(op="setup", peers={"p0": 5}, emulate_links=False, resume_step=None, checkpoint_dir=None, digest=""),
             "field 'peers'"),
            (ctrl(op="hello", part="p1", address="x", pid=1, engine="torch"), "not one this process receives"),
            (decode(encode("ctrl", {"op": "step", "names": ["x/../y"], "it": 0, "want_grads": False, "checkpoint": False},
                           [np.zeros(1)])), "is not '<micro-batch>/<placeholder>'"),
        ]
        for m, reason in to_node:
            with pytest.raises(WireError, match=re.escape(reason)):
                node._on_message("coordinator", m)
        to_coord = [
            (ctrl(op="done", it=0, losses=[["a", 1.0]], stats={}), "field 'losses'"),
            (ctrl(op="done", it=-1, losses=[], stats={}), "field 'it'"),
            (ctrl(op="hello", part=["p0"], address="x", pid=1, engine="torch", digest=""), "field 'part'"),
            (ctrl(op="step", it=0, want_grads=False, checkpoint=False), "not one this process receives"),
        ]
        for m, reason in to_coord:
            with pytest.raises(WireError, match=re.escape(reason)):
                coord._on_message("p0", m)
        assert decode_ctrl(ctrl(op="done", it=0, losses=[[0, 1.5]], stats={})).losses == [[0, 1.5]]
    finally:
        node.transport.close(timeout_s=1, linger_s=0)
        coord.transport.close(timeout_s=1, linger_s=0)

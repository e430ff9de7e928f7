"""Memory under attack (issue 15): a 1 GiB message and a flood of 10 000 messages leave the executor's memory bounded
and the run exact; a sender whose rejected messages come too fast is cut off and named, and when it is a peer of the
run (a valid key sending garbage) the run stops naming it.

The stranger here runs without CURVE (``--insecure``), where it can reach the executor's decoder at all; with CURVE it
does not get past the handshake (test_curve.py)."""
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq

from tests.executors.dist_models import CNN_SPLITS, branching_cnn, cnn_batch, save_hand_plan, wait_for
from fusion.executors.runtime.coordinator import CompNodeFailure, CoordinatorConfig
from fusion.executors.runtime.keys import load_secret
from fusion.executors.runtime.launcher import LocalCluster
from fusion.executors.runtime.transport import REJECT_LIMIT
from fusion.ir.opdata import OpData
from fusion.ir.wire import encode_opdata
from fusion.plan import OptimizerConfig

FLOOD = 10_000


def _status_mb(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field}")


def _train(plan_dir, run_dir, batches, attack=None, curve=False):
    with LocalCluster(plan_dir, run_dir, CoordinatorConfig(peer_timeout_s=30), threads=1, trace=False, curve=curve) as lc:
        lc.start()
        out, mem = [], {}
        for i, b in enumerate(batches):
            if attack is not None and i == 1:
                mem = attack(lc)
            out.append(lc.coordinator.step(b))
        alive = {p: pr.poll() for p, pr in lc.processes.items()}
    return out, alive, mem


def test_a_1gib_message_and_a_flood_from_a_stranger_leave_memory_bounded_and_the_run_exact(tmp_path):
    model = branching_cnn(mb=2)
    plan_dir = save_hand_plan(tmp_path, model, CNN_SPLITS[2], micro_batches=2, optimizer=OptimizerConfig("sgd", lr=0.1))
    batches = [cnn_batch(s, 4) for s in range(4)]
    clean, _, _ = _train(plan_dir, tmp_path / "clean", batches)
    ctx = zmq.Context()
    log = tmp_path / "hit" / "logs" / "p1.log"

    def attack(lc):
        pid = lc.processes["p1"].pid
        before = _status_mb(pid, "VmRSS")

        def dealer(identity: bytes):  # one identity per connection: a ROUTER ignores a second one under a taken name
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDTIMEO, 20_000)
            s.setsockopt(zmq.IDENTITY, identity)
            s.connect(lc.coordinator.addresses["p1"])
            return s

        # 1 GiB declared and sent (untouched zero pages: the sender's memory does not grow): over the link's limit,
        # ZeroMQ drops the connection when it reads the frame's size, before buffering it (logged, counted: connwatch)
        big = dealer(b"mallory-big")
        gib = np.zeros(1 << 30, np.uint8)
        big.send_multipart([msgpack.packb({"v": 1, "k": "opdata", "h": {}, "t": [{"d": "uint8", "s": [1 << 30]}]}),
                            memoryview(gib)], copy=False)
        # 10 000 well-formed activations: rejected, until the sender is cut off; the rest dropped unread
        flood = dealer(b"mallory")
        for _ in range(FLOOD):
            flood.send_multipart(_activation(), copy=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not _cut_off(log, "mallory"):
            time.sleep(0.1)
        time.sleep(1.0)  # the rest of the flood arrives and is dropped
        after = _status_mb(pid, "VmRSS")
        big.close()
        flood.close()
        del gib
        return {"before": before, "after": after, "warnings": log.read_text().count("rejected message from 'mallory'")}

    hit, alive, mem = _train(plan_dir, tmp_path / "hit", batches, attack)
    ctx.term()
    print(f"p1 RSS before the attack {mem['before']:.1f} MB, after {mem['after']:.1f} MB; {mem['warnings']} warnings")
    assert all(rc is None for rc in alive.values()), alive
    assert mem["after"] - mem["before"] < 32, mem  # not 1 GiB, not the flood: bounded
    assert mem["warnings"] == REJECT_LIMIT + 1  # then one line naming the sender, and the log stays quiet
    assert [r.loss for r in hit] == [r.loss for r in clean]
    # every message counted, read or not, and the 1 GiB one too: the connection ZeroMQ closed on it (issue 39)
    # (the watch notes the closed connection on its own thread: counted by the last step at the latest)
    assert hit[1].parts["p1"]["rejected"] in (FLOOD, FLOOD + 1) and hit[-1].parts["p1"]["rejected"] == FLOOD + 1


def _activation(it: int = 10_000, src: str = "p0"):
    """A well-formed activation p0 would send p1, for an iteration far ahead (rejected by the inbox)."""
    return encode_opdata(OpData(name="relu_a", index=None, op_users=("add_ab",), actual_user=("add_ab",), is_grad=False,
                                local_iter=it, micro_batch=0, src=src, dst="p1", payload=np.ones((2, 4, 6, 6), np.float32)))


def _cut_off(log: Path, sender: str) -> bool:
    return f"{sender} sent {REJECT_LIMIT + 1} rejected messages within" in log.read_text()


def test_a_peer_of_the_run_sending_garbage_is_cut_off_and_the_run_stops_naming_it(tmp_path):
    """p0's own key (a broken or compromised p0) floods p1 with rejected messages: p1 names p0, the run stops."""
    model = branching_cnn(mb=2)
    plan_dir = save_hand_plan(tmp_path, model, CNN_SPLITS[2], micro_batches=2)
    ctx = zmq.Context()
    try:
        with LocalCluster(plan_dir, tmp_path / "run", CoordinatorConfig(peer_timeout_s=30), threads=1, trace=False,
                          curve=True) as lc:
            lc.start()
            lc.coordinator.step(cnn_batch(0, 4))
            p0 = load_secret(tmp_path / "run" / "keys" / "p0.secret")
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.curve_publickey, s.curve_secretkey = p0.public.encode(), p0.secret.encode()
            s.curve_serverkey = lc.cfg.security.peers["p1"].encode()
            s.connect(lc.coordinator.addresses["p1"])
            for _ in range(2 * REJECT_LIMIT):
                s.send_multipart(_activation())
            assert wait_for(lambda: _cut_off(tmp_path / "run" / "logs" / "p1.log", "p0"))
            with pytest.raises(CompNodeFailure, match=f"CompNode 'p1' failed: peer p0 sent {REJECT_LIMIT + 1} rejected "
                                                      f"messages within 10 s .*for iteration 10000"):
                lc.coordinator.step(cnn_batch(1, 4))
            s.close()
    finally:
        ctx.term()


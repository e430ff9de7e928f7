"""Memory under attack (issue 15): a 1 GiB message and a flood of 10 000 messages, both from a peer holding a valid
key (a stranger does not get past the CURVE handshake at all), leave the executor's memory bounded and the run
exact."""
import time
from pathlib import Path

import msgpack
import numpy as np
import zmq

from tests.executors.dist_models import CNN_SPLITS, branching_cnn, cnn_batch, save_hand_plan
from fusion.executors.runtime.coordinator import CoordinatorConfig
from fusion.executors.runtime.keys import load_secret
from fusion.executors.runtime.launcher import LocalCluster
from fusion.ir.opdata import OpData
from fusion.ir.wire import encode_opdata
from fusion.plan import OptimizerConfig

FLOOD = 10_000


def _status_mb(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field}")


def _train(plan_dir, run_dir, batches, attack=None):
    with LocalCluster(plan_dir, run_dir, CoordinatorConfig(peer_timeout_s=30), threads=1, trace=False, curve=True) as lc:
        lc.start()
        out, mem = [], {}
        for i, b in enumerate(batches):
            if attack is not None and i == 1:
                mem = attack(lc)
            out.append(lc.coordinator.step(b))
        alive = {p: pr.poll() for p, pr in lc.processes.items()}
    return out, alive, mem


def test_a_1gib_message_and_a_flood_leave_memory_bounded_and_the_run_exact(tmp_path):
    model = branching_cnn(mb=2)
    plan_dir = save_hand_plan(tmp_path, model, CNN_SPLITS[2], micro_batches=2, optimizer=OptimizerConfig("sgd", lr=0.1))
    batches = [cnn_batch(s, 4) for s in range(4)]
    clean, _, _ = _train(plan_dir, tmp_path / "clean", batches)
    ctx = zmq.Context()
    log = tmp_path / "hit" / "logs" / "p1.log"

    def attack(lc):
        pid = lc.processes["p1"].pid
        before = _status_mb(pid, "VmRSS")
        p0 = load_secret(tmp_path / "hit" / "keys" / "p0.secret")

        def dealer():
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDTIMEO, 20_000)
            s.curve_publickey, s.curve_secretkey = p0.public.encode(), p0.secret.encode()
            s.curve_serverkey = lc.cfg.security.peers["p1"].encode()
            s.connect(lc.coordinator.addresses["p1"])
            return s

        # 1 GiB declared and sent (untouched zero pages: the sender's memory does not grow): over the link's limit,
        # ZeroMQ drops the connection when it reads the frame's size, before buffering it
        big = dealer()
        gib = np.zeros(1 << 30, np.uint8)
        big.send_multipart([msgpack.packb({"v": 1, "k": "opdata", "h": {}, "t": [{"d": "uint8", "s": [1 << 30]}]}),
                            memoryview(gib)], copy=False)
        # 10 000 well-formed activations for an iteration far ahead: each decoded, checked and rejected
        flood = dealer()
        frames = encode_opdata(OpData(name="relu_a", index=None, op_users=("add_ab",), actual_user=("add_ab",),
                                      is_grad=False, local_iter=10_000, micro_batch=0, src="p0", dst="p1",
                                      payload=np.ones((2, 4, 6, 6), np.float32)))
        for _ in range(FLOOD):
            flood.send_multipart(frames, copy=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and log.read_text().count("for iteration 10000") < FLOOD:
            time.sleep(0.1)
        after = _status_mb(pid, "VmRSS")
        big.close()
        flood.close()
        del gib
        return {"before": before, "after": after, "rejected": log.read_text().count("for iteration 10000")}

    hit, alive, mem = _train(plan_dir, tmp_path / "hit", batches, attack)
    ctx.term()
    print(f"p1 RSS before the attack {mem['before']:.1f} MB, after {mem['after']:.1f} MB; {mem['rejected']} rejected")
    assert all(rc is None for rc in alive.values()), alive
    assert mem["rejected"] == FLOOD
    assert mem["after"] - mem["before"] < 32, mem  # not 1 GiB, not the flood: bounded
    assert [r.loss for r in hit] == [r.loss for r in clean]
    assert hit[1].parts["p1"]["rejected"] >= FLOOD

"""A hello lost with a closing coordinator's socket is said again (CI of stop 47: a supervisor restarted a killed
executor within a second; its hello reached ``fusion coordinator --max-restarts`` while the old coordinator closed to
rebind, was lost with that socket, and the new coordinator waited out ``--restart-wait`` for a part that waited for it).

Here a ROUTER at the coordinator's address reads the executor's hello and closes without answering, as the closing
coordinator did; a new ROUTER bound at the same address must get the same hello again (same pid and address, so the
coordinator takes it as a repeat, not as a new executor: tests/fusion/test_coordinator_restarts.py)."""
import subprocess
import sys
import time

import zmq

from tests.executors.dist_models import CNN_SPLITS, branching_cnn, save_hand_plan
from tests.fusion.cli_helpers import free_ports
from fusion.executors.runtime.control import TO_COORDINATOR, decode_ctrl
from fusion.executors.runtime.process import HELLO_REPEAT_S
from fusion.ir.wire import decode


def _hello(ctx, addr: str, timeout_s: float):
    """The first hello a fresh ROUTER bound at ``addr`` receives within ``timeout_s`` (heartbeats skipped), or None."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        deadline = time.monotonic() + timeout_s
        while True:  # the previous ROUTER's listener closes in ZeroMQ's I/O thread, after its close() returned
            try:
                sock.bind(addr)
                break
            except zmq.ZMQError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        while time.monotonic() < deadline:
            if sock.poll(100):
                sender, *frames = sock.recv_multipart()
                c = decode_ctrl(decode(frames), TO_COORDINATOR)
                if c.op == "hello":
                    return sender.decode(), c, time.monotonic()
        return None
    finally:
        sock.close(linger=0)


def test_an_executor_says_hello_again_until_the_coordinator_answers(tmp_path):
    plan_dir = save_hand_plan(tmp_path, branching_cnn(mb=2), CNN_SPLITS[2], micro_batches=2)
    coord = f"tcp://127.0.0.1:{free_ports(1)[0]}"
    log = open(tmp_path / "p1.log", "wb")
    ex = subprocess.Popen([sys.executable, "-m", "fusion.cli", "executor", str(plan_dir), "--node", "p1",
                           "--coordinator", coord, "--bind", "tcp://127.0.0.1:*", "--insecure",
                           "--startup-timeout", "60"], stdout=log, stderr=subprocess.STDOUT)
    ctx = zmq.Context()
    try:
        first = _hello(ctx, coord, 60)  # read, never answered; the socket closes
        assert first is not None, (tmp_path / "p1.log").read_text()
        second = _hello(ctx, coord, 10 * HELLO_REPEAT_S)  # the next coordinator at the same address
        assert second is not None, (tmp_path / "p1.log").read_text()
        (s1, h1, _), (s2, h2, _) = first, second
        assert s1 == s2 == "p1" and h1 == h2 and h1.pid == ex.pid  # the same executor, the same hello
        assert ex.poll() is None  # still waiting for its setup
    finally:
        ex.kill()
        ex.wait()
        log.close()
        ctx.term()

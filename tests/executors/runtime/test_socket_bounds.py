"""Bounded in memory at the socket (issue 39): libzmq refuses an over-limit frame when it reads its length.

Before, a keyless executor took a 960 MiB message of 60 x 16 MiB frames whole into memory (each frame under
ZMQ_MAXMSGSIZE = 2 x limit + 1 MiB) before the transport refused it: peak RSS +959 MiB. Now ZMQ_MAXMSGSIZE is the
part's own limit, so the first frame is refused unread, and the connection watch (``connwatch.py``) logs the
refusal (a connection closed by ZeroMQ while its peer was still sending), counted; a peer that leaves is not.
"""
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import zmq

from tests.executors.dist_models import CNN_SPLITS, branching_cnn, save_hand_plan, wait_for
from fusion.executors.runtime.transport import FRAME_SLACK, Transport
from fusion.ir.wire import encode
from fusion.plan import OptimizerConfig


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _hwm_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def test_a_960_mib_multipart_message_does_not_raise_a_keyless_executor_s_peak_memory(tmp_path):
    model = branching_cnn(mb=2)
    plan_dir = save_hand_plan(tmp_path, model, CNN_SPLITS[2], micro_batches=2, optimizer=OptimizerConfig("sgd", lr=0.01))
    addr = f"tcp://127.0.0.1:{_free_port()}"
    log = open(tmp_path / "p1.log", "wb")
    ex = subprocess.Popen([sys.executable, "-m", "fusion.cli", "executor", str(plan_dir), "--node", "p1",
                           "--coordinator", f"tcp://127.0.0.1:{_free_port()}", "--bind", addr, "--insecure",
                           "--startup-timeout", "60"], stdout=log, stderr=subprocess.STDOUT)
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    try:
        assert wait_for(lambda: b"said hello" in (tmp_path / "p1.log").read_bytes(), timeout=60), \
            (tmp_path / "p1.log").read_text()
        time.sleep(0.5)
        before = _hwm_mb(ex.pid)
        s.setsockopt(zmq.IDENTITY, b"p0")  # a name the part accepts (keyless: senders name themselves)
        s.setsockopt(zmq.LINGER, 5000)
        s.connect(addr)
        chunk = np.zeros(16 << 20, np.uint8)
        s.send_multipart([encode("opdata", {})[0]] + [chunk] * 60, copy=False)  # 960 MiB
        assert wait_for(lambda: b"closed by ZeroMQ while" in (tmp_path / "p1.log").read_bytes(), timeout=30), \
            (tmp_path / "p1.log").read_text()[-2000:]
        time.sleep(1.0)
        after = _hwm_mb(ex.pid)
        print(f"executor VmHWM before {before:.1f} MiB, after the 960 MiB message {after:.1f} MiB")
        assert after - before <= 128, (before, after)
        assert ex.poll() is None  # still serving
    finally:
        s.close(linger=0)  # (before term: an open socket with unsent frames would hold term() forever)
        ex.kill()
        ex.wait(10)
        ctx.term()
        log.close()
    text = (tmp_path / "p1.log").read_text()
    line = next(ln for ln in text.splitlines() if "closed by ZeroMQ while" in ln)
    assert re.search(r"limit of \d+ bytes", line) and "127.0.0.1:" in line


def test_an_over_limit_frame_is_refused_and_counted_and_a_leaving_peer_is_not():
    limit = 64 << 10
    got, rejected = [], []
    rx = Transport("p1", "tcp://127.0.0.1:*", {"p0"}, lambda s, m: got.append(m.header), max_message_bytes=limit,
                   on_reject=lambda s, r: rejected.append(r))
    tx = Transport("p0", "tcp://127.0.0.1:*", set(), lambda s, m: None)
    try:
        addr = rx.start()
        tx.connect("p1", addr)  # no max_bytes: the sender does not check, as a foreign sender would not
        tx.send("p1", encode("opdata", {"n": 0}, [np.zeros(16, np.uint8)]))
        assert wait_for(lambda: got, timeout=20)
        tx.send("p1", encode("opdata", {}, [np.zeros(limit + FRAME_SLACK + 1, np.uint8)]))
        assert wait_for(lambda: rejected, timeout=20)
        tx.send("p1", encode("opdata", {"n": 1}, [np.zeros(16, np.uint8)]))  # ZeroMQ reconnected: arrives
        assert wait_for(lambda: len(got) == 2, timeout=20), (rejected, got)
        assert len(rejected) == 1 and "closed by ZeroMQ while it was still sending" in rejected[0]
        assert f"limit of {limit + FRAME_SLACK} bytes" in rejected[0]
        # exactly at the limit: taken
        tx.send("p1", encode("opdata", {"n": 2}, [np.zeros(limit - 200, np.uint8)]))
        assert wait_for(lambda: len(got) == 3, timeout=20), got
    finally:
        tx.close(timeout_s=1, linger_s=0)
    time.sleep(0.5)  # the peer left: its connection's end is no refusal
    try:
        assert len(rejected) == 1 and rx.watch.watch.refused == 1
    finally:
        rx.close(timeout_s=1, linger_s=0)


def test_a_refusal_is_counted_even_when_the_watch_lags_behind_libzmq():
    """The watch sees each connection 0.3 s late (a loaded host, the GIL held elsewhere) and the sender never
    reconnects: libzmq refuses the over-limit frame long before a separate reading thread would have held the
    connection. The ZAP handler drains the monitor before it lets the handshake end, so the watch holds the
    connection before a frame of it is read: counted (missed before: the CI failure of stop 42)."""
    limit = 64 << 10
    rejected = []
    rx = Transport("p1", "tcp://127.0.0.1:*", {"p0"}, lambda s, m: None, max_message_bytes=limit,
                   on_reject=lambda s, r: rejected.append(r))
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    try:
        addr = rx.start()
        watch = rx.watch.watch
        accepted = watch.accepted

        def late(fd):
            time.sleep(0.3)
            accepted(fd)

        watch.accepted = late
        s.setsockopt(zmq.IDENTITY, b"p0")
        s.setsockopt(zmq.RECONNECT_IVL, 60_000)  # no reconnection reusing the descriptor number meanwhile
        s.connect(addr)
        s.send_multipart([encode("opdata", {})[0], np.zeros(limit + FRAME_SLACK + 1, np.uint8)])
        assert wait_for(lambda: rejected, timeout=10), watch.refused
        assert watch.refused == 1 and "closed by ZeroMQ while it was still sending" in rejected[0]
    finally:
        s.close(linger=0)
        ctx.term()
        rx.close(timeout_s=1, linger_s=0)

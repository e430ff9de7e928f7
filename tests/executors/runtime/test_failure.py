"""Failures: a CompNode killed mid-run, resume from checkpoint, and bad messages to a live executor."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
import zmq

from tests.executors.dist_models import CNN_SPLITS, GPT_SPLITS, branching_cnn, cnn_batch, cnn_plain_loss, plain_training, save_hand_plan, \
    tied_transformer
from fusion.executors.runtime.compnode import CompNode, ExecutorConfig
from fusion.cluster.scenarios import load_scenario
from fusion.executors.runtime.control import Setup
from fusion.executors.runtime.coordinator import CoordinatorConfig
from fusion.executors.runtime.keys import load_secret
from fusion.executors.runtime.launcher import LocalCluster
from fusion.plan import OptimizerConfig
from fusion.ir.errors import WireError
from fusion.ir.opdata import OpData
from fusion.ir.wire import decode, encode, encode_opdata
from fusion.plan import load_plan

TWO_SITES = load_scenario("local-4-two-sites").to_dict()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _fusion(*args, **kw):
    return subprocess.Popen([sys.executable, "-m", "fusion.cli", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **kw)


def _finish(proc, timeout):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"fusion did not finish within {timeout} s:\n{err[-3000:]}")
    return proc.returncode, err


class _TimedStderr:
    """Reads a process's stderr as it comes, each line with the monotonic time it arrived, so a test can time
    when something was *said* (a failure detected and reported) apart from how long the process then takes to
    exit (tearing down executors, writing the plot and trace: seconds more on a loaded host)."""

    def __init__(self, proc):
        import threading

        self.proc, self.lines = proc, []
        self._t = threading.Thread(target=self._read, daemon=True)
        self._t.start()

    def _read(self):
        for line in self.proc.stderr:
            self.lines.append((time.monotonic(), line))

    def first(self, text: str) -> float | None:
        """When the first line containing ``text`` arrived (None: not yet)."""
        return next((t for t, line in list(self.lines) if text in line), None)

    def finish(self, timeout: float) -> tuple[int, str]:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            self._t.join(10)
            pytest.fail(f"fusion did not finish within {timeout} s:\n{self.text()[-3000:]}")
        self._t.join(10)
        return self.proc.returncode, self.text()

    def text(self) -> str:
        return "".join(line for _, line in list(self.lines))


def _final(run: Path) -> dict:
    from safetensors.numpy import load_file

    return load_file(str(run / "final.safetensors"))


def _losses(run: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def test_killed_compnode_is_reported_and_resume_loses_no_step(tmp_path):
    model = tied_transformer(mb=2)
    plan_dir = save_hand_plan(tmp_path, model, GPT_SPLITS[2], schedule="1f1b", micro_batches=2,
                              optimizer=OptimizerConfig("adamw", lr=0.01), cluster=TWO_SITES,
                              devices={"p0": "cpu-0", "p1": "cpu-2"})  # 30 ms, 20 Mbit/s between them
    steps = "14"
    common = ["--steps", steps, "--emulate-links", "--data", "synthetic", "--no-progress", "--peer-timeout", "5"]
    # the uninterrupted run, and beside it the same run that will be killed
    uninterrupted = _fusion("run", str(plan_dir), "--out", str(tmp_path / "a"), *common)
    run = tmp_path / "b"
    proc = _fusion("run", str(plan_dir), "--out", str(run), "--checkpoint-every", "3", *common)
    watched = _TimedStderr(proc)
    try:  # p1 dies while steps are in flight
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and proc.poll() is None:
            m = run / "metrics.jsonl"
            if m.exists() and len(m.read_text().splitlines()) >= 4:
                break
            time.sleep(0.01)
        assert proc.poll() is None, "the run ended before the kill"
        pids = json.loads((run / "pids.json").read_text())
        os.kill(pids["p1"], signal.SIGKILL)
        t_kill = time.monotonic()
        rc, err = watched.finish(60)
        reported = watched.first("CompNode 'p1' failed")
    except BaseException:
        for p in (proc, uninterrupted):
            p.kill()
        raise
    rc_a, err_a = _finish(uninterrupted, 120)
    assert rc_a == 0, err_a[-3000:]
    assert rc != 0
    assert "CompNode 'p1' failed" in err and "exited with status -9" in err, err[-2000:]
    # detection, not the whole exit: the failure is said within 15 s of the kill (a few seconds on a quiet host;
    # the exit after it, which tears the other executors down and writes the plot, took 20 s at load 39)
    assert reported is not None and reported - t_kill < 15.0, (reported and reported - t_kill, err[-2000:])
    deadline = time.monotonic() + 10
    while any(pid_alive(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(pid_alive(p) for p in pids.values()), "an executor outlived the failed run"
    done_before = len((run / "metrics.jsonl").read_text().splitlines())
    assert done_before < int(steps)
    # resume from the last complete checkpoint and finish
    rc, err = _finish(_fusion("run", str(plan_dir), "--out", str(run), "--checkpoint-every", "3", "--resume", *common), 120)
    assert rc == 0, err[-3000:]
    assert "resuming at step" in err
    a, b = _final(tmp_path / "a"), _final(run)
    assert set(a) == set(b)
    for k in a:  # same processes, same order of operations: the same bits
        np.testing.assert_array_equal(b[k], a[k], err_msg=k)
    la, lb = _losses(tmp_path / "a"), _losses(run)
    assert sorted(lb) == list(range(int(steps)))
    for s in range(int(steps)):
        assert lb[s] == la[s], f"step {s}"


def _frames_from(identity: bytes, address: str, messages: list[list], ctx, keys=None, server_key: str = "") -> None:
    """Send ``messages`` to ``address`` under ``identity``, or (``keys``: a KeyPair) over CURVE under that key."""
    s = ctx.socket(zmq.DEALER)
    if keys is not None:
        s.curve_publickey, s.curve_secretkey, s.curve_serverkey = keys.public.encode(), keys.secret.encode(), server_key.encode()
    else:
        s.setsockopt(zmq.IDENTITY, identity)
    s.setsockopt(zmq.LINGER, 2000)
    s.connect(address)
    for frames in messages:
        s.send_multipart(frames, copy=True)
    s.close()


def test_bad_messages_to_a_live_executor_are_logged_and_dropped(tmp_path):
    model = branching_cnn(mb=2)
    plan_dir = save_hand_plan(tmp_path, model, CNN_SPLITS[2], micro_batches=2, optimizer=OptimizerConfig("sgd", lr=0.1))
    limit = 1 << 20
    cfg = CoordinatorConfig(max_message_bytes=limit, peer_timeout_s=20)
    batches = [cnn_batch(s, 4) for s in range(2)]
    expected = plain_training(model, cnn_plain_loss, batches, 2, lambda ps: torch.optim.SGD(ps, lr=0.1))
    good = encode_opdata(OpData("conv1", None, ("conv_a", "conv_b", "add_skip"), ("conv_b",), False, 1, 0, "p0", "p1",
                                np.zeros((2, 4, 6, 6), np.float32), requires_grad=True))
    head = msgpack.unpackb(good[0])
    raw = good[1].tobytes()
    pack = lambda h: msgpack.packb(h, use_bin_type=True)  # noqa: E731
    bad = {
        "protocol version 99": [pack({**head, "v": 99}), raw],
        "dtype 'object' is not allowed": [pack({**head, "t": [{"d": "object", "s": [2, 4, 6, 6]}]}), raw],
        "needs 1152 bytes, frame has 1000": [good[0], raw[:1000]],
        "declares 1 tensor frames, message has 0": [good[0]],
        "malformed header": [b"\x92\xc1"],
        # last: libzmq refuses a frame over the socket's limit (ZMQ_MAXMSGSIZE, the part's limit + 256) before
        # storing it and closes the connection; the executor logs and counts it (issue 39)
        f"a frame over this socket's limit of {limit + 256} bytes": [pack({**head, "t": [{"d": "uint8", "s": [3 << 19]}]}),
                                                                      bytes(3 << 19)],
    }
    ctx = zmq.Context()
    # sent under p0's own key: the sender is checked before decoding, so only a peer of the run reaches the decoder
    # (a stranger's messages are rejected unread: "unknown sender", test_hostile.py; without a key: test_curve.py)
    with LocalCluster(plan_dir, tmp_path / "run", cfg, threads=1, curve=True) as lc:
        lc.start()
        r0 = lc.coordinator.step(batches[0], want_grads=True)
        _frames_from(b"", lc.coordinator.addresses["p1"], list(bad.values()), ctx,
                     keys=load_secret(tmp_path / "run" / "keys" / "p0.secret"), server_key=lc.cfg.security.peers["p1"])
        log = tmp_path / "run" / "logs" / "p1.log"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not all(reason in log.read_text() for reason in bad):
            time.sleep(0.05)
        r1 = lc.coordinator.step(batches[1], want_grads=True)  # the executor is still alive and correct
    ctx.term()
    text = log.read_text()
    for reason in bad:
        assert reason in text, f"no logged reason {reason!r} in\n{text[-3000:]}"
    # the socket's refusal is counted by the connection watcher's thread: in this step's count or the next one's
    assert r1.parts["p1"]["rejected"] in (len(bad) - 1, len(bad))
    for r, (loss, grads, _) in zip([r0, r1], expected):
        np.testing.assert_allclose(r.loss, loss, rtol=1e-5)
        for k, g in grads.items():
            np.testing.assert_allclose(r.grads[k], g, rtol=1e-4, atol=1e-6)


def test_compnode_checks_each_message_against_its_boundary(tmp_path):
    """The semantic checks, on a real CompNode set up from a real plan (no sockets needed for these)."""
    model = branching_cnn(mb=2)
    plan_dir = save_hand_plan(tmp_path, model, CNN_SPLITS[4], micro_batches=2)
    node = CompNode(load_plan(plan_dir), plan_dir, ExecutorConfig("p3", "tcp://127.0.0.1:9"))
    node._setup(Setup(peers={p: "tcp://127.0.0.1:9" for p in ("p0", "p1", "p2")}, emulate_links=False,
                      resume_step=None, checkpoint_dir=None))
    try:
        def msg(**kw):
            base = dict(name="relu_a", index=None, op_users=("add_ab",), actual_user=("add_ab",), is_grad=False,
                        local_iter=0, micro_batch=0, src="p1", dst="p3", payload=np.zeros((2, 4, 6, 6), np.float32))
            return decode(encode_opdata(OpData(**{**base, **kw})))

        node._on_message("p1", msg())  # a good one is accepted
        cases = [
            ("p1", msg(), "duplicate activation"),
            ("p1", msg(micro_batch=1, payload=np.zeros((2, 4, 6, 5), np.float32)), "does not match the graph's float32[2, 4, 6, 6]"),
            ("p1", msg(micro_batch=1, payload=np.zeros((2, 4, 6, 6), np.float64)), "float64[2, 4, 6, 6] does not match"),
            ("p1", msg(micro_batch=1, payload=7), "expected a tensor payload"),
            ("p1", msg(micro_batch=5), "micro-batch 5 out of range"),
            ("p1", msg(local_iter=3), "for iteration 3, this part is at iteration 0"),
            ("p2", msg(src="p2"), "unexpected activation ('relu_a', None)"),
            ("p2", msg(), "claims to come from 'p1' but was sent by 'p2'"),
            ("p1", msg(dst="p2"), "for 'p2' arrived at 'p3'"),
            ("p1", msg(is_grad=True), "unexpected gradient"),
            ("p1", decode(encode("ctrl", {"op": "stop", "names": []})), "only the coordinator sends those"),
        ]
        for sender, m, reason in cases:
            with pytest.raises(WireError, match=re.escape(reason)):
                node._on_message(sender, m)
    finally:
        node.transport.close(timeout_s=1, linger_s=0)


def test_executors_exit_when_the_coordinator_dies(tmp_path):
    model = branching_cnn(mb=2)
    plan_dir = save_hand_plan(tmp_path, model, CNN_SPLITS[2], micro_batches=2)
    run = tmp_path / "run"
    proc = _fusion("run", str(plan_dir), "--out", str(run), "--steps", "100000", "--data", "synthetic", "--no-progress",
                   "--peer-timeout", "3")
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not ((run / "metrics.jsonl").exists() and (run / "metrics.jsonl").stat().st_size):
            time.sleep(0.05)
        pids = json.loads((run / "pids.json").read_text())
        proc.send_signal(signal.SIGKILL)  # no goodbye: the executors must notice the silence themselves
        proc.wait(10)
        t0 = time.monotonic()
        while any(pid_alive(p) for p in pids.values()) and time.monotonic() - t0 < 20:
            time.sleep(0.1)
        left = [p for p in pids.values() if pid_alive(p)]
    finally:
        if proc.poll() is None:
            proc.kill()
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert not left, "executors kept running without a coordinator"
    assert "the coordinator sent nothing for" in (run / "logs" / "p0.log").read_text()

"""``fusion coordinator`` with executors started by hand (issue 28): ``--max-restarts`` waits for a killed part to come
back, ``--eval-every`` evaluates, ``--log-every`` logs; checked against ``fusion run`` of the same plan, unfaulted."""
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from tests.executors.dist_models import CNN_SPLITS, branching_cnn, save_hand_plan
from tests.fusion.cli_helpers import free_ports
from fusion.executors.runtime.faults import ENV

STEPS = 8
COMMON = ["--steps", str(STEPS), "--checkpoint-every", "2", "--data", "synthetic", "--no-progress", "--eval-every", "4",
          "--eval-batches", "2", "--insecure"]


def _fusion(*args, env=None, **kw):
    return subprocess.Popen([sys.executable, "-m", "fusion.cli", *map(str, args)], text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, **kw)


def _rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _final(run: Path) -> dict:
    from safetensors.numpy import load_file

    return load_file(str(run / "final.safetensors"))


class Supervisor:
    """What systemd's ``Restart=on-failure`` does for one ``fusion executor``: start it again when it exits with a
    non-zero status, at most ``limit`` times; its statuses in ``codes``."""

    def __init__(self, args: list, env: dict, log: Path, limit: int = 3):
        self.args, self.env, self.log, self.limit, self.codes = args, env, log, limit, []
        self.proc = None
        self.stopped = False
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self):
        with open(self.log, "a") as f:
            while not self.stopped and len(self.codes) <= self.limit:
                self.proc = _fusion(*self.args, env=self.env, stdout=f, stderr=subprocess.STDOUT)
                self.codes.append(self.proc.wait())
                if self.codes[-1] == 0:
                    return

    def stop(self):
        self.stopped = True
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        self.thread.join(30)


def test_a_killed_executor_started_again_resumes_the_standalone_run_with_the_same_weights(tmp_path):
    plan_dir = save_hand_plan(tmp_path, branching_cnn(mb=2), CNN_SPLITS[2], micro_batches=2)
    a, b = tmp_path / "a", tmp_path / "b"
    ref = _fusion("run", plan_dir, "--out", a, "--trace", "off", "--threads", "1", *COMMON,
                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out_a, err_a = ref.communicate(timeout=240)
    assert ref.returncode == 0, err_a[-3000:]

    addr = f"tcp://127.0.0.1:{free_ports(1)[0]}"
    err = open(tmp_path / "coordinator.log", "w")
    coord = _fusion("coordinator", plan_dir, "--bind", addr, "--out", b, *COMMON, "--max-restarts", "1",
                    "--restart-wait", "90", "--log-every", "0",
                    stdout=subprocess.DEVNULL, stderr=err)
    env = {ENV: f"p1:3:KILL:{tmp_path / 'fired'}"}  # p1 SIGKILLs itself at the start of step 3, once
    sups = [Supervisor(["executor", plan_dir, "--node", p, "--coordinator", addr, "--bind", "tcp://127.0.0.1:*",
                        "--insecure", "--fast-exit"], env, tmp_path / f"{p}.log")
            for p in ("p0", "p1")]
    try:
        try:
            coord.wait(timeout=200)
        except subprocess.TimeoutExpired:
            coord.kill()
            coord.wait()
            pytest.fail(f"fusion coordinator did not finish:\n{(tmp_path / 'coordinator.log').read_text()[-3000:]}")
        for s in sups:
            s.thread.join(60)
    finally:
        err.close()
        for s in sups:
            s.stop()
    err_b = (tmp_path / "coordinator.log").read_text()
    logs = "".join((tmp_path / f"{p}.log").read_text() for p in ("p0", "p1"))
    assert coord.returncode == 0, err_b[-3000:] + logs[-3000:]
    assert (tmp_path / "fired").exists()
    # p1 was killed, p0 told to stop (status 1); both were started again and ended with the run
    assert sups[1].codes == [-9, 0] and sups[0].codes == [1, 0], (sups[0].codes, sups[1].codes, err_b[-3000:])
    assert "restarting every CompNode from the latest checkpoint (restart 1 of 1)" in err_b
    assert "waiting up to 90 s for a new executor of every part (p0, p1)" in err_b
    assert "resuming at step 2" in err_b
    assert f"step {STEPS}/{STEPS} loss" in err_b and "step 1/8 loss" in err_b  # --log-every 0: every step
    rows = _rows(b)
    events = [r for r in rows if "event" in r]
    assert [(e["event"], e["part"], e["resumed_step"]) for e in events] == [("restart", "p1", 2)]
    # 3, or 2 when p1's SIGKILL at the start of step 3 (sent ahead) took its unsent ``done`` of step 2 with it
    # (tests/executors/runtime/test_restart.py says more)
    assert events[0]["failed_step"] in (2, 3), events
    ra = _rows(a)
    train = lambda rs: [(r["step"], r["loss"]) for r in rs if "loss" in r and "event" not in r]
    evals = lambda rs: [(r["step"], r["val_loss"]) for r in rs if "val_loss" in r]
    assert train(rows) == train(ra) and len(train(rows)) == STEPS  # each step once, the same bits
    assert evals(rows) == evals(ra) and [s for s, _ in evals(rows)] == [3, 7]  # --eval-every 4, as fusion run
    fa, fb = _final(a), _final(b)
    assert set(fa) == set(fb)
    for k in fa:
        np.testing.assert_array_equal(fb[k], fa[k], err_msg=k)


def test_coordinator_max_restarts_needs_checkpoints(tmp_path, capsys):
    from fusion.cli import main

    plan_dir = tmp_path / "plan"  # refused before anything is read
    assert main(["coordinator", str(plan_dir), "--bind", "tcp://127.0.0.1:*", "--out", str(tmp_path / "r"),
                 "--max-restarts", "1", "--insecure"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "needs --checkpoint-every" in lines[0], lines
    assert not (tmp_path / "r").exists()


def test_a_second_hello_names_the_replaced_part_and_is_handed_to_the_next_coordinator(tmp_path):
    """In-process: what the coordinator does with a new executor's hello while it trains, and with messages from a part
    that has not said hello to it (late ones of an executor of the previous coordinator at that address)."""
    from fusion.executors.runtime.control import Done, Hb, Hello
    from fusion.executors.runtime.coordinator import Coordinator, CoordinatorConfig
    from fusion.ir.wire import decode
    from fusion.plan import load_plan

    plan = load_plan(save_hand_plan(tmp_path, branching_cnn(mb=2), CNN_SPLITS[2], micro_batches=2))
    msg = lambda c: decode(c.frames())  # noqa: E731
    hello = lambda pid: msg(Hello(part="p1", address="tcp://127.0.0.1:9", pid=pid, engine="torch", digest=""))  # noqa: E731
    old, new = Coordinator(plan, CoordinatorConfig()), Coordinator(plan, CoordinatorConfig())
    try:
        old._on_message("p0", msg(Done(it=0, losses=[], stats={})))  # before p0's hello: dropped, not a sign of life
        old._on_message("p0", msg(Hb()))
        assert not old._inbox["p0"] and "p0" not in old._last_seen
        old._on_message("p1", hello(11))
        old._on_message("p1", hello(11))  # repeated until answered (process.HELLO_REPEAT_S): not queued twice
        assert old._failure(["p1"]) is None and len(old._inbox["p1"]) == 1  # the first hello is start-up
        old._inbox["p1"].clear()  # (taken by start)
        old._on_message("p1", hello(11))  # a late repeat is a sign of life, not a new executor
        assert old._failure(["p0", "p1"]) is None and not old._inbox["p1"]
        old._on_message("p1", hello(12))  # a new executor of p1 while the run trains
        old._on_message("p1", hello(12))
        fail = old._failure(["p0", "p1"])
        assert fail is not None and fail.part == "p1" and "a new executor said hello (pid 12)" in fail.reason
        sent = []
        old.transport.send = lambda p, frames: sent.append(p)
        old.transport.senders.update({"p0": None, "p1": None})
        old.abort("restart")
        assert sent == ["p0"]  # the abort is not sent to the link that may reach the new p1
        pending = old.pending_hellos()
        assert [(p, c.pid) for p, c in pending] == [("p1", 12)]
        new.take_hellos(pending)
        new._on_message("p1", hello(12))  # its repeat reaching the next coordinator as well
        assert [c.pid for c in new._inbox["p1"]] == [12] and new._failure(["p0", "p1"]) is None
    finally:
        old.transport.senders.clear()
        old.close(linger_s=0)
        new.close(linger_s=0)

"""Warm start (issue 38): executors forked from one process that imported torch once train exactly as executors
started as processes of their own, are stopped and reaped the same way, and a part with its own environment or
engine still gets a process of its own. How much sooner they are ready is a benchmark's (bench_scale.py)."""
import os
import signal
import subprocess
import sys

import pytest

from tests.executors.dist_models import CNN_SPLITS, branching_cnn, cnn_batch, save_hand_plan
from fusion.executors.runtime.coordinator import CoordinatorConfig
from fusion.executors.runtime.launcher import LocalCluster, package_root
from fusion.executors.runtime.warm import WarmProcess, WarmServer, can_warm_start

pytestmark = pytest.mark.skipif(not can_warm_start(), reason="no fork on this platform")


def _losses(plan_dir, run_dir, **kw):
    with LocalCluster(plan_dir, run_dir, CoordinatorConfig(peer_timeout_s=30), threads=1, trace=False, **kw) as lc:
        lc.start()
        kinds = {p: type(proc) for p, proc in lc.processes.items()}
        losses = [lc.coordinator.step(cnn_batch(s, 4)).loss for s in range(3)]
    return losses, kinds


def test_warm_executors_train_bit_equal_to_executors_of_their_own(tmp_path):
    plan_dir = save_hand_plan(tmp_path, branching_cnn(mb=2), CNN_SPLITS[2], micro_batches=2)
    warm, kinds = _losses(plan_dir, tmp_path / "warm")
    assert set(kinds.values()) == {WarmProcess}
    cold, kinds = _losses(plan_dir, tmp_path / "cold", warm=False)
    assert set(kinds.values()) == {subprocess.Popen}
    assert warm == cold


def test_a_part_with_its_own_environment_gets_a_process_of_its_own(tmp_path):
    plan_dir = save_hand_plan(tmp_path, branching_cnn(mb=2), CNN_SPLITS[2], micro_batches=2)
    _, kinds = _losses(plan_dir, tmp_path / "run", part_env={"p1": {"FUSION_UNUSED": "1"}})
    assert kinds == {"p0": WarmProcess, "p1": subprocess.Popen}


def test_a_warm_child_gets_its_argv_and_log_and_is_killed_and_reaped_like_a_process(tmp_path):
    server = WarmServer(sys.executable, package_root(), {**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        log = tmp_path / "bad.log"
        proc = server.spawn(["executor", str(tmp_path / "no-plan"), "--node", "p0", "--coordinator",
                             "tcp://127.0.0.1:9", "--insecure"], dict(os.environ), log)
        assert proc.wait(60) == 2  # a missing plan: one line, exit 2, as a fresh `fusion executor` says it
        lines = log.read_text().strip().splitlines()
        assert len(lines) == 1 and "no-plan" in lines[0], lines
        # a child that waits (a coordinator that never answers): stopped by killpg, as the launcher stops one
        plan_dir = save_hand_plan(tmp_path, branching_cnn(mb=2), CNN_SPLITS[2], micro_batches=2)
        waits = server.spawn(["executor", str(plan_dir), "--node", "p0", "--coordinator", "tcp://127.0.0.1:9",
                              "--bind", "tcp://127.0.0.1:*", "--insecure"], dict(os.environ), tmp_path / "p0.log")
        with pytest.raises(subprocess.TimeoutExpired):
            waits.wait(0.5)
        assert waits.poll() is None and os.getpgid(waits.pid) == waits.pid  # a session of its own
        os.killpg(waits.pid, signal.SIGKILL)
        assert waits.wait(30) == -signal.SIGKILL
    finally:
        server.close()
    assert server.proc.returncode is not None

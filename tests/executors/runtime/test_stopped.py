"""A CompNode that stops answering without exiting (SIGSTOP) is named by the coordinator within its peer timeout,
and ``fusion run`` ends with exit status 2 and a one-line message (issue 15; a dead process is in test_failure.py).
Here without the link's heartbeats (``--link-timeout 0``): the peer timeout alone (test_liveness.py has the link)."""
import json
import os
import re
import signal
import subprocess
import sys
import time

from tests.executors.dist_models import CNN_SPLITS, branching_cnn, save_hand_plan

PEER_TIMEOUT = 3.0


def test_a_stopped_compnode_is_named_within_the_peer_timeout(tmp_path):
    plan_dir = save_hand_plan(tmp_path, branching_cnn(mb=2), CNN_SPLITS[2], micro_batches=2)
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "fusion.cli", "run", str(plan_dir), "--out", str(run), "--steps", "100000",
                             "--peer-timeout", str(PEER_TIMEOUT), "--link-timeout", "0", "--no-progress", "--trace", "off", "--threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    stopped = None
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            metrics = run / "metrics.jsonl"
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
                break
            time.sleep(0.1)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        stopped = json.loads((run / "pids.json").read_text())["p1"]
        os.kill(stopped, signal.SIGSTOP)
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=PEER_TIMEOUT + 30)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        if stopped is not None:
            try:
                os.kill(stopped, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert proc.returncode == 2, err[-3000:]
    errors = [ln for ln in err.splitlines() if ln.startswith("fusion run: error:")]
    assert len(errors) == 1 and "CompNode 'p1' failed: stopped answering" in errors[0], err[-3000:]
    silent = re.search(r"nothing received for ([0-9.]+) s", errors[0])
    assert silent, errors[0]
    # Named once the peer timeout ran out: the message gives the silence measured, which is past the timeout by the
    # coordinator's poll interval plus however long this (possibly busy) host kept the coordinator from running.
    assert PEER_TIMEOUT <= float(silent.group(1)) < PEER_TIMEOUT + 5, errors[0]
    assert took < PEER_TIMEOUT + 15, took  # the run ended (teardown and the loss plot take the rest)
    print(f"named after {took:.1f} s (peer timeout {PEER_TIMEOUT} s): {errors[0]}")

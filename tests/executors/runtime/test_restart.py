"""Recovery without a human (issue 28): ``fusion run --max-restarts``, checkpoint fallback, no lost metrics line."""
import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest

from tests.executors.dist_models import CNN_SPLITS, branching_cnn, save_hand_plan
from tests.executors.runtime.test_failure import _finish, _fusion as _run_fusion
from fusion.executors.runtime import checkpoint
from fusion.executors.runtime.faults import ENV, parse_faults
from fusion.ir.errors import FusionError

STEPS = 8


def _fusion(*args, env=None):
    """``fusion run ARGS`` (test_failure's runner) with one thread and ``env`` added to this process's."""
    return _run_fusion("run", *args, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def _rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _final(run: Path) -> dict:
    from safetensors.numpy import load_file

    return load_file(str(run / "final.safetensors"))


def _kill_pids(run: Path) -> None:
    try:
        pids = json.loads((run / "pids.json").read_text()).values()
    except (OSError, ValueError):
        return
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_killed_and_stopped_compnodes_are_restarted_and_a_lost_metrics_line_is_restored(tmp_path):
    """p1 SIGKILLs itself at step 3, p0 SIGSTOPs itself at step 5: --max-restarts 2 brings both back from the
    latest checkpoint. Then the coordinator (fusion run) is SIGKILLed right after committing step 6, before
    its metrics line: the --resume restores that line from the checkpoint. Losses and weights equal an
    unfaulted run bit for bit, and metrics.jsonl has every step exactly once plus the two restarts."""
    plan_dir = save_hand_plan(tmp_path, branching_cnn(mb=2), CNN_SPLITS[2], micro_batches=2)
    common = ["--steps", str(STEPS), "--checkpoint-every", "2", "--data", "synthetic", "--no-progress", "--trace",
              "off", "--threads", "1", "--peer-timeout", "3"]
    a, b = tmp_path / "a", tmp_path / "b"
    faults = ",".join(f"{p}:{s}:{sig}:{tmp_path / f'fired-{p}'}"
                      for p, s, sig in (("p1", 3, "KILL"), ("p0", 5, "STOP"), ("coordinator", 6, "KILL")))
    procs = [_fusion(str(plan_dir), "--out", str(a), *common),
             _fusion(str(plan_dir), "--out", str(b), "--max-restarts", "2", *common, env={ENV: faults})]
    try:
        rc_a, err_a = _finish(procs[0], 240)
        rc_b, err_b = _finish(procs[1], 240)
        assert rc_a == 0, err_a[-3000:]
        assert rc_b == -signal.SIGKILL, err_b[-3000:]  # the coordinator's own fault ended the first attempt
        assert err_b.count("restarting every CompNode from the latest checkpoint") == 2, err_b[-3000:]
        assert "CompNode 'p1' failed: its process" in err_b and "exited with status -9" in err_b
        # the stopped one: its link from the coordinator (ZeroMQ heartbeats, liveness.py), long before --peer-timeout
        assert "CompNode 'p0' failed: its link from coordinator is down" in err_b, err_b[-3000:]
        rows = _rows(b)
        # today's loss, reproduced: step 6 is committed, the line of its last step (5) is not there
        assert checkpoint.latest(b / "checkpoints") == 6
        assert [r["step"] for r in rows if "event" not in r] == [0, 1, 2, 3, 4]
        _kill_pids(b)  # the executors of the killed run (they would exit once they miss the coordinator)
        rc_b, err_b = _finish(_fusion(str(plan_dir), "--out", str(b), "--resume", "--max-restarts", "2", *common,
                                      env={ENV: faults}), 240)
        assert rc_b == 0, err_b[-3000:]
        assert "resuming at step 6" in err_b
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        _kill_pids(b)
    rows = _rows(b)
    events = [r for r in rows if "event" in r]
    # p1 died as it started step 3, which was sent ahead (--steps-ahead 1, the default) while step 2 ran: its SIGKILL
    # may take its ``done`` of step 2 with it (ZeroMQ's I/O thread had not written it yet), and then the coordinator
    # never saw step 2 finish and records it as the failed one; the restart resumes from the same checkpoint either way.
    # SIGSTOP freezes p0's I/O thread with its process, so the same holds for p0's ``done`` of step 4 (CI saw 4 once)
    assert [(e["event"], e["part"], e["resumed_step"]) for e in events] == [("restart", "p1", 2), ("restart", "p0", 4)]
    assert events[0]["failed_step"] in (2, 3) and events[1]["failed_step"] in (4, 5), events
    assert all(e["recovery_s"] > 0 for e in events)
    steps = [r["step"] for r in rows if "event" not in r]
    assert sorted(steps) == list(range(STEPS)) and len(steps) == STEPS  # each step exactly once
    la = {r["step"]: r["loss"] for r in _rows(a)}
    for r in rows:
        if "event" not in r:
            assert r["loss"] == la[r["step"]], f"step {r['step']}"
    fa, fb = _final(a), _final(b)
    assert set(fa) == set(fb)
    for k in fa:  # the restarted run recomputed from checkpoints: the same bits
        np.testing.assert_array_equal(fb[k], fa[k], err_msg=k)
    assert (b / "loss.png").stat().st_size > 0


def _save_step(root: Path, step: int, parts: list[str]) -> None:
    for p in parts:
        checkpoint.save_part(root, step, p, {"w": np.full(3, step, np.float32)}, {}, {})
    checkpoint.commit(root, step, parts, keep=3)


def test_resume_falls_back_to_the_newest_checkpoint_that_verifies(tmp_path):
    root, parts = tmp_path / "ck", ["p0", "p1"]
    stages = {p: p for p in parts}
    for s in (2, 4, 6):
        _save_step(root, s, parts)
    assert checkpoint.newest_verified(root, stages) == (6, {"p0": "p0", "p1": "p1"})
    bad6 = checkpoint.step_dir(root, 6) / "p1.params.safetensors"
    data = bytearray(bad6.read_bytes())
    data[-2] ^= 0x40
    bad6.write_bytes(bytes(data))
    (checkpoint.step_dir(root, 4) / "p0.optim.safetensors").unlink()
    skipped = []
    assert checkpoint.newest_verified(root, stages, lambda s, why: skipped.append((s, why)))[0] == 2
    assert [s for s, _ in skipped] == [6, 4]
    assert str(bad6) in skipped[0][1] and "checksum mismatch" in skipped[0][1]
    assert "p0.optim.safetensors: missing" in skipped[1][1]
    # a latest.json pointing at a step whose folder is gone: the complete ones are still found
    (root / checkpoint.LATEST).write_text(json.dumps({"step": 8}))
    assert checkpoint.newest_verified(root, stages)[0] == 2
    # none verifies: refused with the newest one's bad file, never a silent start from step 0
    (checkpoint.step_dir(root, 2) / "p1.json").write_text("{")
    with pytest.raises(checkpoint.CheckpointError, match="step-00000006/p1.params.safetensors: checksum mismatch"):
        checkpoint.newest_verified(root, stages)
    assert checkpoint.newest_verified(tmp_path / "none", stages) == (None, {})


def test_restore_committed_line_appends_only_a_missing_line(tmp_path):
    from fusion.commands.rundir import restore_committed_line, trim_metrics

    root, metrics = tmp_path / "ck", tmp_path / "metrics.jsonl"
    checkpoint.save_part(root, 2, "p0", {"w": np.ones(2, np.float32)}, {}, {})
    checkpoint.commit(root, 2, ["p0"], {"metrics": {"step": 1, "loss": 0.5}})
    metrics.write_text(json.dumps({"step": 0, "loss": 1.0}) + "\n" + json.dumps({"event": "restart", "step": 9}) + "\n"
                       + json.dumps({"step": 2, "loss": 9.0}) + "\n")
    assert trim_metrics(metrics, 2) == 2  # the event line is history: kept
    assert restore_committed_line(metrics, root, 2)
    assert not restore_committed_line(metrics, root, 2)  # present now: not twice
    assert [json.loads(x).get("step") for x in metrics.read_text().splitlines()] == [0, 9, 1]
    assert not restore_committed_line(metrics, root, 4)  # no such checkpoint


def test_fault_variable_and_max_restarts_options_are_checked(tmp_path, capsys):
    from fusion.cli import main

    assert [f.part for f in parse_faults("p1:3:KILL,coordinator:6:STOP:/m")] == ["p1", "coordinator"]
    assert [(f.point, f.step) for f in parse_faults("p1:save-4:KILL:/m,p0:start-0:STOP:/n,p0:2:KILL")] == \
        [("save", 4), ("start", 0), ("step", 2)]
    assert parse_faults("p1:save-4:ENOSPC")[0].signal == "ENOSPC"
    for bad in ("p1:3", "p1:x:KILL", "p1:3:TERM", ":3:KILL", "p1:load-3:KILL", "p1:save-:KILL", "p1:save-x:STOP",
                "p1:3:ENOSPC", "p1:start-0:ENOSPC"):
        with pytest.raises(FusionError, match=ENV):
            parse_faults(bad)
    plan_dir = tmp_path / "plan"  # refused before anything is read
    for extra, says in ((["--max-restarts", "1"], "needs --checkpoint-every"),):
        capsys.readouterr()
        assert main(["run", str(plan_dir), "--out", str(tmp_path / "r"), *extra]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and says in lines[0], lines
        assert not (tmp_path / "r").exists()


def test_a_full_disk_during_a_checkpoint_is_one_line_not_a_restart(tmp_path):
    """p1's checkpoint write of step 4 finds the disk full (ENOSPC): a restart would meet it again, and used to die
    writing its fresh keys with a 35-line traceback, exit 1 (issue 39). Now one line naming the part and the
    cause, exit 2, no restart; the run keeps its complete checkpoint of step 2 and its metrics to resume from."""
    plan_dir = save_hand_plan(tmp_path, branching_cnn(mb=2), CNN_SPLITS[2], micro_batches=2)
    run = tmp_path / "run"
    rc, err = _finish(_fusion(str(plan_dir), "--out", str(run), "--steps", "6", "--checkpoint-every", "2",
                              "--max-restarts", "2", "--data", "synthetic", "--no-progress", "--trace", "off",
                              "--threads", "1", env={ENV: "p1:save-4:ENOSPC"}), 240)
    lines = [x for x in err.strip().splitlines() if x.startswith("fusion run: error:")]
    assert rc == 2 and len(lines) == 1, err[-3000:]
    assert "CompNode 'p1' failed" in lines[0] and "No space left on device" in lines[0] and "not restarted" in lines[0]
    assert "Traceback" not in err and "restart 1 of 2" not in err, err[-3000:]
    assert not any("event" in r for r in _rows(run))  # no restart was tried
    assert checkpoint.latest(run / "checkpoints") == 2 and [r["step"] for r in _rows(run)] == [0, 1, 2]


def test_a_kill_in_the_middle_of_a_checkpoint_write_leaves_the_previous_checkpoint_to_resume(tmp_path):
    """FUSION_TEST_FAULT save-N: the writer dies with its parameters file of step 4 in place and neither its
    optimizer file nor its sidecar; step 4 is not complete, and resuming takes step 2, which verifies."""
    import subprocess
    import sys

    root = tmp_path / "ck"
    _save_step(root, 2, ["p0"])
    code = ("import numpy as np; from fusion.executors.runtime import checkpoint as c; "
            f"c.save_part({str(root)!r}, 4, 'p0', {{'w': np.ones(3, np.float32)}}, {{}}, {{}})")
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, ENV: f"p0:save-4:KILL:{tmp_path / 'fired'}"},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    d = checkpoint.step_dir(root, 4)
    assert (d / "p0.params.safetensors").exists()
    assert not (d / "p0.optim.safetensors").exists() and not (d / "p0.json").exists()
    assert checkpoint.newest_verified(root, {"p0": "p0"}) == (2, {"p0": "p0"})
    # the marker makes it fire once: the same write again (a restarted executor) completes
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, ENV: f"p0:save-4:KILL:{tmp_path / 'fired'}"},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    checkpoint.commit(root, 4, ["p0"])
    assert checkpoint.newest_verified(root, {"p0": "p0"})[0] == 4


def test_start_up_and_checkpoint_write_faults_are_restarted_to_the_same_bits(tmp_path):
    """The chaos soak in small: p0 is SIGKILLed during the run's very first start-up (before this fix
    --max-restarts did not cover the first start: the run ended, exit 2), p1 is SIGKILLed in the middle of
    writing its checkpoint of step 4 and again during the start-up that follows (resuming at step 2).
    Three restarts, each with its line in metrics.jsonl (the second one's start-up fails: its line used to be
    lost); losses and final weights equal an unfaulted run's bit for bit, each step exactly once."""
    plan_dir = save_hand_plan(tmp_path, branching_cnn(mb=2), CNN_SPLITS[2], micro_batches=2)
    steps = 6
    common = ["--steps", str(steps), "--checkpoint-every", "2", "--data", "synthetic", "--no-progress", "--trace",
              "off", "--threads", "1", "--peer-timeout", "10"]  # (no STOP here: a wide margin)
    a, b = tmp_path / "a", tmp_path / "b"
    faults = ",".join(f"{p}:{s}:{sig}:{tmp_path / f'fired-{i}'}" for i, (p, s, sig) in
                      enumerate((("p0", "start-0", "KILL"), ("p1", "save-4", "KILL"), ("p1", "start-2", "KILL"))))
    procs = [_fusion(str(plan_dir), "--out", str(a), *common),
             _fusion(str(plan_dir), "--out", str(b), "--max-restarts", "3", *common, env={ENV: faults})]
    try:
        rc_a, err_a = _finish(procs[0], 300)
        rc_b, err_b = _finish(procs[1], 300)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        _kill_pids(b)
    assert rc_a == 0, err_a[-3000:]
    assert rc_b == 0, err_b[-3000:]
    assert all((tmp_path / f"fired-{i}").exists() for i in range(3))
    events = [r for r in _rows(b) if "event" in r]
    # each restart has its line, also the one whose start-up failed (that line used to be lost: restart 2 missing)
    assert [(e["restart"], e["part"], e["resumed_step"]) for e in events] == \
        [(1, "p0", 0), (2, "p1", None), (3, "p1", 2)], events
    assert "during setting up" in events[0]["reason"] and "during setting up" in events[2]["reason"]
    assert events[1]["failed_step"] == 3 and "exited with status -9" in events[1]["reason"]
    assert "exited with status -9" in events[1]["start_failed"] and "start_failed" not in events[2]
    steps_b = [r["step"] for r in _rows(b) if "event" not in r]
    assert sorted(steps_b) == list(range(steps))
    la = {r["step"]: r["loss"] for r in _rows(a)}
    assert all(r["loss"] == la[r["step"]] for r in _rows(b) if "event" not in r)
    fa, fb = _final(a), _final(b)
    assert set(fa) == set(fb)
    for k in fa:
        np.testing.assert_array_equal(fb[k], fa[k], err_msg=k)

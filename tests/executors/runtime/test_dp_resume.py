"""Losing a replica, checkpointing on without it, and resuming the full plan (DP x PP, real processes, loopback).

After a replica is dropped (``drop_failed_replicas``) the survivors go on checkpointing: the replicas of a stage
hold the same bits after every all-reduce, so the survivors' copy of each stage stands for the dropped one, and a
resume of the FULL plan loads every part of the dropped replica from that copy. The whole sequence of steps, over
both runs, must equal single-process PyTorch on the same global batches (a step is neither lost nor applied twice),
and after the resume both replicas must hold the same bits.

The second test kills a CompNode after the coordinator's go-ahead (the two-phase commit) of a checkpoint step:
the others of that step have applied it, so it is kept (not redone), its checkpoint is completed by the survivors,
and the resume from it continues exactly.
"""
from __future__ import annotations

import json
import os
import signal
import time

import numpy as np
import torch

from fusion.executors.runtime import checkpoint
from fusion.ir.wire import decode
from tests.executors.dist_models import MODELS, assert_matches_plain, plain_training
from tests.executors.runtime.test_dp import MB, MICRO, SGD, save_dp_plan


def _config(tmp_path, every: int):
    from fusion.executors.runtime.coordinator import CoordinatorConfig

    return CoordinatorConfig(peer_timeout_s=30, drop_failed_replicas=True, checkpoint_dir=str(tmp_path / "ckpt"),
                             checkpoint_every=every, startup_timeout_s=60, step_timeout_s=120)


def _kill(proc) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


def _resume_full_plan(plan_dir, run_dir, cfg, batches, first: int):
    """Resume the full plan (both replicas) from the newest checkpoint; returns (reports, every replica's state)."""
    from fusion.executors.runtime.launcher import LocalCluster

    lines: list[str] = []
    with LocalCluster(plan_dir, run_dir, cfg, threads=1, report=lines.append) as lc:
        assert lc.start(resume=True) == first
        assert lc.coordinator.live == list(lc.plan.parts)  # every replica is back
        reports = [lc.coordinator.step(b, want_grads=True) for b in batches[first:]]
        states = [lc.coordinator.fetch_state(replica=r) for r in range(lc.plan.replicas)]
    return reports, states, lines


def _assert_replicas_equal(states) -> None:
    for st in states[1:]:
        for k, v in states[0].items():
            np.testing.assert_array_equal(st[k], v, err_msg=f"replicas differ in {k} after the resume")


def test_survivors_checkpoint_after_a_drop_and_the_full_plan_resumes_from_their_copy(tmp_path):
    """2 x 2 (tied transformer, 1F1B, SGD with momentum), checkpoint every 2 steps. r1.p1 is killed after step 1;
    step 2 is redone on replica 0 alone; the checkpoint after step 4 is written by p0 and p1 only. Step 4 also
    runs, then the run stops (its step 4 is never saved). The full plan resumes at step 4, r1.p0 and r1.p1 load
    the copies of p0 and p1, and steps 4..6 run on both replicas again."""
    from fusion.executors.runtime.launcher import LocalCluster

    build, splits, plain_loss, batch_fn = MODELS["gpt"]
    model = build(mb=MB)
    plan_dir = save_dp_plan(tmp_path, model, splits[2], 2, schedule="1f1b", micro_batches=MICRO, optimizer=SGD[0])
    batches = [batch_fn(s, 2 * MICRO * MB) for s in range(7)]
    cfg = _config(tmp_path, every=2)
    with LocalCluster(plan_dir, tmp_path / "run", cfg, threads=1) as lc:
        lc.start()
        first = [lc.coordinator.step(b, want_grads=True) for b in batches[:2]]
        _kill(lc.processes["r1.p1"])
        first += [lc.coordinator.step(b, want_grads=True) for b in batches[2:5]]
        assert lc.coordinator.live == ["p0", "p1"]
    (drop,) = first[2].dropped
    assert drop["replica"] == 1 and drop["step"] == 2 and drop["redone"]
    ckpt = tmp_path / "ckpt"
    assert checkpoint.latest(ckpt) == 4  # written after the drop, by the survivors
    assert checkpoint.saved_parts(ckpt, 4) == ["p0", "p1"]
    complete = json.loads((checkpoint.step_dir(ckpt, 4) / checkpoint.COMPLETE).read_text())
    assert [d["replica"] for d in complete["dropped"]] == [1]
    assert checkpoint.saved_parts(ckpt, 2) == ["p0", "p1", "r1.p0", "r1.p1"]  # before the drop: everyone

    second, states, lines = _resume_full_plan(plan_dir, tmp_path / "run2", cfg, batches, first=4)
    assert any("r1.p0 loads p0's copy, r1.p1 loads p1's copy" in x for x in lines), lines
    reports = first[:4] + second  # run 1's step 4 was never saved: the resume redoes it, once
    assert [r.step for r in reports] == list(range(7))
    assert not any(r.dropped for r in second) and all(set(r.parts) == {"p0", "p1", "r1.p0", "r1.p1"} for r in second)
    assert_matches_plain(reports, states[0], plain_training(model, plain_loss, batches, 2 * MICRO, SGD[1]))
    _assert_replicas_equal(states)


def test_a_compnode_lost_after_the_go_ahead_keeps_the_step_and_its_checkpoint(tmp_path):
    """2 x 2 (CNN, GPipe, SGD with momentum), checkpoint every 2 steps. In step 1 the coordinator sends the
    go-ahead (commit) to p0, p1 and r1.p0, which apply the step; r1.p1 is killed just before its own go-ahead
    leaves. The step is kept (not redone, not lost): replica 1 is dropped, the survivors' checkpoint of step 2
    completes, and the full plan resumed from it trains on exactly as one process does."""
    from fusion.executors.runtime.launcher import LocalCluster

    build, splits, plain_loss, batch_fn = MODELS["cnn"]
    model = build(mb=MB)
    plan_dir = save_dp_plan(tmp_path, model, splits[2], 2, micro_batches=MICRO, optimizer=SGD[0])
    batches = [batch_fn(s, 2 * MICRO * MB) for s in range(5)]
    cfg = _config(tmp_path, every=2)
    with LocalCluster(plan_dir, tmp_path / "run", cfg, threads=1) as lc:
        lc.start()
        coord = lc.coordinator
        first = [coord.step(batches[0], want_grads=True)]
        send, victim, seen = coord.transport.send, lc.processes["r1.p1"], []

        def send_but_kill_before_the_last_go_ahead(peer, frames, *a, **kw):
            if decode(frames).header.get("op") == "commit":
                seen.append(peer)
                if peer == "r1.p1":  # the three others have their go-ahead: this one dies before it arrives
                    _kill(victim)
            return send(peer, frames, *a, **kw)

        coord.transport.send = send_but_kill_before_the_last_go_ahead
        first.append(coord.step(batches[1], want_grads=True))
        coord.transport.send = send
        first.append(coord.step(batches[2], want_grads=True))  # on replica 0 alone; not a checkpoint step
    assert seen == ["p0", "p1", "r1.p0", "r1.p1"]
    (drop,) = first[1].dropped
    assert drop["replica"] == 1 and drop["step"] == 1 and drop["part"] == "r1.p1" and not drop["redone"]
    assert set(first[1].parts) == {"p0", "p1"} and not first[2].dropped
    assert checkpoint.latest(tmp_path / "ckpt") == 2 and checkpoint.saved_parts(tmp_path / "ckpt", 2) == ["p0", "p1"]

    second, states, _ = _resume_full_plan(plan_dir, tmp_path / "run2", cfg, batches, first=2)
    reports = first[:2] + second
    assert [r.step for r in reports] == list(range(5))
    expected = plain_training(model, plain_loss, batches, 2 * MICRO, SGD[1])
    # step 1 trained on the whole global batch (its gradients were averaged before the go-ahead), but only the
    # survivors' losses came back: the reported loss is replica 0's share, its first MICRO micro-batches
    P = {k: torch.tensor(v) for k, v in expected[0][2].items()}
    share = [{k: torch.as_tensor(v).chunk(2 * MICRO)[m] for k, v in batches[1].items()} for m in range(MICRO)]
    np.testing.assert_allclose(first[1].loss, np.mean([plain_loss(P, c).item() for c in share]), rtol=1e-5)
    expected[1] = (first[1].loss, *expected[1][1:])
    assert_matches_plain(reports, states[0], expected)  # gradients of step 1 too: the whole batch's
    _assert_replicas_equal(states)


def test_losing_the_last_replica_ends_the_run_with_one_clear_line(tmp_path):
    """2 x 1, failover on: losing replica 1 is survived; losing replica 0 too leaves no copy of the stage, and
    the step fails naming the part and why (no replica left), instead of hanging."""
    import pytest

    from fusion.executors.runtime.coordinator import CompNodeFailure
    from fusion.executors.runtime.launcher import LocalCluster
    from tests.executors.runtime.test_dp import one_stage

    build, _, _, batch_fn = MODELS["cnn"]
    model = build(mb=MB)
    plan_dir = save_dp_plan(tmp_path, model, one_stage(model), 2, micro_batches=1, optimizer=SGD[0])
    cfg = _config(tmp_path, every=0)
    with LocalCluster(plan_dir, tmp_path / "run", cfg, threads=1) as lc:
        lc.start()
        lc.coordinator.step(batch_fn(0, 2 * MB))
        _kill(lc.processes["r1.p0"])
        assert lc.coordinator.step(batch_fn(1, 2 * MB)).dropped
        _kill(lc.processes["p0"])
        t0 = time.monotonic()
        with pytest.raises(CompNodeFailure, match=r"'p0' failed: .*exited.*replica 0 was the last one with a copy "
                                                  r"of stage 'p0': no replica is left to train on") as e:
            lc.coordinator.step(batch_fn(2, 2 * MB))
        assert "\n" not in str(e.value) and time.monotonic() - t0 < 20


def test_resume_sources_map_every_part_to_a_saved_copy_of_its_stage(tmp_path):
    """Which files each part of the full plan loads: its own when it saved the step, else the first saved replica
    of its stage; a stage nobody saved is one line naming it. A checkpoint written before this field existed
    (every part saved) maps every part to itself."""
    import pytest

    stage_of = {"p0": "p0", "p1": "p1", "r1.p0": "p0", "r1.p1": "p1", "r2.p0": "p0", "r2.p1": "p1"}
    checkpoint.commit(tmp_path, 4, ["p0", "p1", "r2.p0", "r2.p1"], check_files=False)  # replica 1 was dropped
    assert checkpoint.resume_sources(tmp_path, 4, stage_of) == {
        "p0": "p0", "p1": "p1", "r1.p0": "p0", "r1.p1": "p1", "r2.p0": "r2.p0", "r2.p1": "r2.p1"}
    checkpoint.commit(tmp_path, 6, ["p0"], check_files=False)  # (a hand-made one: stage p1 saved by nobody)
    with pytest.raises(checkpoint.CheckpointError, match=r"no part of stage 'p1' saved step 6 \(saved: p0\); "
                                                         r"part 'p1' cannot resume from it") as e:
        checkpoint.resume_sources(tmp_path, 6, stage_of)
    assert "\n" not in str(e.value)
    with pytest.raises(checkpoint.CheckpointError, match="step 5 is not a complete checkpoint"):
        checkpoint.saved_parts(tmp_path, 5)


def test_a_part_refuses_to_resume_from_a_part_outside_its_data_parallel_group(tmp_path):
    """setup's resume_from must name a replica of the part's own stage: p0 may load r1.p0's copy, never p1's."""
    import pytest

    from fusion.executors.runtime.compnode import CompNode, ExecutorAbort, ExecutorConfig
    from fusion.plan import load_plan

    build, splits, _, _ = MODELS["cnn"]
    model = build(mb=MB)
    plan_dir = save_dp_plan(tmp_path, model, splits[2], 2, micro_batches=MICRO)
    node = CompNode(load_plan(plan_dir), plan_dir, ExecutorConfig("p0", "tcp://127.0.0.1:1"))
    try:
        assert node._resume_source("r1.p0") == "r1.p0" and node._resume_source("p0") == "p0"
        for bad in ("p1", "r1.p1", "nope", 3):
            with pytest.raises(ExecutorAbort, match=r"resume_from .* is not a replica of stage 'p0' \(p0, r1.p0\)"):
                node._resume_source(bad)
    finally:
        node.transport.close(timeout_s=1.0, linger_s=0.0)

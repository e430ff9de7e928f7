"""A replica joining a running DiLoCo job (executors/runtime/dp/join.py): what a joiner takes from a live
replica, what is refused (a pseudo-gradient of a replica that has not joined, a joiner of another plan)."""
from __future__ import annotations

import numpy as np
import pytest

from fusion.ir.errors import FusionError, WireError
from fusion.plan import DPSync


def _outer(error_feedback: bool, seed: int):
    from fusion.executors.runtime.dp.allreduce import make_buckets
    from fusion.executors.runtime.dp.outer import OuterLoop

    g = np.random.default_rng(seed)
    params = {"a": g.standard_normal((2, 3)).astype(np.float32), "b": g.standard_normal(4).astype(np.float32)}
    sync = DPSync("diloco", inner_steps=2, codec={"algo": "quant", "bits": 8} if error_feedback else None,
                  error_feedback=error_feedback)
    return OuterLoop(sync, make_buckets({k: (v.shape, "float32") for k, v in params.items()}), params), params


def test_a_joiner_takes_the_global_weights_and_momentum_and_starts_its_residual_at_zero():
    from fusion.executors.runtime.dp.join import adopt, join_arrays

    live, _ = _outer(True, 0)
    live.v[0][:] = 0.5
    live.residual[0][:] = 7.0  # the live replica's own residual stays its own
    sent = join_arrays(live)
    assert sorted(sent) == ["momentum::0:float32", "theta::0:float32"]
    joiner, mine = _outer(True, 1)
    weights = adopt(joiner, sent, "outer state from p0")
    np.testing.assert_array_equal(joiner.theta[0], live.theta[0])
    np.testing.assert_array_equal(joiner.v[0], live.v[0])
    np.testing.assert_array_equal(joiner.residual[0], np.zeros_like(live.residual[0]))
    assert sorted(weights) == ["a", "b"]
    np.testing.assert_array_equal(np.concatenate([weights["a"].reshape(-1), weights["b"]]), live.theta[0])
    with pytest.raises(FusionError, match=r"outer state from p0: outer state momentum::0:float32 is missing"):
        adopt(joiner, {"theta::0:float32": sent["theta::0:float32"]}, "outer state from p0")


def test_a_pseudo_gradient_from_a_replica_that_has_not_joined_is_rejected():
    """Before replica 2 joins, the live parts' groups are [p0, r1.p0]: its pseudo-gradients (exact ring chunks
    or encoded all-gather payloads) are rejected by name, though the plan lists it and its key is trusted."""
    from fusion.executors.runtime.dp.allreduce import KIND, RingInbox, make_buckets
    from fusion.executors.runtime.dp.outer import PseudoInbox, encode_pseudo
    from fusion.ir.wire import decode, encode

    buckets = make_buckets({"w": ((10,), "float32")})
    codec = {"algo": "quant", "bits": 8}
    ring = RingInbox("p0", ["p0", "r1.p0"], buckets)
    meta, frames = encode_pseudo(np.arange(10, dtype=np.float32), codec)
    h = {"it": 0, "bucket": 0, "step": 0, "chunk": 0, "src": "r2.p0", "dst": "p0", "gather": True, "payload": meta}
    with pytest.raises(WireError, match=r"'r2.p0', which is not in p0's data-parallel group \['p0', 'r1.p0'\]"):
        PseudoInbox(ring, codec).accept("r2.p0", decode(encode(KIND, h, frames)))
    chunk = decode(encode(KIND, {"it": 0, "bucket": 0, "step": 0, "chunk": 0, "src": "r2.p0", "dst": "p0"},
                          [np.zeros(5, np.float32)]))
    with pytest.raises(WireError, match="r2.p0"):
        ring.accept("r2.p0", chunk)


def test_a_joiner_of_another_plan_is_refused_and_the_job_goes_on(tmp_path):
    """Replica 2 of a DiLoCo plan joins before step 2, but its executor runs the plan of another model (same
    part names, another digest): the coordinator refuses it naming both digests, tells it to abort (it exits
    naming the reason), and the two live replicas train on, equal to the reference in which it never joins."""
    from fusion.executors.runtime.coordinator import CoordinatorConfig
    from fusion.executors.runtime.launcher import LocalCluster
    from tests.executors.runtime.test_diloco import ALL, SGD, assert_matches, diloco_reference, with_sync
    from tests.executors.runtime.test_dp import MB, one_stage, save_dp_plan

    build, _, plain_loss, batch_fn = ALL["mlp"]
    model = build(mb=MB)
    sync = DPSync("diloco", inner_steps=2, outer_lr=0.7, outer_momentum=0.9)
    plan_dir = save_dp_plan(tmp_path / "good", model, one_stage(model), 3, micro_batches=2, optimizer=SGD[0])
    with_sync(plan_dir, model, sync)
    other = ALL["cnn"][0](mb=MB)
    other_dir = save_dp_plan(tmp_path / "other", other, one_stage(other), 3, micro_batches=2, optimizer=SGD[0])
    with_sync(other_dir, other, sync)
    batches = [batch_fn(s, 3 * 2 * MB) for s in range(4)]
    lines: list[str] = []
    with LocalCluster(plan_dir, tmp_path / "run", CoordinatorConfig(peer_timeout_s=30, joins={2: 2}), threads=1,
                      report=lines.append) as lc:
        spawn = lc._spawn

        def spawn_other_plan(parts):  # the joiner is started from another plan's folder
            if parts == ["r2.p0"]:
                lc.plan_dir = other_dir
            try:
                spawn(parts)
            finally:
                lc.plan_dir = plan_dir

        lc._spawn = spawn_other_plan
        lc.start()
        reports = [lc.coordinator.step(b) for b in batches]
        state = lc.coordinator.fetch_state()
        assert lc.processes["r2.p0"].wait(30) == 1
    (refused,) = [x for x in lines if "refused" in x]
    assert refused.startswith("replica 2 refused at step 2: joining CompNode 'r2.p0' runs another plan: its digest is ")
    assert "going on with 2 replica(s)" in refused
    assert not any(r.joined for r in reports)
    assert [r.parts["p0"]["outer"]["replicas"] for r in reports if "outer" in r.parts["p0"]] == [2, 2]
    assert "refused to join: joining CompNode 'r2.p0' runs another plan" in (tmp_path / "run" / "logs" / "r2.p0.log").read_text()
    assert_matches(reports, state, diloco_reference(model, plain_loss, batches, 3, 2, SGD[1], sync, join=(4, 2)))

"""Steps sent ahead (executors/runtime/step_ahead.py, ``--steps-ahead``): the coordinator sends step k+1 before step
k's ``done`` has arrived, and the inboxes keep a message of the next iteration.

The multi-process runs (one executor per part, loopback, the step loop of ``fusion run``) are compared with the same
run in lock step (``--steps-ahead 0``), whose equality with plain PyTorch the DP and DiLoCo tests prove: losses and
every replica's final weights must be the same bits, and the coordinator must have sent every step but the first
ahead (an evaluation in between stops it once). The inboxes' rule is tested on each inbox: a message of the next
iteration is kept and used when that iteration comes, one two iterations ahead is refused naming both."""
from __future__ import annotations

import json

import numpy as np
import pytest

from fusion.executors.runtime.control import Setup
from fusion.executors.runtime.dp.allreduce import KIND, RingInbox, encode_chunk, make_buckets
from fusion.executors.runtime.dp.outer import PseudoInbox, encode_pseudo
from fusion.executors.runtime.step_ahead import MAX_AHEAD, accepts, lock_step_reason
from fusion.ir.errors import WireError
from fusion.ir.wire import decode, encode
from fusion.plan import DPSync, load_plan
from tests.executors.runtime.test_diloco import ALL, SGD_M, with_sync
from tests.executors.runtime.test_dp import MB, MICRO, SGD, one_stage, save_dp_plan

STEPS = 6


def _train(plan_dir, run_dir, batches, ahead: int, eval_every: int = 0):
    """``fusion run``'s step loop on local executors; (metrics lines, every replica's weights, steps sent ahead)."""
    from fusion.commands.steploop import Evaluation, train
    from fusion.executors.runtime.coordinator import CoordinatorConfig
    from fusion.executors.runtime.launcher import LocalCluster

    cfg = CoordinatorConfig(peer_timeout_s=30, steps_ahead=ahead)
    with LocalCluster(plan_dir, run_dir, cfg, threads=1) as lc:
        first = lc.start()
        ev = Evaluation(eval_every, [batches[0]]) if eval_every else None
        train(lc.coordinator, lambda s: batches[s], first, len(batches), run_dir / "out", progress=False,
              evaluation=ev)
        states = [lc.coordinator.fetch_state(replica=r) for r in range(lc.plan.replicas)]
        sent = lc.coordinator.sent_ahead
    lines = [json.loads(x) for x in (run_dir / "out" / "metrics.jsonl").read_text().splitlines()]
    return lines, states, sent


def _assert_same(a, b):
    (la, sa, _), (lb, sb, _) = a, b
    assert [x.get("loss", x.get("val_loss")) for x in la] == [x.get("loss", x.get("val_loss")) for x in lb]
    for ra, rb in zip(sa, sb):
        assert ra.keys() == rb.keys()
        for k in ra:
            np.testing.assert_array_equal(ra[k], rb[k], err_msg=f"parameter {k}")


def _gpt_sync_dp(tmp_path):
    build, splits, _, batch_fn = ALL["gpt"]
    model = build(mb=MB)
    plan_dir = save_dp_plan(tmp_path, model, splits[2], 2, schedule="1f1b", micro_batches=MICRO, optimizer=SGD[0])
    return plan_dir, [batch_fn(s, 2 * MICRO * MB) for s in range(STEPS)]


def _mlp_diloco(tmp_path):
    build, _, _, batch_fn = ALL["mlp"]
    model = build(mb=MB)
    plan_dir = save_dp_plan(tmp_path, model, one_stage(model), 3, micro_batches=1, optimizer=SGD_M[0])
    with_sync(plan_dir, model, DPSync("diloco", inner_steps=2, outer_lr=0.7, outer_momentum=0.9,
                                      codec={"algo": "quant", "bits": 8}, error_feedback=True))
    return plan_dir, [batch_fn(s, 3 * MB) for s in range(STEPS)]


def _mlp_inner_steps_by_speed(tmp_path):
    build, _, _, batch_fn = ALL["mlp"]
    model = build(mb=MB)
    plan_dir = save_dp_plan(tmp_path, model, one_stage(model), 2, micro_batches=1, optimizer=SGD_M[0])
    with_sync(plan_dir, model, DPSync("diloco", inner_steps=3, inner_steps_per_replica={0: 3, 1: 1}))
    return plan_dir, [batch_fn(s, 2 * MB) for s in range(STEPS)]


CASES = {"gpt-2x2-1f1b-sync-dp": _gpt_sync_dp, "mlp-3x1-diloco-quant8": _mlp_diloco,
         "mlp-2x1-inner-steps-3-1": _mlp_inner_steps_by_speed}


@pytest.mark.parametrize("case", list(CASES))
def test_steps_sent_ahead_train_the_same_bits_as_lock_step(tmp_path, case):
    plan_dir, batches = CASES[case](tmp_path)
    lock = _train(plan_dir, tmp_path / "lock", batches, ahead=0)
    ahead = _train(plan_dir, tmp_path / "ahead", batches, ahead=1)
    assert lock[2] == 0 and ahead[2] == STEPS - 1  # every step after the first was sent ahead
    _assert_same(lock, ahead)
    assert len(ahead[0]) == STEPS and all(x["iteration_s"] > 0 for x in ahead[0])


def test_an_evaluation_is_never_overtaken_by_a_step_sent_ahead(tmp_path):
    plan_dir, batches = _gpt_sync_dp(tmp_path)
    lock = _train(plan_dir, tmp_path / "lock", batches, ahead=0, eval_every=2)
    ahead = _train(plan_dir, tmp_path / "ahead", batches, ahead=1, eval_every=2)
    # steps 2 and 4 follow an evaluation (after steps 1 and 3; after 5 the run ends): sent in lock step
    assert ahead[2] == STEPS - 1 - 2
    _assert_same(lock, ahead)
    assert [x["step"] for x in ahead[0] if "val_loss" in x] == [1, 3, 5]


def test_lock_step_reasons():
    free = dict(clip=False, failover=False, joining=False, interleaved=False, want_grads=False)
    assert lock_step_reason(**free) is None
    for k, says in [("clip", "clipping"), ("failover", "--drop-failed-replicas"), ("joining", "joins"),
                    ("interleaved", "interleaved"), ("want_grads", "gradients"), ("checkpoint", "checkpointed")]:
        assert says in lock_step_reason(**{**free, k: True})
    assert MAX_AHEAD == 1 and accepts(3, 3) and accepts(4, 3) and not accepts(5, 3) and not accepts(2, 3)


def test_the_option_and_the_runtime_agree_on_how_far_ahead():
    import argparse

    from fusion.options.types import STEPS_AHEAD_MAX, steps_ahead_count

    assert STEPS_AHEAD_MAX == MAX_AHEAD
    assert steps_ahead_count("0") == 0 and steps_ahead_count("1") == 1
    with pytest.raises(argparse.ArgumentTypeError, match="must be 0 \\(lock step\\) to 1, got 2"):
        steps_ahead_count("2")


# -- the inboxes ----------------------------------------------------------------------------------------------

def test_part_inbox_keeps_the_next_iterations_activation_and_refuses_the_one_after(tmp_path):
    from fusion.executors.runtime.compnode import CompNode, ExecutorConfig
    from fusion.ir.opdata import OpData
    from fusion.ir.wire import decode as wdecode, encode_opdata
    from tests.executors.dist_models import CNN_SPLITS, branching_cnn, save_hand_plan

    model = branching_cnn(mb=2)
    plan_dir = save_hand_plan(tmp_path, model, CNN_SPLITS[4], micro_batches=2)
    node = CompNode(load_plan(plan_dir), plan_dir, ExecutorConfig("p3", "tcp://127.0.0.1:9"))
    node._setup(Setup(peers={p: "tcp://127.0.0.1:9" for p in ("p0", "p1", "p2")}, emulate_links=False,
                      resume_step=None, checkpoint_dir=None))

    def msg(it):
        od = OpData(name="relu_a", index=None, op_users=("add_ab",), actual_user=("add_ab",), is_grad=False,
                    local_iter=it, micro_batch=0, src="p1", dst="p3", payload=np.full((2, 4, 6, 6), it, np.float32))
        return wdecode(encode_opdata(od))

    try:
        node._on_message("p1", msg(1))  # a producer one step ahead: kept
        with pytest.raises(WireError, match=r"for iteration 2, this part is at iteration 0 \(it keeps messages of "
                                            r"iterations 0..1\)"):
            node._on_message("p1", msg(2))
        assert node._aborted is None  # not one this part waits for yet: logged and counted only
        node._on_message("p1", msg(0))
        assert node.inbox.activations(1, 0) is None  # (p2's half of add_ab's inputs is still missing)
        node.inbox.finish(0)
        box = node.inbox._data[(1, "F", 0)]
        assert [float(np.asarray(od.payload).flat[0]) for od in box] == [1.0]  # the early one survived the step's end
    finally:
        node.transport.close(timeout_s=1, linger_s=0)


def test_ring_inbox_keeps_a_chunk_of_the_next_iteration():
    buckets = make_buckets({"w": ((6,), "float32")})
    ring = RingInbox("p0", ["p0", "r1.p0"], buckets)

    def chunk(it):
        return decode(encode_chunk(it, 0, 0, 0, "r1.p0", "p0", np.full(6, it, np.float32), ["p0", "r1.p0"]))

    ring.accept("r1.p0", chunk(1))
    with pytest.raises(WireError, match="iteration 2, this part is at iteration 0"):
        ring.accept("r1.p0", chunk(2))
    ring.accept("r1.p0", chunk(0))
    ring.finish(0)
    assert ring.take(0, 0, 0) is None and float(ring.take(1, 0, 0)[0]) == 1.0


def test_pseudo_inbox_keeps_the_next_iterations_round_without_dropping_the_current_one():
    buckets = make_buckets({"w": ((10,), "float32")})
    ring = RingInbox("p0", ["p0", "r1.p0"], buckets)
    codec = {"algo": "quant", "bits": 8}
    box = PseudoInbox(ring, codec)

    def msg(it, v):
        meta, frames = encode_pseudo(np.full(10, v, np.float32), codec)
        h = {"it": it, "bucket": 0, "step": 0, "chunk": 0, "src": "r1.p0", "dst": "p0", "gather": True,
             "group": ["p0", "r1.p0"], "payload": meta}
        return decode(encode(KIND, h, frames))

    box.accept("r1.p0", msg(0, 1.0))
    box.accept("r1.p0", msg(1, 2.0))  # a replica one step ahead; the current round stays
    with pytest.raises(WireError, match="iteration 2"):
        box.accept("r1.p0", msg(2, 3.0))
    assert box.take(0, 0, "r1.p0") is not None and box.take(1, 0, "r1.p0") is not None


def test_a_step_sent_ahead_and_not_run_by_the_loop_is_settled(tmp_path):
    """Ctrl-C between two steps: the step already sent runs on the CompNodes anyway; ``settle`` collects it (the
    step loop writes its line) so the final weights are never a step past the metrics."""
    from fusion.executors.runtime.coordinator import CoordinatorConfig
    from fusion.executors.runtime.launcher import LocalCluster

    plan_dir, batches = _mlp_diloco(tmp_path)
    with LocalCluster(plan_dir, tmp_path / "run", CoordinatorConfig(peer_timeout_s=30, steps_ahead=1), threads=1) as lc:
        lc.start()
        c = lc.coordinator
        assert c.settle() is None  # nothing in flight
        r0 = c.step(batches[0], ahead=batches[1])
        r1 = c.settle()
        assert (r0.step, r1.step, c.step_index, c.sent_ahead) == (0, 1, 2, 1) and r1.iteration_s > 0
        assert c.settle() is None
        r2 = c.step(batches[2])  # the loop goes on in lock step from there
        assert r2.step == 2

"""Tree all-reduce between data-parallel replicas (``Plan.dp_algo``): the schedule, the inbox's checks, and real runs.

The real runs start one executor process per replica (loopback), run a stage's group over the binomial tree
(reduce to replica 0, broadcast back) and compare with plain PyTorch on the global batch, like ``test_dp.py``;
the replicas must end with the same bits.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

from fusion.executors.runtime.dp.allreduce import (RingInbox, encode_chunk, make_buckets, tree_average, tree_depth,
                                                tree_steps)
from fusion.ir.errors import FusionError, WireError
from fusion.ir.wire import decode
from fusion.plan import PlanError, load_plan, save_plan
from tests.executors.dist_models import MODELS, assert_matches_plain, plain_training
from tests.executors.runtime.test_dp import MB, SGD, ADAMW, STEPS, one_stage, run_dp, save_dp_plan


# -- the schedule ------------------------------------------------------------------------------------

def test_tree_schedule_of_five_by_hand():
    """g = 5, L = 3: reduce 1->0, 3->2 | 2->0 | 4->0, then broadcast 0->4 | 0->2 | 0->1, 2->3."""
    steps = [tree_steps(5, r) for r in range(5)]
    sends = [sorted((r, s[1]) for r in range(5) if (s := steps[r][k]) and s[0] == "send") for k in range(6)]
    assert sends == [[(1, 0), (3, 2)], [(2, 0)], [(4, 0)], [(0, 4)], [(0, 2)], [(0, 1), (2, 3)]]
    assert [tree_depth(g) for g in range(1, 10)] == [0, 1, 2, 2, 3, 3, 3, 3, 4]


@pytest.mark.parametrize("g", [2, 3, 4, 5, 6, 7])
def test_tree_schedule_pairs_every_send_with_a_receive_and_reaches_everyone(g):
    """Every send at step k is the peer's receive at step k; each non-root rank hands its partial sum down
    once and gets the result once; following the reduce, rank 0 holds every rank's contribution exactly once."""
    L = tree_depth(g)
    steps = [tree_steps(g, r) for r in range(g)]
    assert all(len(s) == 2 * L for s in steps)
    holds = [{r} for r in range(g)]  # whose contributions each rank's buffer holds
    has_result = {0}
    for k in range(2 * L):
        for r in range(g):
            s = steps[r][k]
            if s is None:
                continue
            kind, peer, reduce = s
            assert reduce == (k < L)
            other = steps[peer][k]
            assert other == ("recv" if kind == "send" else "send", r, reduce), (g, k, r, s, other)
            if kind == "recv" and reduce:
                assert not holds[r] & holds[peer]  # each contribution is added once
                holds[r] |= holds[peer]
            elif kind == "recv":
                assert peer in has_result and r not in has_result
                has_result.add(r)
        if k == L - 1:
            assert holds[0] == set(range(g))
    assert has_result == set(range(g))
    for r in range(1, g):  # one send in the reduce, one receive in the broadcast
        assert sum(1 for s in steps[r][:L] if s and s[0] == "send") == 1
        assert sum(1 for s in steps[r][L:] if s and s[0] == "recv") == 1


def _simulate(g: int, data: list[np.ndarray], codec=None) -> list[np.ndarray]:
    """Run tree_average on g threads; messages go through encode/decode and each inbox's checks."""
    buckets = make_buckets({"w": ((data[0].size,), data[0].dtype.name)})
    group = [f"r{r}.p0" if r else "p0" for r in range(g)]
    inboxes = [RingInbox(group[r], group, buckets, codec, "tree") for r in range(g)]
    cv = threading.Condition()
    bufs = [d.copy() for d in data]
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        def send(peer, frames, label):
            with cv:
                inboxes[group.index(peer)].accept(group[r], decode(frames))
                cv.notify_all()

        def wait(ready, what):  # ready() takes the message out of the inbox: keep what it returned
            got: list = []
            with cv:
                assert cv.wait_for(lambda: got.append(ready()) or got[-1] is not None, timeout=10), what
                return got[-1]

        try:
            tree_average(inboxes[r], 0, [bufs[r]], send, wait)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(g)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not errors, errors
    assert all(not ib._got for ib in inboxes)
    return bufs


@pytest.mark.parametrize("g", [2, 3, 4, 5, 6, 7])
def test_tree_average_gives_every_rank_the_same_mean(g):
    rng = np.random.default_rng(g)
    data = [rng.standard_normal(13) for _ in range(g)]
    bufs = _simulate(g, data)
    np.testing.assert_allclose(bufs[0], np.mean(data, axis=0), rtol=1e-12)
    for b in bufs[1:]:
        np.testing.assert_array_equal(b, bufs[0])


@pytest.mark.parametrize("g", [3, 5])
def test_quantised_tree_keeps_the_ranks_bit_identical(g):
    """With the codec the partial sums travel quantised and rank 0 quantises the mean once: same bits everywhere."""
    rng = np.random.default_rng(10 + g)
    data = [rng.standard_normal(300).astype(np.float32) for _ in range(g)]
    bufs = _simulate(g, data, {"algo": "quant", "bits": 8})
    for b in bufs[1:]:
        np.testing.assert_array_equal(b, bufs[0])
    np.testing.assert_allclose(bufs[0], np.mean(data, axis=0), atol=0.1)


def _msg(**over):
    h = dict(it=0, bucket=0, step=0, chunk=0, src="r1.p0", dst="p0", data=np.zeros(5, np.float32),
             group=["p0", "r1.p0", "r2.p0", "r3.p0"])
    h.update(over)
    return decode(encode_chunk(h["it"], h["bucket"], h["step"], h["chunk"], h["src"], h["dst"], h["data"], h["group"]))


def test_tree_inbox_rejects_what_the_schedule_does_not_expect():
    group = ["p0", "r1.p0", "r2.p0", "r3.p0"]
    inbox = RingInbox("p0", group, make_buckets({"w": ((5,), "float32")}), algo="tree")
    # rank 0 of 4: step 0 from r1.p0, step 1 from r2.p0, then it only sends
    assert inbox.neighbours == {"r1.p0", "r2.p0", "r3.p0"}
    with pytest.raises(WireError, match=r"'p1', which is not in p0's data-parallel group"):
        inbox.accept("p1", _msg(src="p1"))
    with pytest.raises(WireError, match=r"step 0; in the tree p0 takes that step from 'r1.p0' only"):
        inbox.accept("r3.p0", _msg(src="r3.p0"))
    with pytest.raises(WireError, match=r"step 1; in the tree p0 takes that step from 'r2.p0' only"):
        inbox.accept("r1.p0", _msg(step=1))
    with pytest.raises(WireError, match=r"step 2; in the tree p0 receives nothing at that step"):
        inbox.accept("r2.p0", _msg(src="r2.p0", step=2))
    with pytest.raises(WireError, match="a tree of 4 has 4"):
        inbox.accept("r1.p0", _msg(step=4))
    with pytest.raises(WireError, match="chunk 0, not 1"):
        inbox.accept("r1.p0", _msg(chunk=1))
    with pytest.raises(WireError, match=r"expected float32\[5\]"):
        inbox.accept("r1.p0", _msg(data=np.zeros(3, np.float32)))
    with pytest.raises(WireError, match=r"expected float32\[5\]"):
        inbox.accept("r1.p0", _msg(data=np.zeros(5, np.float64)))
    with pytest.raises(WireError, match="iteration 2"):  # (1: a replica a step ahead, kept: test_step_ahead.py)
        inbox.accept("r1.p0", _msg(it=2))
    inbox.accept("r1.p0", _msg(data=np.ones(5, np.float32)))
    with pytest.raises(WireError, match="duplicate"):
        inbox.accept("r1.p0", _msg(data=np.ones(5, np.float32)))
    leaf = RingInbox("r3.p0", group, make_buckets({"w": ((5,), "float32")}), algo="tree")
    with pytest.raises(WireError, match=r"step 3; in the tree r3.p0 takes that step from 'r2.p0' only"):
        leaf.accept("p0", _msg(src="p0", dst="r3.p0", step=3))
    leaf.accept("r2.p0", _msg(src="r2.p0", dst="r3.p0", step=3))
    with pytest.raises(FusionError, match="all-reduce algorithm 'star'"):
        RingInbox("p0", group, make_buckets({"w": ((5,), "float32")}), algo="star")


# -- the plan field ---------------------------------------------------------------------------------

def test_dp_algo_round_trips_old_plans_are_ring_and_bad_values_name_the_field(tmp_path):
    build, _, _, _ = MODELS["cnn"]
    model = build(mb=MB)
    plan = load_plan(save_dp_plan(tmp_path, model, one_stage(model), 3, micro_batches=1))
    assert plan.dp_algo == {} and plan.dp_algo_of("r2.p0") == "ring"
    plan.dp_algo = {"p0": "tree"}
    save_plan(plan, tmp_path / "plan", params=model.params)
    again = load_plan(tmp_path / "plan")
    assert again.dp_algo == {"p0": "tree"} and again.dp_algo_of("r1.p0") == "tree"
    d = again.to_dict()
    for bad, match in [({"p0": "star"}, r"dp_algo.p0 must be 'ring' or 'tree', got 'star'"),
                       ({"p9": "tree"}, r"dp_algo.p9: not a stage of the assignment"),
                       (["tree"], r"dp_algo must map stages to 'ring' or 'tree'")]:
        with pytest.raises(PlanError, match=match) as e:
            type(again).from_dict({**d, "dp_algo": bad}, "plan.json")
        assert "\n" not in str(e.value) and str(e.value).startswith("plan.json: dp_algo")
    d.pop("dp_algo")  # a plan written before the field
    assert type(again).from_dict(d).dp_algo_of("p0") == "ring"


# -- real processes -----------------------------------------------------------------------------------

def _tree_plan(tmp_path, model, replicas, assignment=None, **kw):
    assignment = assignment or one_stage(model)
    plan_dir = save_dp_plan(tmp_path, model, assignment, replicas, micro_batches=1, **kw)
    plan = load_plan(plan_dir)
    plan.dp_algo = {s: "tree" for s in set(assignment.values())}
    save_plan(plan, plan_dir, params=model.params)
    return plan_dir


@pytest.mark.parametrize("replicas,name,stages,opt,engines", [
    (3, "gpt", 1, SGD, None),
    (4, "cnn", 1, ADAMW, None),
    (3, "gpt", 2, SGD, {"r2.p1": "numpy"}),  # a NumPy CompNode in stage p1's tree
], ids=["3x1-gpt-sgd", "4x1-cnn-adamw", "3x2-gpt-sgd-numpy"])
def test_tree_allreduce_matches_single_process_pytorch_on_the_global_batch(tmp_path, replicas, name, stages, opt,
                                                                            engines):
    build, splits, plain_loss, batch_fn = MODELS[name]
    model = build(mb=MB)
    plan_dir = _tree_plan(tmp_path, model, replicas, splits[2] if stages == 2 else None, optimizer=opt[0],
                          engines=engines)
    plan = load_plan(plan_dir)
    assert {plan.dp_algo_of(p) for p in plan.parts} == {"tree"} and len(plan.parts) == replicas * stages
    batches = [batch_fn(s, replicas * MB) for s in range(STEPS)]
    reports, state, states = run_dp(plan_dir, tmp_path / "run", batches)
    assert_matches_plain(reports, state, plain_training(model, plain_loss, batches, replicas, opt[1]))
    numpy_params = {p for n, part in plan.assignment.items() if engines and "r2." + part in engines
                    for p in plan.graph[n].param_names()}
    for r, st in enumerate(states[1:], 1):  # every replica copied rank 0's average: the same bits
        for k, v in states[0].items():
            if r == 2 and k in numpy_params:  # the NumPy engine's optimizer step may round differently from torch's
                np.testing.assert_allclose(st[k], v, rtol=1e-6, atol=1e-7, err_msg=k)
            else:
                np.testing.assert_array_equal(st[k], v, err_msg=k)
    if replicas == 4:  # the tree of 4: leaf r3 sends to its parent r2 only; the root p0 to its children r1, r2
        sent = {p: {q for q, x in rep["sent"].items() if x["bytes"]} for p, rep in reports[-1].parts.items()}
        assert sent["r3.p0"] - {"coordinator"} == {"r2.p0"}, sent
        assert sent["p0"] - {"coordinator"} == {"r1.p0", "r2.p0"}, sent


def test_quantised_tree_allreduce_keeps_replicas_identical(tmp_path):
    """--dp-codec with the tree: lossy, but every replica ends with the same bits."""
    build, _, plain_loss, batch_fn = MODELS["cnn"]
    model = build(mb=MB)
    plan_dir = _tree_plan(tmp_path, model, 3, optimizer=SGD[0])
    plan = load_plan(plan_dir)
    plan.dp_codec = {"algo": "quant", "bits": 8}
    save_plan(plan, plan_dir, params=model.params)
    batches = [batch_fn(s, 3 * MB) for s in range(STEPS)]
    reports, state, states = run_dp(plan_dir, tmp_path / "run", batches)
    for st in states[1:]:
        for k, v in states[0].items():
            np.testing.assert_array_equal(st[k], v, err_msg=k)
    expected = plain_training(model, plain_loss, batches, 3, SGD[1])
    np.testing.assert_allclose([r.loss for r in reports], [e[0] for e in expected], rtol=1e-2)


def test_compnode_logs_and_drops_tree_messages_from_outside_the_group_or_at_the_wrong_step(tmp_path, caplog):
    """3 x 2 with trees: through the real receive path, p0 rejects an all-reduce message from its pipeline peer
    p1 (not in its group) and one from r2.p0 at step 0 (p0 takes step 0 from r1.p0); r1.p0's is kept."""
    from fusion.executors.runtime.compnode import CompNode, ExecutorConfig
    from tests.executors.runtime.test_dp import _Frame

    build, splits, _, _ = MODELS["cnn"]
    model = build(mb=MB)
    plan_dir = _tree_plan(tmp_path, model, 3, splits[2])
    node = CompNode(load_plan(plan_dir), plan_dir, ExecutorConfig("p0", "tcp://127.0.0.1:1"))
    try:
        assert node.ring.algo == "tree" and node.dp_group == ["p0", "r1.p0", "r2.p0"]
        assert {"p1", "r1.p0", "r2.p0"} <= node.transport.allowed
        n = node.ring.bounds[0][0][1]  # the tree sends the whole bucket
        assert n == node.ring.buckets[0].total
        for sender, rejected, why in [("p1", 1, "not in p0's data-parallel group"),
                                      ("r2.p0", 2, "p0 takes that step from 'r1.p0' only")]:
            node.transport._handle([_Frame(sender.encode()), *encode_chunk(0, 0, 0, 0, sender, "p0",
                                                                             np.zeros(n, np.float32), node.dp_group)])
            assert node.transport.rejected == rejected and not node.ring._got
            assert why in caplog.text
        node.transport._handle([_Frame(b"r1.p0"), *encode_chunk(0, 0, 0, 0, "r1.p0", "p0", np.zeros(n, np.float32),
                                                              node.dp_group)])
        assert node.transport.rejected == 2 and len(node.ring._got) == 1
    finally:
        node.transport.close(timeout_s=1.0, linger_s=0.0)

"""Micro-batch schedules as data (GPipe, 1F1B, zero bubble) and the reference executor's deadlock detection."""
import numpy as np
import pytest
import torch

from fusion.plan import OptimizerConfig
from fusion.executors.reference import ReferenceExecutor
from fusion.executors.runtime.schedule import Action, gpipe, make_schedule, one_f_one_b, part_depths, zero_bubble
from fusion.ir.builder import GraphBuilder


def _s(actions):
    return " ".join(str(a) for a in actions)


def _check_complete(actions, n):
    """Every micro-batch forward and backward exactly once, F before B, backwards in order."""
    assert sorted(a.micro_batch for a in actions if a.kind == "F") == list(range(n))
    assert [a.micro_batch for a in actions if a.kind == "B"] == list(range(n))
    assert [a.micro_batch for a in actions if a.kind == "F"] == list(range(n))
    pos = {(a.kind, a.micro_batch): i for i, a in enumerate(actions)}
    assert len(pos) == len(actions) == 2 * n
    assert all(pos[("F", m)] < pos[("B", m)] for m in range(n))


def _max_in_flight(actions):
    live = peak = 0
    for a in actions:
        live += 1 if a.kind == "F" else -1
        peak = max(peak, live)
    return peak


def test_gpipe_is_all_forwards_then_all_backwards():
    assert _s(gpipe(3)) == "F0 F1 F2 B0 B1 B2"
    assert gpipe(4, depth=2) == gpipe(4)
    for n in (1, 2, 5):
        _check_complete(gpipe(n), n)
        assert _max_in_flight(gpipe(n)) == n


def test_one_f_one_b_warms_up_by_depth():
    assert _s(one_f_one_b(4, 0)) == "F0 B0 F1 B1 F2 B2 F3 B3"
    assert _s(one_f_one_b(4, 1)) == "F0 F1 B0 F2 B1 F3 B2 B3"
    assert _s(one_f_one_b(4, 3)) == "F0 F1 F2 F3 B0 B1 B2 B3"
    assert _s(one_f_one_b(2, 5)) == "F0 F1 B0 B1"  # deeper than the micro-batches: GPipe
    for n in range(1, 7):
        for d in range(0, 6):
            acts = one_f_one_b(n, d)
            _check_complete(acts, n)
            first_b = next(i for i, a in enumerate(acts) if a.kind == "B")
            assert first_b == min(d + 1, n)  # warm-up forwards before the first backward
            assert _max_in_flight(acts) == min(d + 1, n)  # 1F1B bounds the stashed activations


def test_zero_bubble_splits_backward_and_defers_weight_gradients_by_depth():
    assert _s(zero_bubble(3, 0)) == "F0 B0 W0 F1 B1 W1 F2 B2 W2"
    assert _s(zero_bubble(4, 1)) == "F0 F1 B0 F2 B1 W0 F3 B2 W1 W2 B3 W3"
    assert _s(zero_bubble(4, 3)) == "F0 F1 F2 F3 B0 W0 B1 W1 B2 W2 B3 W3"  # cool-down: a W before each waited-for B
    for n in range(1, 7):
        for d in range(0, 6):
            acts = zero_bubble(n, d)
            # without the Ws it is exactly 1F1B, so it deadlocks no more than 1F1B does
            assert [a for a in acts if a.kind != "W"] == one_f_one_b(n, d)
            pos = {(a.kind, a.micro_batch): i for i, a in enumerate(acts)}
            assert len(pos) == len(acts) == 3 * n
            assert all(pos[("B", m)] < pos[("W", m)] for m in range(n))
            assert [a.micro_batch for a in acts if a.kind == "W"] == list(range(n))
            live = peak = waiting = peak_w = peak_all = 0  # forward stashes (F..B), weight stashes (B..W)
            for a in acts:
                live += {"F": 1, "B": -1, "W": 0}[a.kind]
                waiting += {"F": 0, "B": 1, "W": -1}[a.kind]
                peak, peak_w, peak_all = max(peak, live), max(peak_w, waiting), max(peak_all, live + waiting)
            assert peak == min(d + 1, n) and peak_w <= min(d, n) + 1
            assert peak_all <= min(2 * d + 1, n)  # what the estimator charges a zb1 part (in_flight)
    plan = make_schedule("zb1", ["a", "b"], {("a", "b"): []}, 2)
    assert _s(plan["a"]) == "F0 F1 B0 W0 B1 W1" and _s(plan["b"]) == "F0 B0 W0 F1 B1 W1"


def test_make_schedule_depth_follows_the_part_dag():
    chain = ["a", "b", "c", "d"]
    edges = {("a", "b"): [], ("b", "c"): [], ("c", "d"): []}
    assert part_depths(chain, edges) == {"a": 3, "b": 2, "c": 1, "d": 0}
    s = make_schedule("1f1b", chain, edges, 4)
    assert {p: _s(v) for p, v in s.items()} == {
        "a": "F0 F1 F2 F3 B0 B1 B2 B3", "b": "F0 F1 F2 B0 F3 B1 B2 B3",
        "c": "F0 F1 B0 F2 B1 F3 B2 B3", "d": "F0 B0 F1 B1 F2 B2 F3 B3"}
    # a diamond: the branches are one step from the sink, the stem two
    order = ["stem", "left", "right", "head"]
    diamond = {("stem", "left"): [], ("stem", "right"): [], ("left", "head"): [], ("right", "head"): [],
               ("stem", "head"): []}
    assert part_depths(order, diamond) == {"stem": 2, "left": 1, "right": 1, "head": 0}
    # two sinks
    assert part_depths(["p", "q", "r"], {("p", "q"): [], ("p", "r"): []}) == {"p": 1, "q": 0, "r": 0}
    g = make_schedule("gpipe", order, diamond, 2)
    assert all(_s(v) == "F0 F1 B0 B1" for v in g.values()) and list(g) == order
    assert make_schedule("1f1b", ["solo"], {}, 3) == {"solo": one_f_one_b(3, 0)}


def test_make_schedule_errors():
    with pytest.raises(ValueError, match=r"unknown schedule 'zigzag'; choose one of \['1f1b', 'gpipe', 'interleaved', 'zb1'\]"):
        make_schedule("zigzag", ["a"], {}, 2)
    with pytest.raises(ValueError, match="micro_batches must be >= 1, got 0"):
        make_schedule("gpipe", ["a"], {}, 0)
    with pytest.raises(KeyError):
        make_schedule("gpipe", ["a"], {("a", "ghost"): []}, 1)  # an edge to a part not in the order


def _two_part_executor(schedule="gpipe", micro_batches=2):
    b = GraphBuilder()
    x, y = b.input("x"), b.label("y")
    h = b.module("fc1", "torch.nn.Linear", x, in_features=4, out_features=4)
    o = b.module("fc2", "torch.nn.Linear", b.function("act", "torch.tanh", h), in_features=4, out_features=3)
    b.loss("loss", "torch.nn.functional.cross_entropy", o, y)
    m = b.build({"x": torch.zeros(2, 4), "y": torch.zeros(2, dtype=torch.long)})
    a = {"x": "p0", "fc1": "p0", "act": "p1", "fc2": "p1", "y": "p1", "loss": "p1"}
    return ReferenceExecutor(m, a, OptimizerConfig("sgd", lr=0.1), micro_batches=micro_batches, schedule=schedule)


def _batch():
    g = torch.Generator().manual_seed(0)
    return {"x": torch.randn(4, 4, generator=g), "y": torch.randint(0, 3, (4,), generator=g)}


def test_schedules_give_the_same_step():
    a, b = _two_part_executor("gpipe"), _two_part_executor("1f1b")
    assert {p: _s(v) for p, v in b.schedule.items()} == {"p0": "F0 F1 B0 B1", "p1": "F0 B0 F1 B1"}
    ra, rb = a.step(_batch()), b.step(_batch())
    assert ra.loss == rb.loss
    for n in ra.grads:
        np.testing.assert_array_equal(ra.grads[n], rb.grads[n])


def test_reference_executor_detects_a_deadlocking_schedule():
    ex = _two_part_executor()
    # p0 waits for a gradient before producing the activation p1 waits for
    ex.schedule = {"p0": [Action("B", 0), Action("F", 0), Action("F", 1), Action("B", 1)],
                   "p1": [Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1)]}
    with pytest.raises(RuntimeError, match=r"schedule deadlock at \{'p0': 'B0', 'p1': 'F0'\}"):
        ex.step(_batch())
    ex = _two_part_executor()
    # both parts wait on micro-batch orders that cross: p1 wants F1 first, p0 will only send F0
    ex.schedule = {"p0": [Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1)],
                   "p1": [Action("F", 1), Action("B", 1), Action("F", 0), Action("B", 0)]}
    with pytest.raises(RuntimeError, match=r"schedule deadlock at \{'p0': 'B0', 'p1': 'F1'\}"):
        ex.step(_batch())


def test_backward_before_forward_is_a_clear_error():
    ex = _two_part_executor()
    # the last part needs no gradient from anyone, so nothing stops it from running B0 first
    ex.schedule = {"p0": gpipe(2), "p1": [Action("B", 0), Action("F", 0), Action("F", 1), Action("B", 1)]}
    with pytest.raises(RuntimeError, match=r"backward of micro-batch .*0.* before its forward"):
        ex.step(_batch())

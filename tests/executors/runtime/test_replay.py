"""The schedule replay prices a plan the way the executors run it (alpha-beta links, per-link queues)."""
import pytest

from tests.executors.dist_models import CNN_SPLITS, branching_cnn
from fusion.executors.runtime.launcher import hand_plan
from fusion.executors.runtime.linkemu import LinkModel
from fusion.executors.runtime.replay import message_bytes, replay


def test_two_part_gpipe_matches_hand_computation():
    model = branching_cnn(mb=2)
    plan = hand_plan(model, CNN_SPLITS[2], micro_batches=3)
    sends = message_bytes(plan)
    (dst, fwd_bytes), = [(d, n) for d, n in sends[("p0", "F")]][:1]
    assert dst == "p1" and fwd_bytes > 2 * 4 * 6 * 6 * 4  # relu_a and conv1 outputs both go to p1
    alpha, beta = 0.01, 1e-6
    links = {("p0", "p1"): LinkModel(alpha, beta), ("p1", "p0"): LinkModel(alpha, beta)}
    f, b = 0.002, 0.004
    r = replay(plan, {"p0": {"F": f, "B": b}, "p1": {"F": f, "B": b}}, links, tail_s={"p0": 0.001, "p1": 0.001})
    nf = sum(n for _, n in sends[("p0", "F")])
    nb = sum(n for _, n in sends[("p1", "B")])
    # p0: F0 F1 F2 back to back; its messages queue on the link; p1 runs F2 after the last one arrives
    t_last_fwd_arrival = f + 3 * beta * nf + alpha if beta * nf > f else 3 * f + beta * nf + alpha
    t_p1_done = t_last_fwd_arrival + f + 3 * b  # F2 then B0 B1 B2
    # p0's last backward waits for B2's gradient
    expected = t_p1_done + beta * nb + alpha + b + 0.001
    assert r.iteration_s == pytest.approx(expected, rel=1e-9)
    assert r.link_bytes[("p0", "p1")] == 3 * nf and r.link_bytes[("p1", "p0")] == 3 * nb


def test_zero_bubble_replay_fills_the_drain_with_weight_gradients():
    """Two parts, free links, F = 1 and B = 2 (input and weight halves of 1 each), 2 micro-batches.

    1F1B: p1 runs F0 1-2 B0 2-4 F1 4-5 B1 5-7; p0 waits for each gradient: B0 4-6, B1 7-9 -> 9.
    zb1:  p1 runs F0 1-2 B0 2-3 W0 3-4 F1 4-5 B1 5-6 W1 6-7, so p0's gradients arrive at 3 and 6:
          B0 3-4 W0 4-5 (while waiting) B1 6-7 W1 7-8 -> 8.
    """
    import dataclasses

    model = branching_cnn(mb=2)
    free = {("p0", "p1"): LinkModel(0.0, 0.0), ("p1", "p0"): LinkModel(0.0, 0.0)}
    compute = {"p0": {"F": 1.0, "B": 2.0}, "p1": {"F": 1.0, "B": 2.0}}
    plan = hand_plan(model, CNN_SPLITS[2], micro_batches=2, schedule="1f1b")
    assert replay(plan, compute, free).iteration_s == pytest.approx(9.0)
    zb = dataclasses.replace(plan, schedule="zb1")
    r = replay(zb, compute, free)
    assert r.iteration_s == pytest.approx(8.0)
    assert [a for a, _, _ in r.timeline["p0"]] == ["F0", "F1", "B0", "W0", "B1", "W1"]
    # measured halves are used as given: p1 F0 1-2 B0 2-2.5 W0 2.5-4 F1 4-5 B1 5-5.5 W1 5.5-7;
    # p0 B0 2.5-3 W0 3-4.5 B1 5.5-6 W1 6-7.5
    uneven = {p: {"F": 1.0, "B": 0.5, "W": 1.5} for p in compute}
    assert replay(zb, uneven, free).iteration_s == pytest.approx(7.5)

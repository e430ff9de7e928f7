"""The schedule replay prices a plan the way the executors run it (alpha-beta links, per-link queues)."""
import pytest

from tests.executors.dist_models import CNN_SPLITS, branching_cnn
from fusion.executors.launcher import hand_plan
from fusion.executors.linkemu import LinkModel
from fusion.executors.replay import message_bytes, replay


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

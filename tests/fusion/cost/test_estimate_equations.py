"""Eq. (1)-(4) with backward, computed by hand on a 3-device example, match the estimator exactly.

The formulas are the ones in fusion/cost/estimate.py's docstring and docs/compiler.md:
  C_p   = sum_f [(F_fwd+F_bwd)/S* + (B_fwd+B_bwd)/Bmem*] / lambda
  R_p   = sum of forward tensors p receives (alpha+beta*M on src->p)
        + sum of gradients p receives for tensors it sent (alpha+beta*M on dst->p)
  T     = sum_p (C_p + R_p) + (n_b - 1) * max_p max(C_p, R_p)  (+ tied-gradient sync)
  phi   = n_b * batch / T
"""
import numpy as np
import pytest
import torch

from fusion.cluster.model import Cluster, Device
from fusion.cost.estimate import CostModel
from fusion.cost.flops import NodeCost
from fusion.ir.builder import GraphBuilder

A = np.array([[0, .01, .02], [.03, 0, .04], [.05, .06, 0]])
BPS = np.array([[1, 8e3, 16e3], [32e3, 1, 64e3], [8e3, 16e3, 1]])
COSTS = {  # hand-picked, so the test checks the equations rather than the FLOP counter
    "l1": NodeCost(1e9, 1e9, 0, 0, 100), "l2": NodeCost(2e9, 4e9, 1e8, 2e8, 200),
    "l3": NodeCost(3e9, 6e9, 0, 0, 300), "add": NodeCost(0, 0, 4e8, 4e8, 0), "loss": NodeCost(0, 0, 1e8, 3e8, 50),
}


def _cluster():
    devs = [Device("d0", 1e10, 1e6, lam=0.5, memory_bandwidth=1e9),
            Device("d1", 2e10, 1e6, lam=1.0, memory_bandwidth=2e9),
            Device("d2", 8e10, 1e6, lam=0.25, memory_bandwidth=4e9)]
    beta = 8.0 / BPS
    np.fill_diagonal(beta, 0.0)
    return Cluster("three", devs, A.copy(), beta)


def _graph(tied=False):
    b = GraphBuilder()
    x, y = b.input("x"), b.label("y")
    h1 = b.module("l1", "torch.nn.Linear", x, in_features=4, out_features=8)
    h2 = b.module("l2", "torch.nn.Linear", h1, in_features=8, out_features=8)
    h3 = b.module("l3", "torch.nn.Linear", h2, in_features=8, out_features=8,
                  params={"weight": "l2.weight"} if tied else None)
    s = b.function("add", "operator.add", h1, h3)  # skip connection p0 -> p2
    b.loss("loss", "torch.nn.functional.mse_loss", s, y)
    return b.build({"x": torch.zeros(2, 4), "y": torch.zeros(2, 8)}, device="meta").graph


ASSIGN = {"x": 0, "l1": 0, "l2": 1, "l3": 2, "add": 2, "y": 2, "loss": 2}


def _cm(graph, schedule="gpipe"):
    return CostModel.build(graph, COSTS, _cluster(), micro_batches=3, schedule=schedule, optimizer_slots=2,
                           samples_per_micro_batch=2)


def _node_part(cm):
    return np.array([ASSIGN[n] for n in cm.names])


def test_hand_computed_three_devices():
    cm = _cm(_graph())
    est = cm.evaluate(_node_part(cm), [0, 1, 2])
    # C_p: speeds S = lambda * S* = 5e9, 2e10, 2e10; memory speeds 5e8, 2e9, 1e9
    C = [(1e9 + 1e9) / 5e9, (2e9 + 4e9) / 2e10 + (1e8 + 2e8) / 2e9, (3e9 + 6e9) / 2e10 + (4e8 + 4e8 + 1e8 + 3e8) / 1e9]
    # every cut tensor is a (2, 8) float32 = 64 bytes; beta = 8 / bandwidth_bps
    b = lambda i, j: 8 / BPS[i, j]  # noqa: E731
    R = [(A[1, 0] + b(1, 0) * 64) + (A[2, 0] + b(2, 0) * 64),  # grads of l1 from p1 and (skip) from p2
         (A[0, 1] + b(0, 1) * 64) + (A[2, 1] + b(2, 1) * 64),  # l1 in; grad of l2 from p2
         (A[0, 2] + b(0, 2) * 64) + (A[1, 2] + b(1, 2) * 64)]  # l1 (skip, direct) and l2 in
    assert C == pytest.approx([0.4, 0.45, 1.65], rel=1e-12) and R == pytest.approx([0.16, 0.166, 0.1], rel=1e-12)
    for p in range(3):
        assert est.parts[p].compute_s == pytest.approx(C[p], rel=1e-12)
        assert est.parts[p].comm_s == pytest.approx(R[p], rel=1e-12)
    T = sum(c + r for c, r in zip(C, R)) + (3 - 1) * max(max(c, r) for c, r in zip(C, R))
    assert T == pytest.approx(6.226, rel=1e-12)
    assert est.pipeline_s == pytest.approx(T, rel=1e-12)
    assert est.sync_s == 0.0 and est.iteration_s == pytest.approx(T, rel=1e-12)
    assert est.throughput == pytest.approx(3 * 2 / T, rel=1e-12)  # Eq. (4)
    # links carry what crosses them, once per (tensor, destination part)
    links = {(l.src, l.dst): l for l in est.links}
    assert set(links) == {(0, 1), (0, 2), (1, 2)}
    assert links[(0, 2)].fwd_bytes == 64 and links[(0, 2)].tensors == 1


def test_eq1_single_operator_time():
    cm = _cm(_graph())
    np_ = _node_part(cm)
    b = lambda i, j: 8 / BPS[i, j]  # noqa: E731
    # T(l2, d1) = R(Pa) + C + W(=0): l1's output comes from d0
    assert cm.op_time(cm.index["l2"], np_, np.array([0, 1, 2])) == pytest.approx(A[0, 1] + b(0, 1) * 64 + 0.45, rel=1e-12)
    # T(add, d2): l1 is remote (skip), l3 is local
    assert cm.op_time(cm.index["add"], np_, np.array([0, 1, 2])) == pytest.approx(A[0, 2] + b(0, 2) * 64 + 0.8, rel=1e-12)


def test_memory_gpipe_and_1f1b():
    p1, p2 = (8 * 4 + 8) * 4, (8 * 8 + 8) * 4  # parameter bytes of l1 and of l2 / l3
    cm = _cm(_graph())
    est = cm.evaluate(_node_part(cm), [0, 1, 2])
    # AdamW: parameter + gradient + 2 moments = 4x; GPipe keeps all 3 micro-batches' activations
    assert [p.memory_bytes for p in est.parts] == [4 * p1 + 3 * 100, 4 * p2 + 3 * 200, 4 * p2 + 3 * 350]
    cm = _cm(_graph(), schedule="1f1b")
    est = cm.evaluate(_node_part(cm), [0, 1, 2])
    # 1F1B: min(n_b, depth + 1) in flight; depths 2, 1, 0
    assert [p.in_flight for p in est.parts] == [3, 2, 1]
    assert [p.memory_bytes for p in est.parts] == [4 * p1 + 3 * 100, 4 * p2 + 2 * 200, 4 * p2 + 1 * 350]


def test_tied_parameter_gradient_sync():
    cm = _cm(_graph(tied=True))
    est = cm.evaluate(_node_part(cm), [0, 1, 2])
    w = 8 * 8 * 4  # l2.weight, held by p1 and p2; p1 (first owner) collects and sends back the sum
    b = lambda i, j: 8 / BPS[i, j]  # noqa: E731
    sync = (A[2, 1] + b(2, 1) * w) + (A[1, 2] + b(1, 2) * w)
    assert est.sync_s == pytest.approx(sync, rel=1e-12)
    assert est.iteration_s == pytest.approx(est.pipeline_s + sync, rel=1e-12)
    # the shared weight counts in both holders' memory
    assert est.parts[2].param_state_bytes == 4 * (w + 8 * 4)


def test_memory_violation_is_reported():
    cm = _cm(_graph())
    cl = _cluster()
    cl.devices[2] = Device("d2", 8e10, 1000.0, lam=0.25, memory_bandwidth=4e9)
    est = cm.with_cluster(cl).evaluate(_node_part(cm), [0, 1, 2])
    assert not est.feasible and "d2" in est.violations[0]

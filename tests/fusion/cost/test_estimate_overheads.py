"""The per-node and per-message fixed costs fitted by ``fusion profile`` in the estimator's C_p.

  C_p = sum_f C(f, p) + n_p * o_node + m_p * o_msg
with n_p the op nodes p executes and m_p the messages it sends or receives per micro-batch
(docstring of fusion/cost/estimate.py). On the 3-device example of test_estimate_equations:
  p0 runs l1 (x is a placeholder): n = 1; sends l1 to p1 and p2 and gets both gradients back: m = 4
  p1 runs l2: n = 1; gets l1 and sends its gradient, sends l2 and gets its gradient: m = 4
  p2 runs l3, add, loss (y is a placeholder): n = 3; gets l1 and l2, sends both gradients: m = 4
"""
from dataclasses import replace

import numpy as np
import pytest

from fusion.cost.estimate import FORWARD_SHARE, CostModel
from tests.fusion.cost.test_estimate_equations import _cluster, _cm, _graph, _node_part

N_EXEC, N_MSG = [1, 1, 3], [4, 4, 4]


def _with_overheads(node_s, msg_s):
    cl = _cluster()
    cl.devices = [replace(d, node_overhead_s=n, message_overhead_s=m) for d, n, m in zip(cl.devices, node_s, msg_s)]
    return cl


def test_part_time_grows_by_nodes_times_overhead():
    cm = _cm(_graph())
    base = cm.evaluate(_node_part(cm), [0, 1, 2])
    node_s = [1e-3, 2e-3, 5e-3]
    est = cm.with_cluster(_with_overheads(node_s, [0, 0, 0])).evaluate(_node_part(cm), [0, 1, 2])
    for p in range(3):
        assert est.parts[p].compute_s == pytest.approx(base.parts[p].compute_s + N_EXEC[p] * node_s[p], rel=1e-12)
        assert est.parts[p].comm_s == base.parts[p].comm_s
    # Eq. (3) with the larger C_p: the iteration grows by exactly what the new C_p give
    C = [p.compute_s for p in est.parts]
    R = [p.comm_s for p in est.parts]
    assert est.pipeline_s == pytest.approx(sum(C) + sum(R) + 2 * max(max(c, r) for c, r in zip(C, R)), rel=1e-12)
    # Eq. (1) for one node carries its device's overhead; a placeholder none
    cm2 = cm.with_cluster(_with_overheads(node_s, [0, 0, 0]))
    assert cm2.compute_time(cm.index["add"], 2) == pytest.approx(cm.compute_time(cm.index["add"], 2) + 5e-3, rel=1e-12)
    assert cm2.compute_time(cm.index["y"], 2) == cm.compute_time(cm.index["y"], 2) == 0.0


def test_messages_priced_per_message_sent_or_received():
    cm = _cm(_graph())
    base = cm.evaluate(_node_part(cm), [0, 1, 2])
    msg_s = [1e-4, 3e-4, 7e-4]
    est = cm.with_cluster(_with_overheads([0, 0, 0], msg_s)).evaluate(_node_part(cm), [0, 1, 2])
    for p in range(3):
        assert est.parts[p].compute_s == pytest.approx(base.parts[p].compute_s + N_MSG[p] * msg_s[p], rel=1e-12)
    # one part: no message at all
    one = cm.with_cluster(_with_overheads([0, 0, 0], msg_s)).evaluate(np.zeros(len(cm.names), dtype=int), [0])
    assert one.parts[0].compute_s == pytest.approx(cm.evaluate(np.zeros(len(cm.names), dtype=int), [0]).parts[0].compute_s)


def test_recomputation_repeats_the_forward_share_of_the_node_overhead():
    cm = _cm(_graph()).with_cluster(_with_overheads([1e-3, 2e-3, 5e-3], [0, 0, 0]))
    rc = np.array([False, False, True])
    off = cm.evaluate(_node_part(cm), [0, 1, 2])
    on = cm.evaluate(_node_part(cm), [0, 1, 2], recompute=rc)
    fwd_flop_s = (3e9 / 2e10) + (4e8 + 1e8) / 1e9  # l3 forward FLOPs on d2 (S = 2e10), add + loss forward bytes
    assert on.parts[2].compute_s == pytest.approx(off.parts[2].compute_s + fwd_flop_s + FORWARD_SHARE * 3 * 5e-3,
                                                  rel=1e-12)
    assert on.parts[0].compute_s == off.parts[0].compute_s


def test_cost_model_copies_keep_the_overheads():
    cm = _cm(_graph()).with_cluster(_with_overheads([1e-3, 0, 0], [0, 0, 0]))
    kw = {k: getattr(cm, k) for k in cm.__dataclass_fields__ if cm.__dataclass_fields__[k].init}
    copy = CostModel(**kw)
    assert copy.node_overhead.tolist() == [1e-3, 0, 0] and copy.executes.tolist() == cm.executes.tolist()

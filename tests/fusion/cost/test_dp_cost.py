"""The data-parallel cost (fusion.cost.dp): the ring all-reduce by hand, R = 1 is the single pipeline, overlap."""
import numpy as np
import pytest

from fusion.cost.dp import BACKWARD_SHARE, dp_estimate, replica_cost_model, ring_allreduce_time, stage_grad_bytes
from fusion.cost.estimate import CostModel
from fusion.partition.chain import build_chain
from tests.fusion.dp_clusters import matrix_cluster, tiny_gpt, two_regions


@pytest.fixture(scope="module")
def tiny():
    return tiny_gpt()


def test_ring_allreduce_two_devices_by_hand():
    # 0 -> 1: 1 Gbit/s, 2 ms; 1 -> 0: 500 Mbit/s, 3 ms: the slowest link is 1 -> 0
    cl = matrix_cluster([[0, 2e-3], [3e-3, 0]], [[0, 1e9], [500e6, 0]])
    M = 1e8
    # 2 (n-1)/n * M * beta_max + 2 (n-1) alpha_max = 1 * 1e8 * 8/5e8 + 2 * 3e-3
    assert ring_allreduce_time(cl, [0, 1], M) == pytest.approx(1.6 + 0.006, rel=1e-12)
    assert ring_allreduce_time(cl, [0], M) == 0.0


def test_ring_allreduce_four_devices_by_hand():
    bw = np.full((4, 4), 10e9)
    lat = np.full((4, 4), 1e-4)
    bw[2, 3] = 250e6  # one slow direction sets the price of the whole group
    lat[1, 0] = 0.02
    cl = matrix_cluster(lat, bw)
    M = 4e8
    expect = 2 * 3 / 4 * M * 8 / 250e6 + 2 * 3 * 0.02  # 19.2 s + 0.12 s
    assert ring_allreduce_time(cl, [0, 1, 2, 3], M) == pytest.approx(expect, rel=1e-12)
    assert ring_allreduce_time(cl, [0, 1], M) == pytest.approx(2 * 1 / 2 * M * 8 / 10e9 + 2 * 0.02)


def test_one_replica_is_the_single_pipeline(tiny):
    m, costs = tiny
    cl = two_regions()
    cm = CostModel.build(m.graph, costs, cl, 4, "1f1b", 2, 1)
    ch = build_chain(cm)
    node_part = ch.node_part([ch.n_atoms // 2])
    est = dp_estimate(cm, node_part, [[0, 5]])
    single = cm.evaluate(node_part, [0, 5])
    assert est.iteration_s == single.iteration_s  # to the bit
    assert est.dp_sync_s == 0.0 and est.allreduce_s == [0.0, 0.0]
    assert est.samples_per_s == pytest.approx(single.throughput)


def test_two_replicas_one_stage_by_hand(tiny):
    m, costs = tiny
    cl = two_regions(slow_bps=50e6)
    cm = CostModel.build(m.graph, costs, cl, 2, "1f1b", 2, 1)
    zero = np.zeros(len(cm.names), dtype=np.int64)
    P = float(cm.p_bytes[cm.p_trainable].sum())
    assert stage_grad_bytes(cm, zero, 1)[0] == pytest.approx(P)
    est = dp_estimate(cm, zero, [[0], [4]])  # one replica per region: the slow link averages
    pipe = cm.evaluate(zero, [0]).iteration_s
    ar = 2 * 1 / 2 * P * 8 / 50e6 + 2 * 0.03
    assert est.pipeline_s == pytest.approx(pipe)
    assert est.dp_sync_s == pytest.approx(ar)  # a single stage has no backward left to hide behind
    assert est.iteration_s == pytest.approx(pipe + ar)
    assert est.global_batch == 4 and est.samples_per_s == pytest.approx(4 / (pipe + ar))


def test_overlap_hides_the_later_stage_behind_the_remaining_backward(tiny):
    m, costs = tiny
    cl = two_regions(slow_bps=50e6)
    cm = CostModel.build(m.graph, costs, cl, 2, "1f1b", 2, 1)
    ch = build_chain(cm)
    node_part = ch.node_part([ch.n_atoms // 2])
    devs = [[0, 1], [4, 5]]
    on = dp_estimate(cm, node_part, devs)
    off = dp_estimate(cm, node_part, devs, overlap=False)
    assert off.dp_sync_s == pytest.approx(max(off.allreduce_s))
    slow = int(np.argmax(on.replica_s))
    p0 = cm.evaluate(node_part, devs[slow]).parts[0]
    tail1 = BACKWARD_SHARE * p0.compute_s + p0.comm_bwd_s
    assert on.dp_sync_s == pytest.approx(max(on.allreduce_s[0], max(0.0, on.allreduce_s[1] - tail1)))
    assert on.iteration_s <= off.iteration_s
    half = dp_estimate(cm, node_part, devs, grad_wire_ratio=0.25)
    assert half.allreduce_s[0] < on.allreduce_s[0]


def test_replica_cost_model_scales_the_micro_batch(tiny):
    m, costs = tiny
    cm = CostModel.build(m.graph, costs, two_regions(), 1, "1f1b", 2, 1)
    big = replica_cost_model(cm, 3, 2.0)
    assert big.micro_batches == 3 and big.samples_per_micro_batch == 2
    np.testing.assert_allclose(big.flops, 2 * cm.flops)
    np.testing.assert_allclose(big.p_state, cm.p_state)  # parameters do not grow with the batch


def test_bad_table_is_rejected(tiny):
    m, costs = tiny
    cm = CostModel.build(m.graph, costs, two_regions(), 1, "1f1b", 2, 1)
    with pytest.raises(ValueError, match="R x S"):
        dp_estimate(cm, np.zeros(len(cm.names), dtype=np.int64), [[0, 1], [2]])

"""The tree all-reduce's price (fusion.cost.dp): by hand, and ``auto`` picking ring or tree by latency vs bandwidth."""
import numpy as np
import pytest

from fusion.cost.dp import choose_allreduce, dp_estimate, ring_allreduce_time, tree_allreduce_time
from fusion.cost.estimate import CostModel
from fusion.cost.flops import measure_costs
from tests.fusion.dp_clusters import matrix_cluster
from tests.testing_models import gpt_model


def _uniform(n: int, alpha: float, bps: float):
    return matrix_cluster(np.full((n, n), alpha), np.full((n, n), bps))


def test_tree_allreduce_by_hand():
    cl = _uniform(8, 2e-3, 1e9)
    M = 1e6
    # 2 ceil(log2 n) (alpha + M beta): n = 8 -> 3 levels each way; n = 5 -> 3; n = 2 -> 1
    assert tree_allreduce_time(cl, list(range(8)), M) == pytest.approx(2 * 3 * (2e-3 + M * 8 / 1e9), rel=1e-12)
    assert tree_allreduce_time(cl, list(range(5)), M) == pytest.approx(2 * 3 * (2e-3 + M * 8 / 1e9), rel=1e-12)
    assert tree_allreduce_time(cl, [0, 1], M) == pytest.approx(2 * (2e-3 + M * 8 / 1e9), rel=1e-12)
    assert tree_allreduce_time(cl, [3], M) == 0.0 and tree_allreduce_time(cl, [0, 1], 0.0) == 0.0
    bw = np.full((4, 4), 10e9)
    bw[2, 1] = 100e6  # the slowest link prices the group, as for the ring
    slow = matrix_cluster(np.full((4, 4), 1e-4), bw)
    assert tree_allreduce_time(slow, [0, 1, 2, 3], M) == pytest.approx(2 * 2 * (1e-4 + M * 8 / 100e6), rel=1e-12)


def test_auto_takes_the_tree_when_latency_dominates_and_the_ring_when_bandwidth_does():
    cl = _uniform(8, 50e-3, 1e9)  # far links: 50 ms
    group = list(range(8))
    small, big = 1e4, 1e9
    # 10 kB: ring 14 latencies (0.70 s) vs tree 6 (0.30 s)
    assert choose_allreduce(cl, group, small) == ("tree", pytest.approx(tree_allreduce_time(cl, group, small)))
    assert tree_allreduce_time(cl, group, small) < ring_allreduce_time(cl, group, small)
    # 1 GB: the ring sends 1.75 buffers, the tree 6
    assert choose_allreduce(cl, group, big) == ("ring", pytest.approx(ring_allreduce_time(cl, group, big)))
    assert choose_allreduce(cl, [0, 1], small)[0] == "ring"  # two replicas: the ring (one exchange) always wins
    assert choose_allreduce(cl, group, small, "ring")[0] == "ring"
    assert choose_allreduce(cl, group, big, "tree")[0] == "tree"
    with pytest.raises(ValueError, match="'star'"):
        choose_allreduce(cl, group, big, "star")


def test_dp_estimate_prices_the_chosen_algorithm_per_group():
    m = gpt_model(2, 64, 2, 100, 16, 1, device="meta")
    costs = measure_costs(m.graph)
    cl = _uniform(8, 50e-3, 10e9)
    cm = CostModel.build(m.graph, costs, cl, 1, "1f1b", 2, 1)
    zero = np.zeros(len(cm.names), dtype=np.int64)
    devs = [[r] for r in range(8)]
    ring = dp_estimate(cm, zero, devs, overlap=False)
    tree = dp_estimate(cm, zero, devs, overlap=False, algo="tree")
    auto = dp_estimate(cm, zero, devs, overlap=False, algo="auto")
    P = ring.grad_bytes[0]
    assert ring.algos == ["ring"] and tree.algos == ["tree"]
    assert tree.allreduce_s[0] == pytest.approx(2 * 3 * (50e-3 + P * 8 / 10e9))
    assert auto.algos == ["tree"] and auto.allreduce_s == tree.allreduce_s  # a small model on far links
    assert auto.iteration_s == pytest.approx(auto.pipeline_s + tree.allreduce_s[0])
    assert dp_estimate(cm, zero, devs, algo=["ring"]).algos == ["ring"]
    with pytest.raises(ValueError, match="names 2 stage groups"):
        dp_estimate(cm, zero, devs, algo=["ring", "tree"])


def test_the_planners_price_their_candidates_with_the_chosen_all_reduce():
    """``plan_dp_model(allreduce=...)`` and DT-FM's ``plan_dtfm_model`` price every candidate the way
    ``--dp-allreduce`` will run it: on far links a small model's plan under ``auto`` takes the tree and is
    predicted no slower than the same search priced with the ring only."""
    from fusion.partition.dp import plan_dp_model
    from fusion.partition.dtfm import plan_dtfm_model

    m = gpt_model(2, 64, 2, 100, 16, 1, device="meta")
    cm = CostModel.build(m.graph, measure_costs(m.graph), _uniform(8, 50e-3, 10e9), 1, "1f1b", 2, 1)
    for plan in (lambda a: plan_dp_model(cm, global_batch=64, replicas=[8], allreduce=a),
                 lambda a: plan_dtfm_model(cm, global_batch=64, stages=[1], generations=20, patience=5, allreduce=a)):
        _, ring, *_ = plan("ring")
        _, auto, *_ = plan("auto")
        assert set(ring.estimate.algos) == {"ring"} and "tree" in auto.estimate.algos
        assert auto.estimate.iteration_s <= ring.estimate.iteration_s

"""Our DP x PP planner (fusion.partition.dp): valid layouts, R = 1 is OP-Fence, replicas where they pay, vs DT-FM."""
import numpy as np
import pytest

from fusion.cost.dp import replica_cost_model
from fusion.cost.estimate import CostModel
from fusion.cost.flops import measure_costs
from fusion.partition.dp import DPPlanError, batch_splits, plan_dp, plan_dp_model, replica_paths, virtual_cluster
from fusion.partition.dtfm import plan_dtfm_model
from fusion.partition.fence import op_fence
from tests.fusion.dp_clusters import cost_model, tiny_gpt, two_regions
from tests.fusion.partition.dp_checks import check_placement

MB = 1e6


@pytest.fixture(scope="module")
def tiny():
    return tiny_gpt()


def test_placement_is_valid_and_memory_forces_stages(tiny):
    cl = two_regions(memory=12 * MB)  # 15 MB of parameter state: at least two stages
    cm = cost_model(tiny, cl)
    pl, best = plan_dp_model(cm, global_batch=16)
    assert pl.strategy == "dp" and pl.stages >= 2
    check_placement(cm, pl, best.cm.micro_batches)
    assert pl.predicted["global_batch"] == 16
    assert pl.predicted["replicas"] * pl.predicted["micro_batches"] * pl.predicted["micro_batch_size"] == 16


def test_plan_dp_from_the_graph(tiny):
    m, costs = tiny
    pl = plan_dp(m.graph, two_regions(memory=12 * MB), global_batch=8, costs=costs, replicas=[2])
    assert pl.replicas == 2


def test_one_replica_is_opfence(tiny):
    cl = two_regions()
    cm = cost_model(tiny, cl)
    pl, best = plan_dp_model(cm, global_batch=8, replicas=[1])
    assert pl.replicas == 1 and pl.predicted["dp_sync_s"] == 0.0
    single = op_fence(replica_cost_model(cm, 8))
    assert pl.predicted["iteration_s"] <= single.iteration_s * (1 + 1e-9)


def test_replicas_pay_on_a_compute_bound_cluster(tiny):
    """Slow devices, fast links everywhere: replicas beat one pipeline over the same 8 devices
    (a 4-layer model cuts into few balanced stages)."""
    cl = two_regions(flops=1e9, slow_bps=10e9, slow_lat=1e-4)
    cm = cost_model(tiny, cl)
    pl, _ = plan_dp_model(cm, global_batch=32)
    one, _ = plan_dp_model(cm, global_batch=32, replicas=[1])
    assert pl.replicas >= 2
    assert pl.predicted["samples_per_s"] > 1.2 * one.predicted["samples_per_s"]


def test_groups_stay_inside_regions_when_gradients_are_heavy(tiny):
    """Averaging 15 MB over 10 Mbit/s costs seconds; a group split over both regions would pay it."""
    cl = two_regions(memory=12 * MB, flops=1e10, slow_bps=10e6)
    cm = cost_model(tiny, cl)
    pl, _ = plan_dp_model(cm, global_batch=16)
    if pl.replicas > 1:
        for s in range(pl.stages):
            assert len({pl.devices[r][s][0] for r in range(pl.replicas)}) == 1, pl.devices


def test_beats_or_matches_dtfm_on_two_regions(tiny):
    cl = two_regions(memory=12 * MB, flops=1e10, slow_bps=100e6)
    cm = cost_model(tiny, cl)
    ours, _ = plan_dp_model(cm, global_batch=16)
    theirs, best, _ = plan_dtfm_model(cm, global_batch=16, seed=0, generations=40)
    check_placement(cm, theirs, best.cm.micro_batches)
    assert ours.predicted["iteration_s"] <= theirs.predicted["iteration_s"] * (1 + 1e-9)


def test_batch_that_does_not_split_is_one_clear_error(tiny):
    cm = cost_model(tiny, two_regions())
    with pytest.raises(DPPlanError, match="global_batch 7 is not a multiple"):
        batch_splits(7, 2, 8, None)
    with pytest.raises(DPPlanError, match="global_batch must be an integer"):
        plan_dp_model(cm, global_batch=0)
    with pytest.raises(DPPlanError, match=r"replicas \[3\]: none splits global_batch 8"):
        plan_dp_model(cm, global_batch=8, replicas=[3])
    assert [r for r, _, _ in batch_splits(12, 1, 8, None)] == [1, 2, 3, 4, 6]
    assert batch_splits(12, 1, 8, 3) == [(1, 3, 4.0), (2, 3, 2.0), (4, 3, 1.0)]


def test_replica_paths_follow_the_matchings():
    cl = two_regions()
    groups = [[0, 4], [5, 1]]  # the matching pairs 0 with 1 and 4 with 5 (same region)
    vc, perms = virtual_cluster(cl, groups)
    assert replica_paths(groups, [0, 1], perms) == [[0, 1], [4, 5]]
    assert vc.beta[0, 1] == pytest.approx(8 / 10e9)  # worst link of the best matching: inside a region
    np.testing.assert_allclose(vc.alpha[0, 1], 1e-4)


def test_branchy_dag_stages_are_connected_for_both_planners():
    """Parallel branches: every stage of both planners is one connected piece (OP-Fence's repair runs on both)."""
    from fusion.partition.dtfm import plan_dtfm_model
    from tests.testing_models import branchy_model

    model = branchy_model(width=8)
    cm = CostModel.build(model.graph, measure_costs(model.graph), two_regions(flops=1e5, slow_bps=1e12),
                         1, "1f1b", 0, 1)
    pl, best = plan_dp_model(cm, global_batch=8, replicas=[2])
    assert pl.stages >= 2
    check_placement(cm, pl, best.cm.micro_batches)
    theirs, tb, _ = plan_dtfm_model(cm, global_batch=8, stages=[4], generations=5)
    check_placement(cm, theirs, tb.cm.micro_batches)

"""DT-FM's scheduler (fusion.partition.dtfm): its cost model pieces, a deterministic search that improves."""
import itertools

import numpy as np
import pytest

from fusion.cost.estimate import CostModel
from fusion.cost.flops import measure_costs
from fusion.partition.matching import bottleneck_matching as _bottleneck_matching
from fusion.partition.dtfm import CommCost, dtfm_search, open_loop_tsp, plan_dtfm_model
from tests.fusion.dp_clusters import two_regions
from tests.fusion.partition.dp_checks import check_placement
from tests.testing_models import gpt_model


def _random_links(n, seed):
    rng = np.random.default_rng(seed)
    bw = np.exp(rng.uniform(np.log(1e8), np.log(1e10), size=(n, n)))
    lat = rng.uniform(1e-3, 0.1, size=(n, n))
    return lat, 8.0 / bw


def test_bottleneck_matching_is_optimal():
    rng = np.random.default_rng(3)
    for n in (1, 2, 4, 5):
        w = rng.uniform(size=(n, n))
        val, perm = _bottleneck_matching(w)
        brute = min(max(w[i, p[i]] for i in range(n)) for p in itertools.permutations(range(n)))
        assert val == brute
        assert sorted(perm.tolist()) == list(range(n)) and max(w[i, perm[i]] for i in range(n)) == val


@pytest.mark.parametrize("n", [2, 5, 7])
def test_open_loop_tsp_exact(n):
    rng = np.random.default_rng(n)
    W = rng.uniform(size=(n, n))
    W = W + W.T
    cost, path = open_loop_tsp(W)
    brute = min(sum(W[a, b] for a, b in zip(p, p[1:])) for p in itertools.permutations(range(n)))
    assert cost == pytest.approx(brute) and sorted(path) == list(range(n))


def test_open_loop_tsp_heuristic_on_many_groups():
    rng = np.random.default_rng(0)
    xy = rng.uniform(size=(24, 2))
    W = np.linalg.norm(xy[:, None] - xy[None], axis=-1)
    cost, path = open_loop_tsp(W)
    assert sorted(path) == list(range(24))
    assert cost == pytest.approx(sum(W[a, b] for a, b in zip(path, path[1:])))
    assert cost < 0.5 * sum(W[i, i + 1] for i in range(23))  # far better than the index order


def test_datap_cost_is_eq_2():
    lat, beta = _random_links(4, 1)
    cc = CommCost(lat, beta, c_dp=1e8, c_pp=1e6, d_dp=2)
    a, b = (lat + lat.T) / 2, (beta + beta.T) / 2
    expect = max(2 * (a[0, 3] + 1e8 / 2 * b[0, 3]), 2 * (a[3, 0] + 1e8 / 2 * b[3, 0]))
    assert cc.datap([0, 3]) == pytest.approx(expect)


def test_search_is_deterministic_and_improves_on_random():
    lat, beta = _random_links(16, 7)
    runs = []
    for _ in range(2):
        cc = CommCost(lat, beta, c_dp=2e8, c_pp=5e7, d_dp=4)
        runs.append(dtfm_search(cc, 16, 4, seed=11, generations=30))
    (g1, o1, t1), (g2, o2, t2) = runs
    assert g1 == g2 and o1 == o2 and t1.history == t2.history
    assert t1.final_cost < t1.initial_cost  # better than the best of the random start
    assert all(b <= a for a, b in zip(t1.history, t1.history[1:]))
    other = dtfm_search(CommCost(lat, beta, c_dp=2e8, c_pp=5e7, d_dp=4), 16, 4, seed=12, generations=30)[2]
    assert other.history != t1.history  # the seed matters


def test_plan_uses_every_device_and_is_valid():
    m = gpt_model(4, 128, 4, 1000, 64, 1, device="meta")
    cm = CostModel.build(m.graph, measure_costs(m.graph), two_regions(memory=12e6), 1, "1f1b", 2, 1)
    pl, best, traces = plan_dtfm_model(cm, global_batch=16, seed=0, generations=10)
    assert pl.strategy == "dtfm" and pl.replicas * pl.stages == 8
    check_placement(cm, pl, best.cm.micro_batches)
    again = plan_dtfm_model(cm, global_batch=16, seed=0, generations=10)[0]
    assert again.devices == pl.devices and again.cut == pl.cut
    assert 1 not in traces and set(traces) <= {2, 4, 8}  # one stage does not fit 12 MB devices

"""The DiLoCo planner (fusion.partition.dp.choose_dp_sync): over a slow link it trades the per-step all-reduce
for pseudo-gradients every H steps and uses both regions; over fast links ``auto`` keeps synchronous DP; the
choice is the best of the search it prices; bad knobs fail with one line."""
import numpy as np
import pytest

from fusion.cost.convergence import STEPS_TO_SYNC_LOSS
from fusion.cost.dp import PSEUDO_CODECS, diloco_estimate, diloco_layout, pseudo_wire_bytes, replica_cost_model
from fusion.partition.dp import (TIE, DPPlanError, SyncSearch, build_cost_model, choose_dp_sync, diloco_splits,
                                 plan_diloco_model)
from fusion.plan import DPSync
from tests.fusion.dp_clusters import two_regions
from tests.testing_models import gpt_model


@pytest.fixture(scope="module")
def small():
    return gpt_model(4, 128, 4, 1000, 64, 1, device="meta")


def test_over_a_slow_link_auto_chooses_diloco_on_both_regions(small):
    cm = build_cost_model(small.graph, two_regions(slow_bps=20e6, flops=1e11))
    pl, cand = choose_dp_sync(cm, global_batch=32, mode="auto")
    sync = DPSync.from_dict(pl.info["dp_sync"])
    assert sync.mode == "diloco" and sync.inner_steps in SyncSearch().inner_steps
    regions = {d[0] for row in pl.devices for d in row}
    assert regions == {"a", "b"}  # one replica alone per region would leave half the cluster idle
    p = pl.predicted
    assert p["samples_per_s"] >= 1.1 * p["sync_dp_samples_per_s"] and p["diloco_over_sync_dp"] > 1.1
    est = cand.estimate
    assert p["sync_bytes_per_outer_step"] == sum(pseudo_wire_bytes(s, est.codec) for s in
                                                 diloco_layout(replica_cost_model(cm, 1), cand.node_part,
                                                               cand.devices, 32).specs)
    assert p["sync_bytes_per_step"] == pytest.approx(p["sync_bytes_per_outer_step"] / sync.inner_steps)
    assert sum(pl.info["micro_batches"]) == 32
    # the choice is the best the search prices on this layout by predicted time to synchronous DP's loss: samples/s
    # over the measured steps-to-loss ratio, among the (H, delay) the convergence study measured (ties within TIE
    # to a finer codec, then fewer H)
    lay = diloco_layout(replica_cost_model(cm, 1), cand.node_part, cand.devices, 32)
    rates = {(i, h, d): diloco_estimate(lay, h, c, d).samples_per_s / STEPS_TO_SYNC_LOSS[h, d]
             for h in SyncSearch().inner_steps for i, c in enumerate(PSEUDO_CODECS) for d in (0, 1)
             if (h, d) in STEPS_TO_SYNC_LOSS}
    assert p["steps_to_sync_loss_ratio"] == STEPS_TO_SYNC_LOSS[sync.inner_steps, sync.delay]
    assert p["samples_per_s"] / p["steps_to_sync_loss_ratio"] >= max(rates.values()) * (1 - TIE)
    chosen = (PSEUDO_CODECS.index(sync.codec), sync.inner_steps, sync.delay)
    assert all(k >= chosen for k, v in rates.items() if v >= max(rates.values()) * (1 - TIE))
    assert p["diloco_to_loss_over_sync_dp"] == pytest.approx(
        p["samples_per_s"] / p["steps_to_sync_loss_ratio"] / p["sync_dp_samples_per_s"])
    # by samples/s alone H = 500 would win here: the convergence price is what keeps H measured
    raw = {(h, d): diloco_estimate(lay, h, None, d).samples_per_s for h in SyncSearch().inner_steps for d in (0, 1)}
    assert max(raw, key=raw.get)[0] > 20


def test_an_unmeasured_h_is_ranked_by_samples_per_s_and_says_so(small):
    """``--inner-steps 100,200`` (no H the study measured): the planner ranks by samples/s as before and the plan
    carries no convergence price; inspect says it was not priced."""
    from fusion.inspect import convergence_line

    cm = build_cost_model(small.graph, two_regions(slow_bps=20e6, flops=1e11))
    pl, cand = choose_dp_sync(cm, global_batch=32, mode="diloco", search=SyncSearch(inner_steps=(100, 200)))
    assert cand.estimate.steps_ratio is None and "steps_to_sync_loss_ratio" not in pl.predicted
    sync = DPSync.from_dict(pl.info["dp_sync"])
    assert "convergence: not priced (H = " in convergence_line(pl.predicted, sync)
    priced = choose_dp_sync(cm, global_batch=32, mode="diloco")[0]
    assert f"convergence: {priced.predicted['steps_to_sync_loss_ratio']:g}x synchronous DP's steps" in convergence_line(
        priced.predicted, DPSync.from_dict(priced.info["dp_sync"]))


def test_over_fast_links_auto_keeps_synchronous_dp(small):
    cm = build_cost_model(small.graph, two_regions(slow_bps=10e9, slow_lat=1e-4, flops=1e11))
    pl, _ = choose_dp_sync(cm, global_batch=32, mode="auto")
    assert pl.info["dp_sync"] == {"mode": "every"}
    assert pl.predicted["diloco_samples_per_s"] < 1.1 * pl.predicted["samples_per_s"]


def test_diloco_mode_takes_the_fixed_knobs(small):
    cm = build_cost_model(small.graph, two_regions(slow_bps=20e6, flops=1e11))
    search = SyncSearch(inner_steps=(50,), codecs=({"algo": "quant", "bits": 4},), delays=(0,), fragments=(5,))
    pl, _ = choose_dp_sync(cm, global_batch=32, mode="diloco", search=search, replicas=[2])
    sync = DPSync.from_dict(pl.info["dp_sync"])
    assert (sync.inner_steps, sync.codec, sync.delay, sync.fragments) == (50, {"algo": "quant", "bits": 4}, 0, 5)
    assert len(pl.devices) == 2 and not sync.error_feedback
    topk = SyncSearch(inner_steps=(20,), codecs=({"algo": "topk", "ratio": 100},))
    assert DPSync.from_dict(plan_diloco_model(cm, global_batch=32, search=topk)[0].info["dp_sync"]).error_feedback


def test_bad_knobs_and_a_single_device_fail_with_one_line(small):
    cm = build_cost_model(small.graph, two_regions(slow_bps=20e6, flops=1e11))
    for search, msg in ((SyncSearch(inner_steps=(10, 0)), "inner steps 0: every H must be an integer >= 1"),
                        (SyncSearch(delays=(2,)), "outer delay (2,): expected 0 or 1"),
                        (SyncSearch(codecs=()), "codecs is empty")):
        with pytest.raises(DPPlanError, match=msg.replace("(", r"\(").replace(")", r"\)")):
            choose_dp_sync(cm, global_batch=32, search=search)
    one = build_cost_model(small.graph, two_regions(n_per=1).__class__(
        "one", two_regions(n_per=1).devices[:1], np.zeros((1, 1)), np.zeros((1, 1)), "one.json"))
    with pytest.raises(DPPlanError, match="one.json has one device"):
        choose_dp_sync(one, global_batch=32)
    with pytest.raises(DPPlanError, match="DiLoCo needs 2 or more replicas"):
        diloco_splits(1, 1, 8, None, True)


def test_fusionllm_48_diloco_uses_both_sites_and_prices_the_slow_links_honestly():
    """A small GPT on the shipped 48-GPU testbed (two sites joined by 9-91 Mbit/s): six replicas reach into
    both sites when every GPU is a replica, the fast 4090s get bigger shares than the slow GPUs, and every stage
    group's sync is priced over its slowest link, the cross-site one."""
    from fusion.cluster.scenarios import load_scenario
    from fusion.cost.dp import allgather_time, group_links, ring_allreduce_time

    m = gpt_model(4, 256, 4, 5000, 256, 1, device="meta")
    cl = load_scenario("fusionllm-48")
    cm = build_cost_model(m.graph, cl)
    pl, cand = plan_diloco_model(cm, global_batch=192, replicas=[48])
    est = cand.estimate
    sites = {cl.devices[d].name[0] for row in cand.devices for d in row}
    assert len(pl.devices) == 48 and sites == {"A", "B"}
    assert sum(est.micro_batches) == 192
    share = {cl.devices[row[0]].name[0]: n for row, n in zip(cand.devices, est.micro_batches)}
    assert share["A"] > share["B"]
    slowest = min(1 / cl.beta[i, j] for i in range(48) for j in range(48) if i != j)
    for s in range(len(cand.devices[0])):
        group = [row[s] for row in cand.devices]
        a, b = group_links(cl, group)
        assert b >= 1 / (100e6 / 8)  # the group spans the sites: its price is a link under 100 Mbit/s
        X = ring_allreduce_time if est.codec is None else allgather_time
        assert est.sync_s[s] == pytest.approx(est.fragments * X(cl, group, est.sync_bytes[s] / est.fragments))
    assert slowest < 10e6 / 8
    H, T = est.inner_steps, est.compute_s
    e = max(t if est.delay == 0 else max(0.0, t - H * T) for t in est.sync_s)
    assert est.iteration_s == pytest.approx(T + e / H)

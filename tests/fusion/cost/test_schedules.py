"""The schedule as part of what the compiler prices (issue 17): each schedule's action lists simulated with
the estimator's per-part times, and ``--schedule auto`` keeping the fastest that fits memory."""
import dataclasses
from pathlib import Path

import pytest

from fusion.cluster.model import Cluster
from fusion.cluster.scenarios import load_scenario
from fusion.compile import CompileError, compile_model
from fusion.cost.schedules import SchedulePrice, best_schedule, simulated_iteration
from fusion.loader import load_model

REPO = Path(__file__).resolve().parents[3]
MICRO = 8


@pytest.fixture(scope="module")
def gpt():
    return load_model(f"{REPO / 'examples/models/gpt.py'}:tiny")


def test_two_parts_by_hand_zero_bubble_fills_the_drain():
    """F = 1, B = 2 on two parts, instant links, 2 micro-batches. 1F1B: part1 runs F0 [1,2] B0 [2,4]
    F1 [4,5] B1 [5,7]; part0 B1 [7,9]: 9. zb1 splits B into B 1 + W 1: part1 ends B1 at 6, part0
    runs W0 [4,5] while it waits, then B1 [6,7] W1 [7,8]: 8. GPipe: 9, as 1F1B."""
    compute = {0: {"F": 1.0, "B": 2.0}, 1: {"F": 1.0, "B": 2.0}}
    links = {(0, 1): ((0.0, 0.0), (0.0, 0.0))}
    t = {s: simulated_iteration(s, [0, 1], compute, links, 2) for s in ("gpipe", "1f1b", "zb1")}
    assert t == {"gpipe": 9.0, "1f1b": 9.0, "zb1": 8.0}
    # a link of busy 0.5 s and latency 1 s each way, 1 micro-batch: F0 [0,1], arrives 2.5; F [2.5,3.5];
    # B [3.5,5.5], gradient arrives 7; B [7,9]; a 0.25 s tied sync after
    slow = {(0, 1): ((0.5, 1.0), (0.5, 1.0))}
    assert simulated_iteration("1f1b", [0, 1], compute, slow, 1, tail_s=0.25) == 9.25
    # no gradient flows back: part0's backward does not wait for part1
    assert simulated_iteration("gpipe", [0, 1], compute, {(0, 1): ((0.0, 0.0), None)}, 1) == 4.0


def test_the_rule_fastest_that_fits_then_less_memory():
    p = lambda t, m, fits=True: SchedulePrice(t, m, fits)  # noqa: E731
    assert best_schedule({"gpipe": p(1.0, 9), "1f1b": p(2.0, 3), "zb1": p(1.5, 4)}) == "gpipe"
    assert best_schedule({"gpipe": p(1.0, 9, False), "1f1b": p(2.0, 3), "zb1": p(1.5, 4)}) == "zb1"
    assert best_schedule({"gpipe": p(1.0, 9), "1f1b": p(1.0, 3), "zb1": p(1.0, 4)}) == "1f1b"
    assert best_schedule({"gpipe": p(1.0, 9, False), "1f1b": p(2.0, 3, False)}) is None


def _argmin(prices: dict) -> str:
    fit = {n: v for n, v in prices.items() if v["fits"]}
    best = min(v["iteration_s"] for v in fit.values())
    return min((v["peak_memory_bytes"], n) for n, v in fit.items() if v["iteration_s"] <= best * (1 + 1e-12))[1]


def test_auto_on_a_roomy_cluster_keeps_the_schedule_priced_fastest(gpt):
    cluster = load_scenario("local-4-two-sites")
    plan = compile_model(gpt, cluster, micro_batches=MICRO, schedule="auto")
    prices = plan.predicted["schedules"]
    assert set(prices) == {"gpipe", "1f1b", "zb1"} and all(v["fits"] for v in prices.values())
    assert plan.schedule == _argmin(prices) and plan.predicted["schedule_choice"] == "auto"
    assert prices["zb1"]["iteration_s"] <= prices["1f1b"]["iteration_s"]  # W fills 1F1B's bubbles
    # memory in flight: GPipe all micro-batches, 1F1B depth + 1, zb1 up to 2 depth + 1
    assert prices["1f1b"]["peak_memory_bytes"] < prices["zb1"]["peak_memory_bytes"] < prices["gpipe"]["peak_memory_bytes"]
    # the same cut compiled with the chosen schedule explicitly: same prices, same assignment
    fixed = compile_model(gpt, cluster, micro_batches=MICRO, schedule=plan.schedule)
    assert fixed.assignment == plan.assignment and fixed.predicted["schedules"] == prices
    assert fixed.predicted["schedule_choice"] == "fixed"


def _with_memory(cluster: Cluster, memory: float) -> Cluster:
    devices = [dataclasses.replace(d, memory_bytes=memory) for d in cluster.devices]
    return Cluster(cluster.name, devices, cluster.alpha, cluster.beta, cluster.source, cluster.bandwidth)


def test_auto_on_a_tight_cluster_avoids_gpipes_activations_in_flight(gpt):
    roomy = load_scenario("local-4-two-sites")
    prices = compile_model(gpt, roomy, strategy="equal-flops", micro_batches=MICRO,
                           recompute="off").predicted["schedules"]
    # room for zb1's (and 1F1B's) micro-batches in flight, not for GPipe's
    cap = (prices["zb1"]["peak_memory_bytes"] + prices["gpipe"]["peak_memory_bytes"]) / 2
    tight = _with_memory(roomy, cap)
    with pytest.raises(CompileError, match="memory_bytes"):
        compile_model(gpt, tight, strategy="equal-flops", micro_batches=MICRO, recompute="off", schedule="gpipe")
    plan = compile_model(gpt, tight, strategy="equal-flops", micro_batches=MICRO, recompute="off", schedule="auto")
    got = plan.predicted["schedules"]
    assert not got["gpipe"]["fits"] and got["1f1b"]["fits"] and got["zb1"]["fits"]
    assert plan.schedule in ("1f1b", "zb1") and plan.schedule == _argmin(got)
    assert all(p["memory_bytes"] <= cap for p in plan.predicted["parts"].values())


def test_a_bad_schedule_is_a_compile_error(gpt):
    with pytest.raises(CompileError, match="schedule must be one of"):
        compile_model(gpt, load_scenario("local-4-two-sites"), schedule="zigzag")


@pytest.mark.parametrize("strategy", ["opfence", "equal-flops"])
def test_the_compilers_price_is_the_runtime_replays(gpt, strategy):
    """The same per-part F/B seconds through the runtime's replay (wire bytes of the real messages,
    emulated alpha-beta links) give the compiler's simulated price of every schedule within 3 %."""
    import numpy as np

    from fusion.cost.estimate import CostModel
    from fusion.cost.flops import measure_costs
    from fusion.cost.schedules import part_times
    from fusion.executors.runtime.replay import replay

    cluster = load_scenario("local-4-two-sites")
    plan = compile_model(gpt, cluster, strategy=strategy, micro_batches=MICRO, schedule="auto")
    names = list(plan.parts)
    node_part = np.array([names.index(plan.assignment[n]) for n in gpt.graph.nodes])
    dev_names = [d.name for d in cluster.devices]
    part_device = np.array([dev_names.index(plan.parts[p].device) for p in names])
    cm = CostModel.build(gpt.graph, measure_costs(gpt.graph), cluster, MICRO)
    est = cm.evaluate(node_part, part_device)
    _, compute, _ = part_times(cm, est, node_part, part_device)
    for s, price in plan.predicted["schedules"].items():
        r = replay(dataclasses.replace(plan, schedule=s), {names[p]: c for p, c in compute.items()})
        assert r.iteration_s + est.sync_s == pytest.approx(price["iteration_s"], rel=0.03), s

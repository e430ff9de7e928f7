"""T_step, the iteration's work outside the pipeline (docstring of fusion/cost/estimate.py):

  T_step = max_p o_step + sum_p n_b (k_p o_feed + I_p o_byte) + max_p P_p o_opt

computed by hand on the 3-device example of test_estimate_equations (n_b = 3, AdamW: optimizer slot 2):
  p0 holds x (a (2, 4) float32 input: k = 1, I = 32 bytes) and l1 (Linear(4, 8): P = 40 floats = 160 bytes)
  p1 holds l2 (Linear(8, 8): P = 288 bytes), no placeholder
  p2 holds y (a (2, 8) float32 label: k = 1, I = 64 bytes) and l3 (Linear(8, 8): P = 288 bytes)
"""
from dataclasses import replace

import numpy as np
import pytest

from fusion.cluster import ClusterError, load_cluster
from fusion.cost.estimate import CostModel
from fusion.cost.profile import fit_step
from fusion.cost.schedules import price_schedule
from tests.fusion.cost.test_estimate_equations import COSTS, _cluster, _cm, _graph, _node_part

STEP = [1e-3, 2e-3, 5e-4]
FEED = [1e-4, 0.0, 3e-4]
BYTE = [1e-6, 0.0, 2e-6]
OPT = [(0.0, 0.0, 1e-5), (0.0, 0.0, 2e-5), (0.0, 0.0, 5e-6)]  # only the AdamW entry matters here


def _with_step(cl=None):
    cl = cl or _cluster()
    cl.devices = [replace(d, step_overhead_s=s, feed_overhead_s=f, feed_byte_s=b, optimizer_byte_s=o)
                  for d, s, f, b, o in zip(cl.devices, STEP, FEED, BYTE, OPT)]
    return cl


def test_step_term_priced_by_hand():
    cm = _cm(_graph())
    base = cm.evaluate(_node_part(cm), [0, 1, 2])
    est = cm.with_cluster(_with_step()).evaluate(_node_part(cm), [0, 1, 2])
    opt = [160 * 1e-5, 288 * 2e-5, 288 * 5e-6]
    t_step = max(STEP) + 3 * (1 * 1e-4 + 32 * 1e-6) + 3 * (1 * 3e-4 + 64 * 2e-6) + max(opt)
    assert t_step == pytest.approx(2e-3 + 3.96e-4 + 1.284e-3 + 5.76e-3, rel=1e-12)
    assert est.step_s == pytest.approx(t_step, rel=1e-12)
    assert [p.optimizer_s for p in est.parts] == pytest.approx(opt, rel=1e-12)
    # the pipeline itself is untouched; the iteration and Eq. (4) take the step
    assert est.pipeline_s == base.pipeline_s and est.sync_s == base.sync_s
    assert est.iteration_s == pytest.approx(base.iteration_s + t_step, rel=1e-12)
    assert est.throughput == pytest.approx(3 * 2 / est.iteration_s, rel=1e-12)
    # the partitioner's fast path prices the same iteration
    assert cm.with_cluster(_with_step()).evaluate(_node_part(cm), [0, 1, 2], detail=False)[0] == \
        pytest.approx(est.iteration_s, rel=1e-12)


def test_optimizer_entry_follows_the_plans_optimizer():
    cl = _cluster()
    cl.devices = [replace(d, optimizer_byte_s=(1e-6, 2e-6, 3e-6)) for d in cl.devices]
    for slots, rate in ((0, 1e-6), (1, 2e-6), (2, 3e-6)):
        cm = CostModel.build(_graph(), COSTS, cl, micro_batches=3, optimizer_slots=slots, samples_per_micro_batch=2)
        est = cm.evaluate(_node_part(cm), [0, 1, 2])
        assert est.step_s == pytest.approx(288 * rate, rel=1e-12)  # the largest part's step; nothing else set


def test_frozen_parameters_take_no_optimizer_step():
    g = _graph()
    for name in g.params:
        g.params[name] = replace(g.params[name], trainable=False)
    cl = _cluster()
    cl.devices = [replace(d, optimizer_byte_s=(1.0, 1.0, 1.0)) for d in cl.devices]
    cm = CostModel.build(g, COSTS, cl, micro_batches=3, optimizer_slots=2, samples_per_micro_batch=2)
    assert cm.evaluate(_node_part(cm), [0, 1, 2]).step_s == 0.0


def test_a_cluster_without_the_fields_predicts_what_it_did_before():
    cm = _cm(_graph())
    cl = _cluster()
    cl.devices = [replace(d, node_overhead_s=1e-3, message_overhead_s=1e-4) for d in cl.devices]
    est = cm.with_cluster(cl).evaluate(_node_part(cm), [0, 1, 2])
    assert est.step_s == 0.0 and est.iteration_s == est.pipeline_s + est.sync_s
    assert all(p.optimizer_s == 0.0 for p in est.parts)


def test_schedule_simulation_adds_the_step_after_the_last_action():
    cm = _cm(_graph())
    stepped = cm.with_cluster(_with_step())
    for name in ("gpipe", "1f1b"):
        before, _ = price_schedule(cm, name, _node_part(cm), np.array([0, 1, 2]))
        after, est = price_schedule(stepped, name, _node_part(cm), np.array([0, 1, 2]))
        assert after.iteration_s == pytest.approx(before.iteration_s + est.step_s, rel=1e-12)


def test_fit_step_recovers_the_three_costs():
    shapes = [(1, 1024), (1, 262144), (16, 1024), (16, 65536), (64, 1024), (64, 16384)]
    samples = [(k, k * b, 2e-4 + k * 3e-5 + k * b * 1.5e-9) for k, b in shapes]
    assert fit_step(samples) == pytest.approx((2e-4, 3e-5, 1.5e-9), rel=1e-6)
    with pytest.raises(ValueError, match="three independent"):
        fit_step([(1, 10, 1.0), (2, 20, 2.0), (4, 40, 4.0)])  # bytes proportional to arrays: not separable


CLUSTER = """name: c
devices:
  - {{name: cpu, count: 2, peak_flops: 50 GFLOPS, memory: 4 GB, {fields}}}
links:
  default: {{latency: 1 ms, bandwidth: 1 Gbit/s}}
"""


def test_cluster_file_fields_load_and_bad_values_name_file_and_field(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text(CLUSTER.format(fields="step_overhead_s: 2.0e-4, feed_overhead_s: 3.0e-5, feed_byte_s: 1.0e-9, "
                                       "optimizer_byte_s: {sgd: 1.0e-10, adamw: 9.0e-10}"))
    cl = load_cluster(y)
    d = cl.devices[1]
    assert (d.step_overhead_s, d.feed_overhead_s, d.feed_byte_s) == (2e-4, 3e-5, 1e-9)
    assert d.optimizer_byte_s == (1e-10, 0.0, 9e-10)  # a missing optimizer prices at 0
    back = cl.to_dict()["devices"][0]
    assert back["optimizer_byte_s"] == {"sgd": 1e-10, "sgd_momentum": 0.0, "adamw": 9e-10}
    assert back["feed_byte_s"] == 1e-9
    for fields, match in (("feed_byte_s: -1.0", r"c\.yaml.*devices\[0\]\.feed_byte_s.*>= 0"),
                          ("step_overhead_s: fast", r"c\.yaml.*devices\[0\]\.step_overhead_s.*'fast'"),
                          ("optimizer_byte_s: 1.0e-9", r"c\.yaml.*devices\[0\]\.optimizer_byte_s.*mapping"),
                          ("optimizer_byte_s: {adam: 1.0e-9}", r"c\.yaml.*devices\[0\]\.optimizer_byte_s\.adam.*unknown"),
                          ("optimizer_byte_s: {adamw: -2}", r"c\.yaml.*devices\[0\]\.optimizer_byte_s\.adamw.*>= 0")):
        y.write_text(CLUSTER.format(fields=fields))
        with pytest.raises(ClusterError, match=match) as e:
            load_cluster(y)
        assert "\n" not in str(e.value)


def test_compiled_plan_records_the_step_and_inspect_shows_it():
    """End to end: compile_model on a cluster with the step costs puts T_step in plan.predicted (and in the
    simulated schedules), and `fusion inspect`'s report adds it to the sum."""
    import torch

    from fusion.compile import compile_model
    from fusion.inspect import plan_report
    from fusion.ir.builder import GraphBuilder
    from fusion.plan import OptimizerConfig

    b = GraphBuilder()
    x, y = b.input("x"), b.label("y")
    h = b.module("l1", "torch.nn.Linear", x, in_features=8, out_features=8)
    o = b.module("l2", "torch.nn.Linear", h, in_features=8, out_features=4)
    b.loss("loss", "torch.nn.functional.cross_entropy", o, y)
    model = b.build(example={"x": torch.randn(2, 8), "y": torch.randint(0, 4, (2,))}, seed=0)
    kw = dict(strategy="equal-flops", micro_batches=2, schedule="gpipe", optimizer=OptimizerConfig("sgd", lr=0.1))
    plain = compile_model(model, _cluster(), **kw)
    plan = compile_model(model, _with_step(), **kw)
    step = plan.predicted["step_s"]
    assert plain.predicted["step_s"] == 0.0 and step >= max(STEP)
    assert plan.predicted["iteration_s"] == pytest.approx(plan.predicted["pipeline_s"] + step, rel=1e-12)
    sims = {n: v["iteration_s"] for n, v in plan.predicted["schedules"].items()}
    assert all(sims[n] == pytest.approx(v["iteration_s"] + step, rel=1e-9)
               for n, v in plain.predicted["schedules"].items())
    assert f"+ step {step:.4g} s" in plan_report(plan) and "+ step" not in plan_report(plain)

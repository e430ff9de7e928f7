"""Activation recomputation chosen by the compiler (issue 17): priced by the estimator in memory and
time, turned on only for the parts that would not fit otherwise, and run by the executors."""
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from fusion.cluster.model import Cluster
from fusion.cluster.scenarios import load_scenario
from fusion.compile import CompileError, compile_model
from fusion.cost.estimate import CostModel
from fusion.cost.flops import measure_costs
from fusion.loader import load_model
from fusion.plan import load_plan, save_plan

REPO = Path(__file__).resolve().parents[2]
MICRO = 8


@pytest.fixture(scope="module")
def gpt():
    return load_model(f"{REPO / 'examples/models/gpt.py'}:tiny")


def _with_memory(cluster: Cluster, memory: list[float]) -> Cluster:
    devices = [dataclasses.replace(d, memory_bytes=m) for d, m in zip(cluster.devices, memory)]
    return Cluster(cluster.name, devices, cluster.alpha, cluster.beta, cluster.source, cluster.bandwidth)


def test_the_estimator_prices_recomputation_in_memory_and_time(gpt):
    cluster = load_scenario("local-4-two-sites")
    cm = CostModel.build(gpt.graph, measure_costs(gpt.graph), cluster, MICRO, "gpipe")
    n = len(cm.names)
    node_part = np.array([0] * (n // 2) + [1] * (n - n // 2))
    dev = np.array([0, 1])
    plain = cm.evaluate(node_part, dev, recompute=np.array([False, False]))
    rc = cm.evaluate(node_part, dev, recompute=np.array([False, True]))
    assert rc.parts[0] == plain.parts[0]  # only the recomputing part changes
    p, q = plain.parts[1], rc.parts[1]
    mine = node_part == 1
    fwd_s = cm.fwd_flops[mine].sum() / cm.speed[1] + cm.fwd_mem[mine].sum() / cm.mem_speed[1]
    assert q.compute_s == pytest.approx(p.compute_s + fwd_s, rel=1e-12) and fwd_s > 0
    # it holds one micro-batch's activations plus its (received) inputs per micro-batch in flight
    held = (q.memory_bytes - q.param_state_bytes - q.activation_bytes) / q.in_flight
    assert p.memory_bytes == pytest.approx(p.param_state_bytes + MICRO * p.activation_bytes)
    assert 0 < held < p.activation_bytes and q.memory_bytes < p.memory_bytes
    assert rc.iteration_s > plain.iteration_s
    cm.recompute_all = True
    assert cm.evaluate(node_part, dev).parts[1].memory_bytes == pytest.approx(q.memory_bytes)


def _tight_cluster(gpt):
    """local-4-two-sites with memory between what equal-flops parts need with and without recomputation."""
    roomy = load_scenario("local-4-two-sites")
    plain = compile_model(gpt, roomy, strategy="equal-flops", micro_batches=MICRO, recompute="off")
    rc = compile_model(gpt, roomy, strategy="equal-flops", micro_batches=MICRO, recompute="all")
    need = [plain.parts[f"part{k}"].memory_bytes for k in range(len(roomy))]
    low = [rc.parts[f"part{k}"].memory_bytes for k in range(len(roomy))]
    k = int(np.argmax(np.array(need) - np.array(low)))  # squeeze the part that gains most
    memory = [2 * m for m in need]
    memory[k] = (need[k] + low[k]) / 2
    return _with_memory(roomy, memory), f"part{k}"


def test_the_compiler_recomputes_only_the_part_that_would_not_fit(gpt):
    cluster, squeezed = _tight_cluster(gpt)
    with pytest.raises(CompileError, match="memory_bytes"):
        compile_model(gpt, cluster, strategy="equal-flops", micro_batches=MICRO, recompute="off")
    plan = compile_model(gpt, cluster, strategy="equal-flops", micro_batches=MICRO)
    assert [p for p, part in plan.parts.items() if part.recompute] == [squeezed]
    for p, pred in plan.predicted["parts"].items():
        assert pred["memory_bytes"] <= pred["memory_limit"], p


def test_opfence_counts_on_recomputation_when_nothing_fits_without_it(gpt):
    roomy = load_scenario("local-4-two-sites")
    plain = compile_model(gpt, roomy, strategy="equal-flops", micro_batches=MICRO, recompute="off")
    rc = compile_model(gpt, roomy, strategy="equal-flops", micro_batches=MICRO, recompute="all")
    per_device = max(rc.parts[p].memory_bytes for p in rc.parts) * 1.05
    assert per_device < min(plain.parts[p].memory_bytes for p in plain.parts)  # too small without recomputation
    cluster = _with_memory(roomy, [per_device] * len(roomy))
    with pytest.raises(CompileError, match="memory"):
        compile_model(gpt, cluster, micro_batches=MICRO, recompute="off")
    plan = compile_model(gpt, cluster, micro_batches=MICRO)
    assert any(part.recompute for part in plan.parts.values())
    assert all(v["memory_bytes"] <= v["memory_limit"] for v in plan.predicted["parts"].values())


def _run(cli, plan_dir: Path, out: Path) -> list[float]:
    """``fusion run PLAN_DIR`` for 2 steps (forked from the session's command server); its losses."""
    r = cli.run(["run", str(plan_dir), "--out", str(out), "--steps", "2", "--no-progress"], Path.cwd(), 300)
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_executors_recompute_where_the_plan_says_and_train_the_same(cli, gpt, tmp_path):
    cluster, squeezed = _tight_cluster(gpt)
    plan = compile_model(gpt, cluster, strategy="equal-flops", micro_batches=MICRO)
    with_rc = save_plan(plan, tmp_path / "rc", params=gpt.params)
    for part in plan.parts.values():
        part.recompute = False
    without = save_plan(plan, tmp_path / "plain", params=gpt.params)
    assert load_plan(with_rc).parts[squeezed].recompute and not load_plan(without).parts[squeezed].recompute
    a, b = _run(cli, with_rc, tmp_path / "run_rc"), _run(cli, without, tmp_path / "run_plain")
    assert np.allclose(a, b, rtol=1e-6, atol=0), (a, b)
    log = (tmp_path / "run_rc" / "logs" / f"{squeezed}.log").read_text()
    assert "recompute=True" in log
    others = [p for p in plan.parts if p != squeezed]
    assert all("recompute" not in (tmp_path / "run_rc" / "logs" / f"{p}.log").read_text() for p in others)


def test_a_numpy_engine_cannot_take_a_part_that_needs_recomputation(gpt, tmp_path):
    from fusion.commands.compile import assign_engines
    from fusion.ir.errors import FusionError

    cluster, squeezed = _tight_cluster(gpt)
    plan = compile_model(gpt, cluster, strategy="equal-flops", micro_batches=MICRO)
    with pytest.raises(FusionError, match=f"{squeezed}.*recomputation"):
        assign_engines(plan, [f"{squeezed}=numpy"])


def test_replicas_are_priced_with_the_recomputation_the_compiler_chose(gpt):
    """Issue 34: the DP planner re-prices each replica's pipeline on its devices; it checked memory as if no
    part recomputed, so a plan that fits only with recomputation was refused (``part 0 ... needs 17.477 GB``)."""
    from fusion.ir.boundary import part_order
    from fusion.replicas import replicate

    cluster, squeezed = _tight_cluster(gpt)
    plan = compile_model(gpt, cluster, strategy="equal-flops", micro_batches=MICRO)
    stages = part_order(plan.graph, plan.assignment)
    out = replicate(plan, cluster, [[plan.parts[s].device for s in stages]])
    part = out.parts[squeezed]
    assert part.recompute and part.memory_bytes == plan.parts[squeezed].memory_bytes

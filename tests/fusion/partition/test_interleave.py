"""The interleaved 1F1B cut (issue 17): V*D chunks of the atom chain, chunk s on the (s % D)-th device,
each device's chunks carrying its speed's share of the work."""
import numpy as np
import pytest
import torch

from fusion.cluster.model import Cluster, Device
from fusion.compile import CompileError, compile_model
from fusion.cost.estimate import CostModel
from fusion.cost.flops import measure_costs
from fusion.ir.builder import GraphBuilder
from fusion.partition.chain import build_chain
from fusion.partition.interleave import interleaved_cut
from fusion.plan import load_plan, save_plan

LAYERS = 24


def linear_chain(layers: int = LAYERS):
    """``layers`` equal Linear(128, 128) in a chain and an MSE loss: equal lumps of FLOPs (the loss's are
    under 1 % of a layer's)."""
    b = GraphBuilder()
    h, y = b.input("x"), b.label("y")
    for k in range(layers):
        h = b.module(f"fc{k}", "torch.nn.Linear", h, in_features=128, out_features=128)
    b.loss("loss", "torch.nn.functional.mse_loss", h, y)
    return b.build(example={"x": torch.randn(4, 128), "y": torch.randn(4, 128)}, seed=0)


def cluster(speeds, bps: float = 100e9, latency: float = 1e-5, memory: float = 4e9) -> Cluster:
    n = len(speeds)
    devs = [Device(f"d{i}", float(s), memory) for i, s in enumerate(speeds)]
    alpha = np.full((n, n), latency)
    np.fill_diagonal(alpha, 0.0)
    bw = np.full((n, n), bps)
    np.fill_diagonal(bw, 0.0)
    return Cluster.from_bandwidth("test", devs, alpha, bw, "test.yaml")


def _flops_per_part(plan) -> dict[str, float]:
    out = dict.fromkeys(plan.parts, 0.0)
    for n in plan.graph.nodes.values():
        out[plan.assignment[n.name]] += n.meta.flops_fwd + n.meta.flops_bwd
    return out


def test_the_cut_is_round_robin_and_each_device_gets_its_speed_share(tmp_path):
    """Speeds 1, 1, 2, 2 (fast links), V = 2: 8 chunks, chunk s on d(s % 4); each device's two chunks carry
    its share (1/6, 1/6, 1/3, 1/3) of the 24 layers' FLOPs, within one layer (the cut balances time: the
    loss's memory-bound work counts too, and fc0 computes no input gradient)."""
    model = linear_chain()
    cl = cluster([1e9, 1e9, 2e9, 2e9])
    plan = compile_model(model, cl, strategy="equal-flops", micro_batches=8, schedule="interleaved", virtual_stages=2)
    assert plan.schedule == "interleaved" and len(plan.parts) == 8
    names = list(plan.parts)
    assert [plan.parts[p].device for p in names] == [f"d{s % 4}" for s in range(8)]
    assert plan.lanes() == {f"d{r}": [f"part{r}", f"part{r + 4}"] for r in range(4)}
    layers = {d: sum(1 for n in plan.assignment if n.startswith("fc") and plan.assignment[n] in ps)
              for d, ps in plan.lanes().items()}
    assert all(abs(layers[d] - want) <= 1 for d, want in zip(layers, (4, 4, 8, 8))), layers
    flops = _flops_per_part(plan)
    total = sum(flops.values())
    share = {d: sum(flops[p] for p in ps) / total for d, ps in plan.lanes().items()}
    assert share == pytest.approx({"d0": 1 / 6, "d1": 1 / 6, "d2": 1 / 3, "d3": 1 / 3}, abs=1 / 24 + 0.005)
    # the devices' compute per micro-batch (their chunks' Eq. 1 times) within 30 % of each other (measured 26 %:
    # a layer is a quarter of a fast device's chunk, and the cut balances chunks, not device totals)
    busy = [sum(plan.predicted["parts"][p]["compute_s"] for p in ps) for ps in plan.lanes().values()]
    assert max(busy) / min(busy) < 1.3, busy
    assert plan.predicted["virtual_stages"] == {"chunks_per_device": 2, "lanes": plan.lanes()}
    # the plan it writes loads and passes the plan's checks (round-robin placement, micro-batches % D)
    out = save_plan(plan, tmp_path / "plan", model.params or None)
    again = load_plan(out)
    again.check("reloaded")
    assert again.schedule == "interleaved" and again.lanes() == plan.lanes()


def test_equal_count_cuts_equal_operator_counts_blind_to_speed():
    model = linear_chain()
    plan = compile_model(model, cluster([1e9, 1e9, 2e9, 2e9]), strategy="equal-count", micro_batches=4,
                         schedule="interleaved", virtual_stages=2)
    ops = [sum(1 for n in plan.assignment if n.startswith(("fc", "loss")) and plan.assignment[n] == p)
           for p in plan.parts]
    assert len(ops) == 8 and sum(ops) == LAYERS + 1 and max(ops) - min(ops) <= 1


def test_every_chunk_is_non_empty_on_lumpy_work():
    """More chunks than FLOP lumps: the chain still splits into V*D non-empty, contiguous chunks."""
    model = linear_chain(7)
    cl = cluster([1e9] * 4)
    cm = CostModel.build(model.graph, measure_costs(model.graph), cl, 4, "interleaved")
    ch = build_chain(cm)
    part = interleaved_cut(cm, ch, [0, 1, 2, 3], 2)
    counts = np.bincount(part.node_part, minlength=8)
    assert len(part.part_device) == 8 and (counts > 0).all()
    assert (np.diff(part.node_part[ch.atom_of_node.argsort(kind="stable")]) >= 0).all()  # contiguous in the chain
    with pytest.raises(ValueError, match=r"8 chunks \(2 virtual stages x 4 devices\) need at least 8 operator nodes"):
        interleaved_cut(cm, build_chain(CostModel.build(linear_chain(3).graph, measure_costs(linear_chain(3).graph),
                                                        cl, 4, "interleaved")), [0, 1, 2, 3], 2)


def test_bad_inputs_are_one_clear_compile_error():
    model, cl = linear_chain(), cluster([1e9] * 4)
    with pytest.raises(CompileError, match=r"--micro-batches 6 is not a multiple of the 4 devices .* use --micro-batches 8"):
        compile_model(model, cl, strategy="equal-flops", micro_batches=6, schedule="interleaved", virtual_stages=2)
    with pytest.raises(CompileError, match=r"--virtual-stages 2: .* give --schedule interleaved \(or auto\), not 1f1b"):
        compile_model(model, cl, strategy="equal-flops", micro_batches=8, schedule="1f1b", virtual_stages=2)
    with pytest.raises(CompileError, match=r"strategy opfence cuts a DAG.*use --strategy equal-flops"):
        compile_model(model, cl, micro_batches=8, schedule="interleaved", virtual_stages=2)
    with pytest.raises(CompileError, match=r"--virtual-stages 30: 30 chunks \(30 virtual stages x 1 devices\) .* the model has 25"):
        compile_model(model, cl, strategy="equal-flops", micro_batches=8, schedule="interleaved", virtual_stages=30)

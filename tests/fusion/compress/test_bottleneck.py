"""The bottleneck pass (issue 27, ``fusion.compress.bottleneck``), in process on a small residual MLP.

What it must do: insert ResBM's encoder/decoder at the chosen cut edges (P fixed orthonormal, W_enc = W_dec = 0,
deterministic from the seed), leave everything else alone, train exactly as the same model written in plain
PyTorch (torch and NumPy engines), send the code (D / R fewer bytes, measured on the messages, both directions),
be priced by the estimator, be recorded in the plan and shown by ``fusion inspect``, and refuse bad input with
one line (exit 2 through the CLI).
"""
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fusion.compress.bottleneck import (BottleneckError, BottleneckRequest, auto_ranks, cut_edges, initial_values,
                                        insert_bottlenecks, residual_width, with_bottleneck_nodes)
from fusion.ir.model import Model
from fusion.plan import OptimizerConfig, Plan, PlanError
from tests.fusion.cli_helpers import one_line

D, R, ROWS = 16, 4, 4
SPLIT = {"x": "p0", "a": "p0", "ta": "p0", "b": "p0", "tb": "p1", "y": "p1", "res": "p1", "c": "p1", "loss": "p1"}
CLUSTER = """
name: two
devices:
  - {name: cpu-0, group: a, peak_flops: 50 GFLOPS, memory: 4 GB}
  - {name: cpu-1, group: b, peak_flops: 50 GFLOPS, memory: 4 GB}
links:
  default: {latency: 30 ms, bandwidth: 5 Mbit/s}
"""
MODEL_SRC = '''
import torch
from fusion.ir.builder import GraphBuilder

def mlp(rows=4):
    b = GraphBuilder()
    x, y = b.input("x"), b.label("y")
    h = b.function("ta", "torch.tanh", b.module("a", "torch.nn.Linear", x, in_features=8, out_features=16))
    m = b.module("b", "torch.nn.Linear", h, in_features=16, out_features=16)
    s = b.function("res", "operator.add", h, b.function("tb", "torch.tanh", m))
    o = b.module("c", "torch.nn.Linear", s, in_features=16, out_features=5)
    b.loss("loss", "torch.nn.functional.cross_entropy", o, y)
    g = torch.Generator().manual_seed(1)
    return b.build(example={"x": torch.randn(rows, 8, generator=g), "y": torch.randint(0, 5, (rows,), generator=g)},
                   seed=0)
'''


def _mlp(rows: int = 4) -> Model:
    ns: dict = {}
    exec(MODEL_SRC, ns)  # the same source the CLI tests load as a model file
    return ns["mlp"](rows)


def _batch(step: int) -> dict:
    g = np.random.default_rng([5, step])
    return {"x": g.standard_normal((ROWS, 8)).astype(np.float32), "y": g.integers(0, 5, ROWS).astype(np.int64)}


def _bottlenecked(seed=7):
    model = _mlp()
    edges = cut_edges(model.graph, SPLIT, ["all"])  # tanh and Linear outputs: named, not the default's sums
    g, specs = insert_bottlenecks(model.graph, edges, R, seed)
    return model, Model(g, {**model.params, **initial_values(specs)}, model.example), specs


def _plain(P, steps: int):
    """The MLP with both bottlenecks written out in plain torch, SGD: per step (loss, grads)."""
    P = {k: torch.tensor(np.asarray(v), requires_grad=not k.endswith(".P")) for k, v in P.items()}

    def bn(x, e):
        z = x @ P[f"bneck.{e}.P"] + x @ P[f"bneck.{e}.W_enc"]
        return z @ P[f"bneck.{e}.P"].T + z @ P[f"bneck.{e}.W_dec.p1"]

    opt = torch.optim.SGD([t for t in P.values() if t.requires_grad], lr=0.5)
    out = []
    for s in range(steps):
        b = {k: torch.as_tensor(v) for k, v in _batch(s).items()}
        opt.zero_grad()
        h = torch.tanh(F.linear(b["x"], P["a.weight"], P["a.bias"]))
        m = F.linear(h, P["b.weight"], P["b.bias"])
        s_ = bn(h, "ta") + torch.tanh(bn(m, "b"))
        loss = F.cross_entropy(F.linear(s_, P["c.weight"], P["c.bias"]), b["y"])
        loss.backward()
        out.append((loss.item(), {k: t.grad.numpy().copy() for k, t in P.items() if t.grad is not None}))
        opt.step()
    return out


def test_pass_inserts_resbm_bottlenecks_deterministically():
    model, bmodel, specs = _bottlenecked()
    assert residual_width(model.graph) == D
    # the default: the residual stream, i.e. a sum's output of width D, not any tensor of that width
    assert cut_edges(model.graph, SPLIT) == []
    assert [e.name for e in cut_edges(model.graph, {**SPLIT, "y": "p2", "c": "p2", "loss": "p2"})] == ["res"]
    assert [(s.edge, s.src, s.dsts, s.width, s.rank) for s in specs] == [("ta", "p0", ("p1",), D, R),
                                                                         ("b", "p0", ("p1",), D, R)]
    assert len(model.graph) == 9, "the pass must not change its input graph"
    v = initial_values(specs)
    for s in specs:
        P = v[s.projection]
        np.testing.assert_allclose(P.T @ P, np.eye(R), atol=1e-6)  # orthonormal columns
        assert not bmodel.graph.params[s.projection].trainable and bmodel.graph.params[s.encoder].trainable
        assert not v[s.encoder].any() and not v[s.decoders[0]].any()
        assert s.trainable_params == 2 * D * R
    # deterministic from the seed, different per edge and per seed
    assert all(np.array_equal(v[k], w) for k, w in initial_values(_bottlenecked()[2]).items())
    assert not np.array_equal(v[specs[0].projection], v[specs[1].projection])
    assert not np.array_equal(v[specs[0].projection], initial_values(_bottlenecked(seed=8)[2])[specs[0].projection])
    # users on the producing part keep x; users across the cut read the decoder's output
    g = bmodel.graph
    assert g["b"].producers() == ["ta"] and g["res"].producers() == ["bneck_ta_out_p1", "tb"]
    asg = with_bottleneck_nodes(SPLIT, specs)
    assert asg["bneck_ta_code"] == "p0" and asg["bneck_ta_out_p1"] == "p1"
    assert {b.producer for b in cut_edges(g, asg)} == set(), "only codes (width R) cross now"
    assert {e.producer for e in cut_edges(g, asg, ["bneck_ta_code", "bneck_b_code"])} == {"bneck_ta_code",
                                                                                         "bneck_b_code"}


@pytest.mark.parametrize("engine", ["torch", "numpy"])
def test_bottlenecked_parts_train_as_plain_pytorch_and_send_the_code(engine):
    """Two parts in process (torch, or the NumPy engine: the new nodes are matmul / linear / add, which it runs)
    equal plain PyTorch for 3 SGD steps; the messages across the cut carry R of D numbers per row, both ways."""
    from fusion.executors.reference import ReferenceExecutor
    from tests.executors.shared_setup import capture_sent

    def run(m, asg):
        ex = ReferenceExecutor(m, asg, OptimizerConfig("sgd", lr=0.5), engines=dict.fromkeys(("p0", "p1"), engine))
        sent = capture_sent(ex)
        res = [ex.step(_batch(s)) for s in range(3)]
        return res, sent

    model, bmodel, specs = _bottlenecked()
    res, sent = run(bmodel, with_bottleneck_nodes(SPLIT, specs))
    for step, (r, (loss, grads)) in enumerate(zip(res, _plain(bmodel.params, 3))):
        np.testing.assert_allclose(r.loss, loss, rtol=1e-5, err_msg=f"loss of step {step}")
        assert set(r.grads) == set(grads)
        for k, g in grads.items():
            np.testing.assert_allclose(r.grads[k], g, rtol=1e-4, atol=1e-6, err_msg=f"{k} at step {step}")
    _, dense_sent = run(model, SPLIT)

    def nbytes(msgs, name, grad):
        return sum(np.asarray(m.payload).nbytes for m in msgs if m.name == name and m.is_grad == grad)

    for s in specs:
        for grad in (False, True):  # activations forward, gradients back: D / R fewer bytes
            assert nbytes(dense_sent, s.producer, grad) == D / R * nbytes(sent, s.code, grad) > 0
        assert nbytes(sent, s.producer, False) == 0, "x itself no longer crosses"


def test_bad_input_one_line():
    model = _mlp()
    edges = cut_edges(model.graph, SPLIT, ["all"])
    with pytest.raises(BottleneckError, match=r"--bottleneck 16: the rank must be smaller than the width of edge ta "
                                              r"\(p0 -> p1\), which is 16"):
        insert_bottlenecks(model.graph, edges, D, 0)
    with pytest.raises(BottleneckError, match="integer >= 1"):
        insert_bottlenecks(model.graph, edges, 0, 0)
    asg = {**SPLIT, "y": "p0"}  # the int64 label now crosses the cut
    with pytest.raises(BottleneckError, match=r"--bottleneck-edges y: edge y \(p0 -> p1\) is a tensor of dtype int64"):
        cut_edges(model.graph, asg, ["y"])
    assert [e.name for e in cut_edges(model.graph, asg, ["all"])] == ["ta", "b"], "all: the float edges, not y"
    with pytest.raises(BottleneckError, match="not a cut edge of this plan"):
        cut_edges(model.graph, SPLIT, ["c"])
    with pytest.raises(BottleneckError, match="no node 'nope'"):
        cut_edges(model.graph, SPLIT, ["nope"])
    assert auto_ranks(16) == [1, 2] and auto_ranks(1024) == [16, 32, 64, 128]


def _compile(tmp_path, rows=4, **kw):
    from fusion.cluster import load_cluster
    from fusion.compile import compile_model

    (tmp_path / "c.yaml").write_text(CLUSTER)
    return compile_model(_mlp(rows), load_cluster(str(tmp_path / "c.yaml")), strategy="equal-count", **kw)


def test_compile_prices_records_and_checks_bottlenecks(tmp_path):
    dense = _compile(tmp_path)
    plan = _compile(tmp_path, bottleneck=BottleneckRequest(R, ("ta", "tb")))
    assert [b.edge for b in plan.bottlenecks] == ["ta", "tb"] and plan.assignment["bneck_ta_code"] == "part0"
    # priced: the link carries R of D numbers per row, the parts compute the encoder / decoder's FLOPs
    link, dlink = plan.predicted["links"]["part0->part1"], dense.predicted["links"]["part0->part1"]
    assert dlink["fwd_bytes"] == D / R * link["fwd_bytes"] and dlink["bwd_bytes"] == D / R * link["bwd_bytes"]
    for p in ("part0", "part1"):
        assert plan.predicted["parts"][p]["flops"] > dense.predicted["parts"][p]["flops"]
    assert plan.predicted["iteration_s"] < dense.predicted["iteration_s"]  # 5 Mbit/s: the bytes dominate
    info = plan.predicted["bottleneck"]
    assert info["chosen"] == {"ta": R, "tb": R} and info["with_s"] < info["without_s"]
    # the plan format: round trip, and a plan whose bottleneck does not match its graph is refused
    d = json.loads(json.dumps(plan.to_dict()))
    assert Plan.from_dict(d).bottlenecks == plan.bottlenecks
    assert "bottlenecks" not in dense.to_dict(), "plans without bottlenecks are written as before"
    d["bottlenecks"][0]["nodes"]["bneck_ta_out_part1"] = "part0"
    with pytest.raises(PlanError, match=r"bottlenecks\[0\] \(ta\): node 'bneck_ta_out_part1' must be on part 'part0' "
                                        r"\(assignment: 'part1'\)"):
        Plan.from_dict(d)
    d = json.loads(json.dumps(plan.to_dict()))
    d["bottlenecks"][0]["rank"] = D
    with pytest.raises(PlanError, match=r"bottlenecks\[0\] \(ta\): rank 16 must be >= 1 and smaller than the width 16"):
        Plan.from_dict(d)
    # a codec applies to the code edge like to any edge where it pays (4-bit quant of the code; 4096 rows)
    from fusion.compress.policy import request

    q = _compile(tmp_path, 4096, bottleneck=BottleneckRequest(R, ("all",)), compress=request("quant:bits=4"))
    assert {c.producer for c in q.compression} == {"bneck_ta_code", "bneck_tb_code"}
    assert all(c.codec("fwd")["bits"] == 4 for c in q.compression)
    # auto: one of D/64 .. D/8 (here 1 or 2); optional (library use) keeps it
    # only where the estimator says the iteration gets shorter
    auto = _compile(tmp_path, bottleneck=BottleneckRequest("auto", ("all",)))
    assert {b.rank for b in auto.bottlenecks} <= {1, 2} and len(auto.predicted["bottleneck"]["candidates"]) == 2
    opt = _compile(tmp_path, bottleneck=BottleneckRequest("auto", ("all",), optional=True))
    assert not _compile(tmp_path, bottleneck=BottleneckRequest("auto", optional=True)).bottlenecks  # no sum is cut
    assert opt.bottlenecks and opt.predicted["bottleneck"]["chosen"]


def test_cli_compile_inspect_and_bad_input(tmp_path, capsys):
    from fusion.cli import main

    (tmp_path / "model.py").write_text(MODEL_SRC)
    (tmp_path / "c.yaml").write_text(CLUSTER)
    base = ["compile", f"{tmp_path / 'model.py'}:mlp", "--cluster", str(tmp_path / "c.yaml"),
            "--strategy", "equal-count"]
    assert main([*base, "--bottleneck", "4", "-o", str(tmp_path / "bad")]) == 2
    assert "no cut edge of this plan carries the residual stream" in one_line(capsys)
    assert main([*base, "--bottleneck", "16", "--bottleneck-edges", "all", "-o", str(tmp_path / "bad")]) == 2
    assert "rank must be smaller than the width of edge ta (part0 -> part1), which is 16" in one_line(capsys)
    assert main([*base, "--bottleneck", "4", "--bottleneck-edges", "y", "-o", str(tmp_path / "bad")]) == 2
    assert "--bottleneck-edges y: not a cut edge" in one_line(capsys)
    assert main([*base, "--bottleneck", "four", "-o", str(tmp_path / "bad")]) == 2
    assert "expected a rank" in one_line(capsys)
    assert main([*base, "--bottleneck-edges", "ta", "-o", str(tmp_path / "bad")]) == 2
    assert "--bottleneck-edges names the edges of --bottleneck" in one_line(capsys)
    # --compress auto alone never changes the model; with consent it may
    assert main([*base, "--compress", "auto", "-o", str(tmp_path / "auto")]) == 0
    assert "bottleneck" not in capsys.readouterr().out
    assert main([*base, "--compress", "auto", "--allow-architecture-change", "--bottleneck-edges", "all", "-o",
                 str(tmp_path / "auto2")]) == 0
    assert "2 bottlenecks (ta 16->" in capsys.readouterr().out  # priced shorter on 5 Mbit/s: chosen, and said
    assert main([*base, "--bottleneck", "4", "--bottleneck-edges", "ta", "-o", str(tmp_path / "plan")]) == 0
    assert "1 bottleneck (ta 16->4)" in capsys.readouterr().out
    from fusion.plan import load_plan, load_weights

    plan = load_plan(tmp_path / "plan")
    w = load_weights(tmp_path / "plan" / "weights.safetensors")
    np.testing.assert_array_equal(w["bneck.ta.P"], initial_values(plan.bottlenecks)["bneck.ta.P"])
    assert main(["inspect", str(tmp_path / "plan"), "--no-png"]) == 0
    out = capsys.readouterr().out
    assert "bottlenecks at the cut (1; the model is changed: 128 trainable parameters added" in out
    row = next(line for line in out.splitlines() if line.startswith("ta "))
    assert row.split()[:6] == ["ta", "part0->part1", "16", "->", "4", "128"]
    assert "bneck.ta.W_enc, bneck.ta.W_dec.part1 (+ fixed bneck.ta.P, 64)" in row


def test_export_writes_bottlenecks_with_placement_and_loads_back(tmp_path, capsys):
    """``fusion export`` of a run with bottlenecks: the model's own keys in OUT, the bottlenecks and where they sit
    beside it; :func:`apply_export` puts them back into the model, which computes what the trained run computes."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from fusion.cli import main
    from fusion.compress.bottleneck import EXPORT_KEY, apply_export
    from fusion.executors.reference import ReferenceExecutor
    from fusion.plan import save_plan

    plan = _compile(tmp_path, bottleneck=BottleneckRequest(R, ("all",)))
    params = {**_mlp().params, **initial_values(plan.bottlenecks)}
    run = tmp_path / "run"
    save_plan(plan, run / "plan", params)
    ex = ReferenceExecutor(Model(plan.graph, params), plan.assignment, OptimizerConfig("sgd", lr=0.5))
    for s in range(2):
        ex.step(_batch(s))
    trained = {k: torch.as_tensor(v) for k, v in ex.state().items()}
    save_file(trained, str(run / "final.safetensors"))
    (tmp_path / "model.py").write_text(MODEL_SRC)
    out = tmp_path / "mlp.safetensors"
    assert main(["export", str(run), "-o", str(out), "--model", f"{tmp_path / 'model.py'}:mlp"]) == 0
    assert "wrote " + str(tmp_path / "mlp.bottlenecks.safetensors") + ": 2 bottleneck(s) at the cut (ta 16->4, tb " \
           "16->4)" in capsys.readouterr().out
    own = load_file(str(out))
    assert set(own) == set(_mlp().params), "OUT holds the model's own weights only"
    with safe_open(str(tmp_path / "mlp.bottlenecks.safetensors"), "pt") as f:
        desc = json.loads(f.metadata()[EXPORT_KEY])
        side = {k: f.get_tensor(k) for k in f.keys()}
    assert [(d["producer"], d["src"], d["users"], d["width"], d["rank"]) for d in desc] == [
        ("ta", "part0", {"part1": ["res"]}, D, R), ("tb", "part0", {"part1": ["res"]}, D, R)]
    base = _mlp()
    base.params = dict(own)
    back, specs = apply_export(base, desc, side)
    assert specs == plan.bottlenecks
    batch = _batch(9)
    want = ReferenceExecutor(Model(plan.graph, trained), plan.assignment).forward_backward(batch)
    np.testing.assert_allclose(ReferenceExecutor(back).forward_backward(batch), want, rtol=1e-6)

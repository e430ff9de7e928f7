"""The subspace passes (issue 35, ``fusion.compress.subspace``) on the tiny GPT, in process.

What they must do: find the residual stream and its writers (the two embeddings, every attention and MLP output
projection; the tied output layer reads the same table), confine them to span(U); send k coordinates at each cut
and rebuild the sender's activation exactly at the receiver on every training step (max relative error <= 1e-5);
run on the NumPy engine as on torch; be priced by the estimator as plain nodes; fold back into the user's keys
(a plain module loading them with ``strict=True`` computes what the rewritten model computes); and refuse bad
input with one line, exit 2 through the CLI.
"""
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fusion.compress.subspace import (BASIS, TABLE, SubspaceError, SubspaceRequest, SubspaceSpec, confine_writers,
                                      fold_back, initial_params, parse_subspace)
from fusion.ir.model import Model
from fusion.plan import OptimizerConfig
from tests.executors.runtime.test_distributed_gpt import REPO, _gpt_module
from tests.executors.runtime.test_subspace_gpt import cluster_yaml, subspace_plan
from tests.fusion.cli_helpers import one_line

sys.path.insert(0, str(REPO / "benchmarks"))
from subspace_study import rebuild_error  # noqa: E402

K = 8


def _batch(step: int, rows: int = 4) -> dict:
    g = np.random.default_rng([35, step])
    return {"idx": g.integers(0, 64, (rows, 16)).astype(np.int64),
            "targets": g.integers(0, 64, (rows, 16)).astype(np.int64)}


def test_writers_found_and_confined():
    from fusion.ir.trace import trace

    module, example = _gpt_module().tiny()
    g, spec = confine_writers(trace(module, example).graph, SubspaceRequest(K), seed=3)
    kinds = {w.node: w.kind for w in spec.writers}
    assert kinds == {"transformer_wte": "token-embedding", "transformer_wpe": "embedding",
                     "transformer_h_0_attn_c_proj": "linear", "transformer_h_0_mlp_c_proj": "linear",
                     "transformer_h_1_attn_c_proj": "linear", "transformer_h_1_mlp_c_proj": "linear",
                     "lm_head": "tied-reader"}
    assert (spec.width, spec.rank, spec.ids) == (32, K, "idx")
    assert {"transformer_wte", "add", "add_1", "add_2", "add_3", "add_4", "transformer_drop"} == set(spec.stream)
    # per block attn c_proj 32x32 + 32 -> 8x32 + 8, mlp c_proj 32x128 + 32 -> 8x128 + 8; wte 64x32 -> 64x8; wpe
    # 16x32 -> 16x8
    assert spec.params_removed == 2 * (32 * 32 + 32 + 32 * 128 + 32) + 64 * 32 + 16 * 32
    assert spec.params_added == 2 * (8 * 32 + 8 + 8 * 128 + 8) + 64 * 8 + 16 * 8
    assert "transformer.wte.weight" not in g.params and g.params["subspace.transformer.wte.weight"].shape == (64, K)
    assert not g.params[BASIS].trainable and not g.params[TABLE].trainable
    assert SubspaceSpec.from_dict(spec.to_dict()) == spec
    # the fraction form: round(d / 4)
    assert confine_writers(trace(module, example).graph, parse_subspace("0.25"), 0)[1].rank == 8


def test_initial_values_span_and_fold_back_equals_the_plain_module():
    """U orthonormal, T orthogonal to it; folding the rewritten weights back into the user's keys gives a plain
    module (``load_state_dict(strict=True)``) whose loss equals the rewritten graph's (rtol 1e-5)."""
    from fusion.executors.reference import ReferenceExecutor
    from fusion.ir.trace import trace

    module, example = _gpt_module().tiny()
    model = trace(module, example)
    g, spec = confine_writers(model.graph, SubspaceRequest(K), seed=3)
    init = initial_params(spec, model.params)
    U, T = init[BASIS].astype(np.float64), init[TABLE].astype(np.float64)
    np.testing.assert_allclose(U.T @ U, np.eye(K), atol=1e-6)
    assert np.abs(T @ U).max() < 1e-6 * np.abs(T).max() * 10 and np.abs(T).max() > 0
    ex = ReferenceExecutor(Model(g, init, model.example), optimizer=OptimizerConfig("sgd", lr=0.5))
    for s in range(2):  # move away from the projected initial values
        ex.step(_batch(s, 2))
    trained = ex.state()
    folded = fold_back(spec, trained)
    tied = {"lm_head.weight": "transformer.wte.weight"}  # the graph keeps the tied table once
    module.load_state_dict({k: torch.as_tensor(folded[tied.get(k, k)]) for k in module.state_dict()}, strict=True)
    b = _batch(9, 2)
    want = ex.forward_backward(b)
    with torch.no_grad():
        got = module(torch.as_tensor(b["idx"]), torch.as_tensor(b["targets"])).item()
    np.testing.assert_allclose(got, want, rtol=1e-5)
    # the folded weights lie in span(U) (their writers' outputs), the token table's rest is T
    W = folded["transformer.h.0.mlp.c_proj.weight"].astype(np.float64)
    np.testing.assert_allclose(W - U @ (U.T @ W), 0, atol=1e-6)


@pytest.mark.parametrize("n_parts", [2, 4])
def test_receiver_rebuilds_the_sent_activation_every_step(tmp_path, n_parts):
    from fusion.executors.reference import ReferenceExecutor

    _, model, plan = subspace_plan(tmp_path, n_parts)
    spec = SubspaceSpec.from_dict(plan.subspace)
    assert len(spec.cuts) == n_parts - 1
    init = initial_params(spec, model.params)
    ex = ReferenceExecutor(Model(plan.graph, init, model.example), plan.assignment,
                           OptimizerConfig("adamw", lr=1e-2), micro_batches=2)
    errs = []
    for s in range(4):
        ex.step(_batch(s))
        errs.append(rebuild_error(ex, spec, _batch(100 + s)))
    assert max(errs) <= 1e-5, errs
    # the measure can fail: a receiver that forgot the token table is far off
    ex.engines[plan.assignment[spec.cuts[0].outputs[0]]].params[TABLE].data.zero_()
    assert rebuild_error(ex, spec, _batch(200)) > 1e-2


def _residual_tokens(rows: int = 8) -> Model:
    """A token model the NumPy engine runs (it lacks attention): ids -> Embedding -> two residual MLP blocks ->
    head, node by node."""
    from fusion.ir.builder import GraphBuilder

    b = GraphBuilder()
    ids, y = b.input("ids"), b.label("y")
    x = b.module("emb", "torch.nn.Embedding", ids, num_embeddings=40, embedding_dim=16)
    for i in (1, 2):
        h = b.function(f"t{i}", "torch.tanh", b.module(f"a{i}", "torch.nn.Linear", x, in_features=16, out_features=32))
        x = b.function(f"s{i}", "operator.add", x, b.module(f"w{i}", "torch.nn.Linear", h, in_features=32,
                                                              out_features=16))
    b.loss("loss", "torch.nn.functional.cross_entropy",
           b.module("c", "torch.nn.Linear", x, in_features=16, out_features=5), y)
    g = torch.Generator().manual_seed(1)
    return b.build(example={"ids": torch.randint(0, 40, (rows,), generator=g),
                            "y": torch.randint(0, 5, (rows,), generator=g)}, seed=0)


def test_numpy_engine_runs_it_as_torch():
    """The passes' nodes (linear, embedding, matmul, add) on the NumPy engine: equal to torch, step by step, and
    the rebuilt activation equal to the sent one."""
    from fusion.compress.subspace import rebuild_cut
    from fusion.executors.reference import ReferenceExecutor

    model = _residual_tokens()
    g, spec = confine_writers(model.graph, SubspaceRequest(4), seed=1)
    assert {w.node: w.kind for w in spec.writers} == {"emb": "token-embedding", "w1": "linear", "w2": "linear"}
    cut_at = list(g.nodes).index("s1")
    assignment = {n: "p0" if k <= cut_at or n in ("ids", "y") else "p1" for k, n in enumerate(g.nodes)}
    assignment.update({n: "p0" for n in ("emb_sub", "emb_span", "emb_fixed")})
    g2, spec = rebuild_cut(g, spec, assignment)
    from fusion.compress.subspace import with_cut_nodes

    asg = with_cut_nodes(assignment, spec)
    m = Model(g2, initial_params(spec, model.params), model.example)
    opt = OptimizerConfig("sgd", lr=0.2)
    ref = ReferenceExecutor(m, asg, opt, micro_batches=2)
    npy = ReferenceExecutor(m, asg, opt, micro_batches=2, engines={"p0": "numpy", "p1": "numpy"})
    rng = np.random.default_rng(4)
    for s in range(3):
        batch = {"ids": rng.integers(0, 40, 8).astype(np.int64), "y": rng.integers(0, 5, 8).astype(np.int64)}
        np.testing.assert_allclose(npy.step(batch).loss, ref.step(batch).loss, rtol=1e-5)
        assert rebuild_error(ref, spec, batch) <= 1e-5
    for k, v in ref.state().items():
        np.testing.assert_allclose(npy.state()[k], v, rtol=1e-4, atol=1e-6, err_msg=k)


def test_estimator_prices_the_coordinates(tmp_path):
    """The cut priced as the pass leaves it: k of d numbers per token cross (plain nodes, no special case), so
    over a slow link the predicted iteration is shorter than dense's on the same cut."""
    from fusion.cluster import load_cluster
    from fusion.compile import compile_model
    from fusion.ir.trace import trace

    _, _, plan = subspace_plan(tmp_path, 2)
    module, example = _gpt_module().tiny()
    dense = compile_model(trace(module, example), load_cluster(str(tmp_path / "c.yaml")), strategy="opfence",
                          micro_batches=2, recompute="off")
    assert plan.predicted["iteration_s"] < dense.predicted["iteration_s"]
    (c,) = SubspaceSpec.from_dict(plan.subspace).cuts
    crossing = {r.node for n in plan.graph.nodes.values() for r in n.refs()
                if plan.assignment[r.node] != plan.assignment[n.name]}
    assert crossing == {c.coords, "idx"}


def test_bad_input_is_one_line():
    from fusion.ir.builder import GraphBuilder
    from fusion.ir.trace import trace

    module, example = _gpt_module().tiny()
    g = trace(module, example).graph
    with pytest.raises(SubspaceError, match="k = 32 must be smaller than the residual width 32"):
        confine_writers(g, SubspaceRequest(32), 0)
    for bad in ("0", "1.5", "x"):
        with pytest.raises(SubspaceError, match=f"--subspace {bad}"):
            parse_subspace(bad)
    b = GraphBuilder()
    x, y = b.input("x"), b.label("y")
    h = b.module("a", "torch.nn.Linear", x, in_features=8, out_features=16)
    b.loss("loss", "torch.nn.functional.cross_entropy", b.module("c", "torch.nn.Linear", h, in_features=16,
                                                                  out_features=5), y)
    mlp = b.build(example={"x": torch.randn(4, 8), "y": torch.randint(0, 5, (4,))}, seed=0)
    with pytest.raises(SubspaceError, match="no residual stream found"):
        confine_writers(mlp.graph, SubspaceRequest(2), 0)


def test_cli_compile_inspect_export_and_bad_input(tmp_path, capsys):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from fusion.cli import main
    from fusion.compress.subspace import EXPORT_KEY
    from fusion.plan import load_plan, load_weights

    (tmp_path / "c.yaml").write_text(cluster_yaml(2, 0.3))
    gpt = f"{REPO / 'examples/models/gpt.py'}:tiny"
    base = ["compile", gpt, "--cluster", str(tmp_path / "c.yaml"), "--recompute", "off", "--micro-batches", "2"]
    bad = ["-o", str(tmp_path / "bad")]
    assert main([*base, "--subspace", "8", *bad]) == 2
    assert "--allow-architecture-change" in one_line(capsys)
    consent = [*base, "--allow-architecture-change"]
    assert main([*consent, "--subspace", "32", *bad]) == 2
    assert "must be smaller than the residual width 32" in one_line(capsys)
    assert main([*consent, "--subspace", "eight", *bad]) == 2
    assert "--subspace eight: expected K" in one_line(capsys)
    assert main([*consent, "--subspace", "8", "--precision", "bf16", *bad]) == 2
    assert "--subspace with --precision bf16 is not built" in one_line(capsys)
    assert main([*consent, "--subspace", "8", "--bottleneck", "4", *bad]) == 2
    assert "--subspace and --bottleneck" in one_line(capsys)
    from tests.executors.dist_models import TWO_SITES_YAML

    (tmp_path / "big.yaml").write_text(TWO_SITES_YAML)  # equal-flops cuts the tiny GPT inside a block there
    assert main([*consent, "--subspace", "8", "--strategy", "equal-flops", "--cluster", str(tmp_path / "big.yaml"),
                 *bad]) == 2
    assert "is not on the residual stream" in one_line(capsys)

    plan_dir = tmp_path / "plan"
    assert main([*consent, "--subspace", "8", "-o", str(plan_dir)]) == 0
    capsys.readouterr()
    plan = load_plan(plan_dir)
    spec = SubspaceSpec.from_dict(plan.subspace)
    assert main(["inspect", str(plan_dir), "--no-png"]) == 0
    out = capsys.readouterr().out
    assert f"k = 8, seed 0; {spec.params_removed} trainable parameters removed, {spec.params_added} added" in out
    for w in spec.writers:
        assert any(line.startswith(w.node) and w.kind in line for line in out.splitlines()), w.node
    assert f"cut {spec.cuts[0].producer} part0->part1: sends {spec.cuts[0].coords} (8 of 32 per token)" in out

    # export: a run's weights (here the plan's initial ones, moved) folded back into the module's own keys
    w = load_weights(plan_dir / "weights.safetensors")
    run = tmp_path / "run"
    (run / "plan").mkdir(parents=True)
    for f in plan_dir.iterdir():
        (run / "plan" / f.name).write_bytes(f.read_bytes())
    trained = {k: torch.as_tensor(np.asarray(v) + (0.01 if k.startswith("subspace.") else 0.0)) for k, v in w.items()}
    save_file(trained, str(run / "final.safetensors"))
    out_file = tmp_path / "gpt.safetensors"
    assert main(["export", str(run), "-o", str(out_file), "--model", gpt]) == 0
    assert "gpt.subspace.safetensors: the subspace (width 32, k = 8" in capsys.readouterr().out
    module, _ = _gpt_module().tiny()
    module.load_state_dict(load_file(str(out_file)), strict=True)
    with safe_open(str(tmp_path / "gpt.subspace.safetensors"), "pt") as f:
        assert SubspaceSpec.from_dict(__import__("json").loads(f.metadata()[EXPORT_KEY])) == spec
        assert set(f.keys()) == {BASIS, TABLE}
    np.testing.assert_allclose(module.state_dict()["transformer.wte.weight"].numpy(),
                               fold_back(spec, trained)["transformer.wte.weight"], rtol=1e-6)


def test_compress_quantises_the_coordinates(tmp_path):
    """``--compress quant:bits=8`` on top: the codec lands on the coordinates edge (the ids cross as they are)."""
    from fusion.compress.policy import request

    _, _, plan = subspace_plan(tmp_path, 2, compress=request("quant:bits=8"))
    (c,) = SubspaceSpec.from_dict(plan.subspace).cuts
    assert [(e.producer, e.codec("fwd")["bits"], e.codec("bwd")["bits"]) for e in plan.compression] == [
        (c.coords, 8, 8)]


QWEN2_SRC = """
import torch, transformers

def tiny():
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=True)
    ids = torch.randint(0, 256, (2, 32))
    return transformers.Qwen2ForCausalLM(cfg), {"input_ids": ids, "labels": ids}
"""


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_llama_stream_found_and_folds_back_to_the_transformers_model(tmp_path, arch):
    """The ``transformers`` Llama and Qwen2 (traced to aten ops, RMSNorm, no position embedding, tied head; Qwen2
    with q/k/v biases): the stream runs from the token embedding through its ``.to(float32)`` casts and residual
    sums; its writers are the o_proj and down_proj Linears and the embedding. Trained two steps rewritten, folded
    back into the model's own keys, the plain ``...ForCausalLM`` (``strict=True``) gives the rewritten graph's loss
    (rtol 1e-5)."""
    pytest.importorskip("transformers")
    from fusion.executors.reference import ReferenceExecutor
    from fusion.loader import load_function, load_model

    spec_name = f"{REPO / 'examples/models/hf_llama.py'}:tiny"
    if arch == "qwen2":
        (tmp_path / "qwen2.py").write_text(QWEN2_SRC)
        spec_name = f"{tmp_path / 'qwen2.py'}:tiny"
    model = load_model(spec_name)
    g, spec = confine_writers(model.graph, SubspaceRequest(16), seed=5)
    assert sorted(w.kind for w in spec.writers) == ["linear"] * 4 + ["tied-reader", "token-embedding"]
    assert spec.ids == "input_ids" and spec.stream[0] == "model_embed_tokens"
    ex = ReferenceExecutor(Model(g, initial_params(spec, model.params), model.example),
                           optimizer=OptimizerConfig("sgd", lr=0.5))
    rng = np.random.default_rng(7)
    batches = [{"input_ids": (ids := rng.integers(0, 256, (2, 32)).astype(np.int64)), "labels": ids} for _ in range(3)]
    for b in batches[:2]:
        ex.step(b)
    folded = fold_back(spec, ex.state())
    hf, _ = load_function(spec_name)()
    sd = hf.state_dict()
    hf.load_state_dict({k: torch.as_tensor(folded[k if k in folded else "model.embed_tokens.weight"]) for k in sd},
                       strict=True)
    with torch.no_grad():
        got = hf(input_ids=torch.as_tensor(batches[2]["input_ids"]), labels=torch.as_tensor(batches[2]["labels"])).loss
    np.testing.assert_allclose(got.item(), ex.forward_backward(batches[2]), rtol=1e-5)


def test_llama_cut_in_two_rebuilds_exactly(tmp_path):
    """The Llama compiled with ``--subspace 16`` on two 1.5 MB devices: OP-Fence cuts a residual sum; what crosses
    is the coordinates, the ids, and tensors that do not depend on the batch (the rotary cos/sin); the receiver's
    rebuild equals the sent activation on every step."""
    pytest.importorskip("transformers")
    from fusion.cluster import load_cluster
    from fusion.compile import compile_model
    from fusion.executors.reference import ReferenceExecutor
    from fusion.loader import load_model

    model = load_model(f"{REPO / 'examples/models/hf_llama.py'}:tiny")
    (tmp_path / "c.yaml").write_text(cluster_yaml(2, 1.5))
    plan = compile_model(model, load_cluster(str(tmp_path / "c.yaml")), strategy="opfence", micro_batches=2,
                         recompute="off", subspace=SubspaceRequest(16))
    spec = SubspaceSpec.from_dict(plan.subspace)
    (c,) = spec.cuts
    float_crossing = {r.node for n in plan.graph.nodes.values() for r in n.refs()
                      if plan.assignment[r.node] != plan.assignment[n.name]
                      and plan.graph.output_meta(r.node, r.index).dtype == "float32"
                      and plan.graph.output_meta(r.node, r.index).shape[-1] == 64}
    assert float_crossing == set(), float_crossing  # nothing of the stream's width crosses: only c (16 wide)
    ex = ReferenceExecutor(Model(plan.graph, initial_params(spec, model.params), model.example), plan.assignment,
                           OptimizerConfig("adamw", lr=1e-2), micro_batches=2)
    rng = np.random.default_rng(1)
    for _ in range(3):
        ids = rng.integers(0, 256, (4, 32)).astype(np.int64)
        ex.step({"input_ids": ids, "labels": ids})
        assert rebuild_error(ex, spec, {"input_ids": ids, "labels": ids}) <= 1e-5

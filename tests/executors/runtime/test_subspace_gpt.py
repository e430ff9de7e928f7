"""Equivalence with a subspace-confined residual stream (issue 35): the traced tiny GPT compiled with
``subspace=SubspaceRequest(8)`` (``fusion compile --subspace 8 --allow-architecture-change``) and trained as 2 and
4 executor processes equals the same rewritten model written by hand in plain PyTorch in one process: every
step's loss (rtol 1e-5), every gradient (rtol 1e-4) and the parameters after the last step. Only the k = 8
coordinates of the stream (and the token ids) cross each cut, in one message per micro-batch
(executors/runtime/packing.py: the ids do not pay a latency of their own); the receiver rebuilds the activation from
them and the fixed token table (its exactness is measured in tests/fusion/compress/test_subspace.py).

The hand-written model (Pluralis' Subspace Networks, arXiv 2506.01260): every writer of the stream writes through
the fixed basis U, ``y = (h W'^T + b') U^T``; the embedding is ``T[idx] + (E'[idx] + P'[pos]) U^T``; the tied
output layer reads ``T + E' U^T`` as ``h T^T + (h U) E'^T``.
"""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fusion.plan import OptimizerConfig
from tests.executors.dist_models import assert_matches_plain, run_distributed
from tests.executors.runtime.test_distributed_gpt import _gpt_module, plain_sgd

STEPS, MICRO, K = 3, 2, 8
OPT = OptimizerConfig("sgd", lr=0.1, momentum=0.9, weight_decay=0.01)


def cluster_yaml(n: int, memory_mb: float) -> str:
    """n CPU devices in two sites with ``memory_mb`` each: small enough that OP-Fence must cut the tiny GPT into n
    parts, and it cuts between blocks (only the stream crosses)."""
    devs = "\n".join(f"  - {{name: cpu-{i}, group: site-{'ab'[i * 2 // n]}, peak_flops: 50 GFLOPS, "
                     f"memory: {memory_mb} MB}}" for i in range(n))
    return (f"name: t{n}\ndevices:\n{devs}\nlinks:\n  default: {{latency: 30 ms, bandwidth: 20 Mbit/s}}\n"
            "  within_group: {latency: 1 ms, bandwidth: 1 Gbit/s}\n")


#: parts -> device memory that makes OP-Fence cut the tiny GPT into that many parts on the stream
MEMORY_MB = {2: 0.3, 4: 0.2}


def subspace_plan(tmp_path, n_parts, schedule="gpipe", k=K, **kw):
    """(module, traced model, plan) of the tiny GPT with ``--subspace k`` on ``n_parts`` parts."""
    from fusion.cluster import load_cluster
    from fusion.compile import compile_model
    from fusion.compress.subspace import SubspaceRequest
    from fusion.ir.trace import trace

    module, example = _gpt_module().tiny()
    model = trace(module, example)
    (tmp_path / "c.yaml").write_text(cluster_yaml(n_parts, MEMORY_MB[n_parts]))
    plan = compile_model(model, load_cluster(str(tmp_path / "c.yaml")), strategy="opfence", micro_batches=MICRO,
                         schedule=schedule, optimizer=OPT, recompute="off", subspace=SubspaceRequest(k), **kw)
    return module, model, plan


def plain_subspace_loss(module, p, U, T):
    """The rewritten tiny GPT in plain PyTorch: ``p`` maps the rewritten graph's trainable names to tensors."""
    tr = module.transformer

    def sub(key, h):  # a confined Linear writer: (h W'^T + b') U^T
        b = p.get(f"subspace.{key}.bias")
        return F.linear(F.linear(h, p[f"subspace.{key}.weight"], b), U)

    def ln(key, x):
        return F.layer_norm(x, (x.shape[-1],), p[f"{key}.weight"], p[f"{key}.bias"])

    def loss_of(idx, tg):
        B, Tn = idx.shape
        x = (F.linear(F.embedding(idx, p["subspace.transformer.wte.weight"]), U) + F.embedding(idx, T)
             + F.linear(F.embedding(torch.arange(Tn), p["subspace.transformer.wpe.weight"]), U))
        for i, blk in enumerate(tr.h):
            pre = f"transformer.h.{i}"
            h = ln(f"{pre}.ln_1", x)
            C, H = h.shape[-1], blk.attn.n_head
            q, kk, v = F.linear(h, p[f"{pre}.attn.c_attn.weight"], p[f"{pre}.attn.c_attn.bias"]).split(C, dim=2)
            q, kk, v = (t.view(B, Tn, H, C // H).transpose(1, 2) for t in (q, kk, v))
            y = F.scaled_dot_product_attention(q, kk, v, is_causal=True).transpose(1, 2).contiguous().view(B, Tn, C)
            x = x + sub(f"{pre}.attn.c_proj", y)
            h = ln(f"{pre}.ln_2", x)
            x = x + sub(f"{pre}.mlp.c_proj", F.gelu(F.linear(h, p[f"{pre}.mlp.c_fc.weight"], p[f"{pre}.mlp.c_fc.bias"])))
        h = ln("transformer.ln_f", x)
        logits = F.linear(h, T) + F.linear(h @ U, p["subspace.transformer.wte.weight"])
        return F.cross_entropy(logits.view(-1, logits.size(-1)), tg.view(-1))

    return loss_of


@pytest.mark.parametrize("n_parts,schedule", [(2, "gpipe"), (4, "1f1b")])
def test_subspace_gpt_processes_match_plain_pytorch(tmp_path, n_parts, schedule):
    from fusion.compress.subspace import BASIS, TABLE, SubspaceSpec, initial_params
    from fusion.data.batches import make_batches
    from fusion.plan import save_plan

    module, model, plan = subspace_plan(tmp_path, n_parts, schedule)
    spec = SubspaceSpec.from_dict(plan.subspace)
    assert len(plan.parts) == n_parts and len(spec.cuts) == n_parts - 1
    for c in spec.cuts:  # only the coordinates (k wide) and integer ids cross each cut
        assert c.producer in spec.stream
        crossing = {r.node for n in plan.graph.nodes.values() for r in n.refs()
                    if plan.assignment[r.node] != plan.assignment[n.name]}
        for e in crossing:
            m = plan.graph.output_meta(e, None)
            assert m.dtype == "int64" or m.shape[-1] == K, (e, m)
    init = initial_params(spec, model.params)
    plan_dir = save_plan(plan, tmp_path / "plan", params=init)

    batch_fn = make_batches(plan, "text", seed=0)
    batches = [batch_fn(s) for s in range(STEPS)]
    reports, state = run_distributed(plan_dir, tmp_path / "run", batches)
    # the coordinates and the ids of a cut travel in one message per micro-batch (executors/runtime/packing.py):
    # what crosses from a cut's sender to a receiver per step is MICRO forward messages (nothing returns that way)
    # and one per tied parameter the two share (its gradient, summed after the pipeline), not 2 x MICRO + tied
    from fusion.inspect import tied_params

    tied = tied_params(plan)
    for c in spec.cuts:
        for dst in c.dsts:
            shared = sum(1 for owners in tied.values() if c.src in owners and dst in owners)
            assert [r.parts[c.src]["sent"][dst]["messages"] for r in reports] == [MICRO + shared] * STEPS, (c, dst)

    trainable = {n for n, s in plan.graph.params.items() if s.trainable}
    params = {n: torch.tensor(np.asarray(v), requires_grad=True) for n, v in init.items() if n in trainable}
    U, T = torch.tensor(init[BASIS]), torch.tensor(init[TABLE])
    expected = [(loss, grads, {**after, BASIS: init[BASIS], TABLE: init[TABLE]})
                for loss, grads, after in plain_sgd(params, plain_subspace_loss(module, params, U, T), batches,
                                                    MICRO, OPT)]
    assert_matches_plain(reports, state, expected)

"""Equivalence with bottlenecks at the cut (issue 27): the traced tiny GPT compiled with ``bottleneck=4``
(``fusion compile --bottleneck 4``) and trained as 2 and 4 executor processes equals the same model, the
bottlenecks written by hand around the residual stream of ``examples/models/gpt.py``, trained in one process in
plain PyTorch: every step's loss (rtol 1e-5) and gradients, the new parameters' included (rtol 1e-4), and the
parameters after the last step. The bottleneck's code is what crosses the cut; the bytes of its messages
shrink by D / R (measured in tests/fusion/compress/test_bottleneck.py).
"""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fusion.plan import OptimizerConfig
from tests.executors.dist_models import TWO_SITES_YAML, assert_matches_plain, run_distributed
from tests.executors.runtime.test_distributed_gpt import REPO, _gpt_module, plain_sgd

STEPS, MICRO, RANK = 3, 2, 4
OPT = OptimizerConfig("sgd", lr=0.1, momentum=0.9, weight_decay=0.01)


def _bottleneck(x, P, W_enc, W_dec):
    """ResBM's bottleneck as docs/compression.md writes it: z = x P + x W_enc, y = z P^T + z W_dec."""
    z = x @ P + x @ W_enc
    return z @ P.T + z @ W_dec


def _plain(module, extra, residual, batches):
    """One process, plain PyTorch: ``module``'s blocks written out, with ``extra[edge]`` = (P, W_enc, W_dec)
    applied to the residual term of the sum that follows the traced node ``edge`` (``add`` is the embedding
    sum, ``add_k`` the k-th residual sum). ``residual``: edge -> the traced sum that consumes it."""
    T = batches[0]["idx"].shape[1]
    tr = module.transformer

    def loss_of(idx, tg):
        x = tr.wte(idx) + tr.wpe(torch.arange(T))
        for k, (blk, part) in enumerate((b, p) for b in tr.h for p in ("attn", "mlp")):
            name = "add" if k == 0 else f"add_{k}"
            branch = blk.attn(blk.ln_1(x)) if part == "attn" else blk.mlp(blk.ln_2(x))
            res = _bottleneck(x, *extra[name]) if name in extra else x
            x = res + branch
        logits = module.lm_head(tr.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), tg.view(-1))

    params = dict(module.named_parameters())
    for name, (P, We, Wd) in extra.items():
        params[f"bneck.{name}.W_enc"], params[f"bneck.{name}.W_dec.{residual[name]}"] = We, Wd
    fixed = {f"bneck.{n}.P": P.numpy() for n, (P, _, _) in extra.items()}
    return [(loss, grads, {**after, **fixed}) for loss, grads, after in plain_sgd(params, loss_of, batches, MICRO, OPT)]


@pytest.mark.parametrize("n_parts,schedule", [(2, "gpipe"), (4, "1f1b")])
def test_bottlenecked_gpt_processes_match_plain_pytorch(tmp_path, n_parts, schedule):
    from fusion.cluster import load_cluster
    from fusion.compile import compile_model
    from fusion.compress.bottleneck import BottleneckRequest, initial_values
    from fusion.data.batches import make_batches
    from fusion.ir.trace import trace
    from fusion.plan import save_plan

    gpt = _gpt_module()
    module, example = gpt.tiny()
    model = trace(module, example)
    if n_parts == 2:
        (tmp_path / "c.yaml").write_text(TWO_SITES_YAML)
        cluster = load_cluster(str(tmp_path / "c.yaml"))
    else:
        cluster = load_cluster(str(REPO / "examples/clusters/local-4-two-sites.yaml"))
    plan = compile_model(model, cluster, strategy="equal-flops", micro_batches=MICRO, schedule=schedule,
                         optimizer=OPT, bottleneck=BottleneckRequest(RANK))
    assert len(plan.parts) == n_parts and len(plan.bottlenecks) == n_parts - 1
    residual = {}
    for b in plan.bottlenecks:  # the residual stream crosses each cut; its one user there is the next residual sum
        assert (b.width, b.rank, len(b.dsts)) == (32, RANK, 1)
        (out,) = b.outputs
        users = [n.name for n in plan.graph.nodes.values() if out in n.producers()]
        k = 0 if b.producer == "add" else int(b.producer.split("_")[1])
        assert users == [f"add_{k + 1}"], users
        residual[b.producer] = b.dsts[0]
    init = initial_values(plan.bottlenecks)
    plan_dir = save_plan(plan, tmp_path / "plan", params={**model.params, **init})

    batch_fn = make_batches(plan, "text", seed=0)
    batches = [batch_fn(s) for s in range(STEPS)]
    reports, state = run_distributed(plan_dir, tmp_path / "run", batches)

    extra = {b.producer: (torch.tensor(init[b.projection]), torch.tensor(init[b.encoder], requires_grad=True),
                          torch.tensor(init[b.decoders[0]], requires_grad=True)) for b in plan.bottlenecks}
    expected = _plain(module, extra, residual, batches)
    assert_matches_plain(reports, state, expected)
    assert any(np.abs(state[b.encoder]).max() > 0 for b in plan.bottlenecks), "W_enc must have trained"

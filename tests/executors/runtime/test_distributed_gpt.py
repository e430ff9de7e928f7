"""Equivalence for the traced GPT: a small GPT with tied embeddings, compiled and run as CompNode processes.

``examples/models/gpt.py:tiny`` (2 blocks, width 32, vocabulary 64, dropout 0,
LM head tied to the token embedding) is traced by ``fusion.ir.trace``,
partitioned by the compiler (``compile_model(strategy="equal-flops")``: with
20 Mbit/s links OP-Fence rightly keeps this model on one device) over 2 or 4
CPU devices, and trained for 5 steps on the generated text corpus with one
real executor process per part. Every step's loss (rtol 1e-5) and gradients
(rtol 1e-4), and the parameters after 5 steps, must equal the *unmodified*
``torch.nn.Module`` trained in one process with gradient accumulation over the
same micro-batches. The tied weight is owned by the first and the last part,
so its gradient is summed across two processes before each step.
"""
from pathlib import Path

import pytest
import torch

from fusion.plan import OptimizerConfig
from tests.executors.dist_models import run_distributed, assert_matches_plain, TWO_SITES_YAML

REPO = Path(__file__).resolve().parents[3]
STEPS, MICRO = 5, 4
# SGD with momentum: AdamW would turn the rounding noise of the key bias's (exactly zero) gradient into full-size steps
OPT = OptimizerConfig("sgd", lr=0.1, momentum=0.9, weight_decay=0.01)


def _gpt_module():
    import importlib.util
    import sys
    if "gpt_example" in sys.modules:
        return sys.modules["gpt_example"]
    spec = importlib.util.spec_from_file_location("gpt_example", REPO / "examples/models/gpt.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpt_example"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def plain_sgd(params, loss_of, batches, micro, opt=OPT):
    """Single-process PyTorch: ``opt`` (SGD) over ``params`` (name -> tensor), each batch's loss ``loss_of(idx,
    targets)`` accumulated over ``micro`` micro-batches; per step (loss, grads, params after the step)."""
    sgd = torch.optim.SGD(list(params.values()), lr=opt.lr, momentum=opt.momentum, weight_decay=opt.weight_decay)
    out = []
    for b in batches:
        sgd.zero_grad()
        loss = 0.0
        for idx, tg in zip(torch.as_tensor(b["idx"]).chunk(micro), torch.as_tensor(b["targets"]).chunk(micro)):
            lc = loss_of(idx, tg) / micro
            lc.backward()
            loss += lc.item()
        grads = {k: p.grad.detach().clone().numpy() for k, p in params.items()}
        sgd.step()
        out.append((loss, grads, {k: p.detach().clone().numpy() for k, p in params.items()}))
    return out


def _plain(module, batches):
    """Single-process PyTorch on the module itself: per step (loss, grads, params after the step)."""
    module.train()
    return plain_sgd(dict(module.named_parameters()), module, batches, MICRO)


# both schedules at both sizes: 4 cases, ~25 s together on 2 cores
@pytest.mark.parametrize("n_parts,schedule", [(2, "gpipe"), (2, "1f1b"), (4, "gpipe"), (4, "1f1b")])
def test_traced_gpt_processes_match_pytorch(tmp_path, n_parts, schedule):
    from fusion.cluster import load_cluster
    from fusion.compile import compile_model
    from fusion.data.batches import make_batches
    from fusion.ir.trace import trace
    from fusion.plan import save_plan

    gpt = _gpt_module()
    assert gpt.TINY.dropout == 0 and gpt.TINY.tie_embeddings
    module, example = gpt.tiny()
    model = trace(module, example)
    if n_parts == 2:
        (tmp_path / "c.yaml").write_text(TWO_SITES_YAML)
        cluster = load_cluster(str(tmp_path / "c.yaml"))
    else:
        cluster = load_cluster(str(REPO / "examples/clusters/local-4-two-sites.yaml"))
    plan = compile_model(model, cluster, strategy="equal-flops", micro_batches=MICRO, schedule=schedule, optimizer=OPT)
    assert len(plan.parts) == n_parts
    owners = {plan.assignment[n] for n in model.graph.param_users()["transformer.wte.weight"]}
    assert len(owners) == 2, "the tied embedding should be held by two parts"
    plan_dir = save_plan(plan, tmp_path / "plan", params=model.params)

    batch_fn = make_batches(plan, "text", seed=0)  # the generated corpus, as `fusion run` feeds it
    batches = [batch_fn(s) for s in range(STEPS)]
    reports, state = run_distributed(plan_dir, tmp_path / "run", batches)

    expected = _plain(module, batches)
    assert_matches_plain(reports, state, expected)

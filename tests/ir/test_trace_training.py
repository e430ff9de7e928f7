"""A traced GPT trains exactly like the PyTorch module it came from.

The traced graph runs through the reference executor split into 1, 2 or 4
parts (contiguous node ranges in topological order; the tied embedding then
lives in the first and the last part, whose gradients the executor sums),
with 1 or 2 micro-batches, GPipe or 1F1B, SGD (with momentum) or AdamW, for
3 optimizer steps. Losses (rtol 1e-5), gradients and the parameters after
the steps (rtol 1e-4) must match plain PyTorch on the original module.

The GPT here has no biases: the gradient of an attention key bias is zero in
exact arithmetic (softmax ignores a shift), so in floats it is rounding noise
that differs with the summation order, and AdamW turns noise-sized gradients
into lr-sized steps of either sign. Without them every gradient is signal.
"""
import dataclasses

import numpy as np
import pytest
import torch

from tests.ir._trace_models import contiguous_parts, load_gpt, plain_step
from fusion.plan import OptimizerConfig
from fusion.executors.reference import ReferenceExecutor
from fusion.ir.trace import trace

gpt = load_gpt()
CFG = dataclasses.replace(gpt.TINY, bias=False)
MICRO = 2  # sequences per micro-batch (the traced example's batch size: shapes are static)
OPTIMIZERS = {
    "sgd": OptimizerConfig("sgd", lr=0.1, momentum=0.9),
    "adamw": OptimizerConfig("adamw", lr=3e-3, weight_decay=0.01),
}


def _torch_optimizer(cfg: OptimizerConfig, params):
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)


@pytest.fixture(scope="module")
def traced():
    """Traced once per method; each test builds a fresh module with the same seed as the reference."""
    out = {}
    for key, kw in {"fx": dict(method="fx"), "op": dict(granularity="op"), "export": dict(method="export")}.items():
        module, example = gpt.gpt_model(CFG, batch=MICRO, seed=0)
        out[key] = trace(module, example, **kw)
    return out


def _batches(steps: int):
    g = torch.Generator().manual_seed(123)
    shape = (3 * MICRO, CFG.seq_len)
    return [{"idx": torch.randint(0, CFG.vocab, shape, generator=g),
             "targets": torch.randint(0, CFG.vocab, shape, generator=g)} for _ in range(steps)]


def _check_equivalent(model, n_parts: int, micro_batches: int, schedule: str, opt_name: str) -> None:
    cfg = OPTIMIZERS[opt_name]
    assign = contiguous_parts(model.graph, n_parts)
    ex = ReferenceExecutor(model, assign, cfg, micro_batches=micro_batches, schedule=schedule)
    if n_parts > 1:  # the tied embedding sits in the first and the last part
        assert ex.shared == {"transformer.wte.weight": ["p0", f"p{n_parts - 1}"]}
    ref, _ = gpt.gpt_model(CFG, batch=1, seed=0)
    opt = _torch_optimizer(cfg, ref.parameters())
    for step, batch in enumerate(_batches(3)):
        batch = {k: v[: MICRO * micro_batches] for k, v in batch.items()}
        r = ex.step(batch)
        loss, grads = plain_step(ref, opt, batch, micro_batches)
        np.testing.assert_allclose(r.loss, loss, rtol=1e-5, err_msg=f"loss, step {step}")
        assert set(r.grads) == set(grads)
        for name, gr in grads.items():
            np.testing.assert_allclose(r.grads[name], gr.numpy(), rtol=1e-4, atol=1e-6, err_msg=f"{name}, step {step}")
    state = ex.state()
    for name, p in ref.named_parameters():
        np.testing.assert_allclose(state[name], p.detach().numpy(), rtol=1e-4, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
@pytest.mark.parametrize("n_parts", [1, 2, 4])
@pytest.mark.parametrize("micro_batches, schedule", [(1, "gpipe"), (2, "gpipe"), (2, "1f1b"), (3, "1f1b")])
def test_traced_gpt_trains_like_pytorch(traced, n_parts, micro_batches, schedule, opt_name):
    _check_equivalent(traced["fx"], n_parts, micro_batches, schedule, opt_name)


@pytest.mark.parametrize("key", ["op", "export"])
@pytest.mark.parametrize("n_parts, micro_batches, schedule", [(1, 1, "gpipe"), (4, 2, "1f1b")])
def test_exported_gpt_trains_like_pytorch(traced, key, n_parts, micro_batches, schedule):
    _check_equivalent(traced[key], n_parts, micro_batches, schedule, "adamw")

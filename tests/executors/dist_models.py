"""Models for the distributed-executor tests, each with a plain PyTorch twin.

* ``branching_cnn``: a convolution feeding two parallel branches and a skip
  connection that all meet in one add (the part graph is a diamond when cut
  in four).
* ``tied_transformer``: a one-block causal transformer whose token embedding
  and output projection share one weight (``F.embedding`` and ``F.linear`` with
  the same ParamRef), with a multi-output ``chunk`` crossing parts.

The plain twins compute the loss from the same parameter dict with ordinary
torch autograd; they are the single-process reference.
"""
from __future__ import annotations

import time

import numpy as np
import torch
import torch.nn.functional as F

from fusion.ir.builder import GraphBuilder
from fusion.ir.node import Ref

# -- branching CNN ---------------------------------------------------------------------------

#: a cluster file of two CPU devices in two sites joined by a 20 Mbit/s, 30 ms link
TWO_SITES_YAML = """
name: two-sites
devices:
  - {name: cpu-0, group: site-a, peak_flops: 50 GFLOPS, memory: 4 GB}
  - {name: cpu-1, group: site-b, peak_flops: 50 GFLOPS, memory: 4 GB}
links:
  default: {latency: 30 ms, bandwidth: 20 Mbit/s}
"""

CNN_CLASSES = 5


def branching_cnn(mb: int = 2, seed: int = 0):
    b = GraphBuilder()
    x, y = b.input("x"), b.label("y")
    h = b.module("conv1", "torch.nn.Conv2d", x, in_channels=3, out_channels=4, kernel_size=3, padding=1)
    a = b.module("conv_a", "torch.nn.Conv2d", h, in_channels=4, out_channels=4, kernel_size=3, padding=1)
    a = b.function("relu_a", "torch.relu", a)
    c = b.module("conv_b", "torch.nn.Conv2d", h, in_channels=4, out_channels=4, kernel_size=1)
    c = b.function("tanh_b", "torch.tanh", c)
    s = b.function("add_ab", "operator.add", a, c)
    s = b.function("add_skip", "operator.add", s, h)
    s = b.function("flat", "torch.flatten", s, 1)
    o = b.module("fc", "torch.nn.Linear", s, in_features=4 * 6 * 6, out_features=CNN_CLASSES)
    b.loss("loss", "torch.nn.functional.cross_entropy", o, y)
    return b.build(example={"x": torch.randn(mb, 3, 6, 6), "y": torch.randint(0, CNN_CLASSES, (mb,))}, seed=seed)


CNN_SPLITS = {
    2: {"x": "p0", "conv1": "p0", "conv_a": "p0", "relu_a": "p0",
        "conv_b": "p1", "tanh_b": "p1", "y": "p1", "add_ab": "p1", "add_skip": "p1", "flat": "p1", "fc": "p1", "loss": "p1"},
    4: {"x": "p0", "conv1": "p0", "conv_a": "p1", "relu_a": "p1", "conv_b": "p2", "tanh_b": "p2",
        "y": "p3", "add_ab": "p3", "add_skip": "p3", "flat": "p3", "fc": "p3", "loss": "p3"},
}


def cnn_plain_loss(P: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> torch.Tensor:
    h = F.conv2d(batch["x"], P["conv1.weight"], P["conv1.bias"], padding=1)
    a = torch.relu(F.conv2d(h, P["conv_a.weight"], P["conv_a.bias"], padding=1))
    c = torch.tanh(F.conv2d(h, P["conv_b.weight"], P["conv_b.bias"]))
    o = F.linear(torch.flatten(a + c + h, 1), P["fc.weight"], P["fc.bias"])
    return F.cross_entropy(o, batch["y"])


def cnn_batch(step: int, rows: int) -> dict[str, np.ndarray]:
    g = np.random.default_rng([7, step])
    return {"x": g.standard_normal((rows, 3, 6, 6)).astype(np.float32),
            "y": g.integers(0, CNN_CLASSES, rows).astype(np.int64)}


# -- tied transformer -----------------------------------------------------------------------

VOCAB, D, HEADS, T = 17, 16, 2, 6


def tied_transformer(mb: int = 2, seed: int = 0):
    b = GraphBuilder()
    idx, y = b.input("idx"), b.label("targets")
    torch.manual_seed(seed)
    W = b.parameter("wte.weight", torch.randn(VOCAB, D) * 0.2)
    h = b.function("emb", "torch.nn.functional.embedding", idx, W)
    n = b.module("ln1", "torch.nn.LayerNorm", h, normalized_shape=D)
    qkv = b.module("qkv", "torch.nn.Linear", n, in_features=D, out_features=3 * D)
    b.function("split", "torch.Tensor.chunk", qkv, 3, -1)
    heads = []
    for i, name in enumerate("qkv_"[:3]):
        v = b.function(f"{name}_view", "torch.Tensor.view", Ref("split", i), mb, T, HEADS, D // HEADS)
        heads.append(b.function(f"{name}_t", "torch.Tensor.transpose", v, 1, 2))
    att = b.function("attn", "torch.nn.functional.scaled_dot_product_attention", *heads, is_causal=True)
    att = b.function("attn_t", "torch.Tensor.transpose", att, 1, 2)
    att = b.function("attn_merge", "torch.Tensor.reshape", att, mb, T, D)
    att = b.module("proj", "torch.nn.Linear", att, in_features=D, out_features=D)
    h = b.function("res1", "operator.add", h, att)
    n = b.module("ln2", "torch.nn.LayerNorm", h, normalized_shape=D)
    m = b.module("fc1", "torch.nn.Linear", n, in_features=D, out_features=2 * D)
    m = b.function("gelu", "torch.nn.functional.gelu", m)
    m = b.module("fc2", "torch.nn.Linear", m, in_features=2 * D, out_features=D)
    h = b.function("res2", "operator.add", h, m)
    n = b.module("lnf", "torch.nn.LayerNorm", h, normalized_shape=D)
    logits = b.function("head", "torch.nn.functional.linear", n, W)
    logits = b.function("flat_logits", "torch.Tensor.reshape", logits, -1, VOCAB)
    yy = b.function("flat_targets", "torch.Tensor.reshape", y, -1)
    b.loss("loss", "torch.nn.functional.cross_entropy", logits, yy)
    ex = {"idx": torch.randint(0, VOCAB, (mb, T)), "targets": torch.randint(0, VOCAB, (mb, T))}
    return b.build(example=ex, seed=seed)


_BLOCK = ["q_view", "q_t", "k_view", "k_t", "v_view", "v_t", "attn", "attn_t", "attn_merge", "proj", "res1"]
_MLP = ["ln2", "fc1", "gelu", "fc2", "res2"]
_HEAD = ["targets", "lnf", "head", "flat_logits", "flat_targets", "loss"]
GPT_SPLITS = {
    2: {**{n: "p0" for n in ["idx", "emb", "ln1", "qkv", "split"] + _BLOCK}, **{n: "p1" for n in _MLP + _HEAD}},
    4: {**{n: "p0" for n in ["idx", "emb", "ln1", "qkv", "split"]}, **{n: "p1" for n in _BLOCK},
        **{n: "p2" for n in _MLP}, **{n: "p3" for n in _HEAD}},
}


def gpt_plain_loss(P: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> torch.Tensor:
    idx = batch["idx"]
    B = idx.shape[0]
    W = P["wte.weight"]
    h = F.embedding(idx, W)
    n = F.layer_norm(h, (D,), P["ln1.weight"], P["ln1.bias"])
    q, k, v = F.linear(n, P["qkv.weight"], P["qkv.bias"]).chunk(3, -1)
    q, k, v = (t.view(B, T, HEADS, D // HEADS).transpose(1, 2) for t in (q, k, v))
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, D)
    h = h + F.linear(a, P["proj.weight"], P["proj.bias"])
    n = F.layer_norm(h, (D,), P["ln2.weight"], P["ln2.bias"])
    m = F.linear(F.gelu(F.linear(n, P["fc1.weight"], P["fc1.bias"])), P["fc2.weight"], P["fc2.bias"])
    h = h + m
    logits = F.linear(F.layer_norm(h, (D,), P["lnf.weight"], P["lnf.bias"]), W)
    return F.cross_entropy(logits.reshape(-1, VOCAB), batch["targets"].reshape(-1))


def gpt_batch(step: int, rows: int) -> dict[str, np.ndarray]:
    g = np.random.default_rng([11, step])
    return {"idx": g.integers(0, VOCAB, (rows, T)).astype(np.int64),
            "targets": g.integers(0, VOCAB, (rows, T)).astype(np.int64)}


MODELS = {
    "cnn": (branching_cnn, CNN_SPLITS, cnn_plain_loss, cnn_batch),
    "gpt": (tied_transformer, GPT_SPLITS, gpt_plain_loss, gpt_batch),
}


def plain_training(model, plain_loss, batches, micro_batches: int, make_opt):
    """Single-process PyTorch with gradient accumulation: per step (loss, grads, params after the step)."""
    P = {k: torch.tensor(np.asarray(v), requires_grad=model.graph.params[k].trainable) for k, v in model.params.items()}
    opt = make_opt([P[k] for k in P if P[k].requires_grad])
    out = []
    for batch in batches:
        opt.zero_grad()
        chunks = [{k: torch.as_tensor(v).chunk(micro_batches)[i] for k, v in batch.items()} for i in range(micro_batches)]
        loss = 0.0
        for c in chunks:  # gradient accumulation, one backward per micro-batch
            lc = plain_loss(P, c) / micro_batches
            lc.backward()
            loss = loss + lc.detach()
        grads = {k: t.grad.detach().clone().numpy() for k, t in P.items() if t.grad is not None}
        opt.step()
        out.append((loss.item(), grads, {k: t.detach().clone().numpy() for k, t in P.items()}))
    return out


def save_hand_plan(tmp_path, model, assignment, **kw):
    """Write a hand-written plan for ``model`` under ``tmp_path/plan``; returns its directory."""
    from fusion.executors.runtime.launcher import hand_plan
    from fusion.plan import save_plan

    return save_plan(hand_plan(model, assignment, **kw), tmp_path / "plan", params=model.params)


def run_distributed(plan_dir, run_dir, batches, want_grads=True, cfg=None, **kw):
    """Train ``plan_dir`` with one executor process per part; returns (step reports, final parameters)."""
    from fusion.executors.runtime.coordinator import CoordinatorConfig
    from fusion.executors.runtime.launcher import LocalCluster

    with LocalCluster(plan_dir, run_dir, cfg or CoordinatorConfig(peer_timeout_s=20), threads=1, **kw) as lc:
        lc.start()
        reports = [lc.coordinator.step(b, want_grads=want_grads) for b in batches]
        state = lc.coordinator.fetch_state()
    return reports, state


def assert_matches_plain(reports, state, expected) -> None:
    """A distributed run equals plain PyTorch: losses (rtol 1e-5) and gradients
    (rtol 1e-4) every step, parameters (rtol 1e-4) after the last one.

    reports/state: from :func:`run_distributed`; expected: from :func:`plain_training`.
    """
    assert len(reports) == len(expected)
    for step, (r, (loss, grads, _)) in enumerate(zip(reports, expected)):
        np.testing.assert_allclose(r.loss, loss, rtol=1e-5, err_msg=f"loss of step {step}")
        assert set(r.grads) == set(grads)
        for k, g in grads.items():
            np.testing.assert_allclose(r.grads[k], g, rtol=1e-4, atol=1e-6, err_msg=f"grad {k} at step {step}")
    for k, v in expected[-1][2].items():
        np.testing.assert_allclose(state[k], v, rtol=1e-4, atol=1e-6, err_msg=f"parameter {k} after {len(expected)} steps")


def wait_for(pred, timeout: float = 20.0) -> bool:
    """Poll ``pred`` every 50 ms until it is true (True) or ``timeout`` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return False

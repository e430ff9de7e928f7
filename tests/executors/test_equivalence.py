"""Equivalence suite: op-node models run by the reference executor, whole or
partitioned into 1, 2 and 4 parts, under GPipe, 1F1B and zero bubble (zb1: backward
split into input-gradient B and weight-gradient W actions), with 1 and 3
micro-batches, train exactly like the same model written in plain PyTorch.

Reference: a plain ``torch.nn.Module`` twin with the same parameter names,
loaded with the same initial weights, doing gradient accumulation over the
same micro-batches (each micro-batch loss divided by their number), stepped
by ``torch.optim.SGD`` (momentum, weight decay) or ``torch.optim.AdamW``.
Checked every step: the loss (rtol 1e-5) and every parameter gradient
(rtol 1e-4); after the last step: every parameter (rtol 1e-4). fp32 on CPU.
Every case runs with compiled torch parts (one fx GraphModule per part, the
default) and with the interpreted node-by-node loop (``compiled=False``).

Models:
  fig7       FusionLLM Figure 7's CNN with the user-registered CustomReLU;
             the 4-part split puts the label on the first part, so an int64
             placeholder crosses three parts without a gradient.
  branching  a CNN whose two branches land on different parts; the stem's
             output feeds both branches and a skip connection (3 parts).
  tied_mlp   an embedding MLP with a user-registered function op, an output
             head tied to the embedding (``params=``) on another part, and a
             free parameter used as a ParamRef by nodes on two parts.
  fanout     a DAG where one output feeds consumers on three parts and the
             two outputs of a multi-output node (``torch.chunk``) go to
             different parts, one of them to two users on the same part.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fusion
from fusion.plan import OptimizerConfig
from fusion.executors.reference import ReferenceExecutor
from fusion.ir.builder import GraphBuilder
from fusion.ir.node import Ref
from tests.examples import load_example

STEPS = 3
BATCH = 6  # divisible into 1, 2 and 3 micro-batches
RTOL_LOSS, RTOL_GRAD, ATOL = 1e-5, 1e-4, 1e-6


# -- tied_mlp: user function, tied head, free parameter on two parts ----------------
VOCAB, DIM, HIDDEN, SEQ = 11, 8, 16, 3


@fusion.register_function("test_equivalence.scaled_swish")
def scaled_swish(x: torch.Tensor, beta: float = 1.0) -> torch.Tensor:
    return x * torch.sigmoid(beta * x)


def tied_mlp_model(seed: int = 0):
    b = GraphBuilder()
    tok, y = b.input("tok"), b.label("y")
    gate = b.parameter("gate", torch.linspace(0.5, 1.5, DIM))
    e = b.module("emb", "torch.nn.Embedding", tok, num_embeddings=VOCAB, embedding_dim=DIM)
    g1 = b.function("gate1", "torch.mul", e, gate)
    h = b.module("fc1", "torch.nn.Linear", g1, in_features=DIM, out_features=HIDDEN)
    h = b.function("act", scaled_swish, h, beta=1.5)
    h = b.module("fc2", "torch.nn.Linear", h, in_features=HIDDEN, out_features=DIM)
    h = b.function("gate2", "torch.mul", h, gate)
    h = b.function("res", "operator.add", h, g1)
    o = b.module("head", "torch.nn.Linear", h, in_features=DIM, out_features=VOCAB, bias=False,
                 params={"weight": "emb.weight"})
    o = b.function("logits", "torch.Tensor.reshape", o, -1, VOCAB)
    t = b.function("targets", "torch.Tensor.reshape", y, -1)
    b.loss("loss", "torch.nn.functional.cross_entropy", o, t)
    g = torch.Generator().manual_seed(seed)
    ex = {"tok": torch.randint(0, VOCAB, (2, SEQ), generator=g), "y": torch.randint(0, VOCAB, (2, SEQ), generator=g)}
    return b.build(ex, seed=seed)


class TiedMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Parameter(torch.empty(DIM))
        self.emb = nn.Embedding(VOCAB, DIM)
        self.fc1, self.fc2 = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)

    def forward(self, tok, y):
        g1 = self.emb(tok) * self.gate
        h = self.fc2(scaled_swish(self.fc1(g1), beta=1.5)) * self.gate + g1
        return F.cross_entropy(F.linear(h, self.emb.weight).reshape(-1, VOCAB), y.reshape(-1))


# -- fanout: one output consumed on three parts, a multi-output node split across parts ---
def fanout_model(seed: int = 0):
    b = GraphBuilder()
    x, y = b.input("x"), b.label("y")
    h = b.function("h", "torch.tanh", b.module("fc1", "torch.nn.Linear", x, in_features=6, out_features=8))
    b.function("halves", "torch.chunk", h, 2, 1)
    a = b.module("fc_a", "torch.nn.Linear", h, in_features=8, out_features=4)
    a = b.function("a2", "torch.mul", a, Ref("halves", 0))
    c = b.module("fc_b", "torch.nn.Linear", h, in_features=8, out_features=4)
    c = b.function("b2", "torch.mul", c, Ref("halves", 1))
    c = b.function("b3", "operator.add", c, Ref("halves", 1))
    s = b.function("cat", "torch.cat", [a, c, h], dim=1)
    o = b.module("head", "torch.nn.Linear", s, in_features=16, out_features=5)
    b.loss("loss", "torch.nn.functional.cross_entropy", o, y)
    return b.build({"x": torch.zeros(2, 6), "y": torch.zeros(2, dtype=torch.long)}, seed=seed)


class Fanout(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc_a, self.fc_b = nn.Linear(6, 8), nn.Linear(8, 4), nn.Linear(8, 4)
        self.head = nn.Linear(16, 5)

    def forward(self, x, y):
        h = torch.tanh(self.fc1(x))
        lo, hi = torch.chunk(h, 2, 1)
        a = self.fc_a(h) * lo
        c = self.fc_b(h) * hi + hi
        return F.cross_entropy(self.head(torch.cat([a, c, h], dim=1)), y)


# -- the cases ------------------------------------------------------------------------------
def _parts(spec: dict[str, list[str]], rest: str):
    """node -> part from ``{part: nodes}``; unlisted nodes go to ``rest``."""
    where = {n: p for p, ns in spec.items() for n in ns}
    return lambda graph: {n: where.get(n, rest) for n in graph.nodes}


def _images(n, seed):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(n, 3, 8, 8, generator=g), "y": torch.randint(0, 10, (n,), generator=g)}


def _tokens(n, seed):
    g = torch.Generator().manual_seed(seed)
    return {"tok": torch.randint(0, VOCAB, (n, SEQ), generator=g), "y": torch.randint(0, VOCAB, (n, SEQ), generator=g)}


def _vectors(n, seed):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(n, 6, generator=g), "y": torch.randint(0, 5, (n,), generator=g)}


CASES = {
    "fig7": dict(
        model=lambda: load_example("cnn_fig7").build(seed=0),
        twin=lambda: load_example("cnn_fig7").TwoLayerNet(),
        data=_images,
        splits={
            2: _parts({"p0": ["x", "conv1", "myrelu"]}, "p1"),
            4: _parts({"p0": ["x", "y", "conv1"], "p1": ["myrelu", "conv2"], "p2": ["relu2", "pool", "flat"]}, "p3"),
        }),
    "branching": dict(
        model=lambda: load_example("branching_cnn").build(seed=0),
        twin=lambda: load_example("branching_cnn").BranchingCNN(),
        data=_images,
        splits={
            2: _parts({"p0": ["x", "stem", "stem_act", "a_conv1", "a_act", "a_conv2"]}, "p1"),
            4: _parts({"p0": ["x", "stem", "stem_act"], "p1": ["a_conv1", "a_act", "a_conv2"], "p2": ["b_conv"]}, "p3"),
        }),
    "tied_mlp": dict(
        model=tied_mlp_model, twin=TiedMLP, data=_tokens,
        splits={
            2: _parts({"p0": ["tok", "emb", "gate1", "fc1", "act"]}, "p1"),
            4: _parts({"p0": ["tok", "emb", "gate1"], "p1": ["fc1", "act"], "p2": ["fc2", "gate2", "res"]}, "p3"),
        }),
    "fanout": dict(
        model=fanout_model, twin=Fanout, data=_vectors,
        splits={
            2: _parts({"p0": ["x", "fc1", "h", "halves", "fc_a", "a2"]}, "p1"),
            4: _parts({"p0": ["x", "fc1", "h", "halves"], "p1": ["fc_a", "a2"], "p2": ["fc_b", "b2", "b3"]}, "p3"),
        }),
}

OPTIMIZERS = {
    "sgd": OptimizerConfig("sgd", lr=0.05, momentum=0.9, weight_decay=0.01),
    "adamw": OptimizerConfig("adamw", lr=0.01, weight_decay=0.05, betas=(0.9, 0.99), eps=1e-8),
}


@functools.lru_cache(maxsize=None)
def _model(name: str):
    return CASES[name]["model"]()


def _torch_optimizer(cfg: OptimizerConfig, params):
    """The plain PyTorch optimizer, written out (not via fusion.plan)."""
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)


def _twin(name: str, model):
    twin = CASES[name]["twin"]()
    twin.load_state_dict({k: torch.as_tensor(v) for k, v in model.params.items()}, strict=True)
    return twin


def _reference_step(twin, opt, batch, n_micro) -> float:
    """Plain PyTorch gradient accumulation over the same micro-batches (loss averaged)."""
    opt.zero_grad(set_to_none=True)
    total = 0.0
    for mb in zip(*(torch.chunk(v, n_micro) for v in batch.values())):
        loss = twin(*mb) / n_micro
        loss.backward()
        total += loss.item()
    return total


ENGINE_MODES = {"compiled": None, "interpreted": {"*": {"compiled": False}}}


def _assert_trains_like_pytorch(name, n_parts, schedule, n_micro, opt_name, engine_options=None, devices=None):
    case, model = CASES[name], _model(name)
    assignment = None if n_parts == 1 else case["splits"][n_parts](model.graph)
    cfg = OPTIMIZERS[opt_name]
    ex = ReferenceExecutor(model, assignment, cfg, micro_batches=n_micro, schedule=schedule,
                           engine_options=engine_options, devices=devices)
    assert len(ex.parts) == n_parts
    twin = _twin(name, model)
    opt = _torch_optimizer(cfg, twin.parameters())
    names = [n for n, _ in twin.named_parameters()]
    for step in range(STEPS):
        batch = case["data"](BATCH, seed=100 + step)
        got = ex.step(batch)
        want = _reference_step(twin, opt, batch, n_micro)
        np.testing.assert_allclose(got.loss, want, rtol=RTOL_LOSS, err_msg=f"loss, step {step}")
        assert sorted(got.grads) == sorted(names)
        for n, p in twin.named_parameters():
            np.testing.assert_allclose(got.grads[n], p.grad.numpy(), rtol=RTOL_GRAD, atol=ATOL,
                                       err_msg=f"grad {n}, step {step}")
        opt.step()
    state = ex.state()
    for n, v in twin.state_dict().items():
        np.testing.assert_allclose(state[n], v.numpy(), rtol=RTOL_GRAD, atol=ATOL, err_msg=f"param {n}")
    return ex


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("n_micro", [1, 3])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb1"])
@pytest.mark.parametrize("n_parts", [1, 2, 4])
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("mode", sorted(ENGINE_MODES))
def test_trains_like_plain_pytorch(mode, name, n_parts, schedule, n_micro, opt_name):
    ex = _assert_trains_like_pytorch(name, n_parts, schedule, n_micro, opt_name, ENGINE_MODES[mode])
    assert all(e.compiled == (mode == "compiled") for e in ex.engines.values())


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("n_micro", [2, 6])  # multiples of the devices (BATCH = 6 rows)
@pytest.mark.parametrize("n_parts,n_devices", [(4, 2), (2, 1), (4, 1)])
@pytest.mark.parametrize("name", sorted(CASES))
def test_interleaved_trains_like_plain_pytorch(name, n_parts, n_devices, n_micro, opt_name):
    """Interleaved 1F1B: the parts go round-robin over ``n_devices`` devices (virtual stages), each
    device runs its chunks in Megatron-LM's merged order (one lane per device)."""
    devices = {f"p{i}": f"d{i % n_devices}" for i in range(n_parts)}
    ex = _assert_trains_like_pytorch(name, n_parts, "interleaved", n_micro, opt_name, devices=devices)
    assert sorted(ex.lanes) == [f"d{r}" for r in range(n_devices)]
    assert all(len(lane) == 2 * n_micro * n_parts // n_devices for lane in ex.lanes.values())


def test_the_splits_exercise_what_they_claim():
    """Guard the suite itself: each 4-part split has the boundary the docstring promises."""
    from fusion.ir.boundary import part_links, partition

    def consumers(name, producer_key):
        a = CASES[name]["splits"][4](_model(name).graph)
        subs = partition(_model(name).graph, a)
        return {(a[e.actual_user], e.actual_user) for sg in subs.values() for e in sg.boundary.sent_acts
                if e.key == producer_key}

    assert {p for p, _ in consumers("fanout", ("h", None))} == {"p1", "p2", "p3"}
    assert consumers("fanout", ("halves", 0)) == {("p1", "a2")}
    assert consumers("fanout", ("halves", 1)) == {("p2", "b2"), ("p2", "b3")}
    assert {p for p, _ in consumers("branching", ("stem_act", None))} == {"p1", "p2", "p3"}
    assert {p for p, _ in consumers("fig7", ("y", None))} == {"p3"}
    g = _model("tied_mlp").graph
    a = CASES["tied_mlp"]["splits"][4](g)
    assert {a[n] for n in g.param_users()["emb.weight"]} == {"p0", "p3"}
    assert {a[n] for n in g.param_users()["gate"]} == {"p0", "p2"}
    ex = ReferenceExecutor(_model("tied_mlp"), a)
    assert ex.shared == {"emb.weight": ["p0", "p3"], "gate": ["p0", "p2"]}
    for name in CASES:
        for n_parts, split in CASES[name]["splits"].items():
            a = split(_model(name).graph)
            assert len(set(a.values())) == n_parts
            assert part_links(_model(name).graph, a)  # something crosses


def test_micro_batching_without_batchnorm_equals_full_batch():
    """No BatchNorm in the branching CNN: 3 micro-batches of 2 == one batch of 6."""
    name, model = "branching", _model("branching")
    ex = ReferenceExecutor(model, CASES[name]["splits"][4](model.graph), OPTIMIZERS["sgd"], micro_batches=3,
                           schedule="1f1b")
    twin = _twin(name, model)
    batch = _images(BATCH, seed=7)
    got = ex.step(batch)
    loss = twin(**batch)
    loss.backward()
    np.testing.assert_allclose(got.loss, loss.item(), rtol=RTOL_LOSS)
    for n, p in twin.named_parameters():
        np.testing.assert_allclose(got.grads[n], p.grad.numpy(), rtol=RTOL_GRAD, atol=ATOL)

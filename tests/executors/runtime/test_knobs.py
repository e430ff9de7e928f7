"""The knobs of a real run: learning-rate schedules and global-norm clipping (issue 26).

The schedule is checked against torch's LambdaLR over the Hugging Face lambdas for every step; clipping's
arithmetic against ``torch.nn.utils.clip_grad_norm_``; and two runs in real processes (2 parts of a transformer
with a tied weight, one of them NumPy; 4 parts of a branching CNN) against plain PyTorch in one process with warmup + cosine and a clip that
binds.
"""
import numpy as np
import pytest
import torch

from fusion.ir.lr_schedule import SCHEDULES, check_schedule, lr_factor
from fusion.executors.runtime.dp.clip import clip_coef, part_sq_norm, scale_grads, total_norm
from fusion.plan import OptimizerConfig
from tests.executors.dist_models import MODELS, run_distributed, save_hand_plan


def _hf(name, opt, warmup, total):
    from transformers import (get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup,
                              get_linear_schedule_with_warmup)

    if name == "constant":
        return get_constant_schedule_with_warmup(opt, warmup)
    f = get_linear_schedule_with_warmup if name == "linear" else get_cosine_schedule_with_warmup
    return f(opt, warmup, total)


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("warmup,total", [(0, 7), (3, 10), (5, 5), (1, 1)])
def test_schedule_equals_transformers_lambdalr_every_step(name, warmup, total):
    """The lr of every optimizer step (and past the end) is the one torch's LambdaLR gives with HF's lambdas."""
    cfg = OptimizerConfig("sgd", lr=0.3, lr_schedule=name, warmup_steps=warmup,
                          total_steps=0 if name == "constant" else total)
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.3)
    sched = _hf(name, opt, warmup, total)
    for step in range(total + 3):
        assert cfg.lr_at(step) == opt.param_groups[0]["lr"], (name, warmup, total, step)
        opt.step()
        sched.step()


def test_schedule_checks_name_the_field():
    assert "lr_schedule" in check_schedule("step", 0, 0)
    assert "total_steps" in check_schedule("cosine", 0, 0)
    assert "warmup_steps (4) exceeds" in check_schedule("linear", 4, 3)
    assert "warmup_steps" in check_schedule("constant", -1, 0)
    with pytest.raises(ValueError, match="clip_grad_norm"):
        OptimizerConfig(clip_grad_norm=0.0)
    with pytest.raises(ValueError, match="lr_schedule"):
        OptimizerConfig(lr_schedule="exp")
    assert lr_factor("cosine", 10, 2, 10) == 0.0


def test_plan_without_knobs_reads_as_before():
    d = OptimizerConfig("adamw", lr=1e-3).to_dict()
    assert set(d) == {"name", "lr", "momentum", "weight_decay", "betas", "eps"}
    cfg = OptimizerConfig("adamw", lr=1e-3, lr_schedule="cosine", warmup_steps=2, total_steps=9, clip_grad_norm=1.5)
    assert OptimizerConfig.from_dict(cfg.to_dict()) == cfg


class _Engine:
    """grads()/set_grad() over arrays, as an engine part gives them."""

    def __init__(self, grads):
        self.g = dict(grads)

    def grads(self):
        return dict(self.g)

    def set_grad(self, name, grad):
        self.g[name] = np.asarray(grad)


@pytest.mark.parametrize("max_norm", [0.05, 1.0, 100.0])
def test_clip_arithmetic_equals_clip_grad_norm(max_norm):
    """Split over two 'parts', the norm, the coefficient and the scaled gradients are torch's in one process."""
    g = torch.Generator().manual_seed(0)
    ts = [torch.randn(s, generator=g) * 0.1 for s in [(3, 4), (5,), (2, 2, 2)]]
    params = [torch.zeros_like(t, requires_grad=True) for t in ts]
    for p, t in zip(params, ts):
        p.grad = t.clone()
    want = torch.nn.utils.clip_grad_norm_(params, max_norm)
    a = _Engine({"a": ts[0].numpy(), "b": ts[1].numpy(), "none": None})
    b = _Engine({"c": ts[2].numpy()})
    norm = total_norm([part_sq_norm(a.grads()), part_sq_norm(b.grads())])
    np.testing.assert_allclose(norm, want.item(), rtol=1e-6)
    assert part_sq_norm({"x": np.ones(4, np.float32)}, skip={"x"}) == 0.0  # a tied copy counted elsewhere
    coef = clip_coef(max_norm, norm)
    assert coef == np.float32(min(1.0, max_norm / (want.item() + 1e-6))) or abs(coef - max_norm / want.item()) < 1e-6
    scale_grads(a, coef)
    scale_grads(b, coef)
    for got, p in zip([a.g["a"], a.g["b"], b.g["c"]], params):
        np.testing.assert_allclose(got, p.grad.numpy(), rtol=1e-6)
    assert a.g["none"] is None


def test_bfloat16_gradients_are_measured_and_scaled_as_torch():
    """bfloat16 gradients arrive as bits: their norm is of their values, their scaling rounds as torch's mul_."""
    t = torch.randn(64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    bits = t.view(torch.int16).numpy().view(np.uint16)
    dtypes = {"w": "bfloat16"}
    np.testing.assert_allclose(part_sq_norm({"w": bits}, dtypes=dtypes), float((t.double() ** 2).sum()), rtol=1e-12)
    e = _Engine({"w": bits})
    coef = np.float32(0.3)
    scale_grads(e, coef, dtypes)
    np.testing.assert_array_equal(e.g["w"], t.mul(torch.tensor(0.3, dtype=torch.float32)).view(torch.int16).numpy().view(np.uint16))


# -- in real processes, against plain PyTorch in one process --------------------------------------------------------
STEPS, MICRO, MB = 4, 2, 2


def _plain(model, plain_loss, batches, make_opt, warmup, clip):
    """Single-process PyTorch: accumulation over micro-batches, clip_grad_norm_, the HF cosine schedule."""
    from transformers import get_cosine_schedule_with_warmup

    P = {k: torch.tensor(np.asarray(v), requires_grad=model.graph.params[k].trainable) for k, v in model.params.items()}
    trainable = [P[k] for k in P if P[k].requires_grad]
    opt = make_opt(trainable)
    sched = get_cosine_schedule_with_warmup(opt, warmup, len(batches))
    out = []
    for batch in batches:
        opt.zero_grad()
        loss = 0.0
        for i in range(MICRO):
            lc = plain_loss(P, {k: torch.as_tensor(v).chunk(MICRO)[i] for k, v in batch.items()}) / MICRO
            lc.backward()
            loss = loss + lc.detach()
        norm = torch.nn.utils.clip_grad_norm_(trainable, clip).item()
        grads = {k: t.grad.detach().clone().numpy() for k, t in P.items() if t.grad is not None}
        opt.step()
        sched.step()
        out.append((loss.item(), norm, grads, {k: t.detach().clone().numpy() for k, t in P.items()}))
    return out


@pytest.mark.parametrize("name,n_parts,engines", [("gpt", 2, {"p1": "numpy"}), ("cnn", 4, None)])
def test_cosine_warmup_and_clipping_in_processes_equal_plain_pytorch(tmp_path, name, n_parts, engines):
    build, splits, plain_loss, batch_fn = MODELS[name]
    model = build(mb=MB)
    warmup, clip = 2, 0.3
    if name == "cnn":
        cfg = OptimizerConfig("adamw", lr=0.01, weight_decay=0.01, lr_schedule="cosine", warmup_steps=warmup,
                              total_steps=STEPS, clip_grad_norm=clip)
        make_opt = lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.01)  # noqa: E731
    else:  # SGD for the transformer (see test_distributed.OPTIMIZERS)
        cfg = OptimizerConfig("sgd", lr=0.1, momentum=0.9, lr_schedule="cosine", warmup_steps=warmup,
                              total_steps=STEPS, clip_grad_norm=clip)
        make_opt = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
    plan_dir = save_hand_plan(tmp_path, model, splits[n_parts], schedule="1f1b", micro_batches=MICRO, optimizer=cfg,
                              engines=engines)
    batches = [batch_fn(s, MB * MICRO) for s in range(STEPS)]
    held_out = batch_fn(1000, MB * MICRO)
    reports, vals, state = _run_with_eval(plan_dir, tmp_path / "run", batches, held_out)
    expected = _plain(model, plain_loss, batches, make_opt, warmup, clip)
    assert any(norm > clip for _, norm, _, _ in expected), "the clip must bind in some step"
    for step, (r, (loss, norm, grads, _)) in enumerate(zip(reports, expected)):
        np.testing.assert_allclose(r.loss, loss, rtol=1e-5, err_msg=f"loss of step {step}")
        np.testing.assert_allclose(r.grad_norms, [norm], rtol=1e-5, err_msg=f"grad norm of step {step}")
        for k, g in grads.items():  # the clipped gradients, as applied
            np.testing.assert_allclose(r.grads[k], g, rtol=1e-4, atol=1e-6, err_msg=f"grad {k} at step {step}")
    for k, v in expected[-1][3].items():
        np.testing.assert_allclose(state[k], v, rtol=1e-4, atol=1e-6, err_msg=f"parameter {k} after {STEPS} steps")
    # the held-out loss after each step is the plain forward loss of the parameters after that step, no_grad
    for step, (val, (_, _, _, params)) in enumerate(zip(vals, expected)):
        P = {k: torch.tensor(v) for k, v in params.items()}
        with torch.no_grad():
            want = sum(plain_loss(P, {k: torch.as_tensor(v).chunk(MICRO)[i] for k, v in held_out.items()}).item()
                       for i in range(MICRO)) / MICRO
        np.testing.assert_allclose(val, want, rtol=1e-5, err_msg=f"held-out loss after step {step}")


def test_reference_executor_applies_the_schedule_and_the_clip():
    """The in-process reference executor (2 parts, one NumPy, a tied weight) equals plain PyTorch with the knobs."""
    from fusion.executors.reference import ReferenceExecutor

    build, splits, plain_loss, batch_fn = MODELS["gpt"]
    model = build(mb=MB)
    cfg = OptimizerConfig("sgd", lr=0.1, momentum=0.9, lr_schedule="linear", warmup_steps=1, total_steps=STEPS,
                          clip_grad_norm=0.3)
    ex = ReferenceExecutor(model, splits[2], cfg, micro_batches=MICRO, engines={"p1": "numpy"})
    batches = [batch_fn(s, MB * MICRO) for s in range(STEPS)]
    got = [ex.step(b) for b in batches]
    from transformers import get_linear_schedule_with_warmup

    P = {k: torch.tensor(np.asarray(v), requires_grad=model.graph.params[k].trainable) for k, v in model.params.items()}
    opt = torch.optim.SGD([t for t in P.values() if t.requires_grad], lr=0.1, momentum=0.9)
    sched = get_linear_schedule_with_warmup(opt, 1, STEPS)
    for step, (b, r) in enumerate(zip(batches, got)):
        opt.zero_grad()
        for i in range(MICRO):
            (plain_loss(P, {k: torch.as_tensor(v).chunk(MICRO)[i] for k, v in b.items()}) / MICRO).backward()
        torch.nn.utils.clip_grad_norm_([t for t in P.values() if t.requires_grad], 0.3)
        for k, t in P.items():
            if t.grad is not None:
                np.testing.assert_allclose(r.grads[k], t.grad.numpy(), rtol=1e-4, atol=1e-6, err_msg=f"{k} step {step}")
        opt.step()
        sched.step()
    state = ex.state()
    for k, t in P.items():
        np.testing.assert_allclose(state[k], t.detach().numpy(), rtol=1e-4, atol=1e-6, err_msg=k)


def _run_with_eval(plan_dir, run_dir, batches, held_out, evaluate=True):
    """Train with one process per part, evaluating ``held_out`` after every step: (reports, val losses, state)."""
    from fusion.executors.runtime.coordinator import CoordinatorConfig
    from fusion.executors.runtime.launcher import LocalCluster

    reports, vals = [], []
    with LocalCluster(plan_dir, run_dir, CoordinatorConfig(peer_timeout_s=20), threads=1) as lc:
        lc.start()
        for b in batches:
            reports.append(lc.coordinator.step(b, want_grads=True))
            if evaluate:
                vals.append(lc.coordinator.evaluate(held_out))
        state = lc.coordinator.fetch_state()
    return reports, vals, state


def _dropout_model():
    from fusion.ir.builder import GraphBuilder

    b = GraphBuilder()
    x, y = b.input("x"), b.label("y")
    h = b.module("fc1", "torch.nn.Linear", x, in_features=8, out_features=16)
    h = b.module("drop", "torch.nn.Dropout", h, p=0.5)
    o = b.module("fc2", "torch.nn.Linear", h, in_features=16, out_features=3)
    b.loss("loss", "torch.nn.functional.cross_entropy", o, y)
    return b.build(example={"x": torch.randn(4, 8), "y": torch.randint(0, 3, (4,))}, seed=0)


@pytest.mark.parametrize("compiled", [True, False])
def test_torch_evaluation_is_model_eval_forward_and_keeps_nothing(compiled):
    """A torch part's evaluate: dropout off (model.eval()), no autograd graph, nothing stashed, training mode back."""
    from fusion.executors.engines.select import make_engine_part
    from fusion.ir.boundary import partition

    model = _dropout_model()
    sub = partition(model.graph, {n: "p0" for n in model.graph.nodes})["p0"]
    part = make_engine_part("torch", model.graph, sub, model.params, "cpu", options={"compiled": compiled})
    feeds = {"x": np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32), "y": np.array([0, 1, 2, 1])}
    P = {k: torch.tensor(np.asarray(v)) for k, v in model.params.items()}
    lin = lambda h, n: h @ P[f"{n}.weight"].T + P[f"{n}.bias"]  # noqa: E731
    want = torch.nn.functional.cross_entropy(lin(lin(torch.tensor(feeds["x"]), "fc1"), "fc2"),
                                             torch.tensor(feeds["y"])).item()
    _, loss = part.evaluate({}, feeds)
    np.testing.assert_allclose(loss, want, rtol=1e-6)
    assert not part.stash and all(m.training for top in part.modules.values() for m in top.modules())
    torch.manual_seed(0)
    _, train_loss = part.forward("k", {}, feeds)  # training mode: dropout on, so the loss differs
    assert abs(train_loss - want) > 1e-4

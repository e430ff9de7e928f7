"""Codecs on the cut under ``--precision bf16`` (issue 36, "torch's best wire") equal plain PyTorch under autocast
with the same codec applied at the cut.

The model is cut in two where one activation is bfloat16 under autocast (``gelu`` of a Linear: autocast runs the
matmul in bfloat16) and one stays float32 (``add``: float32 input plus a bfloat16 Linear output promotes to
float32). Plain PyTorch is the same module in one process, each micro-batch's forward under
``torch.autocast("cpu", dtype=torch.bfloat16)``, fp32 parameters and AdamW state, with each cut tensor passed
through a straight-through autograd Function that encodes and decodes it with the codec's own registry functions
(``CODECS.unit(algo).encode`` / ``.decode``; Top-K with error feedback through ``ErrorFeedback.compress``, one
residual per tensor, direction and micro-batch, as the runtime keeps them) in forward, and the gradient the same
way in backward. So the bfloat16 edge is quantised from its bfloat16 values, and the receiver computes with the
bfloat16 tensor the codec gives back, as one process would.

Tolerances: those of ``test_mixed_precision.py`` and ``dist_models.assert_matches_plain``: losses rtol 1e-5,
gradients and parameters rtol 1e-4 (atol 1e-6). Each test first checks that the codec moves the losses by far
more than that (else the comparison could not fail), and that the bfloat16 edge was encoded as bfloat16 values
in both directions.
"""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fusion.executors.reference import ReferenceExecutor
from fusion.ir.opdata import SAMPLE_IDS
from fusion.kernels.codecs import CODECS
from fusion.plan import EdgeCompression, OptimizerConfig

MB, N_MB, STEPS = 4, 2, 3
OPT = OptimizerConfig("adamw", lr=0.01)
P0 = ("x", "fc1", "gelu", "fc0", "add")  # the first part; the rest (fc2, add_1, head, the loss, y) is p1
CUT = (("gelu", None), ("add", None))  # bfloat16 and float32 under autocast
CODEC_CASES = {
    "quant8": ({"algo": "quant", "bits": 8}, False),
    "topk-ef": ({"algo": "topk", "ratio": 4.0}, True),
    "hadamard-quant4": ({"algo": "hadamard-quant", "bits": 4}, False),
    "delta4": ({"algo": "delta", "bits": 4}, False),  # AQ-SGD: activations only, its gradients go dense
}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc0, self.fc1, self.fc2 = nn.Linear(16, 16), nn.Linear(16, 64), nn.Linear(64, 16)
        self.head = nn.Linear(16, 5)

    def first(self, x):
        return F.gelu(self.fc1(x)), x + self.fc0(x)

    def second(self, h, r, y):
        return F.cross_entropy(self.head(self.fc2(h) + r), y)

    def forward(self, x, y):
        return self.second(*self.first(x), y)


@pytest.fixture(scope="module")
def net_model():
    from fusion.ir.trace import trace

    torch.manual_seed(0)
    net = Net()
    model = trace(copy.deepcopy(net), {"x": torch.zeros(MB, 16), "y": torch.zeros(MB, dtype=torch.long)},
                  labels=("y",))
    return net, model


def _assign(model):
    return {n: "p0" if n in P0 else "p1" for n in model.graph.nodes}


def _batches():
    out = []
    for s in range(STEPS):
        g = torch.Generator().manual_seed(s)
        out.append({"x": torch.randn(MB * N_MB, 16, generator=g).numpy(),
                    "y": torch.randint(0, 5, (MB * N_MB,), generator=g).numpy(),
                    SAMPLE_IDS: np.arange(MB * N_MB, dtype=np.int64)})  # the same samples each step: deltas
    return out


def _bwd(cfg):
    return None if CODECS.unit(cfg["algo"]).stateful else dict(cfg)  # delta compresses activations only


def _edges(cfg, ef):
    return [EdgeCompression(p, i, "p0", "p1", 1.0, ("fwd", "bwd"), ef, dict(cfg), _bwd(cfg)) for p, i in CUT]


class _Codec:
    """The codec of the cut applied as the plan applies it: each direction of each tensor on its own, with error
    feedback one residual per (tensor, direction, micro-batch); a stateful codec (delta) with its own buffers
    (``DeltaCodec.buffer``) at the sending and the receiving end of each tensor, the gradient dense."""

    def __init__(self, cfg, ef):
        from fusion.kernels.error_feedback import ErrorFeedback

        self.cfg, self.unit = cfg, CODECS.unit(cfg["algo"])
        self.ef = ErrorFeedback(enabled=True) if ef else None
        self.dtypes: list = []  # (tensor, direction, dtype the codec saw)
        self.buffers: dict = {}  # delta: tensor -> (sender's buffers, receiver's buffers)
        self.ids = None  # delta: the sample ids of the micro-batch

    def __call__(self, t: torch.Tensor, stream) -> torch.Tensor:
        t = t.detach()
        if self.unit.stateful:
            if stream[1] == "bwd":
                return t
            self.dtypes.append((stream[0], stream[1], t.dtype))
            send, recv = self.buffers.setdefault(stream[0], tuple(self.unit.buffer(self.cfg) for _ in range(2)))
            out = recv.decode(send.encode(t.reshape(len(self.ids), -1, *t.shape[1:]), self.ids)).reshape(t.shape)
            assert out.dtype == t.dtype
            return out
        self.dtypes.append((stream[0], stream[1], t.dtype))
        if self.ef is not None:
            p = self.ef.compress(stream, t, self.unit.k_for(t.numel(), self.cfg))
        else:
            p = self.unit.encode(t, self.cfg)
        out = self.unit.decode(p, like=t)
        assert out.dtype == t.dtype and out.shape == t.shape
        return out


class _Cut(torch.autograd.Function):
    """Forward: the activation through the codec; backward (straight-through): the gradient through the codec."""

    @staticmethod
    def forward(ctx, x, codec, key, mb):
        ctx.codec, ctx.key, ctx.mb = codec, key, mb
        return codec(x, (key, "fwd", mb))

    @staticmethod
    def backward(ctx, g):
        return ctx.codec(g, (ctx.key, "bwd", ctx.mb)), None, None, None


def _plain(net, codec: _Codec | None):
    """Per step (loss, parameter gradients), and the final parameters, of one process under autocast."""
    net = copy.deepcopy(net)
    opt = torch.optim.AdamW(net.parameters(), lr=OPT.lr, weight_decay=OPT.weight_decay)
    steps = []
    for b in _batches():
        opt.zero_grad()
        total = 0.0
        for i in range(N_MB):
            rows = slice(i * MB, (i + 1) * MB)
            if codec is not None:
                codec.ids = b[SAMPLE_IDS][rows]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                h, r = net.first(torch.from_numpy(b["x"][rows]))
                if codec is not None:
                    h, r = _Cut.apply(h, codec, "gelu", i), _Cut.apply(r, codec, "add", i)
                loss = net.second(h, r, torch.from_numpy(b["y"][rows])) / N_MB
            loss.backward()
            total += loss.item()
        steps.append((total, {k: v.grad.detach().numpy().copy() for k, v in net.named_parameters()}))
        opt.step()
    return steps, {k: v.detach().numpy() for k, v in net.named_parameters()}


def _check(got_steps, got_state, want, dense):
    want_steps, want_params = want
    moved = max(abs(a[0] - b[0]) / abs(b[0]) for a, b in zip(want_steps, dense[0]))
    assert moved > 1e-4, f"the codec changed the losses by only {moved:.2g}: the comparison could not fail"
    for step, ((loss, grads), (want_loss, want_grads)) in enumerate(zip(got_steps, want_steps)):
        np.testing.assert_allclose(loss, want_loss, rtol=1e-5, err_msg=f"loss of step {step}")
        for k, g in want_grads.items():
            np.testing.assert_allclose(grads[k], g, rtol=1e-4, atol=1e-6, err_msg=f"grad {k} at step {step}")
    for k, v in want_params.items():
        got = np.asarray(got_state[k])
        assert got.dtype == np.float32, f"{k}: master weights must stay float32, got {got.dtype}"
        np.testing.assert_allclose(got, v, rtol=1e-4, atol=1e-6, err_msg=f"parameter {k}")


@pytest.fixture(scope="module")
def dense(net_model):
    return _plain(net_model[0], None)


@pytest.mark.parametrize("encode", ["device", "torch", "host"])
@pytest.mark.parametrize("case", sorted(CODEC_CASES))
def test_codec_on_a_bf16_cut_equals_plain_pytorch_with_that_codec(net_model, dense, case, encode):
    from tests.executors.shared_setup import capture_sent

    net, model = net_model
    cfg, ef = CODEC_CASES[case]
    codec = _Codec(cfg, ef)
    want = _plain(net, codec)
    # the reference's codec saw the bfloat16 activation and its bfloat16 gradient, and float32 for ``add``
    both = ("fwd",) if _bwd(cfg) is None else ("fwd", "bwd")
    assert set(codec.dtypes) == {(k, d, dt) for d in both for k, dt in (("gelu", torch.bfloat16), ("add", torch.float32))}
    ex = ReferenceExecutor(model, _assign(model), OPT, micro_batches=N_MB, compression=_edges(cfg, ef),
                           engine_options={"*": {"precision": "bf16", "encode": encode}})
    sent = capture_sent(ex)
    got = []
    for b in _batches():
        r = ex.step(b)
        got.append((r.loss, r.grads))
    state = {k: v for p in ex.engines.values() for k, v in p.state().items()}
    _check(got, state, want, dense)
    # every message of the cut left encoded, the gelu edge as bfloat16 values both ways, ``add`` as float32
    seen = {(m.name, m.is_grad, getattr(m.payload, "dtype", None), m.compress_cfg is not None)
            for m in sent if (m.name, m.index) in CUT}
    grads = {("gelu", True, "bfloat16", True), ("add", True, "float32", True)} if _bwd(cfg) else \
        {("gelu", True, np.dtype(np.uint16), False), ("add", True, np.dtype(np.float32), False)}  # dense
    assert seen == {("gelu", False, "bfloat16", True), ("add", False, "float32", True)} | grads, seen


def test_the_table_knows_autocast_edges_explicitly(net_model):
    """The table is told the parts run under autocast (the engine's precision), not left to guess: without it a
    uint16 array of a float32 edge is no bfloat16 and is sent dense; with it, it is encoded as bfloat16."""
    from fusion.executors.runtime.compression import CompressionTable

    _, model = net_model
    edges = _edges({"algo": "quant", "bits": 8}, False)
    bits = torch.randn(MB, 64).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    plain = CompressionTable.build("p0", edges, model.graph)
    assert not plain.autocast and plain.encode(bits, ("gelu", None), "p1", False, 0)[1] is None
    auto = CompressionTable.build("p0", edges, model.graph, autocast=True)
    assert auto.autocast == set(CUT)
    payload, cfg = auto.encode(bits, ("gelu", None), "p1", False, 0)
    assert cfg is not None and payload.dtype == "bfloat16"
    f32 = np.random.default_rng(0).standard_normal((MB, 16)).astype(np.float32)
    assert auto.encode(f32, ("add", None), "p1", False, 0)[0].dtype == "float32"


@pytest.mark.timeout(240)
def test_compnodes_in_real_processes_with_a_codec_on_the_bf16_cut(net_model, dense, tmp_path):
    """One executor process per part, plan.precision bf16, Top-K with error feedback on both cut tensors: the
    receiving inbox takes the bfloat16 payload of a float32 edge, and the run equals plain PyTorch."""
    from fusion.executors.runtime.launcher import hand_plan
    from fusion.plan import save_plan
    from tests.executors.dist_models import run_distributed

    net, model = net_model
    cfg, ef = CODEC_CASES["topk-ef"]
    want = _plain(net, _Codec(cfg, ef))
    plan = hand_plan(model, _assign(model), micro_batches=N_MB, optimizer=OPT)
    plan.precision = "bf16"
    plan.compression = _edges(cfg, ef)
    plan_dir = save_plan(plan, tmp_path / "plan", params=model.params)
    reports, state = run_distributed(plan_dir, tmp_path / "run", _batches())
    _check([(r.loss, r.grads) for r in reports], state, want, dense)


def test_plan_with_bf16_and_codecs_round_trips(net_model):
    """A plan of precision bf16 with compressed edges is valid (it was refused before codecs handled bfloat16)."""
    from fusion.executors.runtime.launcher import hand_plan
    from fusion.plan import Plan

    _, model = net_model
    plan = hand_plan(model, _assign(model), micro_batches=N_MB, optimizer=OPT)
    plan.precision, plan.compression = "bf16", _edges({"algo": "quant", "bits": 8}, False)
    back = Plan.from_dict(plan.to_dict())
    assert back.precision == "bf16" and back.compression == plan.compression


@pytest.mark.timeout(240)
def test_fusion_compile_and_run_with_bf16_and_a_codec(tmp_path):
    """``fusion compile --precision bf16 --compress quant:bits=8 --compress-bwd topk:ratio=8`` writes a bf16 plan
    with codecs on its cut edges, and ``fusion run`` trains it on four CompNodes (finite losses)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from fusion.plan import load_plan

    repo = Path(__file__).resolve().parents[2]
    plan_dir, run_dir = tmp_path / "plan", tmp_path / "run"
    run = lambda *a: subprocess.run([sys.executable, "-m", "fusion.cli", *a], cwd=repo, capture_output=True,  # noqa: E731
                                    text=True, timeout=200)
    r = run("compile", "examples/models/gpt.py:tiny", "--cluster", "examples/clusters/local-4-two-sites.yaml",
            "--strategy", "equal-flops", "--precision", "bf16", "--compress", "quant:bits=8",
            "--compress-bwd", "topk:ratio=8", "-o", str(plan_dir))
    assert r.returncode == 0, r.stderr[-3000:]
    plan = load_plan(plan_dir)
    assert plan.precision == "bf16" and plan.compression
    assert all(e.fwd_codec["algo"] == "quant" and e.bwd_codec["algo"] == "topk" for e in plan.compression)
    r = run("run", str(plan_dir), "--steps", "3", "--out", str(run_dir), "--no-progress")
    assert r.returncode == 0, r.stderr[-3000:]
    losses = [json.loads(x)["loss"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 3 and np.isfinite(losses).all(), losses

"""``--precision bf16`` (issue 26): torch autocast in every part equals plain PyTorch under autocast.

Plain PyTorch is the same GPT trained in one process, each micro-batch's forward under
``torch.autocast("cpu", dtype=torch.bfloat16)``, fp32 parameters and AdamW state. Across parts an
activation travels in the dtype autocast gave it (bfloat16 bits after a matmul, float32 after a residual
sum), so the consumer computes with the very tensor one process would: the tolerance is that of float32
summation order (rtol 1e-6 in one process, 1e-5 across processes), and each test first checks that
autocast itself moves the losses by far more than that (else the comparison could not fail).
"""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from fusion.executors.reference import ReferenceExecutor
from fusion.plan import OptimizerConfig

MB, N_MB, STEPS = 2, 2, 3
OPT = OptimizerConfig("adamw", lr=0.01)
#: cuts (index of the first node of the next part) of the tiny GPT: 26 sends the MLP's c_fc output
#: after gelu (bfloat16 under autocast) and the residual ``add_1`` (float32); 20 an attention output
#: (bfloat16); 12 the q/k/v of an attention (bfloat16) and the embedding sum (float32)
CUT_GELU, CUTS_4 = 26, (12, 26, 44)


@pytest.fixture(scope="module")
def gpt():
    from examples.models.gpt import tiny
    from fusion.loader import load_model

    return tiny()[0], load_model("examples/models/gpt.py:tiny")


def _batches():
    out = []
    for s in range(STEPS):
        g = torch.Generator().manual_seed(s)
        out.append({"idx": torch.randint(0, 64, (MB * N_MB, 16), generator=g).numpy(),
                    "targets": torch.randint(0, 64, (MB * N_MB, 16), generator=g).numpy()})
    return out


def _plain(net, autocast: bool):
    """Losses per step and final parameters of one process, under autocast or in fp32."""
    net = copy.deepcopy(net)
    opt = torch.optim.AdamW(net.parameters(), lr=OPT.lr, weight_decay=OPT.weight_decay)
    losses = []
    for b in _batches():
        opt.zero_grad()
        total = 0.0
        for i in range(N_MB):
            rows = slice(i * MB, (i + 1) * MB)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = net(torch.from_numpy(b["idx"][rows]), torch.from_numpy(b["targets"][rows])) / N_MB
            loss.backward()
            total += loss.item()
        opt.step()
        losses.append(total)
    return losses, {k: v.detach().numpy() for k, v in net.named_parameters()}


def _assign(model, cuts):
    names = list(model.graph.nodes)
    return {n: f"p{sum(i >= c for c in cuts)}" for i, n in enumerate(names)}


def _autocast_matters(want, rtol):
    """Autocast moves the losses by far more than ``rtol``: the comparison at ``rtol`` can fail."""
    fp32 = want["fp32"][0]
    moved = max(abs(a - b) / abs(b) for a, b in zip(want["bf16"][0], fp32))
    assert moved > 10 * rtol, f"autocast changed the losses by only {moved:.2g}"


@pytest.fixture(scope="module")
def want(gpt):
    net, _ = gpt
    return {"bf16": _plain(net, True), "fp32": _plain(net, False)}


def _check(losses, state, want, rtol, atol):
    _autocast_matters(want, rtol)
    want_losses, want_params = want["bf16"]
    np.testing.assert_allclose(losses, want_losses, rtol=rtol)
    for name, v in want_params.items():
        got = np.asarray(state[name])
        assert got.dtype == np.float32, f"{name}: master weights must stay float32, got {got.dtype}"
        np.testing.assert_allclose(got, v, rtol=rtol * 10, atol=atol, err_msg=name)


@pytest.mark.parametrize("cuts", [(CUT_GELU,), (20,), CUTS_4], ids=["2-parts-gelu", "2-parts-attn", "4-parts"])
def test_reference_executor_equals_one_process_autocast(gpt, want, cuts):
    _, model = gpt
    ex = ReferenceExecutor(model, _assign(model, cuts), OPT, micro_batches=N_MB,
                           engine_options={"*": {"precision": "bf16"}})
    losses = [ex.step(b).loss for b in _batches()]
    state = {k: v for p in ex.engines.values() for k, v in p.state().items()}
    _check(losses, state, want, rtol=1e-6, atol=1e-6)


def _wire_bytes(model, precision: str) -> dict:
    """Bytes on the wire of each activation part p0 sends at the gelu cut, by tensor name."""
    from fusion.executors.engines.select import make_engine_part
    from fusion.executors.runtime.part import PartRuntime
    from fusion.ir.boundary import partition
    from fusion.ir.wire import encode_opdata

    assign = _assign(model, (CUT_GELU,))
    sub = partition(model.graph, assign)["p0"]
    engine = make_engine_part("torch", model.graph, sub, model.params, options={"precision": precision})
    rt = PartRuntime(model.graph, "p0", sub, assign, engine)
    feeds = {k: v.numpy() for k, v in model.example.items()}
    msgs, _ = rt.forward(0, 0, feeds, [])
    return {m.name: sum(len(memoryview(f).cast("B")) for f in encode_opdata(m)) for m in msgs}


def test_bfloat16_edges_halve_on_the_wire_and_float32_ones_stay(gpt):
    """The gelu output (autocast bf16) costs half the bytes of fp32; the residual sum ``add_1`` (fp32 under
    autocast too: sending it in bf16 would round what the next block adds to) costs the same."""
    _, model = gpt
    fp32, bf16 = _wire_bytes(model, "fp32"), _wire_bytes(model, "bf16")
    payload = 2 * 16 * 128 * 4  # the gelu activation: rows x seq x 4*d_model, float32
    saved = fp32["gelu"] - bf16["gelu"]  # the header differs by the dtype's name only
    assert fp32["gelu"] > payload and abs(saved - payload // 2) <= 8 and bf16["gelu"] < 0.52 * fp32["gelu"], (fp32, bf16)
    assert bf16["add_1"] == fp32["add_1"]


def test_plan_field_round_trips_and_is_left_out_at_fp32(gpt, tmp_path):
    from fusion.executors.runtime.launcher import hand_plan
    from fusion.plan import Plan, PlanError

    _, model = gpt
    plan = hand_plan(model, _assign(model, (CUT_GELU,)))
    assert "precision" not in plan.to_dict()  # older plans hash the same
    plan.precision = "bf16"
    assert Plan.from_dict(plan.to_dict()).precision == "bf16"
    for bad, match in [({"precision": "fp16"}, "precision 'fp16'"),
                       ({"precision": "bf16", "parts": {**plan.to_dict()["parts"],
                                                         "p1": {**vars(plan.parts["p1"]), "engine": "numpy"}}},
                        "part 'p1' is on the numpy engine")]:
        with pytest.raises(PlanError, match=match):
            Plan.from_dict({**plan.to_dict(), **bad})


@pytest.mark.parametrize("command", ["run", "compile"])
@pytest.mark.parametrize("args,words", [
    (["--precision", "fp16"], "invalid choice: 'fp16'"),
    (["--precision", "bf16", "--engine", "p1=numpy"], "--precision bf16 with --engine p1=numpy"),
])
def test_bad_precision_is_one_line_before_tracing(tmp_path, capsys, command, args, words):
    from fusion.cli import main

    model = tmp_path / "model.py"
    model.write_text("import pathlib\npathlib.Path(__file__).with_name('traced').write_text('imported')\n"
                     "def fn():\n    raise AssertionError('never traced')\n")
    out = ["--out", str(tmp_path / "run")] if command == "run" else ["-o", str(tmp_path / "plan")]
    try:
        rc = main([command, f"{model}:fn", "--cluster", str(tmp_path / "cluster.json"), *out, *args])
    except SystemExit as e:  # argparse's own check of the value
        rc = e.code
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and words in err, err
    assert not (tmp_path / "traced").exists() and not (tmp_path / "run").exists()


def test_bfloat16_gradients_from_two_consumers_are_summed_as_values():
    """Two parts' bf16 gradients of one tensor (uint16 bits on the wire) add as numbers: what the producer
    rounds back to bfloat16 equals autograd's bfloat16 accumulation of the two."""
    from fusion.executors.engines.torch.engine import from_wire, to_array
    from fusion.executors.runtime.part import grad_sum

    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(64, generator=g).to(torch.bfloat16) for _ in range(2))
    got = from_wire(grad_sum(to_array(a), to_array(b)), "bfloat16")
    assert got.dtype == torch.bfloat16 and torch.equal(got, a + b)
    np.testing.assert_array_equal(grad_sum(np.ones(3, np.float32), np.ones(3, np.float32)), 2 * np.ones(3))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("cuts", [(CUT_GELU,), CUTS_4], ids=["2-parts", "4-parts"])
def test_compnodes_in_real_processes_equal_one_process_autocast(gpt, want, tmp_path, cuts):
    """One executor process per part, plan.precision bf16: bf16 activations and gradients cross the wire."""
    from fusion.executors.runtime.launcher import hand_plan
    from fusion.plan import save_plan
    from tests.executors.dist_models import run_distributed

    _, model = gpt
    plan = hand_plan(model, _assign(model, cuts), micro_batches=N_MB, optimizer=OPT)
    plan.precision = "bf16"
    plan_dir = save_plan(plan, tmp_path / "plan", params=model.params)
    reports, state = run_distributed(plan_dir, tmp_path / "run", _batches(), want_grads=False)
    _check([r.loss for r in reports], state, want, rtol=1e-5, atol=1e-5)


def test_inbox_takes_bfloat16_bits_of_a_float32_edge_only_under_autocast(gpt):
    from fusion.executors.runtime.inbox import Inbox
    from fusion.executors.runtime.part import make_routes
    from fusion.ir.boundary import partition
    from fusion.ir.errors import WireError
    from fusion.ir.opdata import OpData

    _, model = gpt
    assign = _assign(model, (CUT_GELU,))
    inbox = Inbox(model.graph, "p1", make_routes(partition(model.graph, assign)["p1"], assign), N_MB, {})
    inbox.open = True
    bits = np.zeros((2, 16, 128), np.uint16)
    msg = lambda mb, payload: OpData("gelu", None, (), (), False, 0, mb, "p0", "p1", payload)  # noqa: E731
    with pytest.raises(WireError, match="payload uint16.*does not match the graph's float32"):
        inbox.accept("p0", msg(0, bits))
    inbox.autocast = True
    inbox.accept("p0", msg(0, bits))
    with pytest.raises(WireError, match="does not match"):  # a wrong shape is still refused
        inbox.accept("p0", msg(1, bits[:1]))

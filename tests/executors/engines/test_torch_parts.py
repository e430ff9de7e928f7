"""The torch engine's part options: compiled parts (one fx GraphModule per part),
``torch.compile`` of that module, and activation recomputation.

Compiled and interpreted parts run the same callables on the same tensors in
the same order, so they must agree bit for bit (losses, gradients, parameters),
not just within a tolerance. Recomputation reruns the forward in backward: also
bit-identical, and it must neither keep the autograd graph between forward and
backward, nor update BatchNorm statistics twice, nor change what a dropout draws.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fusion.executors.engines.select import make_engine_part
from fusion.executors.engines.torch import engine as torch_engine
from fusion.executors.reference import ReferenceExecutor
from fusion.ir.boundary import subgraph
from fusion.ir.builder import GraphBuilder
from fusion.ir.errors import FusionError
from tests.executors.test_equivalence import CASES, OPTIMIZERS, _assert_trains_like_pytorch, _model

INTERPRETED = {"*": {"compiled": False}}


def _run(model, assignment, options, batches, n_micro=3, schedule="1f1b", opt="adamw", seed=None):
    ex = ReferenceExecutor(model, assignment, OPTIMIZERS[opt], micro_batches=n_micro, schedule=schedule,
                           engine_options=options)
    out = []
    for i, b in enumerate(batches):
        if seed is not None:
            torch.manual_seed(seed + i)
        r = ex.step(b)
        out.append((r.loss, {k: v.copy() for k, v in r.grads.items()}))
    return ex, out


def _assert_same_bits(a, b):
    (ex_a, steps_a), (ex_b, steps_b) = a, b
    for (la, ga), (lb, gb) in zip(steps_a, steps_b):
        assert la == lb
        assert sorted(ga) == sorted(gb)
        for k in ga:
            np.testing.assert_array_equal(ga[k], gb[k], err_msg=k)
    sa, sb = ex_a.state(), ex_b.state()
    for k in sa:
        np.testing.assert_array_equal(sa[k], sb[k], err_msg=k)


@pytest.mark.parametrize("name", sorted(CASES))
def test_compiled_parts_are_bit_identical_to_the_interpreter(name):
    model = _model(name)
    split = CASES[name]["splits"][4](model.graph)
    batches = [CASES[name]["data"](6, seed=200 + i) for i in range(2)]
    compiled = _run(model, split, None, batches)
    assert all(e.compiled for e in compiled[0].engines.values())
    _assert_same_bits(compiled, _run(model, split, INTERPRETED, batches))


def _gpt():
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "examples" / "models" / "gpt.py"
    name = "fusion_examples_gpt_parts"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def test_traced_gpt_compiled_matches_interpreted_bit_for_bit():
    from fusion.ir.trace import trace

    gpt = _gpt()
    module, example = gpt.gpt_model(gpt.TINY, batch=2, seed=0)
    model = trace(module, example)
    names = list(model.graph.nodes)
    split = {n: ("p0" if i < len(names) // 2 else "p1") for i, n in enumerate(names)}
    g = torch.Generator().manual_seed(3)
    batches = [{k: torch.randint(0, gpt.TINY.vocab, (4, gpt.TINY.seq_len), generator=g) for k in example}
               for _ in range(2)]
    compiled = _run(model, split, None, batches, n_micro=2)
    p0 = compiled[0].engines["p0"]
    assert p0.compiled and "def forward" in p0.module.code  # one generated function per part
    _assert_same_bits(compiled, _run(model, split, INTERPRETED, batches, n_micro=2))


def test_a_part_fx_cannot_write_falls_back_to_the_interpreter(monkeypatch, caplog):
    from fusion.executors.engines.torch import compiled as compiled_mod

    def refuse(part):
        raise TypeError("not writable")

    monkeypatch.setattr(compiled_mod, "build_part_module", refuse)
    ex = _assert_trains_like_pytorch("fanout", 2, "gpipe", 1, "sgd")
    assert not any(e.compiled for e in ex.engines.values())
    assert "runs interpreted" in caplog.text and "not writable" in caplog.text


def test_engine_options_are_checked():
    model = _model("fanout")
    sub = subgraph(model.graph, list(model.graph.nodes))
    with pytest.raises(FusionError, match=r"engine 'numpy' has no option\(s\) \['compiled'\]"):
        make_engine_part("numpy", model.graph, sub, model.params, options={"compiled": True})
    with pytest.raises(FusionError, match=r"no option\(s\) \['fast'\].*'compiled', 'compile', 'recompute'"):
        make_engine_part("torch", model.graph, sub, model.params, options={"fast": True})
    # "*" reaches only engines that have the option: a NumPy part next to a torch part is fine
    b = GraphBuilder()
    h = b.module("fc1", "torch.nn.Linear", b.input("x"), in_features=6, out_features=8)
    h = b.module("fc2", "torch.nn.Linear", b.function("act", "torch.relu", h), in_features=8, out_features=5)
    b.loss("loss", "torch.nn.functional.cross_entropy", h, b.label("y"))
    mlp = b.build({"x": torch.zeros(2, 6), "y": torch.zeros(2, dtype=torch.long)}, seed=0)
    split = {n: ("p0" if n in ("x", "fc1") else "p1") for n in mlp.graph.nodes}
    ex = ReferenceExecutor(mlp, split, engines={"p1": "numpy"}, engine_options={"*": {"compiled": False}})
    assert not ex.engines["p0"].compiled
    ex.step({"x": torch.randn(4, 6), "y": torch.tensor([0, 1, 2, 3])})


# -- torch.compile ------------------------------------------------------------------------
def test_torch_compile_of_a_part_trains_like_plain_pytorch():
    """``compile=True``: Inductor's fused kernels, within the suite's tolerances (not bitwise)."""
    ex = _assert_trains_like_pytorch("fanout", 1, "gpipe", 1, "sgd", {"*": {"compile": True}})
    assert type(ex.engines["p0"]._fn).__name__ == "OptimizedModule"


# -- activation recomputation -----------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(CASES))
def test_recompute_trains_like_plain_pytorch(name):
    _assert_trains_like_pytorch(name, 4, "1f1b", 3, "adamw", {"*": {"recompute": True}})


@pytest.mark.parametrize("compiled", [True, False])
def test_recompute_is_bit_identical_and_keeps_only_part_inputs(compiled):
    model = _model("tied_mlp")
    split = CASES["tied_mlp"]["splits"][4](model.graph)
    batches = [CASES["tied_mlp"]["data"](6, seed=300 + i) for i in range(2)]
    plain = _run(model, split, {"*": {"compiled": compiled}}, batches)
    re = _run(model, split, {"*": {"compiled": compiled, "recompute": True}}, batches)
    _assert_same_bits(plain, re)
    # between forward and backward a recomputing part holds its inputs, no autograd graph
    part = re[0].engines["p1"]
    sent, _ = part.forward("mb", {k: np.ones(model.graph.output_meta(*k).shape, np.float32) for k in part.recv_keys}, {})
    st = part.stash["mb"]
    assert st.sent == {} and st.loss is None and st.feeds == {} and set(st.leaves) == set(part.recv_keys)
    assert all(v.grad_fn is None for v in st.leaves.values())
    grads = part.backward("mb", {k: np.ones_like(v) for k, v in sent.items()})
    assert set(grads) == set(part.recv_keys) and not part.stash


def _bn_dropout_model():
    b = GraphBuilder()
    x, y = b.input("x"), b.label("y")
    h = b.module("fc1", "torch.nn.Linear", x, in_features=6, out_features=8)
    h = b.module("bn", "torch.nn.BatchNorm1d", h, num_features=8)
    h = b.function("drop", "torch.nn.functional.dropout", h, p=0.5, training=True)
    o = b.module("head", "torch.nn.Linear", h, in_features=8, out_features=5)
    b.loss("loss", "torch.nn.functional.cross_entropy", o, y)
    return b.build({"x": torch.zeros(2, 6), "y": torch.zeros(2, dtype=torch.long)}, seed=0)


def test_recompute_replays_dropout_and_updates_batchnorm_statistics_once():
    model = _bn_dropout_model()
    split = {n: ("p0" if n in ("x", "fc1", "bn", "drop") else "p1") for n in model.graph.nodes}
    g = torch.Generator().manual_seed(5)
    batches = [{"x": torch.randn(6, 6, generator=g), "y": torch.randint(0, 5, (6,), generator=g)} for _ in range(3)]
    plain = _run(model, split, None, batches, opt="sgd", seed=11)
    re = _run(model, split, {"p0": {"recompute": True}}, batches, opt="sgd", seed=11)
    _assert_same_bits(plain, re)  # includes bn.running_mean / running_var / num_batches_tracked
    assert int(re[0].state()["bn.num_batches_tracked"]) == 3 * 3


# -- split backward (zero-bubble B and W) ---------------------------------------------------
def test_split_backward_uses_torch_param_groups_and_equals_the_full_backward():
    """B returns the input gradients and leaves parameter gradients alone; W adds them. A middle part
    goes through torch.distributed.pipelining's parameter groups (no VJP twice); the first part, which
    receives nothing needing a gradient, does all of its backward in W."""
    model = _model("tied_mlp")
    split = CASES["tied_mlp"]["splits"][4](model.graph)
    batch = CASES["tied_mlp"]["data"](6, seed=400)
    full = ReferenceExecutor(model, split, OPTIMIZERS["sgd"], micro_batches=3, schedule="1f1b")
    zb = ReferenceExecutor(model, split, OPTIMIZERS["sgd"], micro_batches=3, schedule="zb1")
    want, got = full.step(batch), zb.step(batch)
    assert got.loss == want.loss
    for k in want.grads:
        np.testing.assert_allclose(got.grads[k], want.grads[k], rtol=1e-6, atol=1e-7, err_msg=k)
    p1, p0 = zb.engines["p1"], zb.engines["p0"]
    ins = {k: np.ones(model.graph.output_meta(*k).shape, np.float32) for k in p1.recv_keys}
    sent, _ = p1.forward("mb", ins, {})
    g_in = p1.backward_input("mb", {k: np.ones_like(v) for k, v in sent.items()})
    assert set(g_in) == set(p1.recv_keys)
    assert all(p.grad is None for p in p1.trainable().values())  # W has not run
    assert p1.stash["mb"].weight.__name__ == "weight"  # the parameter-group path, not the fallback
    p1.backward_weight("mb")
    assert all(p.grad is not None for p in p1.trainable().values()) and not p1.stash
    with pytest.raises(RuntimeError, match="before its input gradient"):
        p1.backward_weight("mb")
    sent, _ = p0.forward("mb", {}, {"tok": batch["tok"][:2]})
    assert p0.backward_input("mb", {k: np.ones_like(v) for k, v in sent.items()}) == {}
    assert all(p.grad is None for p in p0.trainable().values())

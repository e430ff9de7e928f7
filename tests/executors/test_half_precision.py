"""bfloat16 and float16 models across parts equal plain PyTorch in the same precision.

NumPy has no bfloat16, so bfloat16 activations, gradients, parameters and
checkpoints travel as their raw uint16 bits and the torch engine views them
back by the graph's dtype; float32 data fed to a half-precision placeholder is
cast as ``x.to(dtype)`` would. Plain PyTorch is the same module trained with
gradient accumulation in the same dtype; the tolerances are those of the dtype.
"""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fusion.plan import OptimizerConfig
from fusion.executors.reference import ReferenceExecutor
from tests.executors.dist_models import run_distributed, save_hand_plan
from tests.executors.shared_setup import half_mlp

MB, N_MB, STEPS = 2, 2, 3


def _setup(dtype):
    return half_mlp(dtype, MB)


def _batches():
    out = []
    for s in range(STEPS):
        g = torch.Generator().manual_seed(s)
        out.append({"x": torch.randn(MB * N_MB, 8, generator=g).numpy(), "y": torch.randint(0, 4, (MB * N_MB,), generator=g).numpy()})
    return out


def _plain(net, dtype, opt_cfg):
    net = copy.deepcopy(net)
    opt = torch.optim.SGD(net.parameters(), lr=opt_cfg.lr, momentum=opt_cfg.momentum) if opt_cfg.name == "sgd" else \
        torch.optim.AdamW(net.parameters(), lr=opt_cfg.lr, weight_decay=opt_cfg.weight_decay)
    losses = []
    for b in _batches():
        opt.zero_grad()
        x, y = torch.from_numpy(b["x"]).to(dtype), torch.from_numpy(b["y"])
        loss = 0.0
        for i in range(N_MB):
            lc = net(x[i * MB:(i + 1) * MB], y[i * MB:(i + 1) * MB]) / N_MB
            lc.backward()
            loss += lc.item()
        opt.step()
        losses.append(loss)
    return losses, {k: v.detach().float().numpy() for k, v in net.state_dict().items()}


def _params_as_float(state: dict) -> dict:
    out = {}
    for k, v in state.items():
        v = np.asarray(v)
        out[k] = torch.from_numpy(v.view(np.int16)).view(torch.bfloat16).float().numpy() if v.dtype == np.uint16 else \
            v.astype(np.float32)
    return out


CASES = [(torch.bfloat16, OptimizerConfig("adamw", lr=0.01, weight_decay=0.1)),
         (torch.float16, OptimizerConfig("sgd", lr=0.05, momentum=0.9))]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("dtype, opt", CASES, ids=["bf16-adamw", "fp16-sgd"])
def test_reference_executor_every_cut(dtype, opt, schedule):
    net, model = _setup(dtype)
    want, want_params = _plain(net, dtype, opt)
    names = list(model.graph.nodes)
    for cut in range(3, len(names) - 1):
        assign = {n: "p0" if i < cut else "p1" for i, n in enumerate(names)}
        ex = ReferenceExecutor(model, assign, opt, micro_batches=N_MB, schedule=schedule)
        got = [ex.step(b).loss for b in _batches()]
        np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=f"losses, cut before {names[cut]}")
        state = _params_as_float({k: v for p in ex.engines.values() for k, v in p.state().items()})
        for k, v in want_params.items():
            np.testing.assert_array_equal(state[k], v, err_msg=f"{k}, cut before {names[cut]}")


@pytest.mark.timeout(180)
def test_bfloat16_on_two_compnodes(tmp_path):
    """Two processes: bf16 activations and gradients cross the wire as bits; the plan's weights are bf16."""
    dtype, opt = CASES[0]
    net, model = _setup(dtype)
    want, want_params = _plain(net, dtype, opt)
    names = list(model.graph.nodes)
    assign = {n: "p0" if i < names.index("tanh") else "p1" for i, n in enumerate(names)}
    plan_dir = save_hand_plan(tmp_path, model, assign, micro_batches=N_MB, optimizer=opt)
    reports, state = run_distributed(plan_dir, tmp_path / "run", _batches(), want_grads=False)
    np.testing.assert_allclose([r.loss for r in reports], want, rtol=1e-6)
    state = _params_as_float(state)
    for k, v in want_params.items():
        np.testing.assert_array_equal(state[k], v, err_msg=k)


def test_bfloat16_optimizer_state_survives_a_checkpoint_round_trip():
    """AdamW moments of bf16 parameters are saved as bits and read back bit for bit (resume needs this)."""
    from fusion.executors.engines.select import make_engine_part, make_optimizer
    from fusion.ir.boundary import partition

    dtype, opt = CASES[0]
    _, model = _setup(dtype)
    sub = partition(model.graph, {n: "p0" for n in model.graph.nodes})["p0"]
    part = make_engine_part("torch", model.graph, sub, model.params)
    o = make_optimizer("torch", part, opt)
    b = _batches()[0]
    part.forward(0, {}, {"x": b["x"][:MB], "y": b["y"][:MB]})
    part.backward(0, {}, 1.0)
    o.step()
    arrays, meta = o.state()
    assert any(v.dtype == np.uint16 for v in arrays.values())  # bf16 moments as bits
    fresh = make_optimizer("torch", make_engine_part("torch", model.graph, sub, model.params), opt)
    fresh.load_state(arrays, meta)
    back, _ = fresh.state()
    assert back.keys() == arrays.keys()
    for k in arrays:
        np.testing.assert_array_equal(back[k], arrays[k], err_msg=k)
    moments = [v for k, v in fresh.groups[0][0].state_dict()["state"][0].items() if k != "step"]  # adamw: one torch optimizer
    assert all(m.dtype == torch.bfloat16 for m in moments)


def test_numpy_engine_refuses_bfloat16_nodes_by_name():
    from fusion.ir.errors import GraphError

    dtype, opt = CASES[0]
    _, model = _setup(dtype)
    names = list(model.graph.nodes)
    assign = {n: "p0" if i < names.index("b") else "p1" for i, n in enumerate(names)}
    with pytest.raises(GraphError, match="node 'b'.*bfloat16 tensors are not supported"):
        ReferenceExecutor(model, assign, opt, micro_batches=N_MB, engines={"p1": "numpy"})


def test_bfloat16_edges_are_topk_compressed_by_magnitude():
    """A compressed bf16 edge sends the codec's Top-K of the bf16 tensor (bits in, bits out), and the
    receiving part computes with exactly that: the first loss equals plain PyTorch with the same Top-K."""
    from fusion.executors.runtime.compression import CompressionTable, densify
    from fusion.kernels.codec import compress, decompress
    from fusion.kernels.sparse import ratio_to_k
    from fusion.plan import EdgeCompression

    dtype, opt = CASES[0]
    net, model = _setup(dtype)
    names = list(model.graph.nodes)
    assign = {n: "p0" if i < names.index("tanh") else "p1" for i, n in enumerate(names)}
    edges = [EdgeCompression("gelu", None, "p0", "p1", 4.0, ("fwd", "bwd"))]
    table = CompressionTable.build("p0", edges, model.graph)
    h = torch.randn(2, 16).to(dtype)
    bits = h.view(torch.int16).numpy().view(np.uint16)
    k = ratio_to_k(h.numel(), 4.0)
    sp, cfg = table.encode(bits, ("gelu", None), "p1", False, 0)
    want = compress(h, k)
    assert sp.dtype == "bfloat16" and cfg["k"] == k == sp.k
    np.testing.assert_array_equal(sp.indices, want.indices)
    np.testing.assert_array_equal(sp.values, want.values)
    assert torch.equal(torch.from_numpy(densify(sp).view(np.int16)).view(dtype), decompress(want))

    ex = ReferenceExecutor(model, assign, opt, micro_batches=1, compression=edges)
    b = _batches()[0]
    got = ex.step({"x": b["x"][:MB], "y": b["y"][:MB]}).loss
    x, y = torch.from_numpy(b["x"][:MB]).to(dtype), torch.from_numpy(b["y"][:MB])
    with torch.no_grad():
        g = F.gelu(net.a(x))
        sent = decompress(compress(g, ratio_to_k(g.numel(), 4.0)))
        plain = F.cross_entropy(net.c(torch.tanh(net.b(g)) + sent).float(), y).item()
    assert got == pytest.approx(plain, rel=1e-6)

"""Top-K compression in the runtime: which messages change, what the receiver sees, what flows back.

"Bit-identical" here means: in the first iteration (same initial weights, same
batch), every forward message of the compressed run whose value does not
depend on the compressed edge (here: every forward message except the
compressed one) has exactly the bytes of the dense run's message, and the
compressed edge's receiver is handed exactly ``densify(topk(x))`` of the
dense run's ``x``. Backward messages downstream of the compressed activation
legitimately differ (the loss saw ``topk(x)``); the gradient sent back on the
compressed edge is checked against plain torch autograd w.r.t. ``y``.
"""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.executors.dist_models import CNN_SPLITS, branching_cnn, cnn_batch
from fusion.executors.runtime.compression import CompressionTable, densify, topk_numpy
from fusion.plan import OptimizerConfig
from fusion.executors.reference import ReferenceExecutor
from fusion.ir.errors import FusionError
from fusion.kernels.codec import compress
from fusion.kernels.sparse import ratio_to_k
from fusion.plan import EdgeCompression

SPLIT = CNN_SPLITS[4]  # p0: conv1 -> p1: relu_a, p2: tanh_b -> p3: add, fc, loss
EDGE = ("relu_a", None)


def _run(compression, steps=1, lr=0.0, mb=1, fixed=False):
    """Train; returns (executor, recorded OpData per step: list of lists, losses).

    lr=0: forward/backward only (no optimizer step), so weights never change."""
    model = branching_cnn(mb=2)
    ex = ReferenceExecutor(model, SPLIT, OptimizerConfig("sgd", lr=lr or 0.1), micro_batches=mb, compression=compression)
    log: list = []
    for part in ex.parts.values():
        fwd, bwd = part.forward, part.backward

        def f(*a, _fwd=fwd, **kw):
            out, loss = _fwd(*a, **kw)
            log.extend(out)
            return out, loss

        def b(*a, _bwd=bwd, **kw):
            out = _bwd(*a, **kw)
            log.extend(out)
            return out

        part.forward, part.backward = f, b
    steps_log, losses = [], []
    for s in range(steps):
        log.clear()
        losses.append(ex.step(cnn_batch(0 if fixed else s, 2)).loss if lr else ex.forward_backward(cnn_batch(0, 2)))
        steps_log.append(list(log))
    return ex, steps_log, losses


def _msg(msgs, key, is_grad, src, dst):
    (m,) = [m for m in msgs if m.key == key and m.is_grad == is_grad and m.src == src and m.dst == dst]
    return m


def _edge(ratio=10.0, directions=("fwd",), ef=False):
    return [EdgeCompression("relu_a", None, "p1", "p3", ratio, directions, ef)]


def test_numpy_topk_matches_the_codec():
    x = np.random.default_rng(0).standard_normal((4, 9, 11)).astype(np.float32)
    a, b = topk_numpy(x, 17), compress(torch.from_numpy(x), 17)
    assert np.array_equal(a.values, b.values) and np.array_equal(a.indices, b.indices)
    d = densify(a)
    assert d.dtype == np.float32 and np.count_nonzero(d) == 17 and np.array_equal(d[d != 0], x[d != 0])


def test_uncompressed_messages_are_byte_identical_and_the_receiver_sees_topk():
    _, (dense,), _ = _run(None)
    _, (comp,), _ = _run(_edge(10.0, ("fwd",)))
    fwd_dense = [m for m in dense if not m.is_grad]
    assert len(fwd_dense) == 5
    for m in fwd_dense:
        c = _msg(comp, m.key, False, m.src, m.dst)
        if m.key == EDGE and m.dst == "p3":
            k = ratio_to_k(m.payload.size, 10.0)
            assert c.compress_cfg == {"algo": "topk", "ratio": 10.0, "k": k}
            want = topk_numpy(m.payload, k)
            assert np.array_equal(c.payload.indices, want.indices) and np.array_equal(c.payload.values, want.values)
            assert c.payload.values.dtype == np.float32 and c.payload.indices.dtype == np.int32
        else:
            assert c.compress_cfg is None
            assert c.payload.dtype == m.payload.dtype and c.payload.tobytes() == m.payload.tobytes(), m.key
    # labels/inputs/losses are never messages here; gradients of uncompressed edges stay dense
    assert all(m.compress_cfg is None for m in comp if m.is_grad)


def _plain_grad_wrt_y(ex_params, batch, y_np):
    """dL/dy of the loss computed by plain torch with relu_a's output replaced by y."""
    P = {k: torch.tensor(np.array(v)) for k, v in ex_params.items()}
    x, lab = torch.tensor(batch["x"]), torch.tensor(batch["y"])
    h = F.conv2d(x, P["conv1.weight"], P["conv1.bias"], padding=1)
    c = torch.tanh(F.conv2d(h, P["conv_b.weight"], P["conv_b.bias"]))
    y = torch.tensor(y_np, requires_grad=True)
    s = (y + c) + h
    loss = F.cross_entropy(F.linear(torch.flatten(s, 1), P["fc.weight"], P["fc.bias"]), lab)
    loss.backward()
    return y.grad.numpy()


@pytest.mark.parametrize("directions", [("fwd",), ("fwd", "bwd")])
def test_gradient_of_a_compressed_activation_is_straight_through(directions):
    ex, (msgs,), _ = _run(_edge(10.0, directions))
    fwd = _msg(msgs, EDGE, False, "p1", "p3")
    y = densify(fwd.payload)
    g = _msg(msgs, EDGE, True, "p3", "p1")
    want = _plain_grad_wrt_y(ex.state(), cnn_batch(0, 2), y)  # lr=0: state == initial weights
    if "bwd" in directions:
        k = ratio_to_k(want.size, 10.0)
        assert g.compress_cfg == {"algo": "topk", "ratio": 10.0, "k": k}
        assert g.payload.k == k
        got = densify(g.payload)
        np.testing.assert_allclose(got[got != 0], want[got != 0], rtol=1e-5, atol=1e-8)
        # exactly the k largest |dL/dy|: the smallest kept magnitude >= the largest dropped one
        assert np.abs(want[got != 0]).min() >= np.abs(want[got == 0]).max() * (1 - 1e-5)
    else:
        assert g.compress_cfg is None
        # straight-through: dL/dy everywhere, not masked by the forward selection
        assert np.count_nonzero(g.payload) > np.count_nonzero(y)
        np.testing.assert_allclose(g.payload, want, rtol=1e-5, atol=1e-8)


def test_bwd_compression_is_topk_of_the_dense_gradient():
    _, (a,), _ = _run(_edge(10.0, ("fwd",)))
    _, (b,), _ = _run(_edge(10.0, ("fwd", "bwd")))
    dense_g = _msg(a, EDGE, True, "p3", "p1").payload
    sp = _msg(b, EDGE, True, "p3", "p1").payload
    want = topk_numpy(dense_g, ratio_to_k(dense_g.size, 10.0))
    assert np.array_equal(sp.indices, want.indices) and np.array_equal(sp.values, want.values)


def test_ratio_one_is_the_dense_run_bit_for_bit():
    ex_d, logs_d, loss_d = _run(None, steps=2, lr=0.1, mb=2)
    ex_c, logs_c, loss_c = _run(_edge(1.0, ("fwd", "bwd")), steps=2, lr=0.1, mb=2)
    assert loss_d == loss_c
    for n, v in ex_d.state().items():
        assert np.array_equal(v, ex_c.state()[n]), n
    assert all(m.compress_cfg is None for log in logs_c for m in log)


def test_training_with_a_compressed_edge_reduces_the_loss():
    # one fixed batch, fitted: the compressed run must drive the loss down like the dense one
    _, _, losses = _run(_edge(20.0, ("fwd", "bwd")), steps=15, lr=0.1, mb=2, fixed=True)
    _, _, dense = _run(None, steps=15, lr=0.1, mb=2, fixed=True)
    assert all(np.isfinite(losses)) and dense[-1] < 0.5 * dense[0]
    assert losses[-1] < 0.5 * losses[0], losses


def test_error_feedback_carries_the_residual_per_micro_batch_stream():
    # lr=0: the same tensor x is sent twice per micro-batch stream, so sent_0 + sent_1 + residual == 2x
    ex, logs, _ = _run(_edge(10.0, ("fwd",), ef=True), steps=2, lr=0.0, mb=2)
    _, dense, _ = _run(None, steps=1, lr=0.0, mb=2)
    table = ex.parts["p1"].compression
    for mb in range(2):
        sent = [densify(next(m for m in log if m.key == EDGE and not m.is_grad and m.micro_batch == mb).payload)
                for log in logs]
        x = next(m for m in dense[0] if m.key == EDGE and not m.is_grad and m.micro_batch == mb and m.dst == "p3").payload
        k = ratio_to_k(x.size, 10.0)
        np.testing.assert_array_equal(sent[0], densify(topk_numpy(x, k)))  # first message: plain Top-K
        res = table.residual(EDGE, "p3", "fwd", mb).numpy()
        np.testing.assert_allclose(sent[0] + sent[1] + res, 2 * x, rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(sent[1], densify(topk_numpy((x - sent[0]) + x, k)))
        assert not np.array_equal(sent[0], sent[1])  # the residual changed the second selection
    assert table.residual(EDGE, "p3", "bwd", 0) is None  # only "fwd" was asked for


def test_bad_compression_tables_are_rejected():
    model = branching_cnn(mb=2)
    with pytest.raises(FusionError, match="src 'p0' but the node runs on 'p1'"):
        ReferenceExecutor(model, SPLIT, compression=[EdgeCompression("relu_a", None, "p0", "p3", 10.0)])
    with pytest.raises(FusionError, match="unknown directions"):
        CompressionTable.build("p1", [EdgeCompression("relu_a", None, "p1", "p3", 10.0, ("up",))])
    with pytest.raises(FusionError, match="ratio 0.5 < 1"):
        CompressionTable.build("p1", [EdgeCompression("relu_a", None, "p1", "p3", 0.5)])


def test_distributed_run_compresses_like_the_reference(tmp_path):
    """Real executor processes over loopback: the plan's compression gives the reference executor's training."""
    from tests.executors.dist_models import run_distributed
    from fusion.executors.runtime.launcher import hand_plan
    from fusion.plan import save_plan

    model = branching_cnn(mb=2)
    comp = [EdgeCompression("relu_a", None, "p1", "p3", 10.0, ("fwd", "bwd"), True),
            EdgeCompression("conv1", None, "p0", "p2", 4.0, ("fwd",))]
    plan = hand_plan(model, SPLIT, micro_batches=2, optimizer=OptimizerConfig("sgd", lr=0.1))
    plan.compression = comp
    plan_dir = save_plan(plan, tmp_path / "plan", params=model.params)
    batches = [cnn_batch(s, 4) for s in range(3)]
    reports, state = run_distributed(plan_dir, tmp_path / "run", batches, want_grads=False)
    ref = ReferenceExecutor(branching_cnn(mb=2), SPLIT, OptimizerConfig("sgd", lr=0.1), micro_batches=2, compression=comp)
    for r, b in zip(reports, batches):
        np.testing.assert_allclose(r.loss, ref.step(b).loss, rtol=1e-5)
    for n, v in ref.state().items():
        np.testing.assert_allclose(state[n], v, rtol=1e-4, atol=1e-6)


def test_encode_and_densify_do_not_import_torch():
    """A NumPy-engine CompNode compresses and decodes without torch (error feedback aside)."""
    import subprocess
    import sys

    code = ("import sys, numpy as np\n"
            "import fusion.executors.runtime.part, fusion.executors.runtime.inbox, fusion.ir.wire\n"
            "from fusion.executors.runtime.compression import CompressionTable, densify\n"
            "from fusion.plan import EdgeCompression\n"
            "t = CompressionTable.build('p0', [EdgeCompression('a', None, 'p0', 'p1', 4.0)])\n"
            "p, cfg = t.encode(np.arange(20, dtype=np.float32), ('a', None), 'p1', False, 0)\n"
            "assert cfg['k'] == 5 and densify(p)[-5:].tolist() == [15, 16, 17, 18, 19]\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"

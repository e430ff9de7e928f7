"""The NumPy engine: torch-free imports, every op's forward and VJP against torch
autograd, its optimizers against torch.optim, and mixed torch/NumPy parts
training an op-node model exactly like plain PyTorch."""
import subprocess
import sys

import numpy as np
import pytest
import torch

from fusion.executors.engines.numpy.engine import OPS, NumpyPart, supports
from fusion.executors.engines.numpy.optim import NumpyOptimizer
from fusion.ir.boundary import subgraph
from fusion.ir.onnx.semantics import ONNX_OPS
from fusion.executors.engines.torch.optimizer import torch_optimizer
from fusion.plan import OptimizerConfig
from fusion.executors.reference import ReferenceExecutor
from fusion.ir.errors import GraphError
from fusion.ir.registry import REGISTRY

from tests.executors.opnode_models import ASSIGN, T, V, Plain, opnode_model


def test_numpy_engine_import_chain_has_no_torch():
    code = ("import sys; import fusion.executors.engines.numpy.engine, fusion.executors.engines.select, fusion.executors.runtime.part; "
            "import fusion.ir.onnx.ops; assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_supports_answers_from_the_op_table():
    assert supports("torch.nn.Linear") and supports("onnx.Gemm") and supports("torch.nn.functional.gelu")
    assert not supports("torch.nn.Conv2d") and not supports("onnx.Conv")


# -- per-op forward and VJP against torch autograd ---------------------------------------------------

R = np.random.default_rng(0)


def f32(*shape, positive=False):
    a = R.standard_normal(shape).astype(np.float32)
    return np.abs(a) + 0.5 if positive else a


def ints(high, *shape):
    return R.integers(0, high, shape).astype(np.int64)


#: (target, positional args, kwargs); float arrays get gradients
FUNCTION_CASES = [
    ("operator.add", (f32(3, 4), f32(4)), {}),
    ("operator.sub", (f32(3, 1), f32(3, 4)), {}),
    ("operator.mul", (f32(2, 3, 4), f32(3, 1)), {}),
    ("operator.truediv", (f32(3, 4), f32(4, positive=True)), {}),
    ("operator.matmul", (f32(2, 3, 4), f32(4, 5)), {}),
    ("torch.matmul", (f32(4), f32(2, 4, 3)), {}),
    ("torch.nn.functional.linear", (f32(2, 3, 4), f32(5, 4), f32(5)), {}),
    ("torch.nn.functional.gelu", (f32(3, 5),), {}),
    ("torch.nn.functional.gelu", (f32(3, 5),), {"approximate": "tanh"}),
    ("torch.relu", (f32(3, 5),), {}),
    ("torch.tanh", (f32(3, 5),), {}),
    ("torch.sigmoid", (f32(3, 5),), {}),
    ("torch.nn.functional.softmax", (f32(2, 3, 5),), {"dim": -1}),
    ("torch.nn.functional.log_softmax", (f32(2, 5),), {"dim": 1}),
    ("torch.nn.functional.layer_norm", (f32(2, 3, 6), [6], f32(6), f32(6)), {"eps": 1e-5}),
    ("torch.nn.functional.cross_entropy", (f32(6, 5), ints(5, 6)), {}),
    ("torch.nn.functional.cross_entropy", (f32(3, 5, 2), ints(5, 3, 2)), {"reduction": "sum"}),
    ("torch.nn.functional.mse_loss", (f32(3, 4), f32(3, 4)), {}),
    ("torch.nn.functional.embedding", (ints(7, 2, 3), f32(7, 4)), {}),
    ("torch.Tensor.view", (f32(2, 6), 3, 4), {}),
    ("torch.Tensor.reshape", (f32(2, 6), (4, -1)), {}),
    ("torch.Tensor.transpose", (f32(2, 3, 4), 1, 2), {}),
    ("torch.Tensor.permute", (f32(2, 3, 4), 2, 0, 1), {}),
    ("torch.flatten", (f32(2, 3, 4), 1), {}),
    ("onnx.Gemm", (f32(3, 4), f32(5, 4), f32(5)), {"transB": 1}),
    ("onnx.Gemm", (f32(4, 3), f32(4, 5), f32(1, 5)), {"transA": 1, "alpha": 0.5, "beta": 2.0}),
    ("onnx.MatMul", (f32(2, 2, 3, 4), f32(2, 2, 4, 3)), {}),
    ("onnx.Add", (f32(2, 3), f32(3)), {}), ("onnx.Sub", (f32(2, 3), f32(2, 1)), {}),
    ("onnx.Mul", (f32(2, 3), f32(1, 3)), {}), ("onnx.Div", (f32(2, 3), f32(3, positive=True)), {}),
    ("onnx.Pow", (f32(2, 3, positive=True), f32(2, 3)), {}),
    ("onnx.Relu", (f32(4, 3),), {}), ("onnx.Tanh", (f32(4, 3),), {}), ("onnx.Sigmoid", (f32(4, 3),), {}),
    ("onnx.Gelu", (f32(4, 3),), {"approximate": "none"}), ("onnx.Erf", (f32(4, 3),), {}),
    ("onnx.Sqrt", (f32(4, 3, positive=True),), {}), ("onnx.Exp", (f32(4, 3),), {}),
    ("onnx.Log", (f32(4, 3, positive=True),), {}), ("onnx.Neg", (f32(4, 3),), {}),
    ("onnx.Softmax", (f32(2, 3, 4),), {"axis": 1}), ("onnx.LogSoftmax", (f32(2, 4),), {"axis": -1}),
    ("onnx.LayerNormalization", (f32(2, 3, 4), f32(3, 4), f32(3, 4)), {"axis": 1, "epsilon": 1e-5}),
    ("onnx.Gather", (f32(7, 4), ints(7, 2, 3)), {"axis": 0}),
    ("onnx.Gather", (f32(3, 5, 2), np.array([4, -1, 0])), {"axis": 1}),
    ("onnx.Reshape", (f32(2, 3, 4), [0, -1]), {}),
    ("onnx.Transpose", (f32(2, 3, 4),), {"perm": [1, 2, 0]}),
    ("onnx.Flatten", (f32(2, 3, 4),), {"axis": 2}),
    ("onnx.Unsqueeze", (f32(2, 3), [0, -1]), {}), ("onnx.Squeeze", (f32(2, 1, 3, 1), [1, 3]), {}),
    ("onnx.Expand", (f32(3, 1), [2, 3, 4]), {}),
    ("onnx.Concat", (f32(2, 3), f32(2, 1), f32(2, 2)), {"axis": 1}),
    ("onnx.Split", (f32(2, 6), [1, 2, 3]), {"axis": 1}),
    ("onnx.Split", (f32(5, 2),), {"axis": 0, "num_outputs": 2}),
    ("onnx.SplitToSequence", (f32(2, 7), 3), {"axis": 1}),
    ("onnx.Slice", (f32(4, 6, 5), [1, -1], [3, 0], [0, 1], [1, -2]), {}),
    ("onnx.Slice", (f32(4, 6), [0], [10 ** 9], [1], [2]), {}),
    ("onnx.Where", (f32(3, 4) > 0, f32(3, 4), f32(4)), {}),
    ("onnx.ReduceMean", (f32(2, 3, 4), [1, 2]), {"keepdims": 1}),
    ("onnx.ReduceSum", (f32(2, 3, 4), [-1]), {"keepdims": 0}),
    ("onnx.Cast", (f32(2, 3),), {"to": 11}),
    ("onnx.Identity", (f32(2, 3),), {}),
    ("onnx.SoftmaxCrossEntropyLoss", (f32(6, 5), ints(5, 6)), {"reduction": "mean"}),
]


def _torch_fn(target):
    if target.startswith("onnx."):
        return ONNX_OPS[target[5:]]
    call, obj = REGISTRY.resolve(target)
    return (lambda x, *a, **k: getattr(x, obj)(*a, **k)) if call == "method" else obj


def _is_grad_input(a):
    return isinstance(a, np.ndarray) and np.issubdtype(a.dtype, np.floating)


@pytest.mark.parametrize("target,args,kwargs", FUNCTION_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(FUNCTION_CASES)])
def test_op_forward_and_vjp_match_torch_autograd(target, args, kwargs):
    assert supports(target)
    t_args = [torch.tensor(a, requires_grad=_is_grad_input(a)) if isinstance(a, np.ndarray) else a for a in args]
    t_out = _torch_fn(target)(*t_args, **kwargs)
    outs = t_out if isinstance(t_out, tuple) else (t_out,)
    seeds = [torch.randn(o.shape, generator=torch.Generator().manual_seed(i), dtype=o.dtype) for i, o in enumerate(outs)]
    np_out, ctx = OPS[target].fwd(*args, **kwargs)
    np_outs = np_out if isinstance(np_out, tuple) else (np_out,)
    for a, b in zip(np_outs, outs):
        np.testing.assert_allclose(a, b.detach().numpy(), rtol=1e-5, atol=1e-6)
    if not any(o.requires_grad for o in outs):
        return
    torch.autograd.backward([o for o in outs if o.requires_grad], [s for o, s in zip(outs, seeds) if o.requires_grad])
    g = tuple(s.numpy() for s in seeds) if isinstance(np_out, tuple) else seeds[0].numpy()
    grads = OPS[target].vjp(ctx, g)
    for i, a in enumerate(t_args):
        if isinstance(a, torch.Tensor) and a.requires_grad:
            assert i in grads, f"no gradient for input {i}"
            np.testing.assert_allclose(grads[i], a.grad.numpy(), rtol=1e-4, atol=1e-5, err_msg=f"input {i}")


MODULE_CASES = [
    ("torch.nn.Linear", {"in_features": 4, "out_features": 3}, (f32(2, 5, 4),)),
    ("torch.nn.Linear", {"in_features": 4, "out_features": 3, "bias": False}, (f32(2, 4),)),
    ("torch.nn.Embedding", {"num_embeddings": 9, "embedding_dim": 4, "padding_idx": 0}, (ints(9, 3, 5),)),
    ("torch.nn.LayerNorm", {"normalized_shape": [6], "eps": 1e-5}, (f32(2, 3, 6),)),
    ("torch.nn.GELU", {"approximate": "tanh"}, (f32(3, 4),)),
]


@pytest.mark.parametrize("target,attrs,args", MODULE_CASES, ids=[c[0] for c in MODULE_CASES])
def test_module_op_forward_and_vjp_match_torch(target, attrs, args):
    torch.manual_seed(0)
    mod = REGISTRY.resolve(target)[1](**attrs)
    with torch.no_grad():
        for p in mod.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    t_args = [torch.tensor(a, requires_grad=_is_grad_input(a)) for a in args]
    out = mod(*t_args)
    seed = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    out.backward(seed)
    params = {n: p.detach().numpy().copy() for n, p in mod.named_parameters()}
    y, ctx = OPS[target].fwd(params, attrs, *args)
    np.testing.assert_allclose(y, out.detach().numpy(), rtol=1e-5, atol=1e-6)
    grads = OPS[target].vjp(ctx, seed.numpy())
    for n, p in mod.named_parameters():
        np.testing.assert_allclose(grads[n], p.grad.numpy(), rtol=1e-4, atol=1e-5, err_msg=n)
    for i, a in enumerate(t_args):
        if a.requires_grad:
            np.testing.assert_allclose(grads[i], a.grad.numpy(), rtol=1e-4, atol=1e-5)


# -- optimizers -------------------------------------------------------------------------------------

@pytest.mark.parametrize("cfg", [OptimizerConfig("sgd", lr=0.1), OptimizerConfig("sgd", lr=0.05, momentum=0.9, weight_decay=0.01),
                                 OptimizerConfig("adamw", lr=0.01), OptimizerConfig("adamw", lr=0.02, weight_decay=0.1, betas=(0.8, 0.99))])
def test_numpy_optimizers_follow_torch_formulas(cfg):
    class Holder:  # the slice of a NumpyPart an optimizer drives
        def __init__(self):
            self.params = {"w": f32(5, 3), "b": f32(3)}
            self.trainable_names = ["w", "b"]
            self._g = {}

        def grads(self):
            return self._g

        def zero_grad(self):
            self._g = {}

    h = Holder()
    tp = {n: torch.nn.Parameter(torch.tensor(v)) for n, v in h.params.items()}
    opt_np, opt_t = NumpyOptimizer(cfg, h), torch_optimizer(cfg, tp.values())
    for step in range(4):
        for n in h.params:
            g = R.standard_normal(h.params[n].shape).astype(np.float32)
            h._g[n] = g
            tp[n].grad = torch.tensor(g)
        opt_np.step()
        opt_t.step()
        for n in h.params:
            np.testing.assert_allclose(h.params[n], tp[n].detach().numpy(), rtol=1e-6, atol=1e-7, err_msg=f"{n} step {step}")


# -- mixed engines on an op-node model ------------------------------------------------------------------

@pytest.mark.parametrize("engines", [{"A": "torch", "B": "numpy"}, {"A": "numpy", "B": "torch"}, {"A": "numpy", "B": "numpy"}],
                         ids=["torch-numpy", "numpy-torch", "numpy-numpy"])
@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_mixed_engine_parts_train_like_pytorch(engines, opt_name):
    model = opnode_model()
    ref = Plain()
    ref.load_state_dict({k: torch.as_tensor(v) for k, v in model.params.items()})
    cfg = OptimizerConfig(opt_name, lr=0.05, momentum=0.9 if opt_name == "sgd" else 0.0, weight_decay=0.01)
    opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01) if opt_name == "sgd" else \
        torch.optim.AdamW(ref.parameters(), lr=0.05, weight_decay=0.01)
    ex = ReferenceExecutor(model, ASSIGN, cfg, micro_batches=2, schedule="1f1b", engines=engines)
    assert {p: e.engine for p, e in ex.engines.items()} == engines
    assert ex.shared == {"wte.weight": ["A", "B"]}  # tied across engines: gradients summed before the step
    g = torch.Generator().manual_seed(4)
    X, Y = torch.randint(0, V, (4, T), generator=g), torch.randint(0, V, (4, T), generator=g)
    for step in range(3):
        r = ex.step({"idx": X, "y": Y})
        opt.zero_grad()
        loss = sum(ref(a, b) for a, b in zip(X.chunk(2), Y.chunk(2))) / 2
        loss.backward()
        np.testing.assert_allclose(r.loss, loss.item(), rtol=1e-5)
        for n, p in ref.named_parameters():
            np.testing.assert_allclose(r.grads[n], p.grad.numpy(), rtol=1e-4, atol=1e-6, err_msg=f"{n} step {step}")
        opt.step()
    state = ex.state()
    for n, p in ref.named_parameters():
        np.testing.assert_allclose(state[n], p.detach().numpy(), rtol=1e-4, atol=1e-6)


def test_numpy_part_rejects_what_it_cannot_build():
    model = opnode_model()
    sub = subgraph(model.graph, model.graph.nodes)
    with pytest.raises(GraphError, match="runs on the CPU"):
        NumpyPart(model.graph, sub, model.params, device="cuda")
    with pytest.raises(GraphError, match="no initial value for parameter"):
        NumpyPart(model.graph, sub, {})


def test_numpy_forward_errors_name_the_node():
    """The NumPy engine's graph walk: an op that fails, or a placeholder without data, is a GraphError naming it."""
    from fusion.ir.builder import GraphBuilder

    b = GraphBuilder()
    b.output("y", b.module("fc", "torch.nn.Linear", b.input("x"), in_features=4, out_features=3))
    model = b.build({"x": torch.zeros(2, 4)})
    part = NumpyPart(model.graph, subgraph(model.graph, model.graph.nodes), model.params)
    with pytest.raises(GraphError, match=r"^node 'fc': numpy engine failed on torch.nn.Linear: ValueError"):
        part.forward(0, {}, {"x": np.zeros((2, 5), np.float32)})
    with pytest.raises(GraphError, match="^node 'x': no data fed to this placeholder"):
        part.forward(0, {}, {})
    out, loss = part.forward(0, {}, {"x": np.ones((2, 4), np.float32)})
    assert out == {} and loss is None  # nothing sent, no loss node
    assert part.stash[0].needs_grad == {"fc", "y"} and set(part.stash[0].ctx) == {"fc", "y"}  # both depend on fc's weights

"""What torch.export produces for real models, handled by the export front end:
grad-mode and autocast regions (higher-order ops over submodules), in-place
writes into views of fresh tensors, every argument type in the plan encoding,
and one-line errors for what still cannot be traced."""
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fusion.plan import OptimizerConfig
from fusion.executors.reference import ReferenceExecutor, contiguous_parts
from fusion.ir.errors import GraphError
from fusion.ir.serialize import decode_value, encode_value, graph_from_dict, graph_to_dict
from fusion.ir.trace import trace


class NoGradRegion(nn.Module):
    """A no-grad region that reads a trainable weight: that weight must get no gradient."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.register_buffer("table", torch.arange(4.0))

    def forward(self, x, y):
        h = self.a(x)
        with torch.no_grad():
            z = self.b(h) * 2 + self.table
        with torch.autocast("cpu", enabled=False):
            w = torch.tanh(h)
        return F.mse_loss(h * z + w, y)


class ShiftRight(nn.Module):
    """T5's ``_shift_right``: writes into slices of a fresh tensor, then reads it."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.fc = nn.Linear(4, 10)

    def forward(self, ids, y):
        shifted = ids.new_zeros(ids.shape)
        shifted[..., 1:] = ids[..., :-1].clone()
        shifted[..., 0] = 3
        shifted.masked_fill_(shifted == 9, 0)
        h = self.emb(shifted)
        return F.cross_entropy(self.fc(h).flatten(0, 1), y.flatten())


class AutocastOn(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(4, 4))
        self.head = _AutocastHead()

    def forward(self, x):
        return self.head(self.inner(x)).sum()


class _AutocastHead(nn.Module):
    def forward(self, h):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return h @ h.transpose(0, 1)


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = _Branchy()

    def forward(self, x):
        return self.block(x).sum()


class _Branchy(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # control flow on a tensor value
            return x * 2
        return x


def _train_like_pytorch(make, example, labels, n_parts, steps=2, **options):
    torch.manual_seed(0)
    model = trace(make(), example, labels=labels, **options)
    g2 = graph_from_dict(json.loads(json.dumps(graph_to_dict(model.graph))))
    model.graph = g2
    cfg = OptimizerConfig("sgd", lr=0.1)
    ex = ReferenceExecutor(model, contiguous_parts(model, n_parts), cfg)
    torch.manual_seed(0)
    ref = make()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(steps):
        r = ex.step(example)
        opt.zero_grad(set_to_none=True)
        loss = ref(**example)
        loss.backward()
        want = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
        np.testing.assert_allclose(r.loss, loss.item(), rtol=1e-5)
        assert set(want) <= set(r.grads)
        for n in set(r.grads) - set(want):  # read only under no_grad: no gradient reaches them
            assert not np.any(r.grads[n]), n
        for n, g in want.items():
            np.testing.assert_allclose(r.grads[n], g.numpy(), rtol=1e-4, atol=1e-7, err_msg=n)
        opt.step()
    return model


@pytest.mark.parametrize("method", ["fx", "export"])
@pytest.mark.parametrize("n_parts", [1, 3])
def test_no_grad_and_autocast_regions_keep_their_meaning(n_parts, method):
    """export: the regions are higher-order ops, inlined; fx: traced through, the tracer notes the grad mode."""
    ex = {"x": torch.randn(3, 4), "y": torch.randn(3, 4)}
    model = _train_like_pytorch(NoGradRegion, ex, ("y",), n_parts, method=method)
    targets = {n.target for n in model.graph.nodes.values()}
    assert {"fx": "torch.Tensor.detach", "export": "aten.detach.default"}[method] in targets  # the region's output
    assert not model.graph.params["table"].trainable
    # b's weight is read only inside the no-grad region: plain PyTorch gives it no gradient, nor do we
    assert model.graph.params["b.weight"].trainable


@pytest.mark.parametrize("n_parts", [1, 2])
def test_in_place_writes_into_views_of_a_fresh_tensor_are_functionalised(n_parts):
    g = torch.Generator().manual_seed(0)
    ex = {"ids": torch.randint(0, 10, (2, 5), generator=g), "y": torch.randint(0, 10, (2, 5), generator=g)}
    model = _train_like_pytorch(ShiftRight, ex, ("y",), n_parts)
    targets = {n.target for n in model.graph.nodes.values()}
    assert "aten.slice_scatter.default" in targets and not any(t.endswith("_.default") for t in targets)


def test_enabled_autocast_is_refused_in_one_line_naming_the_module():
    with pytest.raises(GraphError) as e:
        trace(AutocastOn(), {"x": torch.randn(2, 4)})
    msg = str(e.value)
    assert "\n" not in msg and "autocast" in msg and "'head'" in msg


def test_untraceable_model_fails_in_one_line_naming_construct_and_module():
    with pytest.raises(GraphError) as e:
        trace(DataDependent(), {"x": torch.randn(2, 4)})
    msg = str(e.value)
    assert "\n" not in msg, msg
    assert "block" in msg and "tensor value" in msg, msg
    assert "torch.fx failed" not in msg  # one reason, not a chain of two tracers' errors


@pytest.mark.parametrize("value", [
    torch.strided, torch.sparse_coo, torch.channels_last, torch.contiguous_format, torch.preserve_format,
    torch.device("cpu"), torch.float16, torch.bfloat16, torch.bool, torch.int64, torch.uint8, torch.complex64,
    float("inf"), float("-inf"), 1 + 2j, slice(1, None, 2), Ellipsis, (1, [2, (3,)]), {"$k": 1}, torch.Size([2, 3]),
])
def test_every_argument_type_export_produces_round_trips(value):
    back = decode_value(json.loads(json.dumps(encode_value(value))))
    want = tuple(value) if isinstance(value, torch.Size) else value
    assert back == want and type(back) is type(want)


def test_symbolic_ints_save_as_their_value_or_are_refused():
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    sym = env.create_symintnode(env.create_symbol(5, ConstantSource("s")), hint=5)
    with pytest.raises(GraphError, match="symbolic value"):
        encode_value(sym, "n")
    fixed = env.create_symintnode(5, hint=5)  # a constant expression: the value is known
    assert encode_value(fixed) == 5 if isinstance(fixed, torch.SymInt) else fixed == 5


def test_export_graph_with_layout_and_dtype_arguments_saves():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            h = self.fc(x).to(device=x.device, dtype=torch.float64)
            h = h.clone(memory_format=torch.contiguous_format) + torch.zeros_like(h, layout=torch.strided)
            return h.to(torch.float32).sum()

    model = trace(M(), {"x": torch.randn(2, 4)}, method="export", granularity="op")
    d = json.loads(json.dumps(graph_to_dict(model.graph)))
    text = json.dumps(d)
    assert "$layout" in text and "$memfmt" in text and "$device" in text and "$dtype" in text
    assert graph_to_dict(graph_from_dict(d)) == graph_to_dict(model.graph)

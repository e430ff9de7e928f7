"""A first end-to-end check: op-node model, partitioned reference run == plain PyTorch."""
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fusion.plan import OptimizerConfig
from fusion.executors.reference import ReferenceExecutor
from fusion.ir.builder import GraphBuilder


def _model():
    b = GraphBuilder()
    x, y = b.input("x"), b.label("y")
    h = b.module("conv1", "torch.nn.Conv2d", x, in_channels=3, out_channels=4, kernel_size=3, padding=1)
    h2 = b.module("conv2", "torch.nn.Conv2d", h, in_channels=4, out_channels=4, kernel_size=3, padding=1)
    h = b.function("add", "operator.add", h, h2)
    h = b.function("flat", "torch.flatten", h, 1)
    o = b.module("fc", "torch.nn.Linear", h, in_features=4 * 6 * 6, out_features=5)
    b.loss("loss", "torch.nn.functional.cross_entropy", o, y)
    return b.build(example={"x": torch.randn(2, 3, 6, 6), "y": torch.randint(0, 5, (2,))}, seed=0)


class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.conv2, self.fc = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1), nn.Linear(144, 5)

    def forward(self, x, y):
        h = self.conv1(x)
        return F.cross_entropy(self.fc(torch.flatten(h + self.conv2(h), 1)), y)


def test_skip_connection_across_three_parts_matches_pytorch():
    model = _model()
    assign = {"x": "a", "conv1": "a", "conv2": "b", "y": "c", "add": "c", "flat": "c", "fc": "c", "loss": "c"}
    ex = ReferenceExecutor(model, assign, OptimizerConfig("sgd", lr=0.1), micro_batches=2, schedule="1f1b")
    ref = Plain()
    ref.load_state_dict({k: torch.as_tensor(v) for k, v in model.params.items()})
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    X, Y = torch.randn(4, 3, 6, 6, generator=g), torch.randint(0, 5, (4,), generator=g)
    for _ in range(3):
        r = ex.step({"x": X, "y": Y})
        opt.zero_grad()
        loss = sum(ref(a, b) for a, b in zip(X.chunk(2), Y.chunk(2))) / 2
        loss.backward()
        np.testing.assert_allclose(r.loss, loss.item(), rtol=1e-5)
        for n, p in ref.named_parameters():
            np.testing.assert_allclose(r.grads[n], p.grad.numpy(), rtol=1e-4, atol=1e-6)
        opt.step()

"""FusionLLM Figure 7: a two-layer CNN with a user-registered ``CustomReLU``,
defined node by node with the op-node API.

    fusion graph examples/cnn_fig7.py:model      # print the OP-DAG
    python examples/cnn_fig7.py                  # print it and train 3 steps

The paper's version uses 64 channels; this one keeps the same structure at a
size that runs in milliseconds on a CPU (``channels`` changes it). The graph:

    x ─► conv1 ─► myrelu ─► conv2 ─► relu2 ─► pool ─► flat ─► fc ─► loss ◄─ y

``TwoLayerNet`` is the same model as a plain ``torch.nn.Module`` whose
parameter names equal the graph's (``conv1.weight``, ...), so
``TwoLayerNet().load_state_dict(model().params)`` gives an identical twin;
the equivalence tests train both and compare.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import fusion
from fusion.ir.builder import GraphBuilder
from fusion.ir.model import Model

IMAGE = 8  #: input height and width
CLASSES = 10


@fusion.register_module("CustomReLU")
class CustomReLU(nn.Module):
    """Figure 7's custom activation: keeps values above -1, zeroes the rest."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return torch.where(input > -1, input, torch.zeros_like(input))


def example_batch(batch: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
    """Synthetic images and labels (no data set is downloaded)."""
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(batch, 3, IMAGE, IMAGE, generator=g), "y": torch.randint(0, CLASSES, (batch,), generator=g)}


def build(channels: int = 8, batch: int = 4, seed: int = 0, device: str = "cpu") -> Model:
    """The Figure 7 CNN as an OP-DAG with initial weights drawn from ``seed``."""
    b = GraphBuilder()
    x = b.input("x", label="images")
    y = b.label("y", label="class ids")
    h = b.module("conv1", "torch.nn.Conv2d", x, in_channels=3, out_channels=channels,
                 kernel_size=3, padding=1, stride=1, label="first layer")
    h = b.module("myrelu", CustomReLU, h, label="user-registered activation")
    h = b.module("conv2", "torch.nn.Conv2d", h, in_channels=channels, out_channels=channels,
                 kernel_size=3, padding=1, stride=1, label="second layer")
    h = b.function("relu2", "torch.nn.functional.relu", h)
    h = b.function("pool", "torch.nn.functional.max_pool2d", h, 2)
    h = b.function("flat", "torch.flatten", h, 1)
    logits = b.module("fc", "torch.nn.Linear", h, in_features=channels * (IMAGE // 2) ** 2, out_features=CLASSES,
                      label="classifier head")
    b.loss("loss", "torch.nn.functional.cross_entropy", logits, y, label="cross-entropy")
    return b.build(example=example_batch(batch, seed), seed=seed, device=device)


def model() -> Model:
    """Entry point for ``fusion graph examples/cnn_fig7.py:model``."""
    return build()


class TwoLayerNet(nn.Module):
    """The same network as a plain PyTorch module (same parameter names)."""

    def __init__(self, channels: int = 8):
        super().__init__()
        self.conv1 = nn.Conv2d(3, channels, kernel_size=3, padding=1, stride=1)
        self.myrelu = CustomReLU()
        self.conv2 = nn.Conv2d(channels, channels, kernel_size=3, padding=1, stride=1)
        self.fc = nn.Linear(channels * (IMAGE // 2) ** 2, CLASSES)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.conv2(self.myrelu(self.conv1(x))))
        h = torch.flatten(F.max_pool2d(h, 2), 1)
        return F.cross_entropy(self.fc(h), y)


def main() -> None:
    from fusion.plan import OptimizerConfig
    from fusion.executors.reference import ReferenceExecutor

    m = model()
    g = m.graph
    print(f"{len(g.nodes)} nodes, {len(g.params)} parameters")
    for n in g.nodes.values():
        shapes = ", ".join(str(list(o.shape)) for o in n.meta.outputs if hasattr(o, "shape"))
        print(f"  {n.name:8s} {n.kind.value:8s} {n.target:36s} {shapes:18s} {n.label}")
    ex = ReferenceExecutor(m, optimizer=OptimizerConfig("sgd", lr=0.1, momentum=0.9), micro_batches=2)
    batch = example_batch(8, seed=1)
    for step in range(3):
        print(f"step {step}: loss {ex.step(batch).loss:.4f}")


if __name__ == "__main__":
    main()

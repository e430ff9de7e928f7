"""A branching CNN with skip connections, defined with the op-node API.

    fusion graph examples/branching_cnn.py:model
    python examples/branching_cnn.py             # print the graph, train 3 steps

The graph (every arrow is a tensor edge; ``+`` adds, ``cat`` concatenates channels):

    x ─► stem ─► stem_act ─┬─► a_conv1 ─► a_act ─► a_conv2 ─┐
                           │                                 + ─► merge_act ─┐
                           ├─► b_conv ───────────────────────┘               cat ─► pool ─► flat ─► head ─► loss ◄─ y
                           └─────────────────── (skip) ──────────────────────┘

``stem_act`` feeds three consumers, so when the two branches and the head
land on different parts its output crosses two part boundaries and its
gradient comes back from several parts and must be summed.

No BatchNorm, on purpose: BatchNorm normalises with the statistics of the
batch it sees, so a model trained on micro-batches is a different function
from one trained on the full batch, and the running-statistics buffers are
updated per micro-batch. Our equivalence tests compare against plain PyTorch
gradient accumulation over the *same* micro-batches, which would make BN
comparable too, but keeping it out lets this model also be checked against
full-batch training and keeps the example about data flow.

``BranchingCNN`` is the plain ``torch.nn.Module`` twin; its parameter names
equal the graph's, so ``BranchingCNN().load_state_dict(model().params)`` works.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fusion.ir.builder import GraphBuilder
from fusion.ir.model import Model

IMAGE = 8
CLASSES = 10


def example_batch(batch: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
    """Synthetic images and labels."""
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(batch, 3, IMAGE, IMAGE, generator=g), "y": torch.randint(0, CLASSES, (batch,), generator=g)}


def build(width: int = 6, batch: int = 4, seed: int = 0, device: str = "cpu") -> Model:
    """The branching CNN as an OP-DAG with initial weights drawn from ``seed``."""
    b = GraphBuilder()
    x, y = b.input("x"), b.label("y")
    s = b.module("stem", "torch.nn.Conv2d", x, in_channels=3, out_channels=width, kernel_size=3, padding=1)
    s = b.function("stem_act", "torch.nn.functional.gelu", s)
    a = b.module("a_conv1", "torch.nn.Conv2d", s, in_channels=width, out_channels=width, kernel_size=3, padding=1,
                 label="branch a")
    a = b.function("a_act", "torch.tanh", a)
    a = b.module("a_conv2", "torch.nn.Conv2d", a, in_channels=width, out_channels=width, kernel_size=3, padding=1,
                 label="branch a")
    bb = b.module("b_conv", "torch.nn.Conv2d", s, in_channels=width, out_channels=width, kernel_size=1,
                  label="branch b")
    m = b.function("merge", "operator.add", a, bb)
    m = b.function("merge_act", "torch.nn.functional.relu", m)
    c = b.function("cat", "torch.cat", [m, s], dim=1, label="skip connection")
    c = b.function("pool", "torch.nn.functional.avg_pool2d", c, kernel_size=2)
    c = b.function("flat", "torch.flatten", c, 1)
    o = b.module("head", "torch.nn.Linear", c, in_features=2 * width * (IMAGE // 2) ** 2, out_features=CLASSES)
    b.loss("loss", "torch.nn.functional.cross_entropy", o, y)
    return b.build(example=example_batch(batch, seed), seed=seed, device=device)


def model() -> Model:
    """Entry point for ``fusion graph examples/branching_cnn.py:model``."""
    return build()


class BranchingCNN(nn.Module):
    """The same network as a plain PyTorch module (same parameter names)."""

    def __init__(self, width: int = 6):
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.a_conv1 = nn.Conv2d(width, width, 3, padding=1)
        self.a_conv2 = nn.Conv2d(width, width, 3, padding=1)
        self.b_conv = nn.Conv2d(width, width, 1)
        self.head = nn.Linear(2 * width * (IMAGE // 2) ** 2, CLASSES)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        s = F.gelu(self.stem(x))
        m = F.relu(self.a_conv2(torch.tanh(self.a_conv1(s))) + self.b_conv(s))
        c = torch.flatten(F.avg_pool2d(torch.cat([m, s], dim=1), kernel_size=2), 1)
        return F.cross_entropy(self.head(c), y)


def main() -> None:
    from fusion.plan import OptimizerConfig
    from fusion.executors.reference import ReferenceExecutor

    m = model()
    for n in m.graph.nodes.values():
        shapes = ", ".join(str(list(o.shape)) for o in n.meta.outputs if hasattr(o, "shape"))
        print(f"  {n.name:10s} {n.kind.value:8s} {n.target:36s} {shapes}")
    # branch a on one part, branch b on another, the merge and head on a third
    parts = {"x": "p0", "stem": "p0", "stem_act": "p0", "a_conv1": "p1", "a_act": "p1", "a_conv2": "p1", "b_conv": "p2"}
    assignment = {n: parts.get(n, "p3") for n in m.graph.nodes}
    ex = ReferenceExecutor(m, assignment, OptimizerConfig("adamw", lr=1e-2), micro_batches=2, schedule="1f1b")
    batch = example_batch(8, seed=1)
    for step in range(3):
        print(f"step {step}: loss {ex.step(batch).loss:.4f}")


if __name__ == "__main__":
    main()

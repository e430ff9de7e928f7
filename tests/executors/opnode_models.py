"""An op-node model with a tied embedding/LM head, and its plain-PyTorch twin,
for the NumPy-engine and mixed-engine tests."""
import torch
import torch.nn.functional as F
from torch import nn

from fusion.ir.builder import GraphBuilder

V, D, T = 11, 8, 5


def opnode_model():
    b = GraphBuilder()
    idx, y = b.input("idx"), b.label("y")
    h = b.module("wte", "torch.nn.Embedding", idx, num_embeddings=V, embedding_dim=D)
    a = b.module("ln1", "torch.nn.LayerNorm", h, normalized_shape=[D])
    a = b.module("fc1", "torch.nn.Linear", a, in_features=D, out_features=2 * D)
    a = b.function("act", "torch.nn.functional.gelu", a)
    a = b.module("fc2", "torch.nn.Linear", a, in_features=2 * D, out_features=D)
    a = b.function("t1", "torch.Tensor.transpose", a, 1, 2)
    a = b.function("t2", "torch.Tensor.transpose", a, 1, 2)
    h = b.function("res", "operator.add", h, a)
    h = b.function("tanh", "torch.tanh", h)
    h = b.module("lnf", "torch.nn.LayerNorm", h, normalized_shape=[D])
    logits = b.module("head", "torch.nn.Linear", h, in_features=D, out_features=V, bias=False, params={"weight": "wte.weight"})
    flat = b.function("flat", "torch.Tensor.view", logits, -1, V)
    yf = b.function("yflat", "torch.Tensor.view", y, -1)
    b.loss("loss", "torch.nn.functional.cross_entropy", flat, yf)
    g = torch.Generator().manual_seed(0)
    return b.build(example={"idx": torch.randint(0, V, (2, T), generator=g), "y": torch.randint(0, V, (2, T), generator=g)}, seed=0)


class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.ln1 = nn.Embedding(V, D), nn.LayerNorm(D)
        self.fc1, self.fc2, self.lnf = nn.Linear(D, 2 * D), nn.Linear(2 * D, D), nn.LayerNorm(D)

    def forward(self, idx, y):
        h = self.wte(idx)
        h = torch.tanh(h + self.fc2(F.gelu(self.fc1(self.ln1(h)))))
        logits = F.linear(self.lnf(h), self.wte.weight)  # tied head
        return F.cross_entropy(logits.view(-1, V), y.view(-1))


ASSIGN = {"idx": "A", "wte": "A", "ln1": "A", "fc1": "A", "act": "A",
          "fc2": "B", "t1": "B", "t2": "B", "res": "B", "tanh": "B", "y": "B", "lnf": "B", "head": "B",
          "flat": "B", "yflat": "B", "loss": "B"}

"""Test setup shared by the executor and codec tests: the residual MLP in half precision, and a recorder of
what the parts of a :class:`~fusion.executors.reference.ReferenceExecutor` send."""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F


class ResidualMLP(nn.Module):
    """A residual MLP whose logits are upcast for the loss, as mixed-precision code does."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x, y):
        h = F.gelu(self.a(x))
        h = torch.tanh(self.b(h)) + h
        return F.cross_entropy(self.c(h).float(), y)


def half_mlp(dtype: torch.dtype, mb: int = 2):
    """``(net, model)``: a :class:`ResidualMLP` in ``dtype`` built from torch seed 0, and its traced graph
    (a copy of ``net``, micro-batches of ``mb`` rows, ``y`` the label)."""
    from fusion.ir.trace import trace

    torch.manual_seed(0)
    net = ResidualMLP().to(dtype)
    model = trace(copy.deepcopy(net), {"x": torch.zeros(mb, 8, dtype=dtype), "y": torch.zeros(mb, dtype=torch.long)},
                  labels=("y",))
    return net, model


def capture_sent(ex) -> list:
    """Wrap every part runtime's ``forward`` / ``backward`` of ``ex`` so that the OpData each sends is appended,
    in order, to the returned list."""
    sent: list = []
    for part in ex.parts.values():
        def fwd(*a, _f=part.forward, **kw):
            out, loss = _f(*a, **kw)
            sent.extend(out)
            return out, loss

        def bwd(*a, _b=part.backward, **kw):
            out = _b(*a, **kw)
            sent.extend(out)
            return out

        part.forward, part.backward = fwd, bwd
    return sent

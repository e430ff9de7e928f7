"""The torch engine's local optimizer, with its state as plain arrays (for checkpoints).

Optimizer state is keyed by graph parameter name, not by position, so a
checkpoint reads back correctly whatever order the part lists its
parameters in: ``"<param>::<state key>"`` -> array (``exp_avg``,
``momentum_buffer``, the ``step`` counter as a 0-d array, ...).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

import numpy as np
import torch

from fusion.ir.errors import FusionError
from fusion.ir.graph import OpGraph
from fusion.plan import OptimizerConfig
from fusion.executors.engines.torch.engine import TorchPart, dtype_name, from_wire, to_array

#: ops that index a 2-D parameter by token id: their tables are embeddings, which Muon leaves to AdamW
EMBEDDING_TARGETS = frozenset({"torch.nn.functional.embedding", "torch.nn.Embedding", "aten.embedding.default",
                               "onnx.Gather"})


def muon_matrices(graph: OpGraph, names: Iterable[str], shapes: Mapping[str, tuple[int, ...]]) -> list[str]:
    """The parameters among ``names`` that Muon updates: the 2-D ones that no embedding op reads (a weight tied
    to an embedding table is an embedding). The rest (embeddings, norms' gains, biases, 1-D/N-D tensors) go to
    AdamW, as the Muon authors (Jordan et al. 2024) and the modded-nanogpt recipe do.

    shapes: parameter name -> its shape."""
    tables = {p for node in graph.nodes.values() if node.target in EMBEDDING_TARGETS for p in node.param_names()}
    return [n for n in names if len(shapes[n]) == 2 and n not in tables]


def _sgd(cfg: OptimizerConfig, named: Mapping[str, torch.Tensor], graph: OpGraph):
    return [(torch.optim.SGD(list(named.values()), lr=cfg.lr, momentum=cfg.momentum,
                             weight_decay=cfg.weight_decay), list(named))]


def _adamw(cfg: OptimizerConfig, named: Mapping[str, torch.Tensor], graph: OpGraph):
    return [(torch.optim.AdamW(list(named.values()), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                               weight_decay=cfg.weight_decay), list(named))]


def _muon(cfg: OptimizerConfig, named: Mapping[str, torch.Tensor], graph: OpGraph):
    """torch.optim.Muon on :func:`muon_matrices`, AdamW on the rest, both at ``cfg.lr``: Muon scales its step by
    ``0.2 * sqrt(max(rows, cols))`` (``adjust_lr_fn="match_rms_adamw"``, Liu et al. 2025, "Muon is Scalable"),
    so its update has AdamW's RMS and one learning rate and weight decay serve both groups."""
    mats = muon_matrices(graph, named, {n: tuple(t.shape) for n, t in named.items()})
    rest = [n for n in named if n not in set(mats)]
    out = []
    if mats:
        out.append((torch.optim.Muon([named[n] for n in mats], lr=cfg.lr, weight_decay=cfg.weight_decay,
                                     momentum=cfg.muon_momentum, nesterov=True, adjust_lr_fn="match_rms_adamw"),
                    mats))
    if rest:
        out += _adamw(cfg, {n: named[n] for n in rest}, graph)
    return out


#: the torch engine's optimizers by ``OptimizerConfig.name`` (every name of ``fusion.plan.OPTIMIZER_NAMES``; a test
#: keeps them equal): ``factory(cfg, {param name: tensor}, graph)`` -> ``[(torch optimizer, its param names)]``
TORCH_OPTIMIZERS: dict[str, Callable[..., list]] = {"sgd": _sgd, "adamw": _adamw, "muon": _muon}


def torch_optimizer(cfg: OptimizerConfig, params: Iterable):
    """The torch optimizer ``cfg`` names over ``params`` (None when there are none); ``sgd`` and ``adamw`` only
    (``muon`` splits the parameters by role: :data:`TORCH_OPTIMIZERS` with the graph)."""
    params = list(params)
    if not params:
        return None
    if cfg.name not in ("sgd", "adamw"):
        raise FusionError(f"torch_optimizer: {cfg.name!r} needs the graph (TORCH_OPTIMIZERS)")
    return TORCH_OPTIMIZERS[cfg.name](cfg, {str(i): p for i, p in enumerate(params)}, None)[0][0]


SEP = "::"


class TorchOptimizer:
    """The plan's optimizer over a :class:`TorchPart`'s trainable parameters: one torch optimizer, or (``muon``)
    one per group of parameters, each parameter in exactly one."""

    def __init__(self, part: TorchPart, cfg: OptimizerConfig):
        self.part, self.cfg = part, cfg
        self.names = list(part.trainable())
        named = part.trainable()
        self.groups = TORCH_OPTIMIZERS[cfg.name](cfg, named, part.graph) if named else []

    def set_lr(self, lr: float) -> None:
        """The learning rate of the next steps (the schedule's ``lr * factor``, set as ``LambdaLR`` sets it)."""
        for opt, _ in self.groups:
            for group in opt.param_groups:
                group["lr"] = lr

    def step(self) -> None:
        for opt, _ in self.groups:
            opt.step()

    def zero_grad(self) -> None:
        for opt, _ in self.groups:
            opt.zero_grad(set_to_none=True)

    def state(self) -> tuple[dict[str, np.ndarray], dict]:
        arrays: dict[str, np.ndarray] = {}
        for opt, names in self.groups:
            for idx, st in opt.state_dict()["state"].items():
                for key, v in st.items():
                    if isinstance(v, torch.Tensor):
                        arrays[f"{names[idx]}{SEP}{key}"] = to_array(v).copy()
                    elif v is not None:
                        arrays[f"{names[idx]}{SEP}{key}"] = np.asarray(v)
        return arrays, {"optimizer": self.cfg.to_dict(), "params": self.names}

    def load_state(self, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> None:
        if not self.groups:
            return
        saved = meta.get("optimizer")
        if saved is not None and saved.get("name") != self.cfg.name:
            raise FusionError(f"checkpoint holds {saved.get('name')} optimizer state, the plan uses {self.cfg.name}")
        index = {n: (g, i) for g, (_, names) in enumerate(self.groups) for i, n in enumerate(names)}
        params = self.part.trainable()
        states: list[dict[int, dict[str, Any]]] = [{} for _ in self.groups]
        for k, v in arrays.items():
            pname, sep, key = k.rpartition(SEP)
            if not sep or pname not in index:
                raise FusionError(f"checkpoint optimizer entry {k!r} names no parameter of this part")
            # moments have the parameter's dtype (bfloat16 ones were saved as their bits); "step" is a counter
            dt = None if key == "step" else dtype_name(params[pname].dtype)
            g, i = index[pname]
            states[g].setdefault(i, {})[key] = from_wire(np.array(v), dt)
        for (opt, _), state in zip(self.groups, states):
            opt.load_state_dict({"state": state, "param_groups": opt.state_dict()["param_groups"]})

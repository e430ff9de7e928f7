"""Engine factory: engine name -> part constructor, op support and optimizer.

``make_engine_part("torch" | "numpy", graph, sub, params, device)`` builds
one CompNode's sub-DAG on the named engine; ``check_engines`` verifies at
compile time that every node can run on the engine of its part. Engines are
imported lazily, so a process that only uses the NumPy engine never imports
torch.
"""
from __future__ import annotations

import importlib
from typing import Any, Mapping

from ..ir.errors import GraphError
from ..ir.node import NodeKind

#: engine name -> "module:class" of its part (imported on first use)
ENGINES: dict[str, str] = {
    "torch": "fusion.executors.torch_engine:TorchPart",
    "numpy": "fusion.executors.numpy_engine:NumpyPart",
}


def _load(engine: str):
    try:
        mod, _, cls = ENGINES[engine].partition(":")
    except KeyError:
        raise GraphError(f"unknown engine {engine!r}; known engines: {sorted(ENGINES)}") from None
    return getattr(importlib.import_module(mod), cls)


def supports(engine: str, target: str) -> bool:
    """Whether ``engine`` implements op ``target``."""
    if engine == "torch":
        from ..ir.registry import REGISTRY

        return REGISTRY.is_known(target)
    if engine == "numpy":
        from .numpy_engine import supports as np_supports

        return np_supports(target)
    _load(engine)  # raises for unknown engines
    return False


def make_engine_part(engine: str, graph, sub, params: Mapping[str, Any], device: str = "cpu"):
    """Build the engine part (an ``EnginePart``, see ``fusion.executors.engine``) for one sub-DAG."""
    return _load(engine)(graph, sub, params, device)


def make_optimizer(part, cfg):
    """The optimizer of one part: an object with ``step()`` and ``zero_grad(set_to_none=True)``, or None."""
    own = getattr(part, "make_optimizer", None)
    if own is not None:
        return own(cfg)
    from .optim import torch_optimizer

    return torch_optimizer(cfg, part.trainable().values())


def check_engines(graph, assignment: Mapping[str, str], engines: Mapping[str, str]) -> None:
    """Raise GraphError naming every node whose op the engine of its part lacks.

    assignment: node -> part; engines: part -> engine name (absent parts run torch).
    """
    problems = []
    for node in graph.nodes.values():
        if node.kind in (NodeKind.INPUT, NodeKind.LABEL, NodeKind.OUTPUT):
            continue
        part = assignment.get(node.name)
        engine = engines.get(part, "torch")
        if not supports(engine, node.target):
            problems.append(f"node {node.name!r} (op {node.target}) on part {part!r}")
            continue
        if engine == "numpy":
            from .numpy_engine import node_problem

            why = node_problem(node)
            if why:
                problems.append(f"node {node.name!r} (op {node.target}) on part {part!r}: {why}")
    if problems:
        first = problems[0].split("'")[1]
        raise GraphError(f"{len(problems)} node(s) placed on an engine that lacks their op: " + "; ".join(problems), first)

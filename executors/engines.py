"""Engine factory: which engine runs a part, and its local optimizer.

A CompNode imports an engine only when its part uses it, so a part on the
``numpy`` engine runs in a process that never imports torch. ``check_engines``
verifies at compile time that every node can run on the engine of its part. Engines are
registered by name with import paths (resolved lazily) or callables:

    register_engine("numpy", "fusion.executors.numpy_engine:NumpyPart",
                    "fusion.executors.numpy_engine:NumpyOptimizer")

A part factory is called as ``factory(graph, subgraph, params, device)`` and
returns an :class:`~fusion.executors.part.EnginePart`. An optimizer factory
is called as ``factory(part, OptimizerConfig)`` and returns a
:class:`LocalOptimizer`.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol

import numpy as np

from ..ir.boundary import SubGraph
from ..ir.errors import FusionError, GraphError
from ..ir.graph import OpGraph
from ..ir.node import NodeKind
from .optim import OptimizerConfig
from .part import EnginePart


class LocalOptimizer(Protocol):
    """The optimizer of one part: steps on the part's own parameters.

    ``state()`` returns ``(arrays, meta)``: optimizer tensors by name and a
    JSON-able map (step counts, hyper-parameters) — what a checkpoint stores.
    ``load_state`` restores them.
    """

    def step(self) -> None: ...

    def zero_grad(self) -> None: ...

    def state(self) -> tuple[dict[str, np.ndarray], dict]: ...

    def load_state(self, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> None: ...


Factory = Callable[..., Any]


@dataclass(frozen=True)
class EngineSpec:
    """part: factory (or ``"module:attr"``) of the engine part; optimizer: factory of its optimizer."""

    part: Factory | str
    optimizer: Factory | str


_ENGINES: dict[str, EngineSpec] = {
    "torch": EngineSpec("fusion.executors.torch_engine:TorchPart", "fusion.executors.torch_optimizer:TorchOptimizer"),
    "numpy": EngineSpec("fusion.executors.numpy_engine:NumpyPart", "fusion.executors.numpy_optim:NumpyOptimizer.for_part"),
}


def register_engine(name: str, part: Factory | str, optimizer: Factory | str) -> None:
    """Make engine ``name`` available to CompNodes."""
    _ENGINES[name] = EngineSpec(part, optimizer)


def engine_names() -> list[str]:
    return sorted(_ENGINES)


def _resolve(f: Factory | str, engine: str) -> Factory:
    if callable(f):
        return f
    mod, _, attr = f.partition(":")
    try:
        obj = importlib.import_module(mod)
        for a in attr.split("."):
            obj = getattr(obj, a)
        return obj
    except (ImportError, AttributeError) as e:
        raise FusionError(f"engine {engine!r}: cannot load {f} ({e})") from None


def _spec(engine: str) -> EngineSpec:
    try:
        return _ENGINES[engine]
    except KeyError:
        raise FusionError(f"unknown engine {engine!r}; known engines: {engine_names()}") from None


def make_engine_part(engine: str, graph: OpGraph, sub: SubGraph, params: Mapping[str, Any], device: str = "cpu") -> EnginePart:
    """The engine part running ``sub`` on ``device``, initialised from ``params`` (arrays by name)."""
    return _resolve(_spec(engine).part, engine)(graph, sub, params, device)


def make_optimizer(engine: str, part: EnginePart, cfg: OptimizerConfig) -> LocalOptimizer:
    """The local optimizer of ``part`` (may step nothing when the part has no trainable parameters)."""
    return _resolve(_spec(engine).optimizer, engine)(part, cfg)


def supports(engine: str, target: str) -> bool:
    """Whether ``engine`` implements op ``target``."""
    if engine == "torch":
        from ..ir.registry import REGISTRY

        return REGISTRY.is_known(target)
    if engine == "numpy":
        from .numpy_engine import supports as np_supports

        return np_supports(target)
    _spec(engine)  # raises for unknown engines
    return False


def check_engines(graph: OpGraph, assignment: Mapping[str, str], engines: Mapping[str, str]) -> None:
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

"""Engine factory: which engine runs a part, and its local optimizer.

A CompNode imports an engine only when its part uses it, so a part on the
``numpy`` engine runs in a process that never imports torch. Engines are
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
from ..ir.errors import FusionError
from ..ir.graph import OpGraph
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
        return getattr(importlib.import_module(mod), attr)
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

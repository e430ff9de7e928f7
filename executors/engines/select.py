"""Engine factory: which engine runs a part, and its local optimizer.

A CompNode imports an engine only when its part uses it, so a part on the
``numpy`` engine runs in a process that never imports torch. ``check_engines``
verifies at compile time that every node can run on the engine of its part. Engines are
registered by name with import paths (resolved lazily) or callables:

    register_engine("numpy", "fusion.executors.engines.numpy.engine:NumpyPart",
                    "fusion.executors.engines.numpy.engine:NumpyOptimizer")

A part factory is called as ``factory(graph, subgraph, params, device)`` and
returns an instance of a subclass of :class:`~fusion.executors.engines.base.EnginePart`. An optimizer factory
is called as ``factory(part, OptimizerConfig)`` and returns a
:class:`LocalOptimizer`.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol

import numpy as np

from fusion.ir.boundary import SubGraph
from fusion.ir.errors import FusionError, GraphError
from fusion.ir.graph import OpGraph
from fusion.ir.node import IDLE_KINDS
from fusion.plan import OPTIMIZER_NAMES, OptimizerConfig
from fusion.executors.engines.base import EnginePart


class LocalOptimizer(Protocol):
    """The optimizer of one part: steps on the part's own parameters.

    ``state()`` returns ``(arrays, meta)``: optimizer tensors by name and a
    JSON-able map (step counts, hyper-parameters) — what a checkpoint stores.
    ``load_state`` restores them.
    """

    def set_lr(self, lr: float) -> None: ...

    def step(self) -> None: ...

    def zero_grad(self) -> None: ...

    def state(self) -> tuple[dict[str, np.ndarray], dict]: ...

    def load_state(self, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> None: ...


Factory = Callable[..., Any]


@dataclass(frozen=True)
class EngineSpec:
    """part: factory (or ``"module:attr"``) of the engine part; optimizer: factory of its optimizer;
    optimizers: the ``OptimizerConfig.name``s that optimizer implements (of ``fusion.plan.OPTIMIZER_NAMES``)."""

    part: Factory | str
    optimizer: Factory | str
    optimizers: tuple[str, ...] = ("sgd", "adamw")


_ENGINES: dict[str, EngineSpec] = {
    "torch": EngineSpec("fusion.executors.engines.torch.engine:TorchPart", "fusion.executors.engines.torch.optimizer:TorchOptimizer",
                        OPTIMIZER_NAMES),
    "numpy": EngineSpec("fusion.executors.engines.numpy.engine:NumpyPart", "fusion.executors.engines.numpy.optim:NumpyOptimizer.for_part"),
}


def register_engine(name: str, part: Factory | str, optimizer: Factory | str,
                    optimizers: tuple[str, ...] = ("sgd", "adamw")) -> None:
    """Make engine ``name`` available to CompNodes (its optimizer implementing ``optimizers``)."""
    _ENGINES[name] = EngineSpec(part, optimizer, tuple(optimizers))


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


def make_engine_part(engine: str, graph: OpGraph, sub: SubGraph, params: Mapping[str, Any], device: str = "cpu",
                     options: Mapping[str, Any] | None = None) -> EnginePart:
    """The engine part running ``sub`` on ``device``, initialised from ``params`` (arrays by name).

    options: engine options as keyword arguments of the part factory (the torch engine's
             ``compiled``, ``compile``, ``recompute``); an option the engine does not list in
             its ``OPTIONS`` is an error naming the ones it has.
    """
    factory = _resolve(_spec(engine).part, engine)
    if options:
        known = tuple(getattr(factory, "OPTIONS", ()))
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise FusionError(f"engine {engine!r} has no option(s) {unknown}; its options: {list(known)}")
    part = factory(graph, sub, params, device, **dict(options or {}))
    if not isinstance(part, EnginePart):  # the runtime calls its optional abilities without probing for them
        raise FusionError(f"engine {engine!r}: its part factory returned a {type(part).__name__}, not a subclass of "
                          f"fusion.executors.engines.base.EnginePart")
    return part


def engine_options_for(part: str, engine: str, options: Mapping[str, Mapping[str, Any]] | None) -> dict[str, Any]:
    """The options of one part from ``{part or "*": {option: value}}``: ``"*"`` applies to every part
    whose engine has that option, a part's own entry overrides it (and must name real options)."""
    if not options:
        return {}
    known = set(getattr(_resolve(_spec(engine).part, engine), "OPTIONS", ()))
    out = {k: v for k, v in options.get("*", {}).items() if k in known}
    out.update(options.get(part, {}))
    return out


def check_optimizer(name: str, engines: Mapping[str, str]) -> None:
    """FusionError naming the first part (of ``engines``: part -> engine name) whose engine has no optimizer
    ``name``; the plan's optimizer steps every part, so one such part refuses the plan."""
    for part, engine in sorted(engines.items()):
        have = _spec(engine).optimizers
        if name not in have:
            raise FusionError(f"part {part!r} runs the {engine} engine, which has no {name!r} optimizer (its "
                              f"optimizers: {', '.join(have)}); run that part on an engine that has it "
                              f"(--engine {part}=torch) or choose another --optimizer")


def make_optimizer(engine: str, part: EnginePart, cfg: OptimizerConfig) -> LocalOptimizer:
    """The local optimizer of ``part`` (may step nothing when the part has no trainable parameters)."""
    return _resolve(_spec(engine).optimizer, engine)(part, cfg)


def supports(engine: str, target: str) -> bool:
    """Whether ``engine`` implements op ``target``."""
    if engine == "torch":
        from fusion.ir.registry import REGISTRY

        return REGISTRY.is_known(target)
    if engine == "numpy":
        from fusion.executors.engines.numpy.engine import supports as np_supports

        return np_supports(target)
    _spec(engine)  # raises for unknown engines
    return False


def check_engines(graph: OpGraph, assignment: Mapping[str, str], engines: Mapping[str, str]) -> None:
    """Raise GraphError naming every node whose op the engine of its part lacks.

    assignment: node -> part; engines: part -> engine name (absent parts run torch).
    """
    problems: dict[tuple[str, str, str], list[tuple[str, str]]] = {}  # (engine, op, why) -> [(node, part)]
    for node in graph.nodes.values():
        if node.kind in IDLE_KINDS:
            continue
        part = assignment.get(node.name)
        engine = engines.get(part, "torch")
        if not supports(engine, node.target):
            problems.setdefault((engine, node.target, ""), []).append((node.name, part))
            continue
        if engine == "numpy":
            from fusion.executors.engines.numpy.engine import node_problem

            why = node_problem(node)
            if why:
                problems.setdefault((engine, node.target, why), []).append((node.name, part))
    if problems:
        # one line however many: a count, then per op (at most 6) its first nodes
        total = sum(len(v) for v in problems.values())
        first = next(iter(problems.values()))[0][0]
        groups = []
        for (engine, op, why), nodes in list(problems.items())[:6]:
            parts = sorted({p for _, p in nodes})
            names = ", ".join(f"node {n!r}" for n, _ in nodes[:3]) + (f", ... ({len(nodes)} nodes)" if len(nodes) > 3 else "")
            groups.append(f"op {op} on {engine} (part {', '.join(repr(p) for p in parts[:4])}"
                          f"{', ...' if len(parts) > 4 else ''}): {names}" + (f": {why}" if why else ""))
        more = f"; and {len(problems) - 6} more ops" if len(problems) > 6 else ""
        raise GraphError(f"{total} node(s) placed on an engine that lacks their op ({len(problems)} op(s)): "
                         + "; ".join(groups) + more, first)

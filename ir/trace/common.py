"""Pieces both tracing front ends share (torch.fx and torch.export).

- :class:`ParamTable`: maps the module's tensors to graph parameters, one
  graph parameter per tensor object, named by its first ``state_dict`` name, so a
  tied weight (``lm_head.weight = wte.weight``) is one :class:`ParamSpec`.
- :func:`function_target`: the registry name of a Python/torch callable.
- :func:`leaf_target` / :func:`module_node`: which modules become MODULE nodes
  and how (target name, constructor ``attrs``, ``params`` mapping).
- :class:`Traced`: what a front end hands to :func:`fusion.ir.trace.trace`.
"""
from __future__ import annotations

import functools
import logging
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
import torch.fx as fx
from torch import nn

from fusion.ir.errors import GraphError
from fusion.ir.graph import OpGraph, ParamSpec
from fusion.ir.node import NodeKind, OpNode
from fusion.ir.registry import REGISTRY, OpRegistry

log = logging.getLogger(__name__)


@dataclass
class Traced:
    """A front end's result, before outputs, shapes and clean-up passes.

    graph:    placeholders, MODULE and FUNCTION nodes in program order, and params.
    returned: forward's return value with every tensor replaced by a :class:`Ref`
              (nested tuples/lists/dicts kept).
    tensors:  graph parameter name -> the module's tensor (for ``Model.params``).
    method:   ``"fx"`` or ``"export"``.
    no_grad:  nodes computed with grad mode off (``torch.no_grad()`` regions
              that fx traced through); :func:`~fusion.ir.trace.passes.detach_no_grad`
              detaches what leaves them.
    """

    graph: OpGraph
    returned: Any
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    method: str = ""
    no_grad: set[str] = field(default_factory=set)


def convert_arg(value: Any, env: Mapping[fx.Node, Any]) -> Any:
    """fx argument -> OpNode argument (fx nodes become Ref/ParamRef/literal)."""
    if isinstance(value, fx.Node):
        return env[value]
    if isinstance(value, tuple):
        return tuple(convert_arg(v, env) for v in value)
    if isinstance(value, list):  # includes fx's immutable_list
        return [convert_arg(v, env) for v in value]
    if isinstance(value, dict):  # includes fx's immutable_dict
        return {k: convert_arg(v, env) for k, v in value.items()}
    if isinstance(value, slice):
        return slice(convert_arg(value.start, env), convert_arg(value.stop, env), convert_arg(value.step, env))
    return value


def name_allocator(reserved: set[str]) -> Callable[[str], str]:
    """``unique(base)``: ``base``, or ``base_1``, ``base_2``, ... if taken; the result is reserved."""
    used = set(reserved)

    def unique(base: str) -> str:
        name, i = base, 1
        while name in used:
            name, i = f"{base}_{i}", i + 1
        used.add(name)
        return name

    return unique


def describe(fn: Any) -> str:
    mod = getattr(fn, "__module__", None) or ""
    return f"{mod}.{getattr(fn, '__name__', repr(fn))}".lstrip(".")


def dtype_str(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


class ParamTable:
    """Graph parameters of one traced module.

    Every parameter and buffer is known by its first name in the module's
    ``named_parameters()`` / ``named_buffers()`` order (the ``state_dict``
    order), so two attributes holding one tensor map to one graph parameter.
    Tensors that are neither (constants) get the name the front end proposes.
    """

    def __init__(self, module: nn.Module, graph: OpGraph):
        self.module, self.graph = module, graph
        self.canon: dict[int, str] = {}
        for n, p in module.named_parameters():
            self.canon.setdefault(id(p), n)
        for n, b in module.named_buffers():
            self.canon.setdefault(id(b), n)
        self.tensors: dict[str, torch.Tensor] = {}

    def name_of(self, t: torch.Tensor, fallback: str) -> str:
        """Register ``t`` as a graph parameter and return its name."""
        name = self.canon.get(id(t), fallback)
        if name not in self.tensors:
            trainable = isinstance(t, nn.Parameter) and t.requires_grad
            self.graph.add_param(ParamSpec(name, tuple(int(s) for s in t.shape), dtype_str(t.dtype), trainable))
            self.tensors[name] = t
        elif self.tensors[name] is not t:
            raise GraphError(f"two different tensors would both be named parameter {name!r}")
        return name


# -- function targets ---------------------------------------------------------------
_SAFE_BUILTIN_NAMES = {getattr: "builtins.getattr", len: "builtins.len", int: "builtins.int", float: "builtins.float",
                       min: "builtins.min", max: "builtins.max", abs: "builtins.abs"}
@functools.lru_cache(maxsize=1)
def _reverse_table() -> dict[int, str]:
    """id(callable) -> its public name under torch.nn.functional, torch, ... (first namespace wins)."""
    import torch.nn.functional as F

    table: dict[int, str] = {}
    spaces = [("torch.nn.functional", F), ("torch", torch), ("torch.special", torch.special),
              ("torch.linalg", torch.linalg), ("torch.fft", torch.fft), ("operator", operator), ("math", math)]
    for prefix, ns in spaces:
        for name, obj in vars(ns).items():
            if name.startswith("_") or not callable(obj) or isinstance(obj, type):
                continue
            table.setdefault(id(obj), f"{prefix}.{name}")
    return table


def function_target(fn: Callable, registry: OpRegistry = REGISTRY) -> str | None:
    """The registry name under which ``fn`` resolves to ``fn`` itself, or None."""
    name = registry.registered_name(fn)
    if name:
        return name
    if fn in _SAFE_BUILTIN_NAMES:
        return _SAFE_BUILTIN_NAMES[fn]
    if isinstance(fn, torch._ops.OpOverload):
        name = f"aten.{fn._schema.name.split('::')[-1]}.{fn._overloadname}" if fn.namespace == "aten" else None
    elif getattr(fn, "__objclass__", None) is torch._C.TensorBase or getattr(fn, "__qualname__", "").startswith("Tensor."):
        name = f"torch.Tensor.{fn.__name__}"
        found = registry.resolve(name)
        return name if found is not None else None
    else:
        name = _reverse_table().get(id(fn))
    if name is None:
        return None
    found = registry.resolve(name)
    return name if found is not None and found[1] is fn else None


def is_assert(fn: Any) -> bool:
    """Trace-time guards that compute nothing (``torch._assert``, fx's ``_assert_is_none``, ``torch._check``)."""
    name = getattr(fn, "__name__", "")
    return name.startswith(("_assert", "_check")) or fn in (torch._assert,)


# -- leaf modules --------------------------------------------------------------------
_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


def module_target(cls: type, registry: OpRegistry = REGISTRY) -> str | None:
    """``torch.nn.<Cls>`` for torch.nn built-ins, the registered name for user types, else None."""
    name = registry.registered_name(cls)
    if name:
        return name
    if cls.__module__.startswith("torch.nn.") and not issubclass(cls, _CONTAINERS) and getattr(nn, cls.__name__, None) is cls:
        return f"torch.nn.{cls.__name__}"
    return None


def _tensor_layout(mod: nn.Module) -> dict[str, tuple[int, ...]]:
    out = {n: tuple(t.shape) for n, t in mod.named_parameters(remove_duplicate=False)}
    out.update({n: tuple(t.shape) for n, t in mod.named_buffers(remove_duplicate=False)})
    return out


def leaf_spec(mod: nn.Module, registry: OpRegistry = REGISTRY) -> tuple[str, dict[str, Any]] | None:
    """``(target, attrs)`` when ``mod`` becomes one MODULE node, else None.

    A module is a leaf when its type is a torch.nn built-in or user-registered
    and rebuilding it from ``attrs`` on the meta device gives the same
    parameter and buffer names and shapes. A registered type that cannot be
    rebuilt is an error; a built-in that cannot (say, a MultiheadAttention
    whose constructor arguments are not all stored on it) is traced through.
    """
    from fusion.ir.torch_ops import module_attrs

    target = module_target(type(mod), registry)
    if target is None:
        return None
    registered = registry.registered_name(type(mod)) is not None
    try:
        attrs = module_attrs(mod)
        with torch.device("meta"):
            rebuilt = type(mod)(**attrs)
        same = _tensor_layout(rebuilt) == _tensor_layout(mod)
        why = "its parameters or buffers differ in name or shape"
    except Exception as e:  # noqa: BLE001 - any constructor failure means "not rebuildable"
        same, why = False, f"{type(e).__name__}: {e}"
    if same:
        return target, attrs
    if registered:
        raise GraphError(f"registered module type {target!r} cannot be rebuilt from its constructor arguments ({why}); "
                         "store every constructor argument as an attribute of the same name")
    log.debug("tracing through %s: cannot rebuild it from attributes (%s)", type(mod).__name__, why)
    return None


def module_node(name: str, qualname: str, mod: nn.Module, spec: tuple[str, dict[str, Any]], args: tuple, kwargs: dict,
                table: ParamTable) -> OpNode:
    """A MODULE node calling leaf ``mod`` (at ``qualname``); its tensors become graph parameters."""
    target, attrs = spec
    params = {}
    for path, t in list(mod.named_parameters(remove_duplicate=False)) + list(mod.named_buffers(remove_duplicate=False)):
        params[path] = table.name_of(t, f"{qualname}.{path}" if qualname else path)
    return OpNode(name, NodeKind.MODULE, target, tuple(args), dict(kwargs), dict(attrs), params, label=qualname)

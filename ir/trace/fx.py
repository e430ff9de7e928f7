"""torch.fx front end: symbolic tracing at module granularity.

Leaf modules (torch.nn built-ins and user-registered module types that can be
rebuilt from their constructor arguments) become MODULE nodes; everything
else is traced through, so each torch function, tensor method and Python
operator becomes a FUNCTION node. ``get_attr`` of a parameter or buffer
becomes a :class:`ParamRef` argument of its users.

Symbolic tracing cannot follow data-dependent Python control flow; such
models raise here and :func:`fusion.ir.trace.trace` falls back to torch.export.
"""
from __future__ import annotations

import inspect
import logging
from typing import Any, Mapping

import torch
import torch.fx as fx
from torch import nn

from fusion.ir.errors import GraphError
from fusion.ir.graph import OpGraph
from fusion.ir.node import NodeKind, OpNode, ParamRef, Ref
from fusion.ir.registry import REGISTRY, OpRegistry
from fusion.ir.trace.common import (ParamTable, Traced, convert_arg, describe, function_target, is_assert, leaf_spec, module_node,
                           name_allocator)

log = logging.getLogger(__name__)


class _LeafTracer(fx.Tracer):
    """An fx tracer whose leaves are exactly the modules :func:`leaf_spec` accepts."""

    def __init__(self, root: nn.Module, registry: OpRegistry):
        super().__init__()
        # decided before tracing: fx patches math functions while it traces, which
        # breaks the module constructors leaf_spec runs
        self.specs: dict[int, tuple[str, dict] | None] = {}
        for _, m in root.named_modules(remove_duplicate=False):
            if id(m) not in self.specs:
                self.specs[id(m)] = leaf_spec(m, registry)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return self.specs.get(id(m)) is not None

    def create_node(self, kind, target, args, kwargs, name=None, type_expr=None):
        # fx records operations, not the grad mode or autocast state they ran under: note the
        # first (the tracer detaches what leaves a no-grad region), refuse the second
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        if kind in ("call_function", "call_method", "call_module") and not torch.is_grad_enabled():
            node.meta["fusion_no_grad"] = True
        if kind != "placeholder" and any(_autocast_on(d) for d in ("cpu", "cuda")):
            raise GraphError("torch.fx cannot keep a torch.autocast region (export can refuse it with the module)")
        return node


def _autocast_on(device: str) -> bool:
    try:
        return torch.is_autocast_enabled(device)
    except (TypeError, RuntimeError):  # an older torch or an unknown device type
        return False


def trace_fx(module: nn.Module, example: Mapping[str, Any], labels: tuple[str, ...],
             registry: OpRegistry = REGISTRY) -> Traced:
    """Symbolically trace ``module`` with the tensors of ``example`` as placeholders.

    Forward arguments that are not tensors in ``example`` (flags, ints, None)
    and arguments left out of it (their defaults) are specialised as
    ``concrete_args``.
    """
    sig = inspect.signature(module.forward)
    concrete: dict[str, Any] = {}
    for name, p in sig.parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            if name in example:
                raise GraphError(f"torch.fx cannot trace variadic argument *{name}/**{name}")
            continue
        if name in example and isinstance(example[name], torch.Tensor):
            continue
        concrete[name] = example[name] if name in example else p.default
    tracer = _LeafTracer(module, registry)
    fx_graph = tracer.trace(module, concrete_args=concrete or None)
    roots = dict(module.named_modules())

    g = OpGraph()
    table = ParamTable(module, g)
    env: dict[fx.Node, Any] = {}
    arg_names = [n for n, p in sig.parameters.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    placeholders = [n for n in fx_graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(arg_names):
        raise GraphError(f"torch.fx made {len(placeholders)} placeholders for forward arguments {arg_names}")
    arg_of = dict(zip(placeholders, arg_names))
    unique = name_allocator({n for n in example if isinstance(example[n], torch.Tensor)})  # placeholder names are reserved
    returned: Any = None
    no_grad: set[str] = set()

    for node in fx_graph.nodes:
        if node.op == "placeholder":
            arg = arg_of[node]
            if arg in concrete:
                env[node] = concrete[arg]
                continue
            g.add(OpNode(arg, NodeKind.LABEL if arg in labels else NodeKind.INPUT))
            env[node] = Ref(arg)
        elif node.op == "get_attr":
            value = _fetch_attr(module, str(node.target))
            if isinstance(value, torch.Tensor):
                env[node] = ParamRef(table.name_of(value, str(node.target)))
            else:
                env[node] = value
        elif node.op == "call_module":
            mod = roots[str(node.target)]
            spec = tracer.specs.get(id(mod))
            if spec is None:  # pragma: no cover - fx only emits call_module for leaves
                raise GraphError(f"module {node.target} is not a leaf", node.name)
            name = unique(node.name)
            g.add(module_node(name, str(node.target), mod, spec, convert_arg(node.args, env), convert_arg(node.kwargs, env), table))
            env[node] = Ref(name)
            if node.meta.get("fusion_no_grad"):
                no_grad.add(name)
        elif node.op == "call_function":
            if is_assert(node.target):
                continue
            target = function_target(node.target, registry)
            if target is None:
                raise GraphError(f"function {describe(node.target)} is not a known op; register it with "
                                 "fusion.register_function", node.name)
            name = unique(node.name)
            g.add(OpNode(name, NodeKind.FUNCTION, target, convert_arg(node.args, env), convert_arg(node.kwargs, env),
                         label=describe(node.target)))
            env[node] = Ref(name)
            if node.meta.get("fusion_no_grad"):
                no_grad.add(name)
        elif node.op == "call_method":
            if not hasattr(torch.Tensor, str(node.target)):
                raise GraphError(f"method {node.target!r} is not a torch.Tensor method", node.name)
            name = unique(node.name)
            g.add(OpNode(name, NodeKind.FUNCTION, f"torch.Tensor.{node.target}", convert_arg(node.args, env),
                         convert_arg(node.kwargs, env), label=f"Tensor.{node.target}"))
            env[node] = Ref(name)
            if node.meta.get("fusion_no_grad"):
                no_grad.add(name)
        elif node.op == "output":
            returned = convert_arg(node.args[0], env)
    return Traced(g, returned, table.tensors, "fx", no_grad)


def _fetch_attr(module: nn.Module, target: str) -> Any:
    obj: Any = module
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj

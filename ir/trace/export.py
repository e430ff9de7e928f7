"""torch.export front end: ATen-level tracing, optionally regrouped by leaf module.

``torch.export.export`` (non-strict) runs the forward with fake tensors, so it
follows Python control flow on shapes and constants, keyword arguments, dict
outputs and cache objects that symbolic tracing (torch.fx) cannot. Every node
of the exported graph is an ATen operator (target ``aten.<op>.<overload>``);
parameters, buffers and lifted constants become :class:`ParamRef` arguments
named by their original ``state_dict`` names (via the graph signature).

Granularity ``"module"`` regroups ATen nodes by the outermost leaf module recorded in each node's ``nn_module_stack``: a group becomes one
MODULE node when it is a clean single-tensor call (one tensor flows in, one
flows out, it reads only its module's own tensors, the module's ``forward``
takes one required argument, and calling the rebuilt module on the meta
device gives the group's output shape). Other groups stay ATen nodes, so a
module-granularity export graph may mix MODULE and ATen nodes.
"""
from __future__ import annotations

import inspect
import logging
import operator
from typing import Any, Mapping

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from fusion.ir.errors import GraphError
from fusion.ir.graph import OpGraph
from fusion.ir.node import NodeKind, OpNode, ParamRef, Ref
from fusion.ir.registry import REGISTRY, OpRegistry
from fusion.ir.trace.common import (ParamTable, Traced, convert_arg, describe, function_target, is_assert, leaf_spec, module_node,
                           name_allocator)

log = logging.getLogger(__name__)

_STRIDE_AGNOSTIC = {"aten.view.default": "aten.reshape.default", "aten._unsafe_view.default": "aten.reshape.default"}


def export_program(module: nn.Module, example: Mapping[str, Any]) -> torch.export.ExportedProgram:
    """Run ``torch.export.export`` (non-strict) with ``example`` as keyword arguments.

    A module on the meta device is exported with meta example tensors (shapes only).
    """
    on_meta = any(t.device.type == "meta" for t in list(module.parameters()) + list(module.buffers()))
    kwargs = {k: (v.to("meta") if on_meta and isinstance(v, torch.Tensor) else v) for k, v in example.items()}
    with _ModuleStack(module) as where:
        try:
            return torch.export.export(module, (), kwargs, strict=False)
        except Exception as e:
            raise ExportFailure(_construct(e), where.path, e) from e


class ExportFailure(Exception):
    """torch.export failed: what construct, in which module (``path``: '' for the top level)."""

    def __init__(self, construct: str, path: str | None, cause: BaseException):
        self.construct, self.path, self.cause = construct, path, cause
        at = f", in module {path!r}" if path else ", in the top-level forward" if path == "" else ""
        super().__init__(f"{construct}{at}")


def _construct(e: BaseException) -> str:
    """One line saying what in the user's code torch.export could not follow."""
    text = str(e)
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    called = ""
    lines = text.splitlines()
    for i, ln in enumerate(lines):
        if ln.strip().startswith("The following call raised this error") and i + 1 < len(lines):
            where = lines[i + 1].strip().removeprefix("File ").replace('"', "")
            called = " at " + where.rsplit("/", 1)[-1]
            break
    if type(e).__name__ == "GuardOnDataDependentSymNode" or "data-dependent" in text:
        return f"Python control flow on a tensor value (torch.export cannot branch on data){called}"
    return f"{type(e).__name__}: {line}{called}"


class _ModuleStack:
    """While tracing, the qualified name of the innermost module whose forward is running."""

    def __init__(self, root: nn.Module):
        self.names = {id(m): n for n, m in root.named_modules(remove_duplicate=False)}
        self.stack: list[str] = []
        self.path: str | None = None

    def __enter__(self) -> "_ModuleStack":
        from torch.nn.modules import module as M

        def pre(mod, args):
            name = self.names.get(id(mod))
            if name is not None:
                self.stack.append(name)
                self.path = name

        def post(mod, args, out):
            if self.names.get(id(mod)) is not None and self.stack:
                self.stack.pop()
                self.path = self.stack[-1] if self.stack else None

        self.handles = [M.register_module_forward_pre_hook(pre), M.register_module_forward_hook(post)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()


def trace_export(module: nn.Module, example: Mapping[str, Any], labels: tuple[str, ...], granularity: str,
                 registry: OpRegistry = REGISTRY) -> Traced:
    ep = functional_program(export_program(module, example))
    gm_graph = ep.graph
    g = OpGraph()
    table = ParamTable(module, g)
    env: dict[fx.Node, Any] = {}
    placeholders = {n.name: n for n in gm_graph.nodes if n.op == "placeholder"}
    user_values = _user_input_values(ep, example)
    unique = name_allocator({k for k, v in example.items() if isinstance(v, torch.Tensor)})
    tensor_of: dict[fx.Node, torch.Tensor] = {}  # parameter/buffer/constant placeholder -> tensor

    for spec in ep.graph_signature.input_specs:
        kind = spec.kind.name
        node = placeholders[spec.arg.name]
        if kind == "USER_INPUT":
            arg, value = user_values[spec.arg.name]
            if isinstance(value, torch.Tensor):
                g.add(OpNode(arg, NodeKind.LABEL if arg in labels else NodeKind.INPUT))
                env[node] = Ref(arg)
            else:
                env[node] = value
        elif kind in ("PARAMETER", "BUFFER", "CONSTANT_TENSOR"):
            t = (module.get_parameter(spec.target) if kind == "PARAMETER" else
                 module.get_buffer(spec.target) if kind == "BUFFER" else ep.constants[spec.target])
            env[node] = ParamRef(table.name_of(t, spec.target))
            tensor_of[node] = t
        else:
            raise GraphError(f"torch.export input {spec.arg.name!r} of kind {kind} is not supported")

    groups = _module_groups(module, gm_graph, registry, tensor_of) if granularity == "module" else {}


    out_node = None
    for node in gm_graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            out_node = node
            continue
        if node.op == "get_attr":  # a constant of the graph (never trainable)
            value = _fetch(ep.graph_module, str(node.target))
            if not isinstance(value, torch.Tensor):
                raise GraphError(f"torch.export produced a get_attr of a {type(value).__name__}, which is not supported"
                                 f"{_where(node)}", node.name)
            env[node] = ParamRef(table.name_of(value, _constant_name(str(node.target))))
            continue
        if node.op != "call_function":
            raise GraphError(f"torch.export produced a {node.op} node, which is not supported{_where(node)}", node.name)
        group = groups.get(node)
        if group is not None:
            if node is group["output"]:
                name = unique(group["qualname"].replace(".", "_") or node.name)
                g.add(module_node(name, group["qualname"], group["module"], group["spec"], (env[group["input"]],), {}, table))
                env[node] = Ref(name)
            continue
        if is_assert(node.target):
            continue
        target = "operator.getitem" if node.target is operator.getitem else function_target(node.target, registry)
        # export drops .contiguous() when the tracing device's strides allow a view; another
        # device (or the meta device) may lay tensors out differently, so views become reshapes
        target = _STRIDE_AGNOSTIC.get(target, target)
        if target is None:
            raise GraphError(f"operator {describe(node.target)} has no registry name (only aten ops and "
                             "registered functions are supported)", node.name)
        name = unique(node.name)
        label = next(iter(reversed(node.meta.get("nn_module_stack", {}).values())), ("",))[0]
        g.add(OpNode(name, NodeKind.FUNCTION, target, convert_arg(node.args, env), convert_arg(node.kwargs, env), label=label))
        env[node] = Ref(name)

    outs = list(out_node.args[0]) if out_node is not None else []
    user_outs = []
    for spec, value in zip(ep.graph_signature.output_specs, outs):
        kind = spec.kind.name
        if kind == "USER_OUTPUT":
            user_outs.append(convert_arg(value, env) if isinstance(value, fx.Node) else value)
        elif kind == "BUFFER_MUTATION":
            log.warning("buffer %s is updated in the forward; the update is not replayed by fusion", spec.target)
        else:
            raise GraphError(f"torch.export output {spec.arg.name!r} of kind {kind} is not supported")
    returned = pytree.tree_unflatten(user_outs, ep.call_spec.out_spec)
    return Traced(g, returned, table.tensors, "export")


# -- making export's graph functional and flat -----------------------------------------
def functional_program(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """Inline higher-order ops over submodules, then functionalise in-place writes.

    ``torch.no_grad()`` / ``torch.set_grad_enabled`` and ``torch.autocast``
    regions reach the graph as ``wrap_with_set_grad_enabled`` /
    ``wrap_with_autocast`` calls of a submodule (a ``get_attr`` node). Their
    nodes are copied into the graph; the outputs of a grad-disabled region are
    detached (``aten.detach``), which keeps its meaning on an engine that runs
    the nodes under autograd. A disabled autocast region is the surrounding
    float computation; an enabled one is refused (mixed precision inside
    forward changes dtypes per op).

    In-place ATen ops that remain (``x[..., 1:] = y`` on a fresh tensor becomes
    ``slice`` + ``copy_``) go through export's functionalisation
    (``run_decompositions({})``: no decomposition, only ``slice_scatter`` /
    ``select_scatter`` for writes through views); graphs without them keep
    export's nodes as they are.
    """
    gm = ep.graph_module
    if _inline_regions(gm, gm):
        for n in [n for n in gm.graph.nodes if n.op == "get_attr" and not n.users]:
            gm.graph.erase_node(n)
        gm.graph.lint()
        gm.recompile()
    if any(_mutates(n) for n in ep.graph.nodes):
        ep = ep.run_decompositions({})
    return ep


def _mutates(node: fx.Node) -> bool:
    t = node.target
    return node.op == "call_function" and isinstance(t, torch._ops.OpOverload) and t._schema.is_mutable


def _where(node: fx.Node) -> str:
    """`` in module 'a.b.c'`` for a node with an nn_module_stack, else ''."""
    stack = node.meta.get("nn_module_stack") or {}
    path = next(iter(reversed(stack.values())), ("",))[0] if stack else ""
    return f" in module {path!r}" if path else " at the top level of forward"


def _fetch(root: nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _constant_name(target: str) -> str:
    return "constant." + target.replace(".", "_")


_REGION_ARGS = {"wrap_with_set_grad_enabled": 1, "wrap_with_autocast": 4}


def _inline_regions(root: fx.GraphModule, gm: fx.GraphModule) -> bool:
    """Replace every region call in ``gm`` (nested ones first) by its nodes; True when any was found."""
    graph = gm.graph
    found = False
    for node in list(graph.nodes):
        t = node.target
        if node.op != "call_function" or not isinstance(t, torch._ops.HigherOrderOperator):
            continue
        name = t.name()
        if name not in _REGION_ARGS:
            raise GraphError(f"torch.export produced the higher-order op {name}{_where(node)}, which is not supported",
                             node.name)
        k = _REGION_ARGS[name]
        flags, sub_node, inputs = node.args[:k], node.args[k], node.args[k + 1:]
        if name == "wrap_with_autocast" and flags[2]:
            raise GraphError(f"torch.autocast(enabled=True, dtype={flags[1]}) region{_where(node)} is not supported: "
                             "mixed precision inside forward changes dtypes per op; trace without it", node.name)
        detach = name == "wrap_with_set_grad_enabled" and not flags[0]
        sub = getattr(gm, str(sub_node.target))
        _inline_regions(root, sub)
        outs = _copy_region(root, gm, sub, node, inputs, detach)
        for user in list(node.users):
            if user.target is not operator.getitem or len(user.args) != 2:
                raise GraphError(f"the result of a {name} region is used whole{_where(node)}", node.name)
            user.replace_all_uses_with(outs[user.args[1]])
            graph.erase_node(user)
        graph.erase_node(node)
        found = True
    return found


def _copy_region(root: fx.GraphModule, gm: fx.GraphModule, sub: fx.GraphModule, call: fx.Node, inputs, detach: bool):
    graph = gm.graph
    env: dict[fx.Node, Any] = {}
    places = [n for n in sub.graph.nodes if n.op == "placeholder"]
    if len(places) != len(inputs):
        raise GraphError(f"region {call.name} takes {len(places)} inputs but is called with {len(inputs)}", call.name)
    env.update(zip(places, inputs))
    outs: list[Any] = []
    with graph.inserting_before(call):
        for n in sub.graph.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                outs = list(pytree.tree_leaves(n.args[0]))
                outs = [env[o] if isinstance(o, fx.Node) else o for o in outs]
                continue
            if n.op == "get_attr":
                value = _fetch(sub, str(n.target))
                attr = f"_inlined_{call.name}_{str(n.target).replace('.', '_')}"
                if isinstance(value, nn.Module):
                    gm.add_submodule(attr, value)
                else:
                    setattr(gm, attr, value)
                env[n] = graph.get_attr(attr)
                env[n].meta.update(n.meta)
                continue
            env[n] = graph.node_copy(n, lambda a: env[a])
        if detach:
            outs = [_detached(graph, o) for o in outs]
    return outs


def _detached(graph: fx.Graph, value: Any) -> Any:
    val = value.meta.get("val") if isinstance(value, fx.Node) else None
    if not isinstance(val, torch.Tensor) or not (val.is_floating_point() or val.is_complex()):
        return value
    d = graph.call_function(torch.ops.aten.detach.default, (value,))
    d.meta.update({k: v for k, v in value.meta.items() if k in ("val", "tensor_meta", "nn_module_stack", "stack_trace")})
    return d


def _user_input_values(ep, example: Mapping[str, Any]) -> dict[str, tuple[str, Any]]:
    """Placeholder name -> (forward argument name, example value) for every user input."""
    leaves, _ = pytree.tree_flatten_with_path(((), dict(example)))
    names = [s.arg.name for s in ep.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
    if len(leaves) != len(names):
        raise GraphError(f"torch.export made {len(names)} user inputs from {len(leaves)} example values")
    out = {}
    for name, (path, value) in zip(names, leaves):
        if len(path) != 2:
            raise GraphError(f"example value {pytree.keystr(path)} is nested; pass tensors or plain values per argument")
        out[name] = (path[1].key, value)
    return out


def _module_groups(module: nn.Module, graph: fx.Graph, registry: OpRegistry,
                   tensor_of: Mapping[fx.Node, torch.Tensor]) -> dict[fx.Node, dict]:
    """ATen node -> its leaf-module group, for groups that can become one MODULE node."""
    specs: dict[int, Any] = {}
    members: dict[str, list[fx.Node]] = {}
    info: dict[str, dict] = {}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        for key, (path, _cls) in (node.meta.get("nn_module_stack") or {}).items():
            try:
                mod = module.get_submodule(path)
            except AttributeError:
                break
            if id(mod) not in specs:
                specs[id(mod)] = leaf_spec(mod, registry) if path else None
            if specs[id(mod)] is not None:
                members.setdefault(key, []).append(node)
                info[key] = {"qualname": path, "module": mod, "spec": specs[id(mod)]}
                break
    out: dict[fx.Node, dict] = {}
    for key, nodes in members.items():
        group = info[key]
        if _fill_group(group, nodes, tensor_of):
            for n in nodes:
                out[n] = group
        else:
            log.debug("module %s stays at ATen granularity", group["qualname"])
    return out


def _fill_group(group: dict, nodes: list[fx.Node], tensor_of: Mapping[fx.Node, torch.Tensor]) -> bool:
    """Check a group is one clean single-tensor module call; record its input and output."""
    mod: nn.Module = group["module"]
    inside = set(nodes)
    own = {id(t) for t in list(mod.parameters()) + list(mod.buffers())}
    inputs, outputs = set(), []
    for n in nodes:
        for a in n.all_input_nodes:
            if a in inside:
                continue
            if a in tensor_of:
                if id(tensor_of[a]) not in own:
                    return False  # reads another module's tensor (or a constant)
                continue
            inputs.add(a)
        if any(u not in inside for u in n.users):
            outputs.append(n)
    if len(inputs) != 1 or len(outputs) != 1:
        return False
    sig = inspect.signature(type(mod).forward)
    required = [p for p in list(sig.parameters.values())[1:]
                if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(required) != 1:
        return False
    (inp,) = inputs
    val_in, val_out = inp.meta.get("val"), outputs[0].meta.get("val")
    if not isinstance(val_in, torch.Tensor) or not isinstance(val_out, torch.Tensor):
        return False
    target, attrs = group["spec"]
    try:
        with torch.device("meta"):
            probe = type(mod)(**attrs)
            floats = [t.dtype for t in mod.parameters() if t.is_floating_point()]
            probe = probe.to(floats[0]) if floats else probe
            got = probe(torch.empty(tuple(val_in.shape), dtype=val_in.dtype, device="meta"))
    except Exception:  # noqa: BLE001 - a module that cannot be probed stays at ATen granularity
        return False
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(val_out.shape) or got.dtype != val_out.dtype:
        return False
    group["input"], group["output"] = inp, outputs[0]
    return True

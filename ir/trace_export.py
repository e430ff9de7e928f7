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

from .errors import GraphError
from .graph import OpGraph
from .node import NodeKind, OpNode, ParamRef, Ref
from .registry import REGISTRY, OpRegistry
from .trace_common import (ParamTable, Traced, convert_arg, describe, function_target, is_assert, leaf_spec, module_node,
                           name_allocator)

log = logging.getLogger(__name__)

_STRIDE_AGNOSTIC = {"aten.view.default": "aten.reshape.default", "aten._unsafe_view.default": "aten.reshape.default"}


def export_program(module: nn.Module, example: Mapping[str, Any]) -> torch.export.ExportedProgram:
    """Run ``torch.export.export`` (non-strict) with ``example`` as keyword arguments.

    A module on the meta device is exported with meta example tensors (shapes only).
    """
    on_meta = any(t.device.type == "meta" for t in list(module.parameters()) + list(module.buffers()))
    kwargs = {k: (v.to("meta") if on_meta and isinstance(v, torch.Tensor) else v) for k, v in example.items()}
    return torch.export.export(module, (), kwargs, strict=False)


def trace_export(module: nn.Module, example: Mapping[str, Any], labels: tuple[str, ...], granularity: str,
                 registry: OpRegistry = REGISTRY) -> Traced:
    ep = export_program(module, example)
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
        if node.op != "call_function":
            raise GraphError(f"torch.export produced a {node.op} node, which is not supported", node.name)
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

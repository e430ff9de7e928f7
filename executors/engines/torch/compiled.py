"""Compiled parts: one sub-DAG as one generated Python function (a ``torch.fx.GraphModule``).

The interpreted torch engine walks its steps in a Python loop every
micro-batch: per node it looks up arguments in a dict, copies templates and
dispatches. A compiled part writes that walk out once, as straight-line
Python code in which every intermediate is a local variable::

    def forward(self, in_0, x):
        fc1 = self.fc1(x);  x = None
        h = torch.tanh(fc1);  fc1 = None
        ...
        return (h, loss)

so a micro-batch's forward is one call. The module runs *the same callables
on the same tensors in the same order* as the interpreter (module nodes call
the part's own ``nn.Module`` objects, parameters are the part's own
``nn.Parameter`` objects, registered by reference), so it is bit-identical to
the interpreted path, and autograd still records the graph that the
engine's backward pushes gradients through across the part boundary.
fx's generated code also drops each local as soon as its last user has run
(``x = None``), as the interpreted walk drops each value from its environment
(``fusion.ir.walk``, last-use freeing).

Optionally the GraphModule goes through ``torch.compile`` (``compile=True``):
Dynamo/Inductor fuse the part's forward and AOTAutograd its backward. That is
not bit-identical (fused kernels round differently) and costs a compile per
part on the first micro-batch.
"""
from __future__ import annotations

import operator
import re
from typing import Any, Protocol

import torch
from torch import fx, nn

from fusion.ir.node import NodeKind, ParamRef, Ref, map_nested, map_refs
from fusion.ir.walk import GraphWalk, Key


class Part(Protocol):
    """What a compiled module is written from: a torch engine part (``engine.TorchPart``) as this module reads it.

    walk:      the part's graph walk (:mod:`fusion.ir.walk`): its steps, callables and Ref addresses.
    modules:   node name -> the part's own ``nn.Module`` for that node.
    recv_keys: the activations the part receives, in argument order.
    send_keys: the activations the part sends, in result order.
    """

    walk: GraphWalk
    modules: dict[str, nn.Module]
    recv_keys: dict[Key, bool]
    send_keys: list[Key]


def _ident(name: str, taken: set[str]) -> str:
    """A fresh Python identifier that reads like ``name``."""
    base = re.sub(r"\W", "_", str(name)) or "v"
    if base[0].isdigit():
        base = "_" + base
    out, i = base, 1
    while out in taken:
        out, i = f"{base}_{i}", i + 1
    taken.add(out)
    return out


def build_part_module(part: Part) -> tuple[fx.GraphModule, int, bool]:
    """The GraphModule computing ``part``'s forward.

    Its arguments are the received activations in ``part.recv_keys`` order, then
    the part's input/label placeholders in node order; it returns the sent values in
    ``part.send_keys`` order followed by the summed loss when the part has loss nodes.
    Returns ``(module, number of sent values, has loss)``.
    """
    g = fx.Graph()
    root = nn.Module()
    taken: set[str] = set()
    env: dict[Any, fx.Node] = {}
    for key in part.recv_keys:
        env[key] = g.placeholder(_ident(f"in_{key[0]}" + ("" if key[1] is None else f"_{key[1]}"), taken))
    walk = part.walk  # the part's graph walk (fusion.ir.walk): its steps, callables and Ref addresses
    for s in walk.steps:
        if s.placeholder:
            env[s.name] = g.placeholder(_ident(s.name, taken))
    attrs: dict[int, fx.Node] = {}
    items: dict[tuple[Any, int], fx.Node] = {}

    def attr(t: torch.Tensor, hint: str) -> fx.Node:
        """A get_attr node for tensor ``t`` (the part's own object, registered by reference)."""
        n = attrs.get(id(t))
        if n is None:
            name = _ident(hint, taken)
            if isinstance(t, nn.Parameter):
                root.register_parameter(name, t)
            else:
                root.register_buffer(name, t, persistent=False)
            n = attrs[id(t)] = g.get_attr(name)
        return n

    def value(key: Any, idx: int | None) -> fx.Node:
        v = env[key]
        if idx is None:
            return v
        n = items.get((key, idx))
        if n is None:
            n = items[(key, idx)] = g.call_function(operator.getitem, (v, idx))
        return n

    def resolve(r):
        if isinstance(r, ParamRef):
            return attr(walk.param(r.name), f"p_{r.name}")
        key, idx = walk.env_key(r)
        return value(key, idx)

    def literal(v):
        return attr(v, "const") if isinstance(v, torch.Tensor) else v

    losses: list[fx.Node] = []
    for s in walk.steps:
        if s.placeholder:
            continue
        node = s.node
        args, kwargs = walk.literals(node)  # device literals on the part's device, as the walk has them
        args = map_nested(map_refs(args, resolve), literal)
        kwargs = map_nested(map_refs(kwargs, resolve), literal)
        if s.output:
            env[s.name] = args[0]
            continue
        if node.kind == NodeKind.MODULE or s.name in part.modules:
            target = _ident(s.name, taken)
            root.add_module(target, part.modules[s.name])
            out = g.create_node("call_module", target, tuple(args), kwargs, name=s.name)
        else:
            out = g.create_node("call_function", s.fn, tuple(args), kwargs, name=s.name)
        env[s.name] = out
        if s.loss:
            losses.append(out)
    outs = [value(k[0], k[1]) for k in part.send_keys]
    if losses:
        total = losses[0]
        for l in losses[1:]:
            total = g.call_function(operator.add, (total, l))
        outs.append(total)
    g.output(tuple(outs))
    g.lint()
    gm = fx.GraphModule(root, g, class_name="CompiledPart")
    # the generated code reads ``self.<name>`` for every module and tensor: put them in the instance
    # dict too (the same objects), so each read is a plain attribute lookup, not nn.Module.__getattr__
    for name, obj in [*gm._modules.items(), *gm._parameters.items(), *gm._buffers.items()]:
        object.__setattr__(gm, name, obj)
    return gm, len(part.send_keys), bool(losses)

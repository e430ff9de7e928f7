"""The op-node API: define a model node by node (FusionLLM Figure 7).

    b = GraphBuilder()
    x = b.input("x")
    y = b.label("y")
    h = b.module("conv1", "torch.nn.Conv2d", x, in_channels=3, out_channels=8, kernel_size=3, padding=1)
    h = b.module("myrelu", "CustomReLU", h)            # a user-registered module type
    h = b.function("flat", "torch.flatten", h, 1)
    b.loss("loss", "torch.nn.functional.cross_entropy", b.module("fc", "torch.nn.Linear", h, ...), y)
    model = b.build(example={"x": torch.randn(4, 3, 8, 8), "y": torch.randint(0, 10, (4,))}, seed=0)

Each call returns a :class:`~fusion.ir.node.Ref` to the new node's output;
index a multi-output node with ``Ref(name, i)``. Module parameters are named
``<node>.<path>`` unless ``params=`` maps them to shared names (tying).
"""
from __future__ import annotations

import inspect
from typing import Any

from fusion.ir.errors import GraphError
from fusion.ir.graph import OpGraph, ParamSpec
from fusion.ir.model import Model
from fusion.ir.node import NodeKind, OpNode, ParamRef, Ref
from fusion.ir.registry import REGISTRY, OpRegistry


class GraphBuilder:
    """Builds an :class:`OpGraph` node by node."""

    def __init__(self, registry: OpRegistry = REGISTRY):
        self.graph = OpGraph()
        self.registry = registry
        self._tensors: dict[str, Any] = {}  # explicitly declared parameter values

    def _target_name(self, target: Any, node: str | None = None) -> str:
        if isinstance(target, str):
            return target
        name = self.registry.registered_name(target)
        if name:
            return name
        mod = getattr(target, "__module__", "")
        if mod.startswith("torch.nn") and inspect.isclass(target):
            return f"torch.nn.{target.__name__}"
        # a library function object (torch.tanh, F.gelu, operator.add): find the public name it resolves from
        short = getattr(target, "__name__", "")
        for prefix in ("torch.nn.functional.", "torch.", "operator.", "math."):
            found = self.registry.resolve(prefix + short) if short else None
            if found is not None and found[1] is target:
                return prefix + short
        raise GraphError(f"{target!r} is not a registered op; register it with fusion.register_module/register_function", node)

    def input(self, name: str, label: str = "") -> Ref:
        self.graph.add(OpNode(name, NodeKind.INPUT, label=label))
        return Ref(name)

    def label(self, name: str, label: str = "") -> Ref:
        self.graph.add(OpNode(name, NodeKind.LABEL, label=label))
        return Ref(name)

    def parameter(self, name: str, value: Any, trainable: bool = True) -> ParamRef:
        """Declare a free parameter (passed to function nodes as an argument)."""
        import torch

        t = torch.as_tensor(value)
        self.graph.add_param(ParamSpec(name, tuple(t.shape), str(t.dtype).removeprefix("torch."), trainable))
        self._tensors[name] = t
        return ParamRef(name)

    def module(self, name: str, target: Any, *args: Any, label: str = "", params: dict[str, str] | None = None,
               call_kwargs: dict[str, Any] | None = None, **attrs: Any) -> Ref:
        """A parametric op node: ``target(**attrs)`` applied to ``args``.

        params: module attribute path -> graph parameter name, to share a
                parameter with another node; unmapped ones get ``<name>.<path>``.
        """
        import torch

        tname = self._target_name(target, name)
        found = self.registry.resolve(tname)
        if found is None or found[0] != "module":
            raise GraphError(f"unknown module type {tname!r}", name)
        try:
            with torch.device("meta"):
                mod = found[1](**attrs)
        except TypeError as e:
            raise GraphError(f"cannot build {tname}: {e}", name) from None
        mapping = dict(params or {})
        for path, t in list(mod.named_parameters(remove_duplicate=False)) + list(mod.named_buffers()):
            gname = mapping.setdefault(path, f"{name}.{path}")
            self.graph.add_param(ParamSpec(gname, tuple(t.shape), str(t.dtype).removeprefix("torch."),
                                           isinstance(t, torch.nn.Parameter) and t.requires_grad))
        self.graph.add(OpNode(name, NodeKind.MODULE, tname, tuple(args), dict(call_kwargs or {}), attrs, mapping, label))
        return Ref(name)

    def function(self, name: str, target: Any, *args: Any, label: str = "", **kwargs: Any) -> Ref:
        """A non-parametric op node: ``target(*args, **kwargs)``."""
        self.graph.add(OpNode(name, NodeKind.FUNCTION, self._target_name(target, name), tuple(args), kwargs, label=label))
        return Ref(name)

    def loss(self, name: str, target: Any, *args: Any, label: str = "", **kwargs: Any) -> Ref:
        """The loss node: a function (or a module type, built with no attrs) returning a scalar."""
        tname = self._target_name(target, name)
        found = self.registry.resolve(tname)
        if found is not None and found[0] == "module":
            self.graph.add(OpNode(name, NodeKind.LOSS, tname, tuple(args), {}, kwargs, {}, label))
        else:
            self.graph.add(OpNode(name, NodeKind.LOSS, tname, tuple(args), kwargs, label=label))
        return Ref(name)

    def output(self, name: str, value: Ref) -> Ref:
        self.graph.add(OpNode(name, NodeKind.OUTPUT, args=(value,)))
        return Ref(name)

    def build(self, example: dict[str, Any], seed: int = 0, device: str = "cpu") -> Model:
        """Validate, infer shapes from ``example`` and initialise weights with ``seed``.

        ``device="meta"`` builds without allocating weights (compile-only).
        """
        from fusion.ir.shapes import infer_meta
        from fusion.ir.init import init_params

        g = self.graph
        g.plugins = self.registry.plugin_modules({n.target for n in g})
        g.validate(self.registry)
        infer_meta(g, example)
        params = {} if device == "meta" else {**init_params(g, seed), **self._tensors}
        return Model(g, params, dict(example))

"""Shape inference: every node's output metadata, from one run of the graph on the meta device.

The IR defines an op by its torch semantics (:mod:`fusion.ir.torch_ops`), so shapes,
dtypes and ``requires_grad`` of every edge follow from running those semantics on
meta tensors: no memory is allocated and no weights are needed, so GPT-2-XL-sized
graphs are cheap. Engines run the same semantics for real; front ends (tracer,
op-node builder, ONNX importer) and the compiler call :func:`infer_meta`.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from fusion.ir.errors import GraphError
from fusion.ir.graph import OpGraph
from fusion.ir.node import NodeKind, OpNode, TensorMeta, ValueMeta
from fusion.ir.torch_ops import TORCH_DTYPES, build_module, dtype_name, make_call, node_callable, on_device, set_module_tensor
from fusion.ir.walk import GraphWalk

_META = torch.device("meta")


def output_meta(value: Any) -> tuple[tuple, bool]:
    """``(outputs, multi)`` metadata of a node's runtime output."""
    def one(v):
        if isinstance(v, torch.Tensor):
            return TensorMeta(tuple(int(s) for s in v.shape), dtype_name(v.dtype), bool(v.requires_grad))
        if isinstance(v, torch.Size):
            return ValueMeta(tuple(int(s) for s in v))
        if isinstance(v, (int, float, bool, str, type(None), torch.device, torch.dtype)):
            return ValueMeta(v)  # devices/dtypes: ``torch.arange(T, device=x.device)`` in traced models
        if isinstance(v, (tuple, list)) and all(isinstance(x, (int, float, bool)) for x in v):
            return ValueMeta(tuple(v))
        raise TypeError(type(v).__name__)

    if isinstance(value, (tuple, list)) and not isinstance(value, torch.Size) and any(isinstance(x, torch.Tensor) for x in value):
        return tuple(one(v) for v in value), True
    return (one(value),), False


def _meta_like(v: Any) -> torch.Tensor:
    """A meta tensor of a feed's shape and dtype (torch tensor or NumPy array)."""
    dtype = v.dtype if isinstance(v, torch.Tensor) else TORCH_DTYPES[str(v.dtype)]
    return torch.empty(tuple(v.shape), dtype=dtype, device=_META)


class _MetaWalk(GraphWalk):
    """The graph walk on the meta device: parameters and fed values are meta tensors of their shapes."""

    missing_feed = "no example value for this placeholder"

    def __init__(self, graph: OpGraph, params: Mapping[str, torch.Tensor]):
        self.params = params
        super().__init__(graph)

    def call(self, node: OpNode):
        if node.kind == NodeKind.OUTPUT:
            return None
        call, obj = node_callable(node)
        module = None
        if call == "module":
            module = build_module(node, obj)
            for path, pname in node.params.items():
                set_module_tensor(module, path, self.params[pname], self.graph.params[pname].trainable)
        return make_call(call, obj, module)

    def param(self, name: str) -> torch.Tensor:
        return self.params[name]

    def literals(self, node: OpNode) -> tuple[tuple, dict]:
        return on_device(node.args, _META), on_device(dict(node.kwargs), _META)

    def fetch_placeholder(self, name: str, value: Any) -> torch.Tensor:
        return _meta_like(value)


def infer_meta(graph: OpGraph, feeds: Mapping[str, Any]) -> OpGraph:
    """Fill every node's ``meta.outputs`` (and ``meta.multi``) by running the graph once on meta tensors.

    ``feeds`` holds a value (tensor or array) of the micro-batch shape for every placeholder.
    Trainable parameters are ``nn.Parameter`` so that ``requires_grad`` is recorded as training sees it.
    The walk is :class:`fusion.ir.walk.GraphWalk`'s; this pass says only how a node runs on the meta device.
    """
    params: dict[str, torch.Tensor] = {}
    for name, spec in graph.params.items():
        t = torch.empty(spec.shape, dtype=TORCH_DTYPES[spec.dtype], device=_META)
        params[name] = nn.Parameter(t) if spec.trainable else t

    def record(name: str, out: Any) -> None:
        node = graph[name]
        try:
            node.meta.outputs, node.meta.multi = output_meta(out)
        except TypeError as e:
            raise GraphError(f"output of type {e} is not supported (tensors, tuples of tensors, ints and shapes are)",
                             name) from None

    # Factory ops in the graph (torch.ones, torch.arange, ... without a device argument) must make
    # meta tensors too, or they would meet meta activations as CPU tensors.
    with torch.device(_META):
        walk = _MetaWalk(graph, params)
        walk.run({}, walk.feed(feeds), record)
    return graph


__all__ = ["infer_meta", "output_meta"]

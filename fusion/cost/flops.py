"""Measure what each OP-DAG node costs, on the meta device (no memory, no weights).

For every node we run its forward and then its backward once on meta tensors
of the recorded shapes, under :class:`torch.utils.flop_counter.FlopCounterMode`
and a small dispatch mode of our own:

- ``flops_fwd`` / ``flops_bwd``: FLOPs counted by ``FlopCounterMode`` (matmul,
  convolution, attention kernels). Backward FLOPs are *measured*, not taken as
  2x forward: a first Linear whose input needs no gradient costs 1x, a hidden one 2x.
- ``mem_fwd`` / ``mem_bwd``: bytes read and written by the ATen operators the
  FLOP counter counts as zero (embeddings, norms, softmax, element-wise,
  copies), i.e. memory-bound work; view operators move nothing, and gather-like
  operators (embedding lookup) read only the rows they output.
- ``saved_bytes``: activation bytes autograd keeps for backward (packed saved
  tensors, parameters excluded), per micro-batch.

Nodes with the same target, attributes, argument shapes and literals cost the
same, so each distinct signature runs once (a 48-block GPT has ~20). A node
that cannot run on meta keeps the FLOPs already in its ``NodeMeta`` (from an
importer, say), with backward = 2x forward, and is reported as not measured.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from fusion.ir.graph import OpGraph
from fusion.ir.node import IDLE_KINDS, OpNode, ParamRef, TensorMeta, ValueMeta, map_refs

log = logging.getLogger(__name__)

_TORCH_DTYPES = {
    "float64": torch.float64, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8,
    "uint8": torch.uint8, "bool": torch.bool, "complex64": torch.complex64, "complex128": torch.complex128,
}
_NO_TRAFFIC = ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "alias",
               "lift_fresh", "_unsafe_view", "_reshape_alias")
#: gather-like ops read only the rows they output, not their whole table
_GATHER = ("embedding", "index_select", "gather", "take", "index")


@dataclass(frozen=True)
class NodeCost:
    """Measured cost of one node for one micro-batch (see the module docstring)."""

    flops_fwd: float = 0.0
    flops_bwd: float = 0.0
    mem_fwd: float = 0.0
    mem_bwd: float = 0.0
    saved_bytes: float = 0.0
    measured: bool = True


class _Traffic(TorchDispatchMode):
    """Bytes read + written by non-view ATen ops that have no FLOP formula."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        packet = func.overloadpacket
        if packet in flop_registry or func.is_view or packet.__name__ in _NO_TRAFFIC:
            return out
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if packet.__name__ in _GATHER:
            ins = [t for t in tree_flatten((args, kwargs or {}))[0] if isinstance(t, torch.Tensor) and not t.is_floating_point()]
            self.bytes += 2 * _nbytes(outs) + _nbytes(ins)
        else:
            self.bytes += _nbytes([t for t in tree_flatten((args, kwargs or {}))[0] if isinstance(t, torch.Tensor)]) + _nbytes(outs)
        return out


def _nbytes(ts: list) -> float:
    return float(sum(t.numel() * t.element_size() for t in ts))


def measure_costs(graph: OpGraph, progress: bool = False) -> dict[str, NodeCost]:
    """Cost of every node; also writes ``flops_fwd``, ``flops_bwd``,
    ``mem_bytes_fwd`` and ``param_bytes`` into each node's ``NodeMeta``."""
    from tqdm import tqdm

    cache: dict[str, NodeCost] = {}
    out: dict[str, NodeCost] = {}
    owned: set[str] = set()
    nodes = list(graph.nodes.values())
    for node in tqdm(nodes, desc="estimate", unit="node", disable=True if not progress else None, leave=False):
        cost = NodeCost()
        if node.kind not in IDLE_KINDS:
            key = _signature(graph, node)
            if key not in cache:
                cache[key] = _measure(graph, node)
            cost = cache[key]
        out[node.name] = cost
        m = node.meta
        m.flops_fwd, m.flops_bwd, m.mem_bytes_fwd = cost.flops_fwd, cost.flops_bwd, cost.mem_fwd
        mine = [p for p in node.param_names() if p not in owned]
        owned.update(mine)
        m.param_bytes = int(sum(graph.params[p].nbytes for p in mine))
    log.info("measured %d nodes (%d distinct signatures)", len(nodes), len(cache))
    return out


def _describe(graph: OpGraph, r: Any) -> Any:
    if isinstance(r, ParamRef):
        p = graph.params[r.name]
        return ("param", p.shape, p.dtype, p.trainable)
    node = graph[r.node]
    outs = node.meta.outputs
    chosen = outs if r.index is None and node.meta.multi else (outs[r.index or 0],) if outs else ()
    return ("ref", r.index is None, tuple(_meta_key(o) for o in chosen))


def _meta_key(o: Any) -> Any:
    if isinstance(o, TensorMeta):
        return ("T", o.shape, o.dtype, o.requires_grad)
    return ("V", repr(o.value))


def _signature(graph: OpGraph, node: OpNode) -> str:
    def d(r):
        return _describe(graph, r)

    params = tuple((path, graph.params[g].shape, graph.params[g].trainable) for path, g in sorted(node.params.items()))
    return repr((node.kind.value, node.target, sorted(node.attrs.items()), map_refs(node.args, d),
                 sorted(map_refs(node.kwargs, d).items()), params))


def _fake(meta: Any) -> Any:
    if isinstance(meta, ValueMeta):
        return meta.value
    t = torch.empty(meta.shape, dtype=_TORCH_DTYPES[meta.dtype], device="meta")
    if meta.requires_grad and t.is_floating_point():
        t.requires_grad_(True)
    return t


def _meta_param(spec) -> torch.Tensor:
    t = torch.empty(spec.shape, dtype=_TORCH_DTYPES[spec.dtype], device="meta")
    return torch.nn.Parameter(t, requires_grad=spec.trainable) if t.is_floating_point() else t


def node_inputs(graph: OpGraph, node: OpNode, params: dict[str, torch.Tensor], tensor=None, param=None):
    """``(args, kwargs)`` of ``node`` with every reference made a tensor: ``tensor(meta)`` for a producer's
    recorded output, ``param(spec)`` for a graph parameter (made once, kept in ``params``); meta tensors by
    default. :mod:`fusion.cost.node_times` passes makers of real tensors."""
    tensor, param = tensor or _fake, param or _meta_param

    def get(r):
        if isinstance(r, ParamRef):
            if r.name not in params:
                params[r.name] = param(graph.params[r.name])
            return params[r.name]
        src = graph[r.node]
        outs = src.meta.outputs
        if not outs:
            raise ValueError(f"producer {r.node!r} has no shape metadata")
        if r.index is None:
            return tuple(tensor(o) for o in outs) if src.meta.multi else tensor(outs[0])
        return tensor(outs[r.index])

    return map_refs(node.args, get), map_refs(node.kwargs, get)


def _to_meta_devices(args, kwargs):
    """``args``, ``kwargs`` with every device a node names (``x.to(device=...)``, ``torch.arange(..., device=...)``
    as traced from transformers models) made the meta device: measured on meta, a copy to the CPU would need data
    (``Cannot copy out of meta tensor``), and where a tensor would live does not change its FLOPs or bytes."""
    from torch.utils._pytree import tree_map

    meta = torch.device("meta")
    args, kwargs = tree_map(lambda v: meta if isinstance(v, torch.device) else v, (args, kwargs))
    if isinstance(kwargs.get("device"), str):
        kwargs = {**kwargs, "device": meta}
    return args, kwargs


def _measure(graph: OpGraph, node: OpNode) -> NodeCost:
    from fusion.ir.torch_ops import build_module, make_call, node_callable

    try:
        call, obj = node_callable(node)
        params: dict[str, torch.Tensor] = {}
        module = None
        if call == "module":
            module = build_module(node, obj)
            for path, gname in node.params.items():
                t = module.get_parameter(path) if _is_param(module, path) else module.get_buffer(path)
                t.requires_grad_(graph.params[gname].trainable and t.is_floating_point())
                params[gname] = t
        fn = make_call(call, obj, module)
        args, kwargs = _to_meta_devices(*node_inputs(graph, node, params))
        param_ids = {id(p) for p in params.values()}
        saved: dict[int, torch.Tensor] = {}

        def pack(t):
            if id(t) not in param_ids and not (t._base is not None and id(t._base) in param_ids):
                saved[id(t)] = t
            return t

        fwd_traffic = _Traffic()
        with FlopCounterMode(display=False) as fwd_flops, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with fwd_traffic:
                out = fn(*args, **kwargs)
        roots = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        bwd_traffic = _Traffic()
        bwd = 0.0
        if roots:
            with FlopCounterMode(display=False) as bwd_flops, bwd_traffic:
                torch.autograd.backward(roots, [torch.ones_like(t) if t.dim() == 0 else torch.empty_like(t) for t in roots])
            bwd = float(bwd_flops.get_total_flops())
        return NodeCost(float(fwd_flops.get_total_flops()), bwd, fwd_traffic.bytes, bwd_traffic.bytes,
                        float(sum(t.numel() * t.element_size() for t in saved.values())))
    except Exception as e:  # any op that meta tensors do not support: fall back, loudly
        log.warning("node %r (%s): cannot measure on meta (%s: %s); using its recorded FLOPs, backward = 2x forward",
                    node.name, node.target, type(e).__name__, e)
        f = float(node.meta.flops_fwd)
        mb = float(node.meta.mem_bytes_fwd)
        return NodeCost(f, 2 * f, mb, 2 * mb, float(node.meta.output_bytes), measured=False)


def _is_param(module: torch.nn.Module, path: str) -> bool:
    try:
        module.get_parameter(path)
        return True
    except AttributeError:
        return False

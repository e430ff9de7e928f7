"""The torch engine: runs one sub-DAG with torch autograd.

An engine part takes framework-neutral inputs (NumPy arrays keyed by
``(producer, index)``) and returns framework-neutral outputs, so parts on
different engines can feed each other. Inside a part, torch autograd does the
local backward; across parts, gradients arrive as arrays and are pushed into
the part's autograd graph with ``torch.autograd.backward`` (remote autodiff).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np
import torch
from torch import nn

from ..ir.boundary import SubGraph
from ..ir.errors import GraphError
from ..ir.graph import OpGraph
from ..ir.node import NodeKind, ParamRef, Ref, TensorMeta, ValueMeta, map_nested, map_refs
from .torch_build import build_module, make_call, node_callable, set_module_tensor

Key = tuple[str, "int | None"]

TORCH_DTYPES = {
    "float64": torch.float64, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8,
    "uint8": torch.uint8, "bool": torch.bool,
}


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def to_array(t: torch.Tensor) -> np.ndarray:
    """A NumPy view (CPU) or copy (other devices) of a tensor, detached."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)  # raw bits; wire records the dtype
    return t.numpy()


def from_array(a: Any, device: torch.device | str = "cpu") -> torch.Tensor:
    if isinstance(a, torch.Tensor):
        return a.to(device)
    arr = np.asarray(a)
    if not arr.flags.writeable:
        arr = arr.copy()
    return torch.from_numpy(arr).to(device)


def from_wire(a: Any, dtype: str | None, device: torch.device | str = "cpu") -> torch.Tensor:
    """An array from the wire, a checkpoint or a feed as a tensor of the graph's ``dtype``.

    NumPy has no bfloat16, so bfloat16 tensors travel as their raw bits in uint16
    (or int16) arrays: those are viewed back, bit for bit. A float array fed to a
    placeholder of another float dtype (float32 data for a bfloat16 model) is cast
    with torch's rounding, as ``x.to(dtype)`` would.
    """
    t = from_array(a, device)
    if dtype is None or dtype_name(t.dtype) == dtype:
        return t
    want = TORCH_DTYPES.get(dtype)
    if want is torch.bfloat16 and t.dtype in (torch.uint16, torch.int16):
        return t.view(torch.bfloat16)
    if want is not None and want.is_floating_point and t.is_floating_point():
        return t.to(want)
    return t


@dataclass
class _Step:
    """One node, prepared for the forward loop.

    args/kwargs are templates: literals, and parameters already resolved to
    their tensors; ``arg_refs``/``kw_refs`` list the slots that take values
    computed in this run as ``(slot, env key, index)``. The env holds local
    outputs under the node name and received activations under their
    ``(producer, index)`` key, so one lookup serves both.
    """

    name: str
    kind: NodeKind
    fn: Callable[..., Any] | None
    args: tuple
    kwargs: dict
    fast: bool  # args/kwargs hold only top-level refs and literals
    arg_refs: tuple = ()
    kw_refs: tuple = ()
    placeholder: bool = False
    output: bool = False
    loss: bool = False


@dataclass
class _Stash:
    """Autograd state of one in-flight micro-batch."""

    leaves: dict[Key, torch.Tensor] = field(default_factory=dict)
    sent: dict[Key, torch.Tensor] = field(default_factory=dict)
    loss: torch.Tensor | None = None


class TorchPart:
    """One sub-DAG on the torch engine.

    params: graph parameter name -> initial value for every parameter this
            part's nodes read. Trainable ones become ``nn.Parameter``.
    """

    engine = "torch"

    def __init__(self, graph: OpGraph, sub: SubGraph, params: Mapping[str, Any], device: str | torch.device = "cpu"):
        self.graph = graph
        self.sub = sub
        self.device = torch.device(device)
        self.params: dict[str, torch.Tensor] = {}
        for node_name in sub.nodes:
            for pname in graph[node_name].param_names():
                if pname in self.params:
                    continue
                spec = graph.params[pname]
                if pname not in params and self.device.type != "meta":
                    raise GraphError(f"no initial value for parameter {pname!r}", node_name)
                t = from_wire(params[pname], spec.dtype, self.device).clone() if self.device.type != "meta" else \
                    torch.empty(spec.shape, dtype=TORCH_DTYPES[spec.dtype], device="meta")
                if tuple(t.shape) != tuple(spec.shape):
                    raise GraphError(f"parameter {pname!r} has shape {tuple(t.shape)}, graph says {spec.shape}", node_name)
                self.params[pname] = nn.Parameter(t) if spec.trainable else t
        self.modules: dict[str, nn.Module] = {}
        self._local = set(sub.nodes)
        self.steps = [self._make_step(n) for n in sub.nodes]
        self.recv_keys: dict[Key, bool] = {}
        for e in sub.boundary.required_acts:
            self.recv_keys[e.key] = self.recv_keys.get(e.key, False) or e.requires_grad
        self.send_keys: list[Key] = list(dict.fromkeys(e.key for e in sub.boundary.sent_acts))
        #: the graph's dtype of every received activation and fed placeholder (bfloat16 arrives as bits)
        self.dtypes: dict[Any, str | None] = {k: getattr(graph.output_meta(*k), "dtype", None) for k in self.recv_keys}
        self.dtypes.update({n: getattr(graph.output_meta(n, None), "dtype", None) for n in sub.nodes
                            if graph[n].kind in (NodeKind.INPUT, NodeKind.LABEL)})
        self.stash: dict[Any, _Stash] = {}

    # -- building ---------------------------------------------------------------
    def _make_step(self, name: str) -> _Step:
        node = self.graph[name]
        call, obj = node_callable(node)
        fn = None
        if call == "module":
            mod = build_module(node, obj)
            for path, pname in node.params.items():
                set_module_tensor(mod, path, self.params[pname], self.graph.params[pname].trainable)
            leftovers = [n for n, t in list(mod.named_parameters()) + list(mod.named_buffers()) if t.device.type == "meta"]
            if leftovers and self.device.type != "meta":
                raise GraphError(f"module tensors {leftovers} have no graph parameter (node.params is incomplete)", name)
            mod.to(self.device) if self.device.type != "meta" else None
            self.modules[name] = mod
            fn = make_call(call, obj, mod)
        elif call == "method" and self._tensor_arg(node):
            fn = getattr(torch.Tensor, obj)  # the receiver is a tensor: call the unbound method, no wrapper
        elif call in ("function", "method"):
            fn = make_call(call, obj, None)
        args, kwargs = _on_device(node.args, self.device), _on_device(dict(node.kwargs), self.device)
        fast = all(not isinstance(a, (list, tuple, dict)) for a in args) and \
            all(not isinstance(v, (list, tuple, dict)) for v in kwargs.values())
        step = _Step(name, node.kind, fn, args, kwargs, fast, placeholder=node.kind in (NodeKind.INPUT, NodeKind.LABEL),
                     output=node.kind == NodeKind.OUTPUT, loss=node.kind == NodeKind.LOSS)
        if fast:  # resolve parameters now, leave slots for values computed per run
            arg_refs, kw_refs = [], []
            targs = list(args)
            for i, a in enumerate(args):
                if isinstance(a, ParamRef):
                    targs[i] = self.params[a.name]
                elif isinstance(a, Ref):
                    arg_refs.append((i, *self._env_key(a)))
            for k, v in kwargs.items():
                if isinstance(v, ParamRef):
                    kwargs[k] = self.params[v.name]
                elif isinstance(v, Ref):
                    kw_refs.append((k, *self._env_key(v)))
            step.args, step.kwargs, step.arg_refs, step.kw_refs = tuple(targs), kwargs, tuple(arg_refs), tuple(kw_refs)
        return step

    def _tensor_arg(self, node) -> bool:
        """Whether shape inference says the node's first argument is a tensor."""
        a = node.args[0] if node.args else None
        if isinstance(a, ParamRef):
            return True
        if not isinstance(a, Ref) or a.node not in self.graph.nodes:
            return False
        outs = self.graph[a.node].meta.outputs
        i = a.index or 0
        return i < len(outs) and isinstance(outs[i], TensorMeta) and (a.index is not None or len(outs) == 1)

    def _env_key(self, r: Ref) -> tuple[Any, int | None]:
        """Where a Ref's value lives in the forward env: ``(name, index)`` for a local
        output, ``((producer, index), None)`` for an activation received from another part."""
        return (r.node, r.index) if r.node in self._local else ((r.node, r.index), None)

    # -- forward -----------------------------------------------------------------
    def forward(self, mb_key: Any, inputs: Mapping[Key, Any], feeds: Mapping[str, Any],
                record: Callable[[str, Any], None] | None = None) -> tuple[dict[Key, Any], float | None]:
        """Run the sub-DAG for one micro-batch.

        inputs: activations from other parts, keyed by ``(producer, index)``.
        feeds:  values of this part's input/label placeholders.
        Returns the activations to send (arrays or values) and this part's
        loss (None when the part has no loss node).
        """
        st = _Stash()
        env: dict[Any, Any] = {}
        for key, needs_grad in self.recv_keys.items():
            if key not in inputs:
                raise GraphError(f"missing activation {key} from another part", key[0])
            v = inputs[key]
            if isinstance(v, (np.ndarray, torch.Tensor)):
                v = from_wire(v, self.dtypes[key], self.device)
                if needs_grad and v.is_floating_point():
                    v = v.detach().requires_grad_(True)
            st.leaves[key] = env[key] = v
        get = None
        losses = []
        for s in self.steps:
            if s.placeholder:
                if s.name not in feeds:
                    raise GraphError("no data fed to this placeholder", s.name)
                out = from_wire(feeds[s.name], self.dtypes[s.name], self.device)
            else:
                if s.fast:
                    args = s.args
                    if s.arg_refs:
                        args = list(args)
                        for i, key, idx in s.arg_refs:
                            v = env[key]
                            args[i] = v if idx is None else v[idx]
                    kwargs = s.kwargs
                    if s.kw_refs:
                        kwargs = dict(kwargs)
                        for k, key, idx in s.kw_refs:
                            v = env[key]
                            kwargs[k] = v if idx is None else v[idx]
                else:
                    if get is None:
                        get = self._resolver(env)
                    args = map_refs(s.args, get)
                    kwargs = map_refs(s.kwargs, get)
                if s.output:
                    out = args[0]
                else:
                    out = s.fn(*args, **kwargs)
                    if s.loss:
                        losses.append(out)
            env[s.name] = out
            if record is not None:
                record(s.name, out)
        for key in self.send_keys:
            v = env[key[0]]
            st.sent[key] = v if key[1] is None else v[key[1]]
        st.loss = sum(losses[1:], losses[0]) if losses else None
        self.stash[mb_key] = st
        sent = {k: (to_array(v) if isinstance(v, torch.Tensor) else v) for k, v in st.sent.items()}
        return sent, (float(st.loss.detach()) if st.loss is not None and self.device.type != "meta" else None)

    def _resolver(self, env: dict[Any, Any]):
        """Ref/ParamRef -> value, for arguments nested in lists, tuples or dicts."""
        params = self.params

        def get(r):
            if isinstance(r, ParamRef):
                return params[r.name]
            key, idx = self._env_key(r)
            v = env[key]
            return v if idx is None else v[idx]

        return get

    # -- backward ----------------------------------------------------------------
    def backward(self, mb_key: Any, grads: Mapping[Key, Any], loss_scale: float = 1.0) -> dict[Key, np.ndarray]:
        """Backward for one micro-batch.

        grads: gradients of this part's sent activations, already summed over
               the actual users in other parts.
        loss_scale: d(total loss)/d(this part's loss), e.g. 1/n_micro_batches.
        Returns gradients of the received activations that require grad.
        Parameter gradients accumulate in ``.grad`` across micro-batches.
        """
        st = self.stash.pop(mb_key, None)
        if st is None:
            raise RuntimeError(f"backward of micro-batch {mb_key} before its forward (or twice); the schedule is wrong")
        roots, seeds = [], []
        if st.loss is not None and st.loss.requires_grad:
            roots.append(st.loss)
            seeds.append(torch.full_like(st.loss, loss_scale))
        for key, g in grads.items():
            t = st.sent.get(key)
            if t is None:
                raise GraphError(f"gradient for {key} which this part did not send", key[0])
            if isinstance(t, torch.Tensor) and t.requires_grad:
                gt = from_wire(g, dtype_name(t.dtype), self.device)
                if tuple(gt.shape) != tuple(t.shape):
                    raise GraphError(f"gradient shape {tuple(gt.shape)} != activation shape {tuple(t.shape)}", key[0])
                roots.append(t)
                seeds.append(gt.to(t.dtype))
        if roots:
            torch.autograd.backward(roots, seeds)
        out: dict[Key, np.ndarray] = {}
        for key, needs_grad in self.recv_keys.items():
            leaf = st.leaves[key]
            if not needs_grad or not isinstance(leaf, torch.Tensor) or not leaf.requires_grad:
                continue
            g = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            out[key] = to_array(g)
        return out

    # -- parameters ----------------------------------------------------------------
    def trainable(self) -> dict[str, nn.Parameter]:
        return {n: p for n, p in self.params.items() if isinstance(p, nn.Parameter)}

    def state(self) -> dict[str, np.ndarray]:
        return {n: to_array(p).copy() for n, p in self.params.items()}

    def grads(self) -> dict[str, np.ndarray | None]:
        return {n: (None if p.grad is None else to_array(p.grad)) for n, p in self.trainable().items()}

    def set_grad(self, name: str, grad: Any) -> None:
        p = self.params[name]
        p.grad = from_wire(grad, dtype_name(p.dtype), self.device).to(p.dtype).clone()


def _on_device(v: Any, device: torch.device) -> Any:
    """Device literals in a graph mean "the device this part runs on" (graphs are device-neutral:
    a traced ``torch.arange(T, device=x.device)`` must follow its part to a GPU or the meta device)."""
    return map_nested(v, lambda x: device if isinstance(x, torch.device) else x)


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


def infer_meta(graph: OpGraph, feeds: Mapping[str, Any], device: str = "meta") -> OpGraph:
    """Fill every node's ``meta.outputs`` by running the graph once.

    Runs on the meta device by default: no memory is allocated and no weights
    are needed, so GPT-2-XL-sized graphs are cheap. ``feeds`` may hold real
    tensors or meta tensors of the micro-batch shape.
    """
    from ..ir.boundary import subgraph

    sub = subgraph(graph, graph.nodes)
    if device == "meta":
        feeds = {k: (torch.empty(tuple(v.shape), dtype=v.dtype, device="meta") if isinstance(v, torch.Tensor)
                     else torch.empty(v.shape, dtype=TORCH_DTYPES[str(v.dtype)], device="meta")) for k, v in feeds.items()}
        params = {}
    else:
        params = {n: torch.zeros(p.shape, dtype=TORCH_DTYPES[p.dtype]) for n, p in graph.params.items()}
    part = TorchPart(graph, sub, params, device=device)

    def record(name: str, value: Any) -> None:
        try:
            outs, multi = output_meta(value)
        except TypeError as e:
            raise GraphError(f"output of type {e} is not supported (tensors, tuples of tensors, ints and shapes are)", name) from None
        graph.nodes[name].meta.outputs = outs
        graph.nodes[name].meta.multi = multi

    # grad mode on: requires_grad is recorded. On the meta device, factory ops in the
    # graph (torch.ones, torch.arange, ... without a device argument) must make meta
    # tensors too, or they would meet meta activations as CPU tensors.
    if device == "meta":
        with torch.device("meta"):
            part.forward("meta", {}, feeds, record=record)
    else:
        part.forward("meta", {}, feeds, record=record)
    part.stash.clear()
    return graph

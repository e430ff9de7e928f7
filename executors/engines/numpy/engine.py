"""The NumPy engine: a second, torch-free engine for one sub-DAG.

It implements the ``EnginePart`` protocol (``fusion.executors.engines.base``):
arrays in, arrays out, forward with a per-micro-batch tape, backward by
vector-Jacobian products node by node in reverse topological order, and
local SGD/AdamW updates written in NumPy with torch's formulas. Its op table
is :data:`OPS` (torch-style targets from ``numpy_ops`` plus ``onnx.*``
targets from ``numpy_onnx_ops``); :func:`supports` answers compile-time
checks. Nothing in this module's import chain imports torch, so a CompNode
can run it on a host without torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np

from fusion.ir.boundary import SubGraph
from fusion.ir.errors import GraphError
from fusion.ir.graph import OpGraph
from fusion.ir.node import IDLE_KINDS, NodeKind, OpNode, ParamRef, Ref, TensorMeta
from fusion.ir.walk import GraphWalk, Key, Step
from fusion.executors.engines.base import EnginePart
from fusion.executors.engines.numpy.ops import NpOp
from fusion.executors.engines.numpy.torch_ops import TORCH_STYLE
from fusion.executors.engines.numpy.onnx_ops import ONNX_NUMPY

#: every target the NumPy engine implements
OPS: dict[str, NpOp] = {**TORCH_STYLE, **ONNX_NUMPY}


def supports(target: str) -> bool:
    """Whether the NumPy engine implements op ``target``."""
    return target in OPS


def node_problem(node: OpNode) -> str | None:
    """Why this node cannot run on the NumPy engine (argument structure), or None."""
    if node.kind in IDLE_KINDS:
        return None
    for v in node.kwargs.values():
        if isinstance(v, (Ref, ParamRef)):
            return "tensor keyword arguments are not supported; pass tensors positionally"
    for a in node.args:
        if isinstance(a, (list, tuple, dict)) and any(isinstance(x, (Ref, ParamRef)) for x in _flat(a)):
            return "tensors nested in lists are not supported"
    if any(isinstance(m, TensorMeta) and m.dtype == "bfloat16" for m in node.meta.outputs):
        return "bfloat16 tensors are not supported (NumPy has no bfloat16); run this part on the torch engine"
    op = OPS.get(node.target)
    if op is not None and op.module and node.kind not in (NodeKind.MODULE, NodeKind.LOSS):
        return "a module op used as a function"
    if op is not None and not op.module and node.kind == NodeKind.MODULE:
        return "a function op used as a module"
    return None


def _flat(v):
    if isinstance(v, (list, tuple)):
        for x in v:
            yield from _flat(x)
    elif isinstance(v, dict):
        for x in v.values():
            yield from _flat(x)
    else:
        yield v


@dataclass
class _Tape:
    """What one in-flight micro-batch keeps for its backward."""

    ctx: dict[str, Any] = field(default_factory=dict)
    needs_grad: set[str] = field(default_factory=set)  # nodes whose output depends on something trainable
    leaf_grad: dict[Key, bool] = field(default_factory=dict)
    sent: dict[Key, Any] = field(default_factory=dict)
    multi: dict[str, int] = field(default_factory=dict)  # node -> number of outputs (multi-output nodes)
    losses: list[str] = field(default_factory=list)


def _is_float(x: Any) -> bool:
    return isinstance(x, np.ndarray) and np.issubdtype(x.dtype, np.floating)


def _asarray(v: Any) -> Any:
    if isinstance(v, (bool, int, float, str, type(None), tuple, list)):
        return v
    return np.asarray(v)  # NumPy arrays, and anything with __array__ (CPU torch tensors in the same process)


class NumpyPart(EnginePart):
    """One sub-DAG on the NumPy engine (``engine = "numpy"``).

    params: graph parameter name -> initial value (array-like) for every
            parameter this part's nodes read; trainable ones get gradients.
    """

    engine = "numpy"

    def forget(self, mb_key: Any = None) -> None:
        """Drop the tapes of micro-batch ``mb_key`` (None: of every one)."""
        if mb_key is None:
            self.stash.clear()
        else:
            self.stash.pop(mb_key, None)

    def __init__(self, graph: OpGraph, sub: SubGraph, params: Mapping[str, Any], device: str = "cpu"):
        if str(device) not in ("cpu", "meta"):
            raise GraphError(f"the numpy engine runs on the CPU, not on {device!r}")
        self.graph, self.sub = graph, sub
        self.params: dict[str, np.ndarray] = {}
        self.trainable_names: list[str] = []
        self._grads: dict[str, np.ndarray | None] = {}
        for name in sub.nodes:
            node = graph[name]
            for pname in node.param_names():
                if pname in self.params:
                    continue
                spec = graph.params[pname]
                if pname not in params:
                    raise GraphError(f"no initial value for parameter {pname!r}", name)
                value = np.array(_asarray(params[pname]), dtype=spec.dtype, copy=True)
                if tuple(value.shape) != tuple(spec.shape):
                    raise GraphError(f"parameter {pname!r} has shape {value.shape}, graph says {spec.shape}", name)
                self.params[pname] = value
                if spec.trainable:
                    self.trainable_names.append(pname)
                    self._grads[pname] = None
        self._local = frozenset(sub.nodes)
        self._trainable_set = frozenset(self.trainable_names)
        #: the op of every compute node (what backward's vector-Jacobian products use)
        self.ops: dict[str, NpOp] = {}
        #: the tape of the micro-batch whose forward is running (the walk's callables write to it)
        self._tape: _Tape | None = None
        #: the part's nodes ready to run (the graph walk of :mod:`fusion.ir.walk`; fills ``ops``)
        self.walk = _NumpyWalk(self)
        self.steps = self.walk.steps
        self.recv_keys: dict[Key, bool] = self.walk.recv_keys
        self.send_keys: list[Key] = self.walk.send_keys
        self.stash: dict[Any, _Tape] = {}

    def _op(self, node: OpNode) -> NpOp:
        op = OPS.get(node.target)
        if op is None:
            raise GraphError(f"the numpy engine has no op {node.target!r}", node.name)
        why = node_problem(node)
        if why:
            raise GraphError(f"the numpy engine cannot run {node.target}: {why}", node.name)
        self.ops[node.name] = op
        return op

    def _call(self, node: OpNode) -> Callable[..., Any]:
        """The callable of ``node`` for the walk: runs the op's forward and writes what backward needs
        (the op's context when a gradient flows through the node, the number of outputs) to the tape."""
        name, kind = node.name, node.kind
        op = None if kind == NodeKind.OUTPUT else self._op(node)
        trainable = self._trainable_set
        # whether a gradient flows through the node: static for parameters, per run for values
        static = any(r.name in trainable for r in node.param_refs()) or \
            any(p in trainable for p in node.params.values())
        local = tuple(r.node for r in node.refs() if r.node in self._local)
        received = tuple((r.node, r.index) for r in node.refs() if r.node not in self._local)
        keeps = kind == NodeKind.OUTPUT or op.vjp is not None
        module = {p: g for p, g in node.params.items()} if op is not None and op.module else None
        attrs = dict(node.attrs)
        params = self.params

        def fn(*args, **kwargs):
            tape = self._tape
            if op is None:
                out, ctx = args[0], None
            elif module is not None:
                out, ctx = op.fwd({p: params[g] for p, g in module.items()}, attrs, *args, **kwargs)
            else:
                out, ctx = op.fwd(*args, **kwargs)
            if isinstance(out, tuple):
                tape.multi[name] = len(out)
            if keeps and (static or any(n in tape.needs_grad for n in local)
                          or any(tape.leaf_grad.get(k, False) for k in received)):
                tape.needs_grad.add(name)
                tape.ctx[name] = ctx
            if kind == NodeKind.LOSS:
                tape.losses.append(name)
            return out

        return fn

    # -- forward -----------------------------------------------------------------------
    def forward(self, mb_key: Any, inputs: Mapping[Key, Any], feeds: Mapping[str, Any]) -> tuple[dict[Key, Any], float | None]:
        """Run the sub-DAG for one micro-batch (same contract as ``TorchPart.forward``)."""
        tape = _Tape()
        leaves = self.walk.receive(inputs)
        for key, needs_grad in self.recv_keys.items():
            tape.leaf_grad[key] = needs_grad and _is_float(leaves[key])
        fed = self.walk.feed(feeds)
        self._tape = tape
        try:
            sent, losses = self.walk.run(leaves, fed)
        finally:
            self._tape = None
        tape.sent = sent
        self.stash[mb_key] = tape
        loss = float(sum(float(np.asarray(v)) for v in losses)) if losses else None
        return dict(sent), loss

    # -- backward ----------------------------------------------------------------------
    def backward(self, mb_key: Any, grads: Mapping[Key, Any], loss_scale: float = 1.0) -> dict[Key, np.ndarray]:
        """Reverse pass by VJPs; accumulates parameter gradients; returns received activations' gradients."""
        tape = self.stash.pop(mb_key)
        out_grad: dict[Key, np.ndarray] = {}  # (node, index) -> gradient of that output

        def add(key: Key, g: np.ndarray) -> None:
            out_grad[key] = g if key not in out_grad else out_grad[key] + g

        for name in tape.losses:
            if name in tape.needs_grad:
                add((name, None), np.asarray(loss_scale, dtype=np.float32))
        for key, g in grads.items():
            if key not in tape.sent:
                raise GraphError(f"gradient for {key} which this part did not send", key[0])
            sent = tape.sent[key]
            g = np.asarray(g)
            if isinstance(sent, np.ndarray) and g.shape != sent.shape:
                raise GraphError(f"gradient shape {g.shape} != activation shape {sent.shape}", key[0])
            add(key, g.astype(sent.dtype, copy=False) if isinstance(sent, np.ndarray) else g)
        leaf_out: dict[Key, np.ndarray] = {}
        trainable = set(self.trainable_names)
        for s in reversed(self.steps):
            if s.name not in tape.needs_grad:
                continue
            n_out = tape.multi.get(s.name)
            if n_out is None:
                g = out_grad.pop((s.name, None), None)
                if g is None:
                    continue
            else:
                gs = [out_grad.pop((s.name, i), None) for i in range(n_out)]
                whole = out_grad.pop((s.name, None), None)
                if whole is not None:
                    gs = [a if b is None else (b if a is None else a + b) for a, b in zip(gs, whole)]
                if all(x is None for x in gs):
                    continue
                g = tuple(gs)
            if s.kind == NodeKind.OUTPUT:
                in_grads = {0: g}
            else:
                in_grads = self.ops[s.name].vjp(tape.ctx[s.name], g)
            for slot, gi in in_grads.items():
                if gi is None:
                    continue
                if isinstance(slot, str):  # a module's parameter
                    self._accumulate(s.node.params[slot], gi)
                    continue
                ref = s.node.args[slot]
                if isinstance(ref, ParamRef):
                    if ref.name in trainable:
                        self._accumulate(ref.name, gi)
                elif isinstance(ref, Ref):
                    if ref.node in self._local:
                        add((ref.node, ref.index), np.asarray(gi))
                    elif tape.leaf_grad.get((ref.node, ref.index)):
                        k = (ref.node, ref.index)
                        leaf_out[k] = gi if k not in leaf_out else leaf_out[k] + gi
        out: dict[Key, np.ndarray] = {}
        for key, needs in self.recv_keys.items():
            if needs and tape.leaf_grad.get(key):
                g = leaf_out.get(key)
                out[key] = np.zeros_like(self._leaf_like(key, tape)) if g is None else np.array(g, order="C")  # keeps 0-d shapes
        return out

    def _leaf_like(self, key: Key, tape: _Tape) -> np.ndarray:
        node = self.graph[key[0]]
        m = node.meta.outputs[key[1] or 0] if node.meta.outputs else None
        return np.zeros(m.shape, dtype=m.dtype) if m is not None else np.zeros(())

    def _accumulate(self, name: str, g: np.ndarray) -> None:
        p = self.params[name]
        g = np.asarray(g, dtype=p.dtype).reshape(p.shape)
        cur = self._grads.get(name)
        self._grads[name] = g.copy() if cur is None else cur + g

    # -- parameters ------------------------------------------------------------------------
    def trainable(self) -> dict[str, np.ndarray]:
        return {n: self.params[n] for n in self.trainable_names}

    def state(self) -> dict[str, np.ndarray]:
        return {n: p.copy() for n, p in self.params.items()}

    def grads(self) -> dict[str, np.ndarray | None]:
        return dict(self._grads)

    def set_grad(self, name: str, grad: Any, owned: bool = False) -> None:
        a = _asarray(grad)
        dtype = self.params[name].dtype
        self._grads[name] = np.asarray(a, dtype=dtype) if owned else np.array(a, dtype=dtype, copy=True)

    def zero_grad(self) -> None:
        for n in self._grads:
            self._grads[n] = None


class _NumpyWalk(GraphWalk):
    """The graph walk (:class:`fusion.ir.walk.GraphWalk`) of a NumPy part: a node calls its NumPy kernel
    (:meth:`NumpyPart._call`, which also keeps the tape); values are arrays; an op that fails is a
    :class:`GraphError` naming the node."""

    def __init__(self, part: NumpyPart):
        self.part = part
        super().__init__(part.graph, part.sub)

    def call(self, node: OpNode) -> Callable[..., Any]:
        return self.part._call(node)

    def param(self, name: str) -> np.ndarray:
        return self.part.params[name]

    def fetch_placeholder(self, name: str, value: Any) -> np.ndarray:
        return np.asarray(value)

    def fetch_received(self, key: Key, value: Any, needs_grad: bool) -> Any:
        return _asarray(value)

    def failed(self, step: Step, error: Exception) -> Exception:
        if isinstance(error, GraphError):
            return error
        return GraphError(f"numpy engine failed on {step.node.target}: {type(error).__name__}: {error}", step.name)

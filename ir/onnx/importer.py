"""The ONNX front end: an ``.onnx`` file becomes a trainable :class:`Model`.

    model = load_onnx("mlp.onnx", loss="cross_entropy")

* One OpNode per ONNX node, target ``onnx.<OpType>``, ONNX attributes as
  keyword arguments, inputs as positional :class:`Ref` / :class:`ParamRef`
  arguments. Multi-output nodes are indexed with ``Ref(node, i)``.
* Initializers that a gradient can reach are trainable parameters, named as
  in the file (``torch.onnx.export`` keeps ``state_dict`` names); the others
  (BatchNorm running statistics, masks) are frozen buffers.
* Constants are data, not operators: ``Constant`` nodes, and nodes whose
  inputs are all constants (shape arithmetic such as Cast/Concat/Reshape of
  constants, ``Shape`` of a statically shaped tensor), are evaluated here
  with the NumPy engine's kernels. Their values become int-list literals
  where an op needs a static value (Reshape's shape, Slice bounds, axes) and
  frozen buffers elsewhere.
* Output shapes come from ONNX shape inference (``example`` may pin the
  input shapes of one micro-batch first).
* Every op that no engine path can run is reported at load time, all at once,
  with node names.

Exporting from torch: ``torch.onnx.export(module, args, path, dynamo=True,
optimize=False)``. The optimiser (``optimize=True``) is an *inference*
optimiser: it folds weight transposes into unnamed initializers, merges
equal-valued initializers (three LayerNorm weights of ones become one tied
tensor) and fuses BatchNorm into Conv, all of which change what training
means.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Collection, Mapping

import numpy as np

from fusion.ir.errors import GraphError
from fusion.ir.graph import OpGraph, ParamSpec
from fusion.ir.model import Model
from fusion.ir.node import NodeKind, NodeMeta, OpNode, ParamRef, Ref, TensorMeta
from fusion.ir.onnx.ops import LABEL_INPUTS, OPTIONAL_OUTPUTS, no_grad_inputs, split_sizes, static_inputs
from fusion.ir.onnx.read import OnnxNode, fold_all, literal, normalise_nodes, read_model, reinfer, value_types

log = logging.getLogger(__name__)

#: losses ``load_onnx(loss=...)`` can append to a model's single output
APPENDED_LOSSES = {"cross_entropy": "torch.nn.functional.cross_entropy", "mse": "torch.nn.functional.mse_loss"}


def _trainable(nodes: list[OnnxNode], sinks: list[str], inits: dict[str, np.ndarray]) -> set[str]:
    """Float initializers a gradient reaches from the graph outputs through differentiable inputs."""
    producer = {o: n for n in nodes for o in n.outputs}
    reached, stack = set(sinks), list(sinks)
    while stack:
        n = producer.get(stack.pop())
        if n is None:
            continue
        skip = no_grad_inputs(n.op)
        for i, v in enumerate(n.inputs):
            if v and i not in skip and v not in reached:
                reached.add(v)
                stack.append(v)
    return {k for k, v in inits.items() if k in reached and np.issubdtype(v.dtype, np.floating)}


def load_onnx(path: str | Path, *, loss: str | None = None, label: str = "y", labels: Collection[str] | None = None,
              trainable: Collection[str] | None = None, example: Mapping[str, Any] | None = None,
              engine: str = "torch", supports: Callable[[str], bool] | None = None) -> Model:
    """Import an ONNX model as a trainable :class:`Model`.

    loss:      None: the model computes its own loss (its one scalar float
               output becomes the loss node); ``"cross_entropy"`` or ``"mse"``:
               append that loss to the model's single output, fed by a new
               label placeholder named ``label``.
    labels:    graph inputs that are labels (default: inputs that reach the
               loss only through a loss op's label input).
    trainable: initializer names to train (default: every float initializer a
               gradient reaches; BatchNorm statistics and masks stay frozen).
    example:   input name -> array of one micro-batch, to pin symbolic shapes.
    engine:    the engine whose op support is checked at load time (named in errors).
    supports:  that engine's predicate on ``onnx.<Op>`` target names; default: the IR's torch
               semantics (:mod:`fusion.ir.onnx.semantics`). Another engine passes its own, e.g.
               ``fusion.executors.engines.numpy.engine.supports``, which keeps the import torch-free.
    """
    from onnx import numpy_helper

    path = Path(path)
    if supports is None:
        if engine != "torch":
            raise GraphError(f"load_onnx(engine={engine!r}) needs supports=, that engine's op predicate")
        from fusion.ir.registry import REGISTRY

        supports = REGISTRY.is_known
    mp = read_model(path, example)
    types = value_types(mp)
    inits = {i.name: numpy_helper.to_array(i) for i in mp.graph.initializer}
    consts: dict[str, np.ndarray] = {}
    nodes = normalise_nodes(mp, consts)
    graph_inputs = [i.name for i in mp.graph.input if i.name not in inits]
    graph_outputs = [o.name for o in mp.graph.output]
    if trainable is None:
        train = _trainable(nodes, graph_outputs, inits)
    else:
        unknown = sorted(set(trainable) - set(inits))
        if unknown:
            raise GraphError(f"{path}: trainable names {unknown} are not initializers of the model")
        train = set(trainable)
    base = {**consts, **{k: v for k, v in inits.items() if k not in train}}
    # Fold constants, then infer shapes again on the folded graph (shape inference cannot see
    # through computed shape arguments, e.g. Slice bounds built by Unsqueeze of Constants);
    # repeat while new static shapes enable more folding (Shape of a now-known tensor).
    for _ in range(4):
        consts = dict(base)
        runtime, problems = fold_all(nodes, consts, types, supports)
        unknown = [v for n in runtime for v in n.outputs if types.get(v, (None,))[0] is None]
        if problems or not unknown:
            break
        more = value_types(reinfer(path, mp, runtime, consts, inits, train))
        if all(more.get(v, (None,))[0] is None for v in unknown):
            break
        types.update({k: v for k, v in more.items() if v[0] is not None})
    problems += [f"node {n.name!r} (If on a condition computed at run time)" for n in runtime if n.op == "If"]
    if problems:
        raise GraphError(f"{path}: {len(problems)} unsupported ONNX op(s) for the {engine} engine: {', '.join(problems)}")
    builder = _GraphBuild(path, types, consts, train, inits)
    return builder.build(runtime, graph_inputs, graph_outputs, loss, label, labels, engine)


class _GraphBuild:
    """Turns the runtime ONNX nodes into an OpGraph (one pass, in ONNX order)."""

    def __init__(self, path: Path, types, consts: dict[str, np.ndarray], train: set[str], inits: dict[str, np.ndarray]):
        self.path, self.types, self.consts, self.train, self.inits = path, types, consts, train, inits
        self.g = OpGraph()
        self.values: dict[str, Ref] = {}  # runtime value -> reference to its producer
        self.params: dict[str, np.ndarray] = {}
        self.rg: set[str] = set(train)  # values that require grad
        self.problems: list[str] = []
        self.refused: set[str] = set()  # outputs of nodes refused at load (their reason is already recorded)

    def _tensor_meta(self, value: str, node: str) -> TensorMeta:
        shape, dtype = self.types.get(value, (None, "float32"))
        if shape is None:
            self.problems.append(f"node {node!r}: shape inference left output {value!r} without a static shape")
            shape = ()
        return TensorMeta(shape, dtype, value in self.rg and np.issubdtype(np.dtype(dtype), np.floating))

    def _param(self, name: str, value: np.ndarray, trainable: bool) -> ParamRef:
        value = np.array(value, copy=True, order="C")  # writable, owned (initializers may be read-only views)
        self.g.add_param(ParamSpec(name, tuple(value.shape), value.dtype.name, trainable))
        self.params[name] = value
        return ParamRef(name)

    def _arg(self, n, i: int, v: str) -> Any:
        if not v:
            return None
        if i in static_inputs(n.op):
            if v not in self.consts:
                self.problems.append(f"node {n.name!r}: input {i} ({v!r}) of {n.op} must be a constant (static shapes)")
                return None
            return literal(self.consts[v])
        if v in self.train:
            return self._param(v, self.inits[v], True)
        if v in self.consts:
            return self._param(v, self.consts[v], False)
        if v not in self.values:
            self.problems.append(f"node {n.name!r}: input {v!r} has no producer")
            return None
        return self.values[v]

    def _refuse(self, n) -> bool:
        """Record why the torch engine cannot run ``n`` (an attribute, a dtype); True when refused."""
        import inspect

        from fusion.ir.onnx.semantics import ONNX_OPS, ONNX_DTYPES, TORCH_OK_DTYPES

        fn = ONNX_OPS.get(n.op)
        if fn is None:
            return False
        for v in [*n.inputs, *n.outputs]:
            dtype = self.types.get(v, (None, None))[1] if v else None
            if v and v in self.consts:
                dtype = self.consts[v].dtype.name
            if dtype is not None and dtype not in TORCH_OK_DTYPES:
                self.problems.append(f"node {n.name!r}: {n.op} on dtype {dtype} is not supported (value {v!r})")
                return True
        params = inspect.signature(fn).parameters
        takes_any = any(p.kind == p.VAR_KEYWORD for p in params.values())
        for k in n.attrs:
            if not takes_any and (k not in params or params[k].kind != params[k].KEYWORD_ONLY):
                self.problems.append(f"node {n.name!r}: attribute {k!r} of {n.op} is not supported")
                return True
        if n.op == "Cast" and int(n.attrs.get("to", 0)) not in ONNX_DTYPES:
            self.problems.append(f"node {n.name!r}: Cast to ONNX type {n.attrs.get('to')} is not supported")
            return True
        return False

    def _node(self, n) -> None:
        if self.engine == "torch" and self._refuse(n):  # another engine's support was checked by its predicate
            self.refused.update(n.outputs)
            return
        kwargs = dict(n.attrs)
        if n.op == "SequenceAt":
            seq = self.values.get(n.inputs[0])
            pos = self.consts.get(n.inputs[1]) if len(n.inputs) > 1 else None
            if seq is None or pos is None:
                self.problems.append(f"node {n.name!r}: SequenceAt needs a SplitToSequence input and a constant position")
                return
            args: tuple = (Ref(seq.node, int(pos)),)
        else:
            args = tuple(self._arg(n, i, v) for i, v in enumerate(n.inputs))
            while args and args[-1] is None:
                args = args[:-1]
        if n.op in OPTIONAL_OUTPUTS and len(n.outputs) > 1:
            kwargs["outputs"] = len(n.outputs)
        if n.op == "Split" and "num_outputs" not in kwargs and (len(n.inputs) < 2 or not n.inputs[1]):
            kwargs["num_outputs"] = len(n.outputs)
        if n.op == "Dropout" and len(n.inputs) > 2 and n.inputs[2] and bool(np.any(self.consts.get(n.inputs[2], True))):
            self.problems.append(f"node {n.name!r}: Dropout in training mode is random and not supported")
        for k, v in list(kwargs.items()):
            if isinstance(v, np.ndarray):
                self.problems.append(f"node {n.name!r}: tensor attribute {k!r} of {n.op} is not supported")
        skip = no_grad_inputs(n.op)
        if any(v in self.rg for i, v in enumerate(n.inputs) if i not in skip):
            self.rg.update(n.outputs)
        if n.op == "SplitToSequence":
            outs = self._sequence_meta(n, kwargs)
        else:
            outs = tuple(self._tensor_meta(v, n.name) for v in n.outputs)
        multi = len(outs) > 1 or n.op in ("Split", "SplitToSequence")
        self.g.add(OpNode(n.name, NodeKind.FUNCTION, f"onnx.{n.op}", args, kwargs, label=n.op,
                          meta=NodeMeta(outputs=outs, multi=multi)))
        for i, v in enumerate(n.outputs):
            self.values[v] = Ref(n.name, i if multi else None)

    def _sequence_meta(self, n, kwargs) -> tuple[TensorMeta, ...]:
        shape, dtype = self.types.get(n.inputs[0], (None, "float32"))
        if shape is None:
            self.problems.append(f"node {n.name!r}: input of SplitToSequence has no static shape")
            return ()
        axis = kwargs.get("axis", 0) % len(shape)
        split = literal(self.consts[n.inputs[1]]) if len(n.inputs) > 1 and n.inputs[1] in self.consts else None
        sizes = split_sizes(shape[axis], 1 if split is None else split)
        rg = n.outputs[0] in self.rg
        if split is None and not kwargs.get("keepdims", 1):
            return tuple(TensorMeta(shape[:axis] + shape[axis + 1:], dtype, rg) for _ in sizes)
        return tuple(TensorMeta(shape[:axis] + (s,) + shape[axis + 1:], dtype, rg) for s in sizes)

    def build(self, runtime, inputs, outputs, loss, label, labels, engine: str) -> Model:
        g = self.g
        self.engine = engine
        read = {v for n in runtime for v in n.inputs} | set(outputs)
        for n in runtime:  # optional outputs nothing reads (an old Dropout's mask) need no shape: drop them
            while len(n.outputs) > 1 and n.outputs[-1] not in read:
                n.outputs.pop()
        for name in inputs:
            g.add(OpNode(name, NodeKind.INPUT, meta=NodeMeta(outputs=(self._tensor_meta(name, name),))))
            self.values[name] = Ref(name)
        for n in runtime:
            self._node(n)
        example = {}
        loss_node = self._loss(runtime, outputs, loss, label)
        for name in _labels(runtime, inputs, outputs, loss_node, labels, self.path):
            g.nodes[name].kind = NodeKind.LABEL
        for name in inputs + ([label] if loss else []):
            m = g.nodes[name].meta.outputs[0]
            example[name] = np.zeros(m.shape, dtype=m.dtype)
        if self.problems:
            raise GraphError(f"{self.path}: cannot import: " + "; ".join(self.problems))
        g.validate(check_targets=engine == "torch")  # other engines' support was checked above
        log.info("imported %s: %d nodes, %d parameters", self.path, len(g.nodes), len(g.params))
        return Model(g, self.params, example)

    def _loss(self, runtime, outputs, loss, label) -> str | None:
        g = self.g
        if loss is not None:
            if loss not in APPENDED_LOSSES:
                raise GraphError(f"{self.path}: unknown loss {loss!r}; choose one of {sorted(APPENDED_LOSSES)}")
            if len(outputs) != 1 or outputs[0] not in self.values:
                raise GraphError(f"{self.path}: loss={loss!r} needs a model with one computed output, it has {outputs}")
            out = g.nodes[self.values[outputs[0]].node].meta.outputs[self.values[outputs[0]].index or 0]
            if loss == "cross_entropy" and len(out.shape) != 2:
                raise GraphError(f"{self.path}: loss='cross_entropy' needs (batch, classes) outputs, got {out.shape}; "
                                 "export the model with its loss instead")
            if label in g.nodes:
                raise GraphError(f"{self.path}: label name {label!r} is already a node; pass label=")
            lmeta = TensorMeta(out.shape[:1], "int64") if loss == "cross_entropy" else TensorMeta(out.shape, out.dtype)
            g.add(OpNode(label, NodeKind.LABEL, meta=NodeMeta(outputs=(lmeta,))))
            g.add(OpNode("loss", NodeKind.LOSS, APPENDED_LOSSES[loss], (self.values[outputs[0]], Ref(label)),
                         meta=NodeMeta(outputs=(TensorMeta((), out.dtype, out.requires_grad),))))
            return "loss"
        loss_node = None
        for o in outputs:
            ref = self.values.get(o)
            if ref is None and o in self.consts:  # folded at import (Shape of a static tensor, Range of constants)
                if self.engine == "torch" and self.consts[o].dtype.name not in _torch_ok_dtypes():
                    self.problems.append(f"graph output {o!r}: a constant of dtype {self.consts[o].dtype.name} "
                                         "is not supported")
                    continue
                const = f"constant:{o}"
                g.add(OpNode(const, NodeKind.FUNCTION, "onnx.Identity", (self._param(const, self.consts[o], False),),
                             label="constant output",
                             meta=NodeMeta(outputs=(TensorMeta(tuple(self.consts[o].shape), self.consts[o].dtype.name),))))
                ref = self.values[o] = Ref(const)
            if ref is None:
                if o not in self.refused:
                    self.problems.append(f"graph output {o!r} has no producer")
                continue
            if g.nodes[ref.node].target == "onnx.SplitToSequence":
                self.problems.append(f"graph output {o!r} is a sequence (SplitToSequence); fusion outputs tensors")
                continue
            shape, dtype = self.types.get(o, (None, ""))
            if loss_node is None and shape == () and np.issubdtype(np.dtype(dtype), np.floating) and ref.index is None:
                g.nodes[ref.node].kind = NodeKind.LOSS
                loss_node = ref.node
            else:
                g.add(OpNode(f"output:{o}", NodeKind.OUTPUT, args=(ref,)))
        return loss_node


def _torch_ok_dtypes() -> frozenset[str]:
    from fusion.ir.onnx.semantics import TORCH_OK_DTYPES  # torch: only when the torch engine is the target

    return TORCH_OK_DTYPES


def _labels(runtime, inputs, outputs, loss_node, labels, path) -> list[str]:
    """Inputs that are labels: given, or reaching the loss only through a loss op's label inputs."""
    if labels is not None:
        unknown = sorted(set(labels) - set(inputs))
        if unknown:
            raise GraphError(f"{path}: labels {unknown} are not inputs of the model")
        return list(labels)
    if loss_node is None:
        return []
    out = []
    for x in inputs:
        tainted, is_label, reached = {x}, True, False
        for n in runtime:
            hit = [i for i, v in enumerate(n.inputs) if v in tainted]
            if not hit:
                continue
            if n.name == loss_node:
                reached = True
                if any(i not in LABEL_INPUTS.get(n.op, ()) for i in hit):
                    is_label = False
                continue
            tainted.update(n.outputs)
        if is_label and reached and not (tainted & set(outputs)):
            out.append(x)
    return out

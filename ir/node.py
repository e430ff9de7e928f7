"""OpNode: one operator of the OP-DAG (FusionLLM §3.3, Table 2).

Nodes are plain data. A node never holds a framework object: its operator is a
registered *target name* and its arguments are references to other nodes
(:class:`Ref`), to graph-level parameters (:class:`ParamRef`) or JSON-able
literals. Engines turn targets into callables on the host that runs them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Iterator


class NodeKind(str, Enum):
    """What role a node plays in the DAG (FusionLLM Table 2, "OP Type")."""

    INPUT = "input"  #: placeholder fed from the data set; never requires grad
    LABEL = "label"  #: placeholder holding targets; never requires grad, never compressed
    MODULE = "module"  #: parametric op: a module type built from ``target`` + ``attrs``
    FUNCTION = "function"  #: non-parametric op: a function applied to ``args``
    LOSS = "loss"  #: a module or function whose scalar output is the training loss
    OUTPUT = "output"  #: marks a value returned to the user (identity, no compute)


PLACEHOLDER_KINDS = (NodeKind.INPUT, NodeKind.LABEL)
#: kinds of node that run no op: the placeholders (fed data) and the output marker
IDLE_KINDS = (*PLACEHOLDER_KINDS, NodeKind.OUTPUT)


@dataclass(frozen=True)
class Ref:
    """Output ``index`` of producer ``node``; ``index=None`` means the whole output."""

    node: str
    index: int | None = None


@dataclass(frozen=True)
class ParamRef:
    """A graph-level parameter passed as a function argument (e.g. a tied weight)."""

    name: str


@dataclass(frozen=True)
class TensorMeta:
    """Static description of one tensor output.

    ``requires_grad`` says whether a gradient flows back through this tensor
    (it depends on a trainable parameter and is floating point).
    """

    shape: tuple[int, ...]
    dtype: str  #: torch-style dtype name without prefix, e.g. ``"float32"``
    requires_grad: bool = False

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_size(self.dtype)


@dataclass(frozen=True)
class ValueMeta:
    """A non-tensor output known at trace time (an int, a shape tuple, ...)."""

    value: Any


OutputMeta = TensorMeta | ValueMeta

_DTYPE_SIZES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
    "complex64": 8, "complex128": 16,
}


def dtype_size(dtype: str) -> int:
    """Bytes per element of a dtype name; raises ValueError for unknown names."""
    try:
        return _DTYPE_SIZES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(_DTYPE_SIZES)}") from None


@dataclass
class NodeMeta:
    """What passes learn about a node. Front ends fill ``outputs``; the
    estimator (``fusion.cost.estimate``) fills the cost fields.

    ``outputs`` lists the node's outputs. ``multi`` is True when the node
    returns a tuple, so consumers pick an element with ``Ref(node, index)``.
    """

    outputs: tuple[OutputMeta, ...] = ()
    multi: bool = False
    flops_fwd: float = 0.0  #: forward FLOPs for one micro-batch
    flops_bwd: float = 0.0  #: backward FLOPs for one micro-batch
    mem_bytes_fwd: float = 0.0  #: bytes a memory-bound op moves (used when FLOPs are ~0)
    param_bytes: int = 0  #: bytes of the parameters this node owns (shared ones counted once per graph)

    @property
    def output_bytes(self) -> int:
        """Bytes of all tensor outputs (M_f of FusionLLM Eq. 2)."""
        return sum(o.nbytes for o in self.outputs if isinstance(o, TensorMeta))


@dataclass
class OpNode:
    """One operator of the OP-DAG.

    Fields:
      name:   unique name within the graph (FusionLLM "OP name").
      kind:   role in the DAG, see :class:`NodeKind`.
      target: registered op type, e.g. ``"torch.nn.Linear"``,
              ``"torch.nn.functional.gelu"``, ``"torch.Tensor.view"``,
              ``"aten.addmm.default"``, ``"onnx.Gemm"`` or a user-registered name.
              Empty for placeholders and outputs.
      args / kwargs: call arguments: :class:`Ref`, :class:`ParamRef` or
              JSON-able literals (nested lists/tuples/dicts allowed).
      attrs:  constructor keyword arguments of a module target.
      params: module attribute path -> graph parameter name (module targets),
              e.g. ``{"weight": "transformer.wte.weight"}``.
      label:  free text for humans (FusionLLM Figure 7 labels).
      meta:   shapes and costs learned by passes.
    """

    name: str
    kind: NodeKind
    target: str = ""
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    attrs: dict[str, Any] = field(default_factory=dict)
    params: dict[str, str] = field(default_factory=dict)
    label: str = ""
    meta: NodeMeta = field(default_factory=NodeMeta)

    def refs(self) -> Iterator[Ref]:
        """Every :class:`Ref` in args and kwargs, in order, nested ones included."""
        yield from _walk(self.args, Ref)
        yield from _walk(tuple(self.kwargs.values()), Ref)

    def param_refs(self) -> Iterator[ParamRef]:
        yield from _walk(self.args, ParamRef)
        yield from _walk(tuple(self.kwargs.values()), ParamRef)

    def param_names(self) -> list[str]:
        """Graph parameters this node reads: owned by its module or passed as args."""
        names = list(self.params.values()) + [p.name for p in self.param_refs()]
        return list(dict.fromkeys(names))

    def producers(self) -> list[str]:
        """Distinct producer node names, in first-use order."""
        return list(dict.fromkeys(r.node for r in self.refs()))


def _walk(value: Any, cls: type) -> Iterator[Any]:
    if isinstance(value, cls):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _walk(v, cls)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _walk(v, cls)


def map_nested(value: Any, fn) -> Any:
    """Rebuild nested tuples, lists and dict values with every other leaf replaced by ``fn(leaf)``."""
    if isinstance(value, tuple):
        return tuple(map_nested(v, fn) for v in value)
    if isinstance(value, list):
        return [map_nested(v, fn) for v in value]
    if isinstance(value, dict):
        return {k: map_nested(v, fn) for k, v in value.items()}
    return fn(value)


def map_refs(value: Any, fn) -> Any:
    """Rebuild ``value`` with every Ref/ParamRef replaced by ``fn(ref)``."""
    return map_nested(value, lambda v: fn(v) if isinstance(v, (Ref, ParamRef)) else v)

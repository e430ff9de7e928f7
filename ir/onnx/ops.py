"""What the ONNX importer must know about each ONNX op, independent of any engine.

Engines implement ``onnx.<OpType>`` targets (``fusion.ir.onnx.semantics``
for torch, ``fusion.executors.engines.numpy.ops`` for NumPy); this module only says,
per op type, which inputs are *static* (shape-like integer lists that must be
known when the graph is built, e.g. Reshape's ``shape``), which inputs no
gradient flows into, and which inputs are labels of a loss. It imports
neither torch nor onnx, so both engines and the importer can share it.
"""
from __future__ import annotations

from typing import Sequence

#: op type -> input positions that must be constants; they become literals
#: (Python int lists) in the node's arguments, never tensors.
STATIC_INPUTS: dict[str, frozenset[int]] = {
    "Reshape": frozenset({1}),
    "Slice": frozenset({1, 2, 3, 4}),
    "Unsqueeze": frozenset({1}),
    "Squeeze": frozenset({1}),
    "Split": frozenset({1}),
    "SplitToSequence": frozenset({1}),
    "SequenceAt": frozenset({1}),
    "Expand": frozenset({1}),
    "Tile": frozenset({1}),
    "ReduceMean": frozenset({1}),
    "ReduceSum": frozenset({1}),
    "ReduceMax": frozenset({1}),
    "ReduceMin": frozenset({1}),
    "ReduceProd": frozenset({1}),
    "ReduceL2": frozenset({1}),
    "ReduceL1": frozenset({1}),
    "ReduceSumSquare": frozenset({1}),
    "ReduceLogSum": frozenset({1}),
    "ReduceLogSumExp": frozenset({1}),
    "Pad": frozenset({1, 3}),
    "Dropout": frozenset({1, 2}),
    "ConstantOfShape": frozenset({0}),
    "Range": frozenset({0, 1, 2}),
    "Resize": frozenset({1, 2, 3}),
    "Upsample": frozenset({1}),
    "TopK": frozenset({1}),
    "OneHot": frozenset({1}),
    "CumSum": frozenset({1}),
    "Trilu": frozenset({1}),
}

_NO_GRAD_ALL = frozenset(range(64))

#: op type -> input positions that no gradient flows into (besides static ones).
NO_GRAD_INPUTS: dict[str, frozenset[int]] = {
    "BatchNormalization": frozenset({3, 4}),  # running mean / variance are buffers
    "Gather": frozenset({1}),
    "GatherElements": frozenset({1}),
    "OneHot": frozenset({0}),
    "Where": frozenset({0}),
    "CastLike": frozenset({1}),
    "SoftmaxCrossEntropyLoss": frozenset({1, 2}),
    "NegativeLogLikelihoodLoss": frozenset({1, 2}),
    **{op: _NO_GRAD_ALL for op in (
        "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Not", "And", "Or", "Xor",
        "Shape", "Size", "ArgMax", "ArgMin", "ConstantOfShape", "Range", "IsNaN", "IsInf", "Hardmax", "Sign",
    )},
}

#: op type -> input positions holding class labels (a graph input that reaches
#: the loss only through these is a label placeholder).
LABEL_INPUTS: dict[str, frozenset[int]] = {
    "SoftmaxCrossEntropyLoss": frozenset({1}),
    "NegativeLogLikelihoodLoss": frozenset({1}),
}

#: ops whose older opsets carry an input as an attribute of the same meaning:
#: op type -> [(attribute name, input position, first opset with the input, dtype)].
ATTR_TO_INPUT: dict[str, list[tuple[str, int, int, str]]] = {
    "Unsqueeze": [("axes", 1, 13, "int64")],
    "Squeeze": [("axes", 1, 13, "int64")],
    "Split": [("split", 1, 13, "int64")],
    "ReduceSum": [("axes", 1, 13, "int64")],
    "ReduceMean": [("axes", 1, 18, "int64")],
    "ReduceMax": [("axes", 1, 18, "int64")],
    "ReduceMin": [("axes", 1, 18, "int64")],
    "ReduceProd": [("axes", 1, 18, "int64")],
    "ReduceL2": [("axes", 1, 18, "int64")],
    "ReduceL1": [("axes", 1, 18, "int64")],
    "ReduceSumSquare": [("axes", 1, 18, "int64")],
    "ReduceLogSum": [("axes", 1, 18, "int64")],
    "ReduceLogSumExp": [("axes", 1, 18, "int64")],
    "Pad": [("pads", 1, 11, "int64"), ("value", 2, 11, "float32")],
    "Clip": [("min", 1, 11, "float32"), ("max", 2, 11, "float32")],
    "Upsample": [("scales", 1, 9, "float32")],
    "Slice": [("starts", 1, 10, "int64"), ("ends", 2, 10, "int64"), ("axes", 3, 10, "int64")],
}

#: ops whose semantics changed with the opset: op type -> first opset of today's meaning.
#: Before it, Softmax/LogSoftmax/Hardmax view the input as 2-D around ``axis`` (default 1).
COERCE_2D_BEFORE = {"Softmax": 13, "LogSoftmax": 13, "Hardmax": 13}

#: ops that may return several outputs; the importer passes ``outputs=n``
#: when a node asks for more than the first.
OPTIONAL_OUTPUTS = frozenset({
    "LayerNormalization", "BatchNormalization", "Dropout", "MaxPool",
    "SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss", "TopK",
})

#: ops that the importer evaluates away rather than turning into nodes
#: (when all their inputs are constants).
CONSTANT_OPS = frozenset({"Constant"})


def static_inputs(op_type: str) -> frozenset[int]:
    return STATIC_INPUTS.get(op_type, frozenset())


def no_grad_inputs(op_type: str) -> frozenset[int]:
    return STATIC_INPUTS.get(op_type, frozenset()) | NO_GRAD_INPUTS.get(op_type, frozenset())


def slice_range(dim: int, start: int, end: int, step: int) -> range:
    """Indices an ONNX Slice takes along one axis of length ``dim`` (Slice-13 clamping rules)."""
    if step == 0:
        raise ValueError("Slice step cannot be 0")
    if start < 0:
        start += dim
    if end < 0:
        end += dim
    if step > 0:
        start, end = min(max(start, 0), dim), min(max(end, 0), dim)
    else:
        start, end = min(max(start, -1), dim - 1), min(max(end, -1), dim - 1)
    return range(start, end, step)


def normalize_slice(shape: Sequence[int], starts, ends, axes=None, steps=None) -> list[tuple[int, range]]:
    """``[(axis, index range)]`` of an ONNX Slice on a tensor of ``shape``."""
    rank = len(shape)
    axes = list(range(len(starts))) if axes is None else [a + rank if a < 0 else a for a in axes]
    steps = [1] * len(starts) if steps is None else list(steps)
    return [(a, slice_range(shape[a], int(s), int(e), int(k))) for a, s, e, k in zip(axes, starts, ends, steps)]


def split_sizes(dim: int, split=None, num_outputs: int | None = None) -> list[int]:
    """Chunk sizes of an ONNX Split / SplitToSequence along an axis of length ``dim``.

    ``split`` may be a list of sizes, one int (chunk size, last one smaller:
    SplitToSequence), or None with ``num_outputs`` (equal chunks, last one
    smaller, Split-18 rule).
    """
    if split is None:
        n = num_outputs or dim
        size = -(-dim // n)
        return [min(size, dim - i * size) for i in range(n)]
    if isinstance(split, int):
        return [min(split, dim - i) for i in range(0, dim, split)]
    return [int(s) for s in split]


def pad_source(n: int, begin: int, end: int, mode: str):
    """(source index, valid mask) of each position of an axis of length ``n`` padded by ``begin``/``end``
    (negative: cropped) in ONNX Pad ``mode``, as ``numpy.pad`` reads it (reflect repeats as often as needed)."""
    import numpy as np

    i = np.arange(-begin, n + end)
    if mode == "constant":
        return np.clip(i, 0, n - 1), (i >= 0) & (i < n)
    if mode == "edge":
        src = np.clip(i, 0, n - 1)
    elif mode == "wrap":
        src = i % n
    elif mode == "reflect":
        j = i % (2 * (n - 1)) if n > 1 else np.zeros_like(i)
        src = np.where(j >= n, 2 * (n - 1) - j, j)
    else:
        raise ValueError(f"Pad mode {mode!r} is not an ONNX mode")
    return src, np.ones(i.shape, bool)


def reshape_target(in_shape: Sequence[int], shape: Sequence[int], allowzero: int = 0) -> list[int]:
    """Resolve an ONNX Reshape ``shape`` (0 copies the input dim unless ``allowzero``; -1 is inferred)."""
    out = [int(in_shape[i]) if (s == 0 and not allowzero) else int(s) for i, s in enumerate(shape)]
    if -1 in out:
        known = 1
        for s in out:
            if s != -1:
                known *= s
        total = 1
        for s in in_shape:
            total *= int(s)
        out[out.index(-1)] = total // known if known else 0
    return out


def reduce_axes(rank: int, axes, noop_with_empty_axes: int = 0) -> tuple[int, ...] | None:
    """Axes of an ONNX Reduce* (None: reduce nothing); empty axes mean all unless ``noop_with_empty_axes``."""
    if axes is None or len(axes) == 0:
        return None if noop_with_empty_axes else tuple(range(rank))
    return tuple(sorted(a + rank if a < 0 else a for a in axes))

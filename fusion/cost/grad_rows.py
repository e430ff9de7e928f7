"""How many bytes a part's gradient of a tied parameter puts on the wire: an embedding lookup's is mostly exact zeros.

An embedding's backward writes only the rows of the token ids it saw, so over one step (``n_b`` micro-batches of
``k`` ids each) its gradient has at most ``min(V, n_b k)`` nonzero rows of a ``V``-row table, and without a tied
codec the runtime sends such a gradient as its nonzero elements, value and index each
(``executors/runtime/exact_zeros.py``). :func:`node_grad_nbytes` bounds what one node contributes to a parameter's
gradient; the estimator sums a part's nodes and caps the sum at the dense size (FusionLLM Eq. 2's ``M`` of the
tied-gradient exchange, see :mod:`fusion.cost.estimate`). Any other node's contribution counts dense.
"""
from __future__ import annotations

import math

from fusion.ir.graph import OpGraph
from fusion.ir.node import OpNode, TensorMeta
from fusion.kernels.dtypes import dtype_size, index_dtype_for
from fusion.kernels.sparse import EXACT_SPARSE_MAX_FRACTION


def is_embedding(node: OpNode) -> bool:
    """An embedding lookup (``torch.nn.Embedding``, ``F.embedding``): its table's gradient rows are its ids."""
    return "embedding" in node.target.lower() and "bag" not in node.target.lower()


def _ids_numel(graph: OpGraph, node: OpNode) -> int | None:
    """Elements of the node's id tensor (its first input) per micro-batch; None when unknown."""
    refs = list(node.refs())
    if not refs:
        return None
    src = graph.nodes.get(refs[0].node)
    outs = src.meta.outputs if src is not None and src.meta is not None else None
    meta = outs[refs[0].index or 0] if outs and len(outs) > (refs[0].index or 0) else None
    if not isinstance(meta, TensorMeta) or not meta.dtype.startswith(("int", "uint")):
        return None
    return math.prod(meta.shape)


def node_grad_nbytes(graph: OpGraph, node: OpNode, param: str, micro_batches: int) -> float:
    """Wire bytes of ``node``'s contribution to the gradient of ``param`` over one step: an embedding's nonzero rows
    as values and indices when they are at most the runtime's share for the sparse form, else the dense size."""
    spec = graph.params[param]
    dense = float(spec.nbytes)
    ids = _ids_numel(graph, node) if is_embedding(node) else None
    if ids is None or len(spec.shape) != 2 or spec.dtype not in ("float16", "bfloat16", "float32", "float64"):
        return dense
    rows = min(int(spec.shape[0]), ids * micro_batches)
    if rows > EXACT_SPARSE_MAX_FRACTION * spec.shape[0]:  # the runtime would send it dense (exact_zeros.py's rule)
        return dense
    numel = math.prod(spec.shape)
    per = dtype_size(spec.dtype) + dtype_size(index_dtype_for(numel))
    return min(dense, float(rows * spec.shape[1] * per))

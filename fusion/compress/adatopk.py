"""AdaTopK: a Top-K compression ratio per cut edge, heaviest on the slowest links (FusionLLM §5.2).

Eq. (7) of the paper, ``r_i = max(1, 3 r R_i / max_p R_p)``, for a user ratio
r. Here i is a cut edge: one tensor t sent from part a to part b, and
``R_i = alpha_ab + beta_ab M_t`` its dense forward transfer time (Eq. 2);
the maximum runs over all cut edges, so the slowest edge gets ``c r`` and the
others proportionally less.

The paper's 3 is the wire cost of a kept element relative to a dense one:
float32 values plus int64 indices cost (4 + 8) / 4 = 3 dense elements. We
derive this factor ``c`` from our own wire encoding instead
(:func:`wire_cost_factor`: values in the tensor's dtype, int32 indices below
2**31 elements, else int64; float32 gives c = 2). With ``k = ceil(numel / r_i)``
kept elements, an edge at ``r_i = c r`` sends ``M_t / r`` bytes: r is the size
reduction on the slowest edge.

An edge whose ratio would not shrink the wire (``r_i <= c``: k elements at c
dense elements each are at least the dense tensor) is sent dense. Only
floating-point tensors are compressed (never token ids, labels or losses);
gradients on the same edge use the same ratio.
"""
from __future__ import annotations

import math

from fusion.cost.estimate import CostModel
from fusion.ir.node import TensorMeta
from fusion.kernels.sparse import index_dtype_for, sparse_nbytes, topk_cost_factor
from fusion.plan import EdgeCompression


def wire_cost_factor(numel: int, value_dtype: str) -> float:
    """c of Eq. (7) for one tensor, from the kernels' wire encoding
    (:func:`fusion.kernels.sparse.topk_cost_factor`).

    float32 with int32 indices -> 2.0; float16 -> 3.0; float32 over 2**31 elements -> 3.0.
    """
    return topk_cost_factor(value_dtype, index_dtype_for(numel))


def sparse_wire_bytes(numel: int, value_dtype: str, ratio: float) -> float:
    """Bytes of a Top-K payload keeping ``ceil(numel / ratio)`` elements."""
    return float(sparse_nbytes(numel, math.ceil(numel / ratio), value_dtype))


def _tensor_meta(cm: CostModel, t: int) -> TensorMeta | None:
    producer, index = cm.t_key[t]
    node = cm.graph[producer]
    outs = node.meta.outputs
    if index is None:
        if node.meta.multi or len(outs) != 1:
            return None
        o = outs[0]
    else:
        o = outs[index] if index < len(outs) else None
    if not isinstance(o, TensorMeta) or not o.dtype.startswith(("float", "bfloat")):
        return None
    return o


def adatopk(cm: CostModel, node_part, part_device, part_names: list[str], ratio: float,
            error_feedback: bool = False) -> tuple[list[EdgeCompression], dict[tuple[int, int, int], tuple[float, float]]]:
    """Eq. (7) for every cut edge of an assignment.

    Returns the plan's compression list and the wire bytes per
    (tensor, src part, dst part) for :meth:`CostModel.evaluate`.
    """
    import numpy as np

    if not ratio >= 1:
        raise ValueError(f"compression ratio must be >= 1, got {ratio}")
    node_part = np.asarray(node_part)
    dev = np.asarray(part_device)
    src = node_part[cm.t_prod[cm.e_t]]
    dst = node_part[cm.e_cons]
    edges = sorted({(int(t), int(a), int(b)) for t, a, b in zip(cm.e_t, src, dst) if a != b})
    times = {e: cm.cluster.comm_time(int(dev[e[1]]), int(dev[e[2]]), float(cm.t_bytes[e[0]])) for e in edges}
    r_max = max(times.values(), default=0.0)
    out: list[EdgeCompression] = []
    wire: dict[tuple[int, int, int], tuple[float, float]] = {}
    if r_max <= 0:
        return out, wire
    for e in edges:
        meta = _tensor_meta(cm, e[0])
        if meta is None or meta.numel == 0:
            continue
        c = wire_cost_factor(meta.numel, meta.dtype)
        r_i = max(1.0, c * ratio * times[e] / r_max)
        if r_i <= c:
            continue
        producer, index = cm.t_key[e[0]]
        dirs = ("fwd", "bwd") if cm.t_rg[e[0]] else ("fwd",)
        out.append(EdgeCompression(producer, index, part_names[e[1]], part_names[e[2]], float(r_i), dirs, error_feedback))
        b = sparse_wire_bytes(meta.numel, meta.dtype, r_i)
        wire[e] = (b, b)
    return out, wire

"""What bfloat16 autocast does to a tensor's bytes, for the estimator (``--precision bf16``, issue 36).

Under ``torch.autocast(dtype=torch.bfloat16)`` the runtime's parts compute matrix products in bfloat16, and a cut
edge carries whatever dtype its producer gave it (``CompressionTable.autocast``): a Linear's output travels as
bfloat16 (2 bytes an element), a residual sum of a bfloat16 and a float32 tensor, a LayerNorm's or a softmax's
output as float32. The graph records float32 for all of them (it was traced without autocast), so the estimator
priced every edge at 4 bytes.

:func:`bf16_tensors` follows autocast's rules over the graph, conservatively: a tensor is bfloat16 when its
producer is a matrix product autocast runs in lower precision (:data:`LOWER`), or an op that keeps its input's
dtype (:data:`KEEPS`: views, activations, dropout) of a bfloat16 input, or an elementwise arithmetic op
(:data:`PROMOTES`) whose float inputs are all bfloat16 (type promotion: one float32 input makes it float32).
Anything else (normalisations, softmax, embeddings, losses, a user's module whose inside the graph does not show)
stays float32, as it was priced before. :func:`with_precision` halves the bytes of those tensors in a cost model.
"""
from __future__ import annotations

from typing import Iterable

import numpy as np

from fusion.ir.graph import OpGraph
from fusion.ir.node import TensorMeta

#: ops autocast runs in bfloat16 (torch's "lower precision" list), by the last part of the node's target
LOWER = frozenset({"Linear", "linear", "matmul", "mm", "bmm", "addmm", "addbmm", "baddbmm", "einsum", "Conv1d",
                   "Conv2d", "Conv3d", "conv1d", "conv2d", "conv3d", "ConvTranspose1d", "ConvTranspose2d",
                   "conv_transpose1d", "conv_transpose2d", "scaled_dot_product_attention", "Gemm", "MatMul",
                   "prelu", "addmm.default", "mm.default", "bmm.default", "linear.default"})
#: ops whose output has their (first) tensor input's dtype
KEEPS = frozenset({"view", "reshape", "flatten", "permute", "transpose", "contiguous", "getitem", "squeeze",
                   "unsqueeze", "expand", "split", "chunk", "narrow", "select", "gelu", "GELU", "relu", "ReLU", "silu",
                   "SiLU", "tanh", "Tanh", "dropout", "Dropout", "Identity", "clone", "neg", "t"})
#: elementwise arithmetic: bfloat16 only when every float tensor input is (type promotion)
PROMOTES = frozenset({"add", "sub", "mul", "truediv", "iadd", "imul", "where", "cat", "stack", "maximum",
                      "minimum"})


def _op(target: str) -> str:
    """``torch.nn.Linear`` -> ``Linear``; ``aten.addmm.default`` -> ``addmm.default``; ``operator.add`` -> ``add``."""
    if target.startswith("aten."):
        return target[len("aten."):]
    return target.rsplit(".", 1)[-1]


def bf16_tensors(graph: OpGraph) -> frozenset[str]:
    """Names of the nodes whose float32 output(s) autocast makes bfloat16 (by the rules in the module docstring)."""
    out: set[str] = set()
    for name in graph.topo_order():
        node = graph[name]
        if not node.target:
            continue
        outs = [o for o in node.meta.outputs if isinstance(o, TensorMeta)]
        if not outs or not all(o.dtype == "float32" for o in outs):
            continue
        op = _op(node.target)
        inputs = [r.node for r in node.refs() if _is_float(graph, r.node)]
        if op in LOWER:
            out.add(name)
        elif op in KEEPS and inputs and inputs[0] in out:
            out.add(name)
        elif op in PROMOTES and inputs and all(i in out for i in inputs):
            out.add(name)
    return frozenset(out)


def _is_float(graph: OpGraph, node: str) -> bool:
    return any(isinstance(o, TensorMeta) and o.dtype.startswith(("float", "bfloat")) for o in graph[node].meta.outputs)


def halved(keys: Iterable[tuple[str, int | None]], t_bytes: np.ndarray, bf16: frozenset[str]) -> np.ndarray:
    """``t_bytes`` with the tensors of ``bf16`` nodes at 2 bytes an element instead of 4."""
    scale = np.array([0.5 if k[0] in bf16 else 1.0 for k in keys], dtype=float)
    return t_bytes * scale


def with_precision(cm, precision: str):
    """The cost model ``cm`` as ``precision`` runs it: ``bf16`` prices the tensors autocast makes bfloat16 at 2
    bytes an element (:attr:`CostModel.t_bytes`, and the codecs' prices through :attr:`CostModel.bf16`);
    ``fp32`` leaves it as it is."""
    if precision != "bf16":
        return cm
    bf16 = bf16_tensors(cm.graph)
    return cm.variant(t_bytes=halved(cm.t_key, cm.t_bytes, bf16), bf16=bf16)


__all__ = ["LOWER", "KEEPS", "PROMOTES", "bf16_tensors", "with_precision"]

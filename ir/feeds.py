"""What a placeholder of the graph may be fed: its dtype on the host, and the range of an integer one.

An integer placeholder that indexes something has a range the graph knows:
token ids feeding an embedding must lie in ``[0, num_embeddings)`` (the
rows of its weight), class labels feeding a cross-entropy or NLL loss in
``[0, C)`` (the logits' dimension 1) or equal the loss's ``ignore_index``
(-100 by default). Shape-only ops (view, reshape, flatten, ...) between the
placeholder and that consumer are followed. A value outside the range would
reach the engine as ``IndexError: index out of range in self``, naming
neither the field nor the node; the data pipeline and the executors check it
first (:mod:`fusion.executors.runtime.feeds`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fusion.ir.graph import OpGraph
from fusion.ir.node import TensorMeta

_SHAPE_ONLY = ("view", "reshape", "flatten", "contiguous", "squeeze", "unsqueeze")


def feed_dtype(name: str) -> np.dtype:
    """The NumPy dtype a placeholder of dtype ``name`` is fed in: NumPy has no bfloat16, so a
    bfloat16 placeholder takes float32 data, which the engine rounds as ``x.to(torch.bfloat16)``."""
    return np.dtype(np.float32) if name == "bfloat16" else np.dtype(name)


@dataclass(frozen=True)
class IndexBound:
    """The values an integer placeholder may take: ``0 <= v < high``, or ``v == ignore`` when not None.

    node: the node whose semantics set the range (an embedding, a loss); what: what ``high`` counts
    (``"rows of the embedding"``, ``"classes of the loss"``).
    """

    high: int
    node: str
    what: str
    ignore: int | None = None

    def first_outside(self, a: np.ndarray) -> tuple[int, int] | None:
        """(flat position, value) of the first element of ``a`` outside the range, or None."""
        flat = np.asarray(a).reshape(-1)
        bad = (flat < 0) | (flat >= self.high)
        if self.ignore is not None:
            bad &= flat != self.ignore
        if not bad.any():
            return None
        i = int(np.argmax(bad))
        return i, int(flat[i])


def index_bound(graph: OpGraph, name: str) -> IndexBound | None:
    """The range of integer placeholder ``name`` where the graph knows one (see the module), else None."""
    users = graph.users()
    seen, frontier = set(), [name]
    while frontier:  # follow shape-only ops to the real consumer
        n = frontier.pop()
        for u in users.get(n, []):
            if u in seen:
                continue
            seen.add(u)
            node = graph[u]
            t = node.target
            if "cross_entropy" in t or "nll_loss" in t or "CrossEntropyLoss" in t:
                logits = node.args[0]
                meta = graph[logits.node].meta.outputs
                out = meta[logits.index or 0] if meta else None
                if isinstance(out, TensorMeta) and len(out.shape) >= 2:
                    ignore = node.kwargs.get("ignore_index", -100)
                    return IndexBound(int(out.shape[1]), u, "classes of the loss",
                                      int(ignore) if isinstance(ignore, int) else -100)
            if "embedding" in t.lower():
                pnames = node.param_names()
                if pnames:
                    return IndexBound(int(graph.params[pnames[0]].shape[0]), u, "rows of the embedding")
            if any(k in t for k in _SHAPE_ONLY):
                frontier.append(u)
    return None

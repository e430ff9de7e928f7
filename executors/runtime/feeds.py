"""Feeds checked against the plan: what the coordinator sends each part in a ``step``, checked before it is sent
and again on receipt.

A feed is one micro-batch of one placeholder (an input or a label). It must have the placeholder's number of
dimensions and, after the first (the rows of the micro-batch, which may differ from the plan's example), its
sizes; a dtype of the placeholder's kind (floating, integer, bool); only finite values when floating; and,
where the graph knows a range (:func:`fusion.ir.feeds.index_bound`: an embedding's rows, a loss's classes), only
values in it. Without this a token id past the vocabulary reached the engine as ``IndexError: index out of range
in self``, naming neither the field nor the node.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np

from fusion.ir.feeds import IndexBound, feed_dtype, index_bound
from fusion.plan import Plan


@dataclass(frozen=True)
class FeedSpec:
    """What placeholder ``name`` takes: ``dtype`` (host dtype, None: not in the plan's example), ``shape`` of one
    micro-batch in the plan's example (None: unknown), and ``bound`` (None: any value of the dtype)."""

    name: str
    dtype: np.dtype | None
    shape: tuple[int, ...] | None
    bound: IndexBound | None


def feed_specs(plan: Plan, names: Iterable[str]) -> dict[str, FeedSpec]:
    """The specs of placeholders ``names`` of ``plan``."""
    out = {}
    for n in names:
        ex = plan.example.get(n) if isinstance(plan.example, dict) else None
        dtype = feed_dtype(ex["dtype"]) if isinstance(ex, dict) and isinstance(ex.get("dtype"), str) else None
        shape = tuple(int(s) for s in ex["shape"]) if isinstance(ex, dict) and isinstance(ex.get("shape"), list) else None
        bound = index_bound(plan.graph, n) if dtype is None or dtype.kind in "iu" else None
        out[n] = FeedSpec(n, dtype, shape, bound)
    return out


def _kind(dt: np.dtype) -> str:
    return "integer" if dt.kind in "iu" else "floating" if dt.kind in "fc" else "bool" if dt.kind == "b" else dt.name


def feed_problem(spec: FeedSpec, a: np.ndarray) -> str | None:
    """Why ``a`` cannot be fed to ``spec``'s placeholder (one phrase naming the node that sets a range), or None."""
    if spec.dtype is not None and _kind(a.dtype) != _kind(spec.dtype):
        return f"has dtype {a.dtype}, the plan expects {spec.dtype}"
    if spec.shape is not None and (a.ndim != len(spec.shape) or tuple(a.shape[1:]) != spec.shape[1:]):
        want = ["rows", *spec.shape[1:]] if spec.shape else []
        return f"has shape {list(a.shape)}, the plan expects [{', '.join(map(str, want))}]"
    if a.dtype.kind in "fc" and a.size and not np.isfinite(a).all():
        i = int(np.argmax(~np.isfinite(a.reshape(-1))))
        return f"holds a non-finite value ({a.reshape(-1)[i]}) at flat position {i}"
    if spec.bound is not None and a.dtype.kind in "iu" and a.size:
        hit = spec.bound.first_outside(a)
        if hit is not None:
            b = spec.bound
            allowed = f"0..{b.high - 1}" + (f" or {b.ignore}" if b.ignore is not None else "")
            return (f"holds {hit[1]} at flat position {hit[0]}, outside {allowed} (the {b.high} {b.what} "
                    f"{b.node!r})")
    return None

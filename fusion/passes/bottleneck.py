"""The bottleneck pass's search on a chosen cut (:mod:`fusion.compress.bottleneck`): each candidate rank priced
by the estimator on that same cut."""
from __future__ import annotations

import logging
from typing import Any, Callable

import numpy as np

from fusion.cost.estimate import CostModel
from fusion.ir.model import Model
from fusion.ir.graph import OpGraph
from fusion.partition.fence import Partition
from fusion.passes.pricing import recompute_choice
from fusion.passes.state import CompileError

log = logging.getLogger("fusion.compile")


def insert_bottleneck(model: Model, cm: CostModel, part: Partition, req, seed: int, recompute: str,
                      build: Callable[[OpGraph], CostModel]):
    """``(model, cost model, partition, specs, info)`` of the rewritten graph, or ``(model, None, part, [],
    info)`` when nothing is inserted; ``cm`` prices the cut as it is, ``build(graph)`` the cost model a candidate
    is priced with (``auto``: the smallest ranks within ``AUTO_SLACK`` of the best; ``optional``: nothing unless
    it shortens the iteration). ``info`` is ``plan.predicted["bottleneck"]``."""
    from fusion.compress.bottleneck import AUTO_SLACK, cut_edges, initial_values, insert_bottlenecks, with_bottleneck_nodes

    names = [f"part{k}" for k in range(len(part.part_device))]
    assignment = {n: names[int(p)] for n, p in zip(cm.names, part.node_part)}
    edges = cut_edges(model.graph, assignment, list(req.edges) if req.edges is not None else None)
    rc0 = recompute_choice(cm, part, recompute)
    without = float(cm.evaluate(part.node_part, part.part_device, recompute=rc0).iteration_s)
    # with_s / without_s: Eq. 3's iteration (what the partitioners minimise) on this cut, with and without
    info: dict[str, Any] = {"request": req.rank, "optional": req.optional, "without_s": without, "candidates": []}
    if not edges:
        if req.optional:
            info["chosen"] = None
            return model, None, part, [], info
        raise CompileError("--bottleneck: no cut edge of this plan carries the residual stream (a sum's float output "
                           "of the graph's most common width); name edges with --bottleneck-edges NODE,... or all")
    priced = []
    for ranks in _candidates(model, edges, req):
        g2, specs = insert_bottlenecks(model.graph, edges, ranks, seed)
        asg2 = with_bottleneck_nodes(assignment, specs)
        cm2 = build(g2)
        index = {n: k for k, n in enumerate(names)}
        node_part = np.array([index[asg2[n]] for n in cm2.names], dtype=np.int64)
        p2 = Partition(node_part, list(part.part_device), 0.0, part.info)
        rc = recompute_choice(cm2, p2, recompute)
        p2.iteration_s = float(cm2.evaluate(node_part, part.part_device, recompute=rc).iteration_s)
        info["candidates"].append({"ranks": ranks, "iteration_s": p2.iteration_s})
        priced.append((p2.iteration_s, g2, specs, cm2, p2))
    best = min(t for t, *_ in priced)
    t, g2, specs, cm2, p2 = next(x for x in priced if x[0] <= best * (1 + AUTO_SLACK))
    if req.optional and not t < without:
        log.info("bottleneck: %.4g s/iteration with it, %.4g s without: left out", t, without)
        info["chosen"] = None
        return model, None, part, [], info
    info["chosen"] = {s.edge: s.rank for s in specs}
    info["with_s"] = t
    log.info("bottleneck on %s: predicted %.4g s/iteration (%.4g s without)",
             ", ".join(f"{s.edge} {s.width}->{s.rank}" for s in specs), t, without)
    params = {**model.params, **initial_values(specs)} if model.params else {}
    return Model(g2, params, model.example), cm2, p2, specs, info


def _candidates(model: Model, edges, req) -> list[dict]:
    """The ranks per edge to price: ``req.rank`` on every edge, or (``auto``) width / each of ``AUTO_DIVISORS``."""
    from fusion.compress.bottleneck import AUTO_DIVISORS

    width = {e.name: model.graph.output_meta(e.producer, e.index).shape[-1] for e in edges}
    if req.rank != "auto":
        return [dict.fromkeys(width, req.rank)]
    candidates = list({tuple(max(1, w // k) for w in width.values()): None for k in AUTO_DIVISORS})
    candidates = [dict(zip(width, c)) for c in candidates if all(r < w for r, w in zip(c, width.values()))]
    if not candidates:
        raise CompileError(f"--bottleneck auto: the cut edges are too narrow for a bottleneck (widths {width})")
    return candidates

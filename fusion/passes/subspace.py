"""The two compiler passes of ``--subspace`` (:mod:`fusion.compress.subspace`, Pluralis' Subspace Networks,
arXiv 2506.01260): the writers of the residual stream confined to span(U) before the graph is priced, and the
cut edges on the stream turned into k coordinates + ids once the cut is chosen. Both rewrite the model with plain
nodes; the estimator prices the result as any graph."""
from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np

from fusion.cost.estimate import CostModel, optimizer_slots, samples_per_micro_batch
from fusion.cost.flops import measure_costs
from fusion.ir.model import Model
from fusion.partition.fence import Partition
from fusion.passes.pricing import CUT_SCHEDULES, price_schedules
from fusion.passes.state import CompileError, CompileState

log = logging.getLogger("fusion.compile")


def subspace_writers(s: CompileState) -> CompileState:
    """``--subspace``: every writer of the residual stream confined to span(U); the model becomes the rewritten
    one (its initial weights the projections of the user's)."""
    from fusion.compress.subspace import confine_writers, initial_params, token_std

    r = s.request
    if r.subspace is None:
        return s
    if r.bottleneck is not None:
        raise CompileError("--subspace and --bottleneck both change the cut; give one of them")
    if r.virtual_stages or r.node_times is not None:
        raise CompileError("--subspace is not built with " + ("--node-times (measured on the graph before the "
                           "pass)" if r.node_times is not None else "an interleaved schedule (--virtual-stages)"))
    m = s.model
    g, spec = confine_writers(m.graph, r.subspace, r.seed, token_std(m.graph, m.params))
    log.info("subspace: %d writers of the residual stream (width %d) confined to k = %d", len(spec.writers),
             spec.width, spec.rank)
    return replace(s, model=Model(g, initial_params(spec, m.params), m.example), subspace=spec)


def subspace_cut(s: CompileState) -> CompileState:
    """Each cut edge on the stream sends its k coordinates; each receiver rebuilds the activation from them and
    the ids. The cost model and the cut become the rewritten graph's."""
    from fusion.compress.subspace import rebuild_cut, with_cut_nodes
    from fusion.compress.policy import codec_prices as prices_of

    if s.subspace is None:
        return s
    r, part = s.request, s.part
    names = [f"part{k}" for k in range(len(part.part_device))]
    assignment = {n: names[int(p)] for n, p in zip(s.cm.names, part.node_part)}
    g2, spec = rebuild_cut(s.model.graph, s.subspace, assignment)
    asg2 = with_cut_nodes(assignment, spec)
    cm = CostModel.build(g2, measure_costs(g2), s.cluster, r.micro_batches, s.cm.schedule,
                         optimizer_slots(r.optimizer.name, r.optimizer.momentum), samples_per_micro_batch(g2))
    cm = cm.variant(recompute_all=s.cm.recompute_all)
    index = {n: k for k, n in enumerate(names)}
    node_part = np.array([index[asg2[n]] for n in cm.names], dtype=np.int64)
    p2 = Partition(node_part, list(part.part_device), part.iteration_s, part.info)
    prices = prices_of(cm, r.compress) if r.compress is not None else None
    s = replace(s, model=Model(g2, s.model.params, s.model.example), cm=cm, part=p2, subspace=spec,
                codec_prices=prices)
    kept = tuple(n for n in s.schedule_prices if n in CUT_SCHEDULES)
    log.info("subspace: %d cut edge(s) on the stream send %d of %d numbers per token (+ the ids)",
             len(spec.cuts), spec.rank, spec.width)
    return replace(s, schedule_prices=price_schedules(s.estimator(), p2, r.recompute, kept))

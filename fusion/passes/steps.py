"""The compiler's passes, in the order :data:`PASSES` runs them; each takes the compile state and returns a new one.

    shapes        infer missing shape metadata from the model's example
    subspace_writers  --subspace: the residual stream's writers confined to span(U), the model rewritten
    costs         per-node costs and the plain cost model (schedule partitioned with, recompute all or not)
    node_times    measured per-node seconds into the cost model
    codec_prices  the estimator's prices for partitioning: --compress codecs, the bottleneck's code, the tied codec
    partition     the cut (and the interleaved cut), every schedule priced on it
    schedule      ``auto``: the schedule that prices shortest, and its cut
    bottleneck    learned bottlenecks inserted at the cut, the model rewritten
    subspace_cut  --subspace: the cut edges on the stream sent as k coordinates + the ids
    recompute     which parts recompute their activations
    tied_codec    ``auto``: the tied codec kept only where it shortens the iteration
    compression   the dense baseline (and the memory check), the cut edges' codecs, the plan's estimate
    assemble      the plan with its predictions

A pass reads the state's fields and returns ``dataclasses.replace(state, ...)``; it never changes the cost
model in the state, only asks :meth:`CompileState.estimator` for one with the prices it needs. Adding a pass:
a function here and its place in :data:`PASSES` (docs/design.md, "Compiler passes").
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Callable

from fusion.cluster.topology import device_clusters
from fusion.cost.autocast import with_precision
from fusion.cost.estimate import CostModel, optimizer_slots, samples_per_micro_batch
from fusion.cost.flops import measure_costs
from fusion.cost.schedules import best_schedule
from fusion.ir.schedule import LANE_SCHEDULES
from fusion.kernels.codecs import CODECS, Role
from fusion.passes.assemble import assemble_plan
from fusion.passes.cut import cut, interleaved_partition
from fusion.passes.pricing import CUT_SCHEDULES, price_schedules, recompute_choice
from fusion.passes.state import CompileError, CompileState
from fusion.passes.subspace import subspace_cut, subspace_writers

log = logging.getLogger("fusion.compile")

#: the schedule ``auto`` partitions with: the fewest activations in flight, so a cut that fits any schedule is found
AUTO_PARTITION_SCHEDULE = "1f1b"
#: what ``tied_codec="auto"`` tries: the codecs' own tied-gradient candidate (8-bit quant: SWARM's 8-bit gradients)
TIED_AUTO = CODECS.auto(Role.TIED_GRADIENT)[0]


def shapes(s: CompileState) -> CompileState:
    """Shape metadata on every node (inferred from the example where missing)."""
    ensure_shapes(s.model)
    return s


def costs(s: CompileState) -> CompileState:
    """Node costs and the plain cost model: the requested schedule (``auto``: :data:`AUTO_PARTITION_SCHEDULE`)."""
    r, graph = s.request, s.model.graph
    node_costs = measure_costs(graph, progress=len(graph) > 200)
    cm = CostModel.build(graph, node_costs, s.cluster, r.micro_batches,
                         AUTO_PARTITION_SCHEDULE if r.auto_schedule else r.schedule,
                         optimizer_slots(r.optimizer.name, r.optimizer.momentum), samples_per_micro_batch(graph))
    cm = with_precision(cm, r.precision)
    return replace(s, costs=node_costs, cm=cm.variant(recompute_all=r.recompute == "all"), schedule=cm.schedule)


def node_times(s: CompileState) -> CompileState:
    """The timed nodes priced by their measured seconds (``--node-times``)."""
    if s.request.node_times is None:
        return s
    cm = s.cm.variant()
    s.request.node_times.apply(cm)
    return replace(s, cm=cm)


def codec_prices(s: CompileState) -> CompileState:
    """What partitioning prices every candidate cut with: ``--compress``'s codecs (compression-aware
    partitioning), else the bottleneck's code (bottleneck-aware), and the tied codec's wire bytes."""
    from fusion.compress.policy import codec_prices as prices_of
    from fusion.cost.estimate import tied_prices

    r = s.request
    prices = prices_of(s.cm, r.compress) if r.compress is not None else None
    cut_prices = prices
    if r.bottleneck_priced:
        from fusion.compress.bottleneck import partition_prices

        cut_prices = partition_prices(s.cm, r.bottleneck)
    if s.subspace is not None and r.compress is None:  # the stream priced as the subspace cut pass leaves it
        from fusion.compress.subspace import partition_prices as subspace_prices

        cut_prices = subspace_prices(s.cm, s.subspace)
    tied = dict(TIED_AUTO) if r.tied_codec == "auto" else r.tied_codec
    # a codec without a measured rate is priced as quant
    tp = tied_prices(s.cm, tied, CODECS.rate(tied["algo"])) if tied is not None else None
    return replace(s, clusters=device_clusters(s.cluster, r.seed), codec_prices=prices, cut_prices=cut_prices,
                   tied=tied, tied_prices=tp)


def partition(s: CompileState) -> CompileState:
    """The cut by the strategy (and, with virtual stages, the interleaved cut), every schedule priced on it."""
    r = s.request
    cutter = s.estimator(codecs=s.cut_prices)
    ipart = interleaved_partition(cutter, s.cluster, r.strategy, r.virtual_stages) if r.virtual_stages else None
    if r.schedule == "interleaved":
        part, prices = ipart, {}
    else:
        part = cut(cutter, s.cluster, s.clusters, r.strategy, r.seed, retry_recompute=r.recompute == "auto")
        prices = price_schedules(s.estimator(), part, r.recompute)
    if ipart is not None:
        prices["interleaved"] = price_schedules(s.estimator(), ipart, r.recompute, LANE_SCHEDULES)["interleaved"]
    return replace(s, part=part, interleaved=ipart, schedule_prices=prices)


def schedule(s: CompileState) -> CompileState:
    """``auto``: the schedule simulated shortest among those that fit (its cut: the interleaved one for
    ``interleaved``); the fixed schedule otherwise."""
    if not s.request.auto_schedule:
        return s
    name = best_schedule(s.schedule_prices) or AUTO_PARTITION_SCHEDULE  # none fits: 1F1B's error below
    log.info("schedule auto: %s (%s)", name, ", ".join(
        f"{n} {p.iteration_s:.4g} s{'' if p.fits else ' (does not fit)'}" for n, p in s.schedule_prices.items()))
    return replace(s, schedule=name, cm=s.cm.variant(schedule=name),
                   part=s.interleaved if name in LANE_SCHEDULES else s.part)


def bottleneck(s: CompileState) -> CompileState:
    """Learned bottlenecks at the cut (``--bottleneck``); the model, cost model and cut become the rewritten ones."""
    from fusion.compress.policy import codec_prices as prices_of
    from fusion.cost.estimate import tied_prices
    from fusion.passes.bottleneck import insert_bottleneck

    r = s.request
    if r.bottleneck is None:
        return s
    if r.virtual_stages or r.node_times is not None:
        raise CompileError("--bottleneck is not built with " + ("--node-times (measured on the graph before the "
                           "pass)" if r.node_times is not None else "an interleaved schedule (--virtual-stages)"))

    def build(g) -> CostModel:  # a candidate's model: --compress's prices, its tied gradients dense
        c = CostModel.build(g, measure_costs(g), s.cluster, r.micro_batches, s.cm.schedule,
                            optimizer_slots(r.optimizer.name, r.optimizer.momentum), samples_per_micro_batch(g))
        c = with_precision(c, r.precision).variant(recompute_all=s.cm.recompute_all)
        return c.variant(codec_prices=prices_of(c, r.compress)) if r.compress is not None else c

    model, cm2, part, specs, info = insert_bottleneck(s.model, s.estimator(), s.part, r.bottleneck, r.seed,
                                                      r.recompute, build)
    s = replace(s, bottleneck_info=info)
    if not specs:
        return s
    plain = cm2.variant(codec_prices=None)
    tp = tied_prices(plain, s.tied, CODECS.rate(s.tied["algo"])) if s.tied is not None else None
    s = replace(s, model=model, cm=plain, part=part, bottlenecks=specs, codec_prices=cm2.codec_prices, tied_prices=tp)
    kept = tuple(n for n in s.schedule_prices if n in CUT_SCHEDULES)
    return replace(s, schedule_prices=price_schedules(s.estimator(), part, r.recompute, kept))


def recompute(s: CompileState) -> CompileState:
    """Which parts recompute their activations (``auto``: those over their device's memory without it)."""
    return replace(s, recompute=recompute_choice(s.estimator(), s.part, s.request.recompute))


def tied_codec(s: CompileState) -> CompileState:
    """``tied_codec="auto"``: the tied codec stays only where the iteration is shorter with it."""
    if s.tied is None or s.request.tied_codec != "auto":
        return s
    part, rc = s.part, s.recompute
    with_codec = s.estimator().evaluate(part.node_part, part.part_device, recompute=rc).iteration_s
    if s.estimator(tied=False).evaluate(part.node_part, part.part_device, recompute=rc).iteration_s <= with_codec:
        log.info("tied codec auto: %s does not shorten the iteration here; tied gradients stay dense", s.tied)
        return replace(s, tied=None, tied_prices=None)
    return s


def compression(s: CompileState) -> CompileState:
    """The dense estimate (CompileError when it does not fit), the cut edges' codecs (AdaTopK's ratio or
    ``--compress``'s, where they pay) and the plan's estimate with them."""
    from fusion.compress.adatopk import adatopk
    from fusion.compress.policy import choose

    r, part, rc = s.request, s.part, s.recompute
    dense = s.estimator(tied=False).evaluate(part.node_part, part.part_device, recompute=rc, priced=False)
    if dense.violations:
        raise CompileError(f"{s.cluster.source}: devices[].memory_bytes: strategy {r.strategy}"
                           f"{' interleaved' if s.schedule in LANE_SCHEDULES else ''} does not fit"
                           f"{'' if r.recompute == 'off' else ' even with activation recomputation'}: {dense.violations[0]}")
    names = [f"part{k}" for k in range(len(part.part_device))]
    cm, compressed, wire = s.estimator(), [], {}
    if r.compress_ratio is not None and r.compress_ratio > 1:
        compressed, wire = adatopk(cm, part.node_part, part.part_device, names, float(r.compress_ratio))
    elif r.compress is not None:
        compressed, wire = choose(cm, part.node_part, part.part_device, names, r.compress, recompute=rc)
    if r.compress is not None:  # the same edges choose() compressed, with their encode/decode time
        est = cm.evaluate(part.node_part, part.part_device, recompute=rc)
        if est.violations:  # the codecs' buffers (delta, AQ-SGD) on top of what fits dense
            raise CompileError(f"{s.cluster.source}: devices[].memory_bytes: strategy {r.strategy} with --compress "
                               f"does not fit: {est.violations[0]}")
    else:
        est = cm.evaluate(part.node_part, part.part_device, wire or None, recompute=rc) if (wire or s.tied) else dense
    return replace(s, names=names, dense=dense, compression=compressed, estimate=est)


def assemble(s: CompileState) -> CompileState:
    """The plan: parts, links, predictions (every schedule's price, node times, virtual stages, the stateful
    codecs' data set size), recomputation per part, the tied codec and the bottlenecks."""
    r, names, rc = s.request, s.names, s.recompute
    plan = assemble_plan(s.model, s.cluster, s.estimator(), s.part, names, s.estimate, s.dense, s.compression,
                         s.clusters, r.strategy, s.schedule, r.micro_batches, r.optimizer, r.seed)
    plan.tied_codec = s.tied
    plan.bottlenecks = s.bottlenecks
    if s.subspace is not None:
        plan.subspace = s.subspace.to_dict()
    if s.bottleneck_info is not None:
        plan.predicted["bottleneck"] = s.bottleneck_info
    plan.predicted["schedules"] = {n: p.to_dict() for n, p in s.schedule_prices.items()}
    plan.predicted["schedule_choice"] = "auto" if r.auto_schedule else "fixed"
    if r.node_times is not None:
        plan.predicted["node_times"] = r.node_times.summary()
    if s.schedule in LANE_SCHEDULES:
        plan.predicted["virtual_stages"] = {"chunks_per_device": r.virtual_stages, "lanes": plan.lanes()}
    for k, name in enumerate(names):
        plan.parts[name].recompute = bool(rc[k])
    if rc.any():
        log.info("activation recomputation on %s (they would not fit their devices otherwise)",
                 ", ".join(n for n, r_ in zip(names, rc) if r_))
    if stateful_edges(s.compression):
        plan.predicted["delta_samples"] = r.compress.samples  # the data set size the stateful codecs' buffers fit
    plan.predicted["compile_s"] = round(time.perf_counter() - s.started, 4)
    log.info("compiled %d nodes onto %d of %d devices with %s: predicted %.4g s/iteration",
             len(s.model.graph), len(names), len(s.cluster), r.strategy, plan.predicted["iteration_s"])
    return replace(s, plan=plan)


#: the compiler, pass by pass: the one place a pass is added
PASSES: tuple[Callable[[CompileState], CompileState], ...] = (
    shapes, subspace_writers, costs, node_times, codec_prices, partition, schedule, bottleneck, subspace_cut, recompute,
    tied_codec, compression, assemble)


def stateful_edges(compression) -> list:
    """The compressed edges whose activation codec keeps per-sample state at both ends (``delta``): their
    buffers are sized by the data set (``plan.predicted["delta_samples"]``)."""
    return [c for c in compression if CODECS.needs_sample_ids(c.codec("fwd"))]


def ensure_shapes(model) -> None:
    """Infer shape metadata where a node lacks it (CompileError when the model has no example to infer from)."""
    missing = [n.name for n in model.graph.nodes.values() if not n.meta.outputs and n.kind.value not in ("output",)]
    if not missing:
        return
    if not model.example:
        raise CompileError(f"node {missing[0]!r} has no shape metadata and the model has no example inputs")
    from fusion.ir.shapes import infer_meta

    infer_meta(model.graph, model.example)

"""``compile_model``: a model plus a cluster become a plan (FusionLLM §3.5-3.6, §4, §5.2).

Stages, each reading only what the previous one produced::

    Model.graph --measure_costs--> node costs --CostModel--> arrays
        --op_fence | equal-count | equal-flops--> node -> part, part -> device
        --adatopk--> compression per cut edge --> Plan (with predictions)
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from fusion.compress.adatopk import adatopk
from fusion.compress.policy import CompressRequest, choose, codec_prices
from fusion.partition.baselines import BASELINES
from fusion.partition.chain import build_chain
from fusion.partition.interleave import INTERLEAVE_BY, interleaved_cut, interleaved_devices
from fusion.cluster.model import Cluster
from fusion.cost.estimate import CostModel, Estimate, device_memory, optimizer_slots, samples_per_micro_batch
from fusion.cost.schedules import SchedulePrice, best_schedule, price_schedule, simulate_estimate
from fusion.plan import OptimizerConfig
from fusion.partition.fence import NoFitError, Partition, op_fence
from fusion.cost.flops import measure_costs
from fusion.ir.errors import FusionError
from fusion.ir.model import Model
from fusion.ir.node import TensorMeta
from fusion.ir.schedule import LANE_SCHEDULES
from fusion.plan import SCHEDULE_NAMES, Part, Plan, boundary_tables
from fusion.cluster.topology import device_clusters

if TYPE_CHECKING:
    from fusion.compress.bottleneck import BottleneckRequest
    from fusion.cost.node_times import NodeTimes

log = logging.getLogger(__name__)

STRATEGIES = ("opfence", "equal-count", "equal-flops")
RECOMPUTE = ("auto", "off", "all")
#: what ``schedule=`` accepts: a schedule the executors run, or ``auto`` (the compiler prices each and picks)
SCHEDULE_CHOICES = (*SCHEDULE_NAMES, "auto")
#: the schedule ``auto`` partitions with: the fewest activations in flight, so a cut that fits any schedule is found
AUTO_PARTITION_SCHEDULE = "1f1b"
#: the schedules priced on one cut with one part per device; ``interleaved`` is priced on its own cut
CUT_SCHEDULES = tuple(n for n in SCHEDULE_NAMES if n not in LANE_SCHEDULES)
#: chunks per device of ``schedule="interleaved"`` when ``virtual_stages`` is not given
DEFAULT_VIRTUAL_STAGES = 2
COST_MODEL = "fusion.estimate/2"  # 2: iteration_s is the simulated schedule, Eq. 3 in eq3_iteration_s


class CompileError(FusionError):
    """The model cannot be compiled for this cluster; the message says why."""


def compile_model(model: Model, cluster: Cluster, *, strategy: str = "opfence", micro_batches: int = 1,
                  compress_ratio: float | None = None, schedule: str = "gpipe",
                  optimizer: OptimizerConfig = OptimizerConfig(), seed: int = 0,
                  compress: CompressRequest | None = None, recompute: str = "auto",
                  tied_codec: dict | str | None = None, virtual_stages: int | None = None,
                  node_times: "NodeTimes | None" = None, bottleneck: "BottleneckRequest | None" = None) -> Plan:
    """Partition ``model`` over ``cluster`` and return the plan executors run.

    strategy:       ``opfence`` (default), ``equal-count`` or ``equal-flops``.
    micro_batches:  n_b of Eq. (3); the example in ``model`` is one micro-batch.
    compress_ratio: AdaTopK's r of Eq. (7); None or 1 compresses nothing.
    compress:       per-direction codecs, applied where they pay (:mod:`fusion.compress.policy`);
                    exclusive with ``compress_ratio``.
    schedule:       ``gpipe``, ``1f1b`` or ``zb1`` (changes the activation memory in flight and the time, see
                    :mod:`fusion.cost.schedules`), ``interleaved`` (interleaved 1F1B: the chain cut into
                    ``virtual_stages`` x D parts, part s on the (s % D)-th device, :mod:`fusion.partition.interleave`;
                    ``equal-flops`` or ``equal-count`` only), or ``auto``: partition with 1F1B's memory, price
                    gpipe, 1f1b and zb1 on that cut and devices (each with the recomputation it would need) and,
                    with ``virtual_stages`` > 1, ``interleaved`` on its own cut, and keep the shortest simulated
                    iteration among those that fit memory, ties to the smaller peak memory. Every schedule's
                    price is in ``plan.predicted["schedules"]``.
    virtual_stages: V, chunks per device of ``interleaved`` (default 2); with ``auto``, V > 1 adds interleaved
                    to what is priced. Any other schedule takes none.
    recompute:      activation recomputation per part: ``auto`` turns it on only for parts that would
                    not fit their device otherwise (and lets the partitioner count on it when nothing
                    fits without it), ``off`` never, ``all`` on every part.
    tied_codec:     codec cfg for the gradients of tied parameters (``Plan.tied_codec``), priced by the
                    estimator with its wire bytes; ``"auto"``: 8-bit quant when the cost model says the
                    iteration gets shorter with it, else none.
    node_times:     measured per-node seconds (:class:`fusion.cost.node_times.NodeTimes`, ``--node-times``):
                    the estimator prices the timed nodes by them (FusionError if measured on another graph).
    bottleneck:     learned bottlenecks at the cut (:mod:`fusion.compress.bottleneck`): after partitioning, the
                    chosen cut edges get an encoder/decoder pair (new parameters), the plan's graph is the
                    rewritten one, the estimator prices it (smaller wire bytes, extra FLOPs and memory), and
                    ``plan.bottlenecks`` says what was inserted. The returned plan's graph has new parameters:
                    their initial values are :func:`fusion.compress.bottleneck.initial_values` of
                    ``plan.bottlenecks``. Not with an interleaved schedule or ``node_times``.
    Raises CompileError (naming the cluster file and field) when nothing fits.
    """
    t0 = time.perf_counter()
    if strategy not in STRATEGIES:
        raise CompileError(f"strategy must be one of {', '.join(STRATEGIES)}; got {strategy!r}")
    if not isinstance(micro_batches, int) or micro_batches < 1:
        raise CompileError(f"micro_batches must be an integer >= 1, got {micro_batches!r}")
    if schedule not in SCHEDULE_CHOICES:
        raise CompileError(f"schedule must be one of {list(SCHEDULE_CHOICES)}, got {schedule!r}")
    v_stages = _virtual_stages(schedule, virtual_stages, strategy)
    if compress is not None and compress_ratio is not None:
        raise CompileError("give either compress_ratio (AdaTopK) or compress (codecs), not both")
    if compress_ratio is not None and not compress_ratio >= 1:
        raise CompileError(f"compress_ratio must be >= 1, got {compress_ratio!r}")
    if recompute not in RECOMPUTE:
        raise CompileError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {recompute!r}")
    graph = model.graph
    _ensure_shapes(model)
    costs = measure_costs(graph, progress=len(graph) > 200)
    auto = schedule == "auto"
    cm = CostModel.build(graph, costs, cluster, micro_batches, AUTO_PARTITION_SCHEDULE if auto else schedule,
                         optimizer_slots(optimizer.name, optimizer.momentum), samples_per_micro_batch(graph))
    cm.recompute_all = recompute == "all"
    if node_times is not None:
        node_times.apply(cm)
    clusters = device_clusters(cluster, seed)
    if compress is not None:  # compression-aware partitioning: every candidate cut priced with its codec
        cm.codec_prices = codec_prices(cm, compress)
    tied = _tied_codec(cm, tied_codec)
    ipart = _interleaved_partition(cm, cluster, strategy, v_stages) if v_stages else None
    if schedule == "interleaved":
        part, prices = ipart, {}
    else:
        part = _partition(cm, cluster, clusters, strategy, seed, retry_recompute=recompute == "auto")
        prices = _price_schedules(cm, part, recompute)
    if ipart is not None:
        prices["interleaved"] = _price_interleaved(cm, ipart, recompute)
    if auto:
        schedule = best_schedule(prices) or AUTO_PARTITION_SCHEDULE  # none fits: 1F1B's error below
        cm.schedule = schedule
        if schedule in LANE_SCHEDULES:
            part = ipart
        log.info("schedule auto: %s (%s)", schedule, ", ".join(
            f"{n} {p.iteration_s:.4g} s{'' if p.fits else ' (does not fit)'}" for n, p in prices.items()))
    bspecs, binfo = [], None
    if bottleneck is not None:
        if v_stages or node_times is not None:
            raise CompileError("--bottleneck is not built with " + ("--node-times (measured on the graph before the "
                               "pass)" if node_times is not None else "an interleaved schedule (--virtual-stages)"))

        def build(g):
            c = CostModel.build(g, measure_costs(g), cluster, micro_batches, cm.schedule,
                                optimizer_slots(optimizer.name, optimizer.momentum), samples_per_micro_batch(g))
            c.recompute_all = cm.recompute_all
            if compress is not None:
                c.codec_prices = codec_prices(c, compress)
            return c

        model, cm, part, bspecs, binfo = _bottleneck(model, cm, part, bottleneck, seed, recompute, build)
        graph = model.graph
        if bspecs:
            tied = _tied_codec(cm, tied_codec)
            prices = _price_schedules(cm, part, recompute, tuple(n for n in prices if n in CUT_SCHEDULES))
    rc = _recompute_choice(cm, part, recompute)
    tied = _tied_pays(cm, part, rc, tied, tied_codec == "auto")
    tied_prices_ = (cm.tied_wire, cm.tied_codec_s)
    cm.tied_wire = cm.tied_codec_s = None  # the dense baseline sums tied gradients dense too
    dense = cm.evaluate(part.node_part, part.part_device, recompute=rc, priced=False)
    cm.tied_wire, cm.tied_codec_s = tied_prices_
    if dense.violations:
        raise CompileError(f"{cluster.source}: devices[].memory_bytes: strategy {strategy}"
                           f"{' interleaved' if schedule in LANE_SCHEDULES else ''} does not fit"
                           f"{'' if recompute == 'off' else ' even with activation recomputation'}: {dense.violations[0]}")
    names = [f"part{k}" for k in range(len(part.part_device))]
    compression, wire = [], {}
    if compress_ratio is not None and compress_ratio > 1:
        compression, wire = adatopk(cm, part.node_part, part.part_device, names, float(compress_ratio))
    elif compress is not None:
        compression, wire = choose(cm, part.node_part, part.part_device, names, compress, recompute=rc)
    if compress is not None:  # the same edges choose() compressed, with their encode/decode time
        est = cm.evaluate(part.node_part, part.part_device, recompute=rc)
        if est.violations:  # the codecs' buffers (delta, AQ-SGD) on top of what fits dense
            raise CompileError(f"{cluster.source}: devices[].memory_bytes: strategy {strategy} with --compress "
                               f"does not fit: {est.violations[0]}")
    else:
        est = cm.evaluate(part.node_part, part.part_device, wire or None, recompute=rc) if (wire or tied) else dense
    plan = _assemble(model, cluster, cm, part, names, est, dense, compression, clusters, strategy, schedule,
                     micro_batches, optimizer, seed)
    plan.tied_codec = tied
    plan.bottlenecks = bspecs
    if binfo is not None:
        plan.predicted["bottleneck"] = binfo
    plan.predicted["schedules"] = {n: p.to_dict() for n, p in prices.items()}
    plan.predicted["schedule_choice"] = "auto" if auto else "fixed"
    if node_times is not None:
        plan.predicted["node_times"] = node_times.summary()
    if schedule in LANE_SCHEDULES:
        plan.predicted["virtual_stages"] = {"chunks_per_device": v_stages, "lanes": plan.lanes()}
    for k, name in enumerate(names):
        plan.parts[name].recompute = bool(rc[k])
    if rc.any():
        log.info("activation recomputation on %s (they would not fit their devices otherwise)",
                 ", ".join(n for n, r in zip(names, rc) if r))
    from fusion.kernels.codecs import CODECS

    if any(CODECS.needs_sample_ids(c.codec("fwd")) for c in compression):
        plan.predicted["delta_samples"] = compress.samples  # the data set size the buffers were sized for
    plan.predicted["compile_s"] = round(time.perf_counter() - t0, 4)
    log.info("compiled %d nodes onto %d of %d devices with %s: predicted %.4g s/iteration",
             len(graph), len(names), len(cluster), strategy, plan.predicted["iteration_s"])
    return plan


def _bottleneck(model: Model, cm: CostModel, part: Partition, req, seed: int, recompute: str, build):
    """The bottleneck pass on the cut ``part`` (:mod:`fusion.compress.bottleneck`): ``(model, cost model,
    partition, specs, info)`` of the rewritten graph, each candidate rank priced by the estimator on that same cut
    (``auto``: the smallest ranks within ``AUTO_SLACK`` of the best; ``optional``: nothing unless it shortens the
    iteration). ``info`` is ``plan.predicted["bottleneck"]``."""
    from fusion.compress.bottleneck import (AUTO_DIVISORS, AUTO_SLACK, cut_edges, initial_values,
                                            insert_bottlenecks, with_bottleneck_nodes)

    names = [f"part{k}" for k in range(len(part.part_device))]
    assignment = {n: names[int(p)] for n, p in zip(cm.names, part.node_part)}
    edges = cut_edges(model.graph, assignment, list(req.edges) if req.edges is not None else None)
    rc0 = _recompute_choice(cm, part, recompute)
    without = float(cm.evaluate(part.node_part, part.part_device, recompute=rc0).iteration_s)
    # with_s / without_s: Eq. 3's iteration (what the partitioners minimise) on this cut, with and without
    info: dict[str, Any] = {"request": req.rank, "optional": req.optional, "without_s": without, "candidates": []}
    if not edges:
        if req.optional:
            info["chosen"] = None
            return model, cm, part, [], info
        raise CompileError("--bottleneck: no cut edge of this plan carries the residual stream (the float tensors of "
                           "the graph's most common width); name edges with --bottleneck-edges")
    width = {e.name: model.graph.output_meta(e.producer, e.index).shape[-1] for e in edges}
    if req.rank == "auto":
        candidates = list({tuple(max(1, w // k) for w in width.values()): None for k in AUTO_DIVISORS})
        candidates = [dict(zip(width, c)) for c in candidates if all(r < w for r, w in zip(c, width.values()))]
        if not candidates:
            raise CompileError(f"--bottleneck auto: the cut edges are too narrow for a bottleneck (widths {width})")
    else:
        candidates = [dict.fromkeys(width, req.rank)]
    priced = []
    for ranks in candidates:
        g2, specs = insert_bottlenecks(model.graph, edges, ranks, seed)
        asg2 = with_bottleneck_nodes(assignment, specs)
        cm2 = build(g2)
        index = {n: k for k, n in enumerate(names)}
        node_part = np.array([index[asg2[n]] for n in cm2.names], dtype=np.int64)
        p2 = Partition(node_part, list(part.part_device), 0.0, part.info)
        rc = _recompute_choice(cm2, p2, recompute)
        p2.iteration_s = float(cm2.evaluate(node_part, part.part_device, recompute=rc).iteration_s)
        info["candidates"].append({"ranks": ranks, "iteration_s": p2.iteration_s})
        priced.append((p2.iteration_s, g2, specs, cm2, p2))
    best = min(t for t, *_ in priced)
    t, g2, specs, cm2, p2 = next(x for x in priced if x[0] <= best * (1 + AUTO_SLACK))
    if req.optional and not t < without:
        log.info("bottleneck: %.4g s/iteration with it, %.4g s without: left out", t, without)
        info["chosen"] = None
        return model, cm, part, [], info
    info["chosen"] = {s.edge: s.rank for s in specs}
    info["with_s"] = t
    log.info("bottleneck on %s: predicted %.4g s/iteration (%.4g s without)",
             ", ".join(f"{s.edge} {s.width}->{s.rank}" for s in specs), t, without)
    params = {**model.params, **initial_values(specs)} if model.params else {}
    return Model(g2, params, model.example), cm2, p2, specs, info


def _partition(cm: CostModel, cluster: Cluster, clusters, strategy: str, seed: int, retry_recompute: bool) -> Partition:
    """Node -> part and part -> device by ``strategy``. With ``retry_recompute``, a model that fits no
    device split as it is gets a second try priced with activation recomputation on every part."""
    try:
        _check_fits(cm, cluster)
        if strategy == "opfence":
            try:
                return op_fence(cm, clusters, seed=seed, progress=len(cluster) > 128)
            except NoFitError:
                raise CompileError(_no_fit_message(cm, cluster)) from None
        return BASELINES[strategy](cm, build_chain(cm))  # a fixed split: recomputation is chosen per part after
    except CompileError:
        if not retry_recompute or cm.recompute_all:
            raise
        log.info("nothing fits without activation recomputation; partitioning again with it")
        cm.recompute_all = True
        try:
            return _partition(cm, cluster, clusters, strategy, seed, retry_recompute=False)
        finally:
            cm.recompute_all = False


def _price_schedules(cm: CostModel, part: Partition, recompute: str,
                     names: tuple[str, ...] = CUT_SCHEDULES) -> dict[str, SchedulePrice]:
    """Schedules ``names`` priced on the cut (:func:`fusion.cost.schedules.price_schedule`), each with the
    recomputation ``recompute`` would choose under it. Leaves ``cm.schedule`` as it found it."""
    before, out = cm.schedule, {}
    try:
        for name in names:
            cm.schedule = name
            rc = _recompute_choice(cm, part, recompute)
            out[name] = price_schedule(cm, name, part.node_part, part.part_device, rc)[0]
    finally:
        cm.schedule = before
    return out


def _price_interleaved(cm: CostModel, part: Partition, recompute: str) -> SchedulePrice:
    """``interleaved`` priced on its own cut (:func:`_interleaved_partition`)."""
    return _price_schedules(cm, part, recompute, LANE_SCHEDULES)["interleaved"]


def _virtual_stages(schedule: str, virtual_stages: int | None, strategy: str) -> int | None:
    """V of an interleaved cut to build (None: none), checking ``virtual_stages`` against the schedule and
    strategy; CompileError with one line otherwise."""
    if virtual_stages is not None and (not isinstance(virtual_stages, int) or virtual_stages < 1):
        raise CompileError(f"virtual_stages (--virtual-stages) must be an integer >= 1, got {virtual_stages!r}")
    if virtual_stages is not None and schedule not in (*LANE_SCHEDULES, "auto"):
        raise CompileError(f"--virtual-stages {virtual_stages}: virtual stages are chunks of interleaved 1F1B; "
                           f"give --schedule interleaved (or auto), not {schedule}")
    v = virtual_stages or (DEFAULT_VIRTUAL_STAGES if schedule in LANE_SCHEDULES else None)
    if v is None or (schedule == "auto" and v < 2):
        return None
    if strategy not in INTERLEAVE_BY:
        raise CompileError(f"--schedule {schedule} --virtual-stages {v}: strategy {strategy} cuts a DAG, not a chain "
                           "of chunks round-robin over devices; use --strategy equal-flops (chunks sized by device "
                           "speed) or equal-count")
    return v


def _interleaved_partition(cm: CostModel, cluster: Cluster, strategy: str, v: int) -> Partition:
    """The interleaved cut (:func:`fusion.partition.interleave.interleaved_cut`) of ``strategy`` with ``v``
    chunks per device, its parts numbered in the plan's part order (``ir.boundary.part_order``) and placed
    round-robin in it. CompileError when the micro-batches are not a multiple of the devices or the model
    has fewer operators than chunks."""
    from fusion.ir.boundary import part_order

    ch = build_chain(cm)
    devices = interleaved_devices(cm, ch, v)
    d = len(devices)
    if cm.micro_batches % d:
        raise CompileError(f"--micro-batches {cm.micro_batches} is not a multiple of the {d} devices of the interleaved "
                           f"pipeline ({v} virtual stages x {d} devices): interleaved 1F1B runs micro-batches in "
                           f"groups of {d}; use --micro-batches {cm.micro_batches + d - cm.micro_batches % d}")
    before, cm.schedule = cm.schedule, "interleaved"
    try:
        _check_fits(cm, cluster)
        try:
            part = interleaved_cut(cm, ch, devices, v, INTERLEAVE_BY[strategy], {"strategy": strategy})
        except ValueError as e:
            raise CompileError(f"--virtual-stages {v}: {e}") from None
        order = part_order(cm.graph, dict(zip(cm.names, part.node_part.tolist())))
        if order != list(range(len(order))):  # number parts as the plan will order them, devices round-robin
            rank = np.empty(len(order), dtype=np.int64)
            rank[np.asarray(order)] = np.arange(len(order))
            node_part = rank[part.node_part]
            part = Partition(node_part, [devices[s % d] for s in range(len(order))],
                             float(cm.evaluate(node_part, [devices[s % d] for s in range(len(order))], detail=False)[0]),
                             part.info)
    finally:
        cm.schedule = before
    return part


def _recompute_choice(cm: CostModel, part: Partition, mode: str) -> np.ndarray:
    """Which parts recompute: all, none, or (``auto``) those over their device's memory without it (under
    ``interleaved``, every chunk of a device whose chunks together are over its memory)."""
    n = len(part.part_device)
    if mode != "auto":
        return np.full(n, mode == "all")
    est = cm.evaluate(part.node_part, part.part_device, recompute=np.zeros(n, dtype=bool))
    mem = np.array([pe.memory_bytes for pe in est.parts])
    if cm.schedule in LANE_SCHEDULES:
        dev = np.asarray(part.part_device, dtype=np.int64)
        mem = device_memory(mem, dev)[dev]
    return mem > np.array([pe.memory_limit for pe in est.parts])


def _ensure_shapes(model: Model) -> None:
    missing = [n.name for n in model.graph.nodes.values() if not n.meta.outputs and n.kind.value not in ("output",)]
    if not missing:
        return
    if not model.example:
        raise CompileError(f"node {missing[0]!r} has no shape metadata and the model has no example inputs")
    from fusion.ir.shapes import infer_meta

    infer_meta(model.graph, model.example)


def _check_fits(cm: CostModel, cluster: Cluster) -> None:
    """Fail early, naming the field, when the model cannot fit even spread over every device."""
    need_state = float(cm.p_state.sum())
    need_act = float(cm.saved.sum()) * (cm.micro_batches if cm.schedule == "gpipe" and not cm.recompute_all else 1)
    have = float(cm.mem_cap.sum())
    if need_state + need_act > have:
        raise CompileError(
            f"{cluster.source}: devices[].memory_bytes: the model needs {(need_state + need_act) / 1e9:.3f} GB "
            f"(parameters, gradients and optimizer state {need_state / 1e9:.3f} GB + activations {need_act / 1e9:.3f} GB "
            f"for {cm.micro_batches} micro-batch(es)) but all {len(cluster)} devices hold {have / 1e9:.3f} GB")
    per_node = cm.saved * (1 if cm.recompute_all else cm.micro_batches)
    biggest = int(np.argmax(per_node + np.bincount(cm.pn_node, weights=cm.p_state[cm.pn_param], minlength=len(cm.names))))
    node_need = float(per_node[biggest] + cm.p_state[cm.pn_param[cm.pn_node == biggest]].sum())
    if node_need > cm.mem_cap.max():
        raise CompileError(f"{cluster.source}: devices[].memory_bytes: node {cm.names[biggest]!r} alone needs "
                           f"{node_need / 1e9:.3f} GB but the largest device holds {cm.mem_cap.max() / 1e9:.3f} GB")


def _no_fit_message(cm: CostModel, cluster: Cluster) -> str:
    how = " even with activation recomputation" if cm.recompute_all else ""
    return (f"{cluster.source}: devices[].memory_bytes: no split of the model over the devices fits their memory{how} "
            f"({cm.p_state.sum() / 1e9:.3f} GB of parameter state + {cm.saved.sum() / 1e9:.3f} GB of activations per "
            f"micro-batch x {cm.micro_batches}; devices hold {cm.mem_cap.sum() / 1e9:.3f} GB in total)")


#: what ``tied_codec="auto"`` tries: 8-bit block quantisation (SWARM: 8-bit gradients lose nothing)
TIED_AUTO = {"algo": "quant", "bits": 8}


def _tied_codec(cm: CostModel, spec: dict | str | None) -> dict | None:
    """The tied codec to price partitioning with (``auto``: :data:`TIED_AUTO`); sets the estimator's prices."""
    from fusion.cost.estimate import tied_prices
    from fusion.kernels.codecs import CODECS

    cfg = dict(TIED_AUTO) if spec == "auto" else spec
    if cfg is not None:  # a codec without a measured rate is priced as quant
        cm.tied_wire, cm.tied_codec_s = tied_prices(cm, cfg, CODECS.rate(cfg["algo"]))
    return cfg


def _tied_pays(cm: CostModel, part: Partition, rc, cfg: dict | None, auto: bool) -> dict | None:
    """``cfg``, unless ``auto`` and the iteration is not shorter with it (then none, and dense prices)."""
    if cfg is None or not auto:
        return cfg
    with_codec = cm.evaluate(part.node_part, part.part_device, recompute=rc).iteration_s
    prices, (cm.tied_wire, cm.tied_codec_s) = (cm.tied_wire, cm.tied_codec_s), (None, None)
    if cm.evaluate(part.node_part, part.part_device, recompute=rc).iteration_s <= with_codec:
        log.info("tied codec auto: %s does not shorten the iteration here; tied gradients stay dense", cfg)
        return None
    cm.tied_wire, cm.tied_codec_s = prices
    return cfg


def _assemble(model: Model, cluster: Cluster, cm: CostModel, part: Partition, names: list[str], est: Estimate,
              dense: Estimate, compression, clusters, strategy, schedule, micro_batches, optimizer, seed) -> Plan:
    graph = model.graph
    dev_names = [d.name for d in cluster.devices]
    assignment = {n: names[int(p)] for n, p in zip(cm.names, part.node_part)}
    parts = {}
    for k, pe in enumerate(est.parts):
        d = cluster.devices[part.part_device[k]]
        parts[names[k]] = Part(names[k], d.name, d.address, "torch", pe.compute_s, pe.comm_s, pe.memory_bytes)
    links = {}
    for le in est.links:
        a, b = part.part_device[le.src], part.part_device[le.dst]
        links[f"{names[le.src]}->{names[le.dst]}"] = {
            "src_device": dev_names[a], "dst_device": dev_names[b], "tensors": le.tensors,
            "fwd_bytes": le.fwd_bytes, "bwd_bytes": le.bwd_bytes, "fwd_s": le.fwd_s, "bwd_s": le.bwd_s,
            "bandwidth_bps": cluster.bandwidth_bps(a, b), "latency_s": float(cluster.alpha[a, b])}
    # the reported iteration is the schedule simulated with the estimator's numbers (fusion/cost/schedules.py):
    # Eq. 3 charges every part's C_p + R_p for the fill and drain and overlaps nothing, up to ~10 % over on a
    # link-bound cut and blind to an interleaved device's shared clock; Eq. 3 stays what the partitioners minimise
    sim = simulate_estimate(cm, est, schedule, part.node_part, part.part_device)
    dense_sim = sim if dense is est else simulate_estimate(cm, dense, schedule, part.node_part, part.part_device)
    samples = cm.micro_batches * cm.samples_per_micro_batch
    predicted: dict[str, Any] = {
        "cost_model": COST_MODEL,
        "iteration_s": sim, "pipeline_s": sim - est.sync_s - est.step_s, "sync_s": est.sync_s, "step_s": est.step_s,
        "throughput_samples_s": samples / sim if sim > 0 else float("inf"), "dense_iteration_s": dense_sim,
        "eq3_iteration_s": est.iteration_s, "eq3_pipeline_s": est.pipeline_s,
        "samples_per_micro_batch": cm.samples_per_micro_batch,
        "parts": {names[k]: {"device": pe.device, "compute_s": pe.compute_s, "comm_s": pe.comm_s,
                             "comm_fwd_s": pe.comm_fwd_s, "comm_bwd_s": pe.comm_bwd_s, "flops": pe.flops,
                             "memory_bytes": pe.memory_bytes, "param_state_bytes": pe.param_state_bytes,
                             "activation_bytes": pe.activation_bytes, "in_flight": pe.in_flight,
                             "memory_limit": pe.memory_limit,
                             **({"delta_buffer_bytes": pe.delta_buffer_bytes} if pe.delta_buffer_bytes else {}),
                             **({"optimizer_s": pe.optimizer_s} if pe.optimizer_s else {})}
                  for k, pe in enumerate(est.parts)},
        "links": links,
        "clusters": [[dev_names[i] for i in c] for c in clusters],
        "partitioner": {k: v for k, v in part.info.items()},
    }
    example = {}
    for n in graph.placeholders():
        o = n.meta.outputs[0] if n.meta.outputs else None
        if isinstance(o, TensorMeta):
            example[n.name] = {"shape": list(o.shape), "dtype": o.dtype}
    return Plan(graph, cluster.to_dict(), parts, assignment, list(compression), schedule, micro_batches,
                optimizer.to_dict(), seed, predicted, example, strategy, boundary_tables(graph, assignment))


def compare_strategies(model: Model, cluster: Cluster, **kw) -> dict[str, float | None]:
    """Predicted iteration time of every strategy (None where it does not fit)."""
    out: dict[str, float | None] = {}
    for s in STRATEGIES:
        try:
            out[s] = compile_model(model, cluster, strategy=s, **kw).predicted["iteration_s"]
        except CompileError as e:
            log.info("%s: %s", s, e)
            out[s] = None
    return out

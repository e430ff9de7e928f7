"""Data-parallel replicas of a pipeline (DP x PP): one cut, R pipelines on disjoint devices.

Two entry points build a replicated :class:`~fusion.plan.Plan`:

* :func:`compile_replicated` from a cut and a device grid (what a DP planner chooses):
  ``cut[node] = stage`` (0 .. S-1, the same for every replica) and
  ``devices[r][s]`` = the cluster device of replica r's stage s, all distinct.
* :func:`replicate` from a compiled single pipeline: keep its cut and devices as replica 0 and
  place replicas 1 .. R-1 by :func:`next_free_devices`.

Part names: replica 0's parts are the stages (``part0`` .. ``part{S-1}``); replica r's part of
stage ``part{s}`` is ``r{r}.part{s}`` (:func:`~fusion.plan.replica_part_name`).

Predictions: each replica's pipeline is priced by the estimator on its own devices; the plan's
``iteration_s`` is the slowest replica's (the gradient all-reduce between replicas is not priced
here: ``predicted["dp_sync_s"]`` is left for a DP cost model to fill) and its throughput is R
times the samples of one replica per iteration.
"""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Mapping, Sequence

import numpy as np

from fusion.cluster.model import Cluster
from fusion.ir.model import Model
from fusion.plan import OptimizerConfig, Part, Plan, replica_part_name

log = logging.getLogger(__name__)


def _error(msg: str):
    from fusion.compile import CompileError

    return CompileError(msg)


def micro_batch_rows(plan: Plan) -> int | None:
    """Rows (dim 0) of one micro-batch, from the plan's example placeholders (None when unknown)."""
    rows = {int(v["shape"][0]) for v in plan.example.values() if v.get("shape")}
    return rows.pop() if len(rows) == 1 else None


def split_global_batch(global_batch: int, replicas: int, micro_batches: int, rows: int | None) -> int:
    """Micro-batches per replica for a global batch of ``global_batch`` rows.

    micro_batches: the micro-batches per replica asked for (0: derive them from ``rows``).
    rows:          rows of one micro-batch (fixed by the graph's shapes), or None when unknown.
    Raises CompileError (one line) when the global batch does not divide.
    """
    if global_batch < 1:
        raise _error(f"--global-batch must be >= 1, got {global_batch}")
    if global_batch % replicas:
        raise _error(f"--global-batch {global_batch} does not divide over {replicas} replicas")
    share = global_batch // replicas
    if rows:
        if share % rows:
            raise _error(f"--global-batch {global_batch}: each of {replicas} replicas gets {share} rows, not a multiple "
                         f"of the micro-batch of {rows} rows the model was traced with")
        n = share // rows
        if micro_batches and micro_batches != n:
            raise _error(f"--global-batch {global_batch} over {replicas} replicas is {n} micro-batches of {rows} rows "
                         f"per replica, not --micro-batches {micro_batches}")
        return n
    if not micro_batches or share % micro_batches:
        raise _error(f"--global-batch {global_batch} does not divide into {replicas} replicas x "
                     f"{micro_batches} micro-batches")
    return micro_batches


def replica_zero_share(stages: int, cluster: Cluster, replicas: int) -> list[str] | None:
    """The devices replica 0's pipeline is compiled on again when the one compiled on the whole cluster, of
    ``stages`` stages, leaves too few for ``replicas`` copies (OP-Fence is free to use every device for one
    pipeline): its 1/R share, the first floor(N/R) devices taking whole groups (sites) in the order their first
    device appears in the cluster file, so a replica's stages stay inside a site where one holds them. None when the
    pipeline already leaves room (stages x R <= N), or when a share would be empty (the grid's own error then names
    what is missing)."""
    n = len(cluster)
    if stages * replicas <= n or n // replicas < 1:
        return None
    first: dict[str, int] = {}
    for i, d in enumerate(cluster.devices):
        first.setdefault(d.group, i)
    by_site = sorted(range(n), key=lambda i: (first[cluster.devices[i].group], i))
    return [cluster.devices[i].name for i in by_site[:n // replicas]]


def on_whole_cluster(plan: Plan, cluster: Cluster, seed: int = 0) -> Plan:
    """``plan``, compiled on a share of ``cluster`` (:func:`replica_zero_share`), as a plan of the whole cluster:
    its ``cluster`` and its ``predicted["clusters"]`` (the Louvain clusters ``fusion inspect`` draws the devices
    by) name every device, so :func:`replicate` can place the other replicas and they are drawn."""
    from fusion.cluster.topology import device_clusters

    names = [d.name for d in cluster.devices]
    clusters = [[names[i] for i in c] for c in device_clusters(cluster, seed)]
    return replace(plan, cluster=cluster.to_dict(), predicted={**plan.predicted, "clusters": clusters})


def next_free_devices(plan: Plan, cluster: Cluster, replicas: int) -> list[list[str]]:
    """The device grid for ``replicas`` copies of ``plan``'s single pipeline.

    The rule: replica 0 keeps the plan's devices; then, replica by replica and stage by stage
    (pipeline order), each stage takes the fastest device not yet used (by ``Device.speed``, ties by
    cluster order) whose memory holds that stage's predicted memory (``Part.memory_bytes``).
    Raises CompileError when the cluster runs out of devices.
    """
    from fusion.ir.boundary import part_order

    if replicas < 1:
        raise _error(f"--replicas must be >= 1, got {replicas}")
    if plan.replicas != 1:
        raise _error(f"the plan already has {plan.replicas} replicas")
    stages = part_order(plan.graph, plan.assignment)
    grid = [[plan.parts[s].device for s in stages]]
    used = set(grid[0])
    by_speed = sorted(range(len(cluster)), key=lambda i: (-cluster.devices[i].speed, i))
    for r in range(1, replicas):
        row = []
        for s in stages:
            need = plan.parts[s].memory_bytes
            pick = next((i for i in by_speed if cluster.devices[i].name not in used
                         and cluster.devices[i].memory_bytes >= need), None)
            if pick is None:
                free = len(cluster) - len(used)
                raise _error(f"{cluster.source}: devices: no free device for replica {r}'s stage {s} "
                             f"({replicas} replicas x {len(stages)} stages need {replicas * len(stages)} devices; "
                             f"{free} free ones left, none with {need / 1e9:.3f} GB)")
            used.add(cluster.devices[pick].name)
            row.append(cluster.devices[pick].name)
        grid.append(row)
    return grid


def replicate(plan: Plan, cluster: Cluster | None, devices: Sequence[Sequence[str]], global_batch: int = 0,
              engines: Mapping[str, str] | None = None, dp_codec: Mapping[str, Any] | None = None,
              recompute: Sequence[Sequence[bool]] | None = None) -> Plan:
    """``plan`` (one pipeline) as ``len(devices)`` replicas; ``devices[r][s]``: replica r's stage s.

    cluster: the plan's cluster (predictions are re-priced on each replica's devices), or None for a
             hand-written plan: devices are then names from ``plan.cluster`` and nothing is priced.
    Row 0 may move replica 0 too. A stage's engine is copied to its replicas unless ``engines``
    (part name -> engine) says otherwise. dp_codec: the all-reduce codec (``Plan.dp_codec``).
    recompute: ``recompute[r][s]``, replica r's stage s recomputes its activations (a DP planner's choice, priced
    with it); None: each stage's choice in ``plan``.
    """
    from fusion.ir.boundary import part_order

    stages = part_order(plan.graph, plan.assignment)
    names = [d.name for d in cluster.devices] if cluster is not None else [d["name"] for d in plan.cluster["devices"]]
    addresses = ({d.name: d.address for d in cluster.devices} if cluster is not None
                 else {d["name"]: d.get("address", "") for d in plan.cluster["devices"]})
    _check_grid(devices, len(stages), names, cluster.source if cluster is not None else "plan.cluster")
    parts: dict[str, Part] = {}
    for r, row in enumerate(devices):
        for s, stage in enumerate(stages):
            name = replica_part_name(stage, r)
            parts[name] = replace(plan.parts[stage], name=name, device=row[s], address=addresses[row[s]], replica=r,
                                  stage="" if r == 0 else stage)
            if recompute is not None:
                parts[name].recompute = bool(recompute[r][s])
    for p, e in (engines or {}).items():
        if p not in parts:
            raise _error(f"engines names unknown part {p!r} (parts: {', '.join(parts)})")
        parts[p].engine = e
    out = replace(plan, parts=parts, global_batch=global_batch, predicted=dict(plan.predicted),
                  dp_codec=dict(dp_codec) if dp_codec else None)
    if cluster is not None:
        _price_replicas(out, cluster, stages)
    out.check()
    return out


def compile_replicated(model: Model, cluster: Cluster, cut: Mapping[str, int], devices: Sequence[Sequence[str]], *,
                       micro_batches: int = 1, global_batch: int = 0, schedule: str = "gpipe",
                       optimizer: OptimizerConfig = OptimizerConfig(), seed: int = 0, strategy: str = "dp",
                       engines: Mapping[str, str] | None = None, dp_codec: Mapping[str, Any] | None = None,
                       recompute: Sequence[Sequence[bool]] | None = None) -> Plan:
    """A replicated plan from a cut and a device grid.

    cut:           node name -> stage index 0 .. S-1 (every replica uses this cut).
    devices:       devices[r][s] = cluster device name of replica r, stage s; all distinct.
    micro_batches: micro-batches per replica per step; global_batch: rows of a step over all
                   replicas (0: not fixed), checked by :func:`split_global_batch`.
    engines:       part name -> engine (default torch).
    dp_codec:      None (exact averaging) or a quant codec cfg for the all-reduce chunks (lossy).
    recompute:     recompute[r][s]: replica r's stage s recomputes its activations (None: none does).
    """
    from fusion.compile import CompileError, _assemble, _ensure_shapes
    from fusion.cost.estimate import CostModel, optimizer_slots, samples_per_micro_batch
    from fusion.cost.flops import measure_costs
    from fusion.partition.fence import Partition

    graph = model.graph
    missing = [n for n in graph.nodes if n not in cut]
    if missing:
        raise CompileError(f"cut misses node {missing[0]!r}")
    extra = [n for n in cut if n not in graph.nodes]
    if extra:
        raise CompileError(f"cut names unknown node {extra[0]!r}")
    n_stages = 1 + max(int(s) for s in cut.values())
    if sorted({int(s) for s in cut.values()}) != list(range(n_stages)):
        raise CompileError(f"cut stages must be 0 .. {n_stages - 1} with none empty")
    _check_grid(devices, n_stages, [d.name for d in cluster.devices], cluster.source)
    _ensure_shapes(model)
    costs = measure_costs(graph)
    cm = CostModel.build(graph, costs, cluster, micro_batches, schedule,
                         optimizer_slots(optimizer.name, optimizer.momentum), samples_per_micro_batch(graph))
    node_part = np.array([int(cut[n]) for n in cm.names], dtype=np.int64)
    row0 = [cluster.index(d) for d in devices[0]]
    names = [f"part{s}" for s in range(n_stages)]
    est = cm.evaluate(node_part, row0)
    part = Partition(node_part, row0, est.iteration_s, {"replicas": len(devices)})
    from fusion.cluster.topology import device_clusters

    plan = _assemble(model, cluster, cm, part, names, est, est, [], device_clusters(cluster, seed), strategy, schedule,
                     micro_batches, optimizer, seed)
    from fusion.ir.boundary import part_order

    if part_order(graph, plan.assignment) != names:
        raise CompileError("cut: stage indices must follow the pipeline order (stage s may only feed stages > s)")
    if global_batch:
        split_global_batch(global_batch, len(devices), micro_batches, None)
    return replicate(plan, cluster, devices, global_batch, engines, dp_codec, recompute)


def _check_grid(devices: Sequence[Sequence[str]], n_stages: int, names: Sequence[str], source: str) -> None:
    if not devices:
        raise _error("devices: no replica")
    known = set(names)
    seen: dict[str, tuple[int, int]] = {}
    for r, row in enumerate(devices):
        if len(row) != n_stages:
            raise _error(f"devices[{r}] has {len(row)} devices for {n_stages} stages")
        for s, d in enumerate(row):
            if d not in known:
                raise _error(f"devices[{r}][{s}]: {source} has no device {d!r}")
            if d in seen:
                raise _error(f"devices[{r}][{s}]: device {d!r} is already devices[{seen[d][0]}][{seen[d][1]}] "
                             "(replicas run on disjoint devices)")
            seen[d] = (r, s)


def _price_replicas(plan: Plan, cluster: Cluster, stages: list[str]) -> None:
    """Price each replica's pipeline with the estimator on its own devices (compute, links, memory)."""
    pr = plan.predicted
    if "iteration_s" not in pr or not all(n.meta.outputs for n in plan.graph.nodes.values()
                                          if n.kind.value != "output"):
        return  # a hand plan without predictions or shapes: nothing to re-price
    from fusion.cost.estimate import CostModel, optimizer_slots, samples_per_micro_batch
    from fusion.cost.flops import measure_costs
    from fusion.cost.schedules import simulate_estimate

    opt = OptimizerConfig.from_dict(plan.optimizer or {})
    cm = CostModel.build(plan.graph, measure_costs(plan.graph), cluster, plan.micro_batches, plan.schedule,
                         optimizer_slots(opt.name, opt.momentum), samples_per_micro_batch(plan.graph))
    stage_index = {s: k for k, s in enumerate(stages)}
    node_part = np.array([stage_index[plan.assignment[n]] for n in cm.names], dtype=np.int64)
    per: list[dict[str, Any]] = []
    for r in range(plan.replicas):
        m = plan.replica_parts(r)
        row = [cluster.index(plan.parts[m[s]].device) for s in stages]
        # the memory the replica holds is that of the recomputation the compiler chose for each stage
        est = cm.evaluate(node_part, row, recompute=np.array([plan.parts[m[s]].recompute for s in stages]))
        # as the compiler reports a pipeline: its schedule simulated with the estimator's numbers
        per.append({"devices": [plan.parts[m[s]].device for s in stages],
                    "iteration_s": simulate_estimate(cm, est, plan.schedule, node_part, np.array(row)),
                    "violations": list(est.violations)})
        for k, s in enumerate(stages):
            pe = est.parts[k]
            part = plan.parts[m[s]]
            part.predicted_compute_s, part.predicted_comm_s, part.memory_bytes = pe.compute_s, pe.comm_s, pe.memory_bytes
            if r and "parts" in pr:
                pr["parts"][m[s]] = {**pr["parts"].get(s, {}), "device": part.device, "compute_s": pe.compute_s,
                                     "comm_s": pe.comm_s, "memory_bytes": pe.memory_bytes}
    bad = next((p for p in per if p["violations"]), None)
    if bad is not None:
        raise _error(f"{cluster.source}: devices[].memory_bytes: replica on {bad['devices']} does not fit: "
                     f"{bad['violations'][0]}")
    pr["replicas"] = per
    pr["single_pipeline_iteration_s"] = float(pr["iteration_s"])
    pr["iteration_s"] = max(p["iteration_s"] for p in per)
    pr.setdefault("dp_sync_s", None)  # the all-reduce between replicas: for a DP cost model to price
    spmb = float(pr.get("samples_per_micro_batch", 1) or 1)
    pr["throughput_samples_s"] = plan.replicas * plan.micro_batches * spmb / pr["iteration_s"]

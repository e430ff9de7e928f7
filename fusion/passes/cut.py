"""Cutting the model: node -> part and part -> device by the strategy, and the interleaved cut."""
from __future__ import annotations

import logging

import numpy as np

from fusion.cluster.model import Cluster
from fusion.cost.estimate import CostModel
from fusion.ir.schedule import LANE_SCHEDULES
from fusion.partition.baselines import BASELINES
from fusion.partition.chain import build_chain
from fusion.partition.fence import NoFitError, Partition, op_fence
from fusion.partition.interleave import INTERLEAVE_BY, interleaved_cut, interleaved_devices
from fusion.passes.pricing import check_fits, no_fit_message
from fusion.passes.state import CompileError

log = logging.getLogger("fusion.compile")

#: chunks per device of ``schedule="interleaved"`` when ``virtual_stages`` is not given
DEFAULT_VIRTUAL_STAGES = 2


def cut(cm: CostModel, cluster: Cluster, clusters, strategy: str, seed: int, retry_recompute: bool) -> Partition:
    """Node -> part and part -> device by ``strategy``. With ``retry_recompute``, a model that fits no
    device split as it is gets a second try priced with activation recomputation on every part."""
    try:
        check_fits(cm, cluster)
        if strategy == "opfence":
            try:
                return op_fence(cm, clusters, seed=seed, progress=len(cluster) > 128)
            except NoFitError:
                raise CompileError(no_fit_message(cm, cluster)) from None
        return BASELINES[strategy](cm, build_chain(cm))  # a fixed split: recomputation is chosen per part after
    except CompileError:
        if not retry_recompute or cm.recompute_all:
            raise
        log.info("nothing fits without activation recomputation; partitioning again with it")
        return cut(cm.variant(recompute_all=True), cluster, clusters, strategy, seed, retry_recompute=False)


def virtual_stages(schedule: str, virtual_stages: int | None, strategy: str) -> int | None:
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


def interleaved_partition(cm: CostModel, cluster: Cluster, strategy: str, v: int) -> Partition:
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
    cm = cm.variant(schedule="interleaved")
    check_fits(cm, cluster)
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
    return part

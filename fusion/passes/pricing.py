"""The estimator's questions the passes ask: which parts recompute, what each schedule costs on a cut, whether
a model can fit at all. Each takes the cost model to ask (with the prices the caller chose) and changes nothing."""
from __future__ import annotations

import numpy as np

from fusion.cluster.model import Cluster
from fusion.cost.estimate import CostModel, device_memory
from fusion.cost.schedules import SchedulePrice, price_schedule
from fusion.ir.schedule import LANE_SCHEDULES
from fusion.partition.fence import Partition
from fusion.plan import SCHEDULE_NAMES
from fusion.passes.state import CompileError

#: the schedules priced on one cut with one part per device; ``interleaved`` is priced on its own cut
CUT_SCHEDULES = tuple(n for n in SCHEDULE_NAMES if n not in LANE_SCHEDULES)


def recompute_choice(cm: CostModel, part: Partition, mode: str) -> np.ndarray:
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


def price_schedules(cm: CostModel, part: Partition, recompute: str,
                    names: tuple[str, ...] = CUT_SCHEDULES) -> dict[str, SchedulePrice]:
    """Schedules ``names`` priced on the cut (:func:`fusion.cost.schedules.price_schedule`), each with the
    recomputation ``recompute`` would choose under it."""
    out = {}
    for name in names:
        under = cm.variant(schedule=name)
        out[name] = price_schedule(under, name, part.node_part, part.part_device,
                                   recompute_choice(under, part, recompute))[0]
    return out


def check_fits(cm: CostModel, cluster: Cluster) -> None:
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


def no_fit_message(cm: CostModel, cluster: Cluster) -> str:
    """Why no split fits (OP-Fence found none), naming the field."""
    how = " even with activation recomputation" if cm.recompute_all else ""
    return (f"{cluster.source}: devices[].memory_bytes: no split of the model over the devices fits their memory{how} "
            f"({cm.p_state.sum() / 1e9:.3f} GB of parameter state + {cm.saved.sum() / 1e9:.3f} GB of activations per "
            f"micro-batch x {cm.micro_batches}; devices hold {cm.mem_cap.sum() / 1e9:.3f} GB in total)")

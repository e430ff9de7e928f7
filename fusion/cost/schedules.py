"""The schedule as part of what the compiler prices: every schedule's iteration time and peak memory on a cut.

Eq. (3)'s closed form, ``T_pipe = sum_p (C_p + R_p) + (n_b - 1) max_p max(C_p, R_p)``, is the same for every
schedule: the schedule changes only the activation memory in flight (:meth:`CostModel.in_flight`). To price
the *time* of a schedule, this module runs its action lists (:func:`fusion.ir.schedule.make_schedule`, the
lists the CompNodes execute) through :func:`fusion.ir.schedule.simulate` with the estimator's numbers:

- part p's forward ``F_p``: its nodes' forward FLOPs and memory-bound bytes (``fwd_flops / S*``,
  ``fwd_mem / Bmem*``), ``FORWARD_SHARE`` of its per-node overhead and one ``o_msg`` per cut tensor it
  sends or receives; its backward ``B_p = C_p - F_p`` (Eq. 1's C_p, so F + B is exactly the estimator's
  compute, a recomputing part's second forward in B). A split schedule (``zb1``) gives
  ``W_FRACTION`` of B to the weight-gradient action W.
- ``interleaved`` (V chunks per device, :mod:`fusion.partition.interleave`): the chunks of one device run
  on one clock, in Megatron-LM's order (:func:`fusion.ir.schedule.make_lanes`); the estimator's memory of
  a device is the sum over its chunks, each with its own forwards in flight.
- each part pair's activations after F and gradients after B as in Eq. (2), the way the runtime's replay
  moves them: on a link per ordered part pair that transmits one message at a time, a message occupies it
  for ``beta * M`` (M summed over the pair's cut tensors) after the messages queued before it and
  arrives ``alpha`` later.
- the tied-parameter sync ``T_sync`` and the work outside the pipeline ``T_step`` (control round trip,
  feeds, optimizer step: :mod:`fusion.cost.estimate`) after the last action.

``iteration_s = max_p (end of p's last action) + T_sync + T_step``. The compiler's ``--schedule auto`` keeps the schedule
with the shortest such time among those whose every part fits its device; ties go to the smaller peak memory.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from fusion.cost.estimate import FORWARD_SHARE, CostModel, Estimate, device_memory
from fusion.ir.schedule import LANE_SCHEDULES, SCHEDULES, ActionKind, make_lanes, make_schedule, simulate


@dataclass(frozen=True)
class SchedulePrice:
    """One schedule on one cut: ``iteration_s`` the simulated iteration (seconds), ``peak_memory_bytes``
    the most any device needs (the sum of its parts: one part, or an interleaved device's chunks), ``fits``
    whether every device holds what it runs."""

    iteration_s: float
    peak_memory_bytes: float
    fits: bool

    def to_dict(self) -> dict:
        return {"iteration_s": self.iteration_s, "peak_memory_bytes": self.peak_memory_bytes, "fits": self.fits}


def simulated_iteration(schedule: str, order: list[int], compute: Mapping[int, Mapping[str, float]],
                        links: Mapping[tuple[int, int], tuple[tuple[float, float], tuple[float, float] | None]],
                        micro_batches: int,
                        tail_s: float = 0.0, devices: Mapping[int, int] | None = None) -> float:
    """Seconds of one iteration of ``schedule`` (``gpipe``, ``1f1b``, ``zb1``, ``interleaved``).

    order:   parts in a topological order of the part DAG.
    compute: part -> {"F": s, "B": s} of one micro-batch (B the whole backward).
    links:   (src, dst) -> (activations after src's F, gradients after dst's B or None when no gradient flows
             back), each ``(busy_s, latency_s)``: seconds the message holds its link (one message at a time
             per ordered pair) and seconds it then takes to arrive.
    devices: part -> device, for ``interleaved``: the parts of one device run on one clock, in the order
             of its lane (:func:`fusion.ir.schedule.make_lanes`); ``order`` must then go round-robin over them.
    """
    sends: dict[tuple[int, ActionKind], list[tuple[int, float]]] = {}
    for (a, b), (fwd, bwd) in links.items():
        sends.setdefault((a, ActionKind.F), []).append((b, fwd))
        if bwd is not None:
            sends.setdefault((b, ActionKind.B), []).append((a, bwd))
    busy: dict[tuple[int, int], float] = {}

    def deliver(src: int, dst: int, msg: tuple[float, float], ready: float) -> float:
        end = max(ready, busy.get((src, dst), 0.0)) + msg[0]
        busy[(src, dst)] = end
        return end + msg[1]

    actions = make_schedule(schedule, order, links, micro_batches, devices)
    lanes = make_lanes(schedule, order, links, micro_batches, devices) if schedule in LANE_SCHEDULES else None
    sim = simulate(actions, compute, sends, deliver, lanes=lanes)
    return max(sim.end_s.values()) + tail_s


def part_times(cm: CostModel, est: Estimate, node_part: np.ndarray, part_device: np.ndarray):
    """(order, compute, links) of :func:`simulated_iteration` for ``est``, the estimate of a cut (see the
    module doc; a recomputing part's extra forward is in ``est``'s compute and so in its B)."""
    node_part = np.asarray(node_part, dtype=np.int64)
    dev = np.asarray(part_device, dtype=np.int64)
    n = len(dev)
    fwd = (np.bincount(node_part, weights=cm.fwd_flops, minlength=n) / cm.speed[dev]
           + np.bincount(node_part, weights=cm.fwd_mem, minlength=n) / cm.mem_speed[dev]
           + FORWARD_SHARE * np.bincount(node_part, weights=cm.executes, minlength=n) * cm.node_overhead[dev])
    cut = np.zeros(n)
    for le in est.links:
        cut[le.src] += le.tensors
        cut[le.dst] += le.tensors
    fwd = fwd + cut * cm.message_overhead[dev]
    compute = {p: {"F": min(float(fwd[p]), pe.compute_s), "B": max(pe.compute_s - float(fwd[p]), 0.0)}
               for p, pe in enumerate(est.parts)}
    alpha = cm.cluster.alpha
    links = {}
    for le in est.links:
        da, db = int(dev[le.src]), int(dev[le.dst])
        fwd_a, bwd_a = float(alpha[da, db]), float(alpha[db, da])
        fw = (max(le.fwd_s - le.tensors * fwd_a, 0.0), fwd_a)
        bw = (max(le.bwd_s - le.tensors * bwd_a, 0.0), bwd_a) if (le.bwd_bytes > 0 or le.bwd_s > 0) else None
        links[(le.src, le.dst)] = (fw, bw)
    succ: dict[int, set[int]] = {p: set() for p in range(n)}
    indeg = {p: 0 for p in range(n)}
    for a, b in links:
        if b not in succ[a]:
            succ[a].add(b)
            indeg[b] += 1
    order, ready = [], sorted(p for p in range(n) if indeg[p] == 0)
    while ready:
        p = ready.pop(0)
        order.append(p)
        for s in sorted(succ[p]):
            indeg[s] -= 1
            if indeg[s] == 0:
                ready.append(s)
    return order, compute, links


def simulate_estimate(cm: CostModel, est: Estimate, name: str, node_part: np.ndarray,
                      part_device: np.ndarray) -> float:
    """Seconds of one iteration of schedule ``name`` on the cut ``est`` prices, simulated with ``est``'s
    numbers (its links' wire bytes and codec seconds, its recomputation, ``T_sync`` and ``T_step``): what the
    compiler reports as ``plan.predicted["iteration_s"]`` (Eq. 3 stays what the partitioners minimise)."""
    order, compute, links = part_times(cm, est, node_part, part_device)
    devices = None
    if name in LANE_SCHEDULES:  # parts indexed in pipeline order, round-robin over their devices
        order, devices = list(range(len(part_device))), {p: int(d) for p, d in enumerate(part_device)}
    return float(simulated_iteration(name, order, compute, links, cm.micro_batches, est.sync_s + est.step_s,
                                     devices))


def price_schedule(cm: CostModel, name: str, node_part: np.ndarray, part_device: np.ndarray,
                   recompute: np.ndarray | None = None) -> tuple[SchedulePrice, Estimate]:
    """Price schedule ``name`` on a cut: the estimator's memory with ``name``'s micro-batches in flight,
    and the simulated iteration (``cm`` itself is left as it is)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    est = cm.variant(schedule=name).evaluate(node_part, part_device, recompute=recompute)
    t = simulate_estimate(cm, est, name, node_part, part_device)
    peak = max(device_memory(np.array([pe.memory_bytes for pe in est.parts]), part_device), default=0.0)
    return SchedulePrice(float(t), float(peak), not est.violations), est


def best_schedule(prices: Mapping[str, SchedulePrice]) -> str | None:
    """The rule of ``--schedule auto``: among the schedules that fit, the shortest iteration; ties (within
    1e-12 relative) the smaller peak memory, then the name order gpipe, 1f1b, zb1, interleaved. None if none
    fits. (With ``--virtual-stages V``, ``interleaved`` is priced on its own cut, the others on theirs.)"""
    fit = [(n, p) for n, p in prices.items() if p.fits]
    if not fit:
        return None
    best = min(p.iteration_s for _, p in fit)
    tied = [(p.peak_memory_bytes, list(SCHEDULES).index(n), n) for n, p in fit
            if p.iteration_s <= best * (1 + 1e-12)]
    return min(tied)[2]

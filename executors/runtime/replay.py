"""Replay a schedule without a model: predict a plan's iteration time.

Given how long each part's forward and backward of one micro-batch take
(``C_p``, from the estimator or a warm-up profile), the bytes every action
sends, and the alpha-beta parameters of every link, the replay runs the
plan's schedule (a list of F/B actions per part) the way the CompNode
executors do: an action starts when its part is free and its inputs have
arrived; each message occupies its link for ``beta * M`` after the messages
queued before it and arrives ``alpha`` later (FusionLLM §3.5,
``T_comm = alpha + beta * M``). The iteration ends when every part has run
its last action plus its optimizer step. Unlike the closed form of Eq. (3)
it prices branches, 1F1B and per-link queueing exactly as executed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from fusion.ir.boundary import part_links, part_order, partition
from fusion.ir.node import TensorMeta
from fusion.ir.opdata import OpData
from fusion.ir.wire import frames_nbytes
from fusion.executors.runtime.linkemu import EmulatedLink, LinkModel, link_model
from fusion.executors.runtime.packing import by_destination, message_frames
from fusion.executors.runtime.part import make_routes
from fusion.ir.schedule import W_FRACTION, ActionKind, make_lanes, make_schedule, simulate  # noqa: F401 (W_FRACTION: the runtime's name)
from fusion.plan import Plan


@dataclass
class ReplayResult:
    """iteration_s: predicted iteration time; link_bytes: bytes per ordered part pair per iteration;
    link_busy_s: seconds each link spends transmitting; timeline: part -> [(action, start, end)]."""

    iteration_s: float
    link_bytes: dict[tuple[str, str], int] = field(default_factory=dict)
    link_busy_s: dict[tuple[str, str], float] = field(default_factory=dict)
    timeline: dict[str, list[tuple[str, float, float]]] = field(default_factory=dict)


def message_bytes(plan: Plan) -> dict[tuple[str, ActionKind], list[tuple[str, int]]]:
    """(part, F or B) -> [(destination part, wire bytes)] of the messages one action of that part sends (one per
    destination part: what the action sends there, packed as :mod:`.packing` packs it)."""
    g = plan.graph
    subs = partition(g, plan.assignment)
    out: dict[tuple[str, ActionKind], list[tuple[str, int]]] = {}
    for p, sub in subs.items():
        r = make_routes(sub, plan.assignment)
        for kind, pairs in ((ActionKind.F, [(k, d) for k, ds in r.send_to.items() for d in ds]),
                            (ActionKind.B, list(r.grads_to.items()))):
            ods = []
            for key, dst in pairs:
                outs = g[key[0]].meta.outputs
                m = outs[key[1] or 0] if outs else None
                payload = np.empty(m.shape, dtype="uint16" if m.dtype == "bfloat16" else m.dtype) \
                    if isinstance(m, TensorMeta) else 0
                ods.append(OpData(key[0], key[1], tuple(g.users().get(key[0], ())), ("x" * 8,), kind == ActionKind.B,
                                  0, 0, p, dst, payload))
            # one message per destination, as the runtime sends them (packing.py)
            out[(p, kind)] = [(grp[0].dst, frames_nbytes(message_frames(grp))) for grp in by_destination(ods)]
    return out


def replay(plan: Plan, compute: Mapping[str, Mapping[str, float]], links: Mapping[tuple[str, str], LinkModel] | None = None,
           tail_s: Mapping[str, float] | None = None) -> ReplayResult:
    """Predict one iteration of ``plan``.

    compute: part -> {"F": seconds, "B": seconds} for one micro-batch; with a zero-bubble schedule
             (``zb1``) also ``"W"``: then ``B`` is the input-gradient half alone. Without ``"W"``
             the backward is split ``W_FRACTION`` to the parameter half (a linear layer's backward
             is two matmuls of equal size: one for its input, one for its weight).
    links:   (src part, dst part) -> LinkModel; default: from the plan's cluster and part devices.
    tail_s:  part -> seconds after its last action (gradient sync, optimizer step).
    """
    g = plan.graph
    order = part_order(g, plan.assignment)
    devices = {p: plan.parts[p].device for p in order}
    edges = part_links(g, plan.assignment)
    actions = make_schedule(plan.schedule, order, edges, plan.micro_batches, devices)
    lanes = make_lanes(plan.schedule, order, edges, plan.micro_batches, devices)
    sends = message_bytes(plan)
    if links is None:
        links = {(a, b): link_model(plan.cluster, plan.parts[a].device, plan.parts[b].device)
                 for a in order for b in order if a != b}
    emu = {k: EmulatedLink(m) for k, m in links.items()}
    res = ReplayResult(0.0)

    def deliver(src: str, dst: str, nbytes: int, ready: float) -> float:
        s, e, d = emu[(src, dst)].schedule(nbytes, ready)
        res.link_bytes[(src, dst)] = res.link_bytes.get((src, dst), 0) + nbytes
        res.link_busy_s[(src, dst)] = res.link_busy_s.get((src, dst), 0.0) + (e - s)
        return d

    try:
        sim = simulate(actions, compute, sends, deliver, lanes)
    except RuntimeError as e:
        raise RuntimeError(f"{e} in replay") from None
    free, res.timeline = sim.end_s, sim.timeline
    res.iteration_s = max(free[p] + float((tail_s or {}).get(p, 0.0)) for p in order)
    return res

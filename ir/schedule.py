"""Micro-batch schedules as data: a list of actions per part, and their simulation.

As in torch.distributed.pipelining, a schedule is separate from the stage
that executes it, so a simulator can replay it without a model. A part's
*depth* is the length of the longest path from it to a sink of the part-level
DAG (the last stage has depth 0).

Interleaved 1F1B (``interleaved``; Narayanan et al. 2021, Megatron-LM's order) puts several
non-adjacent parts (*virtual stages*, or chunks) on one device: with D devices, the part at position
``s`` of the topological order runs on device ``s % D``, and each device runs one merged action list
over its chunks (a *lane*), which cuts the fill/drain bubble by the number of chunks ``v``.
:func:`make_lanes` gives the lanes; :func:`make_schedule` gives each part its own projection of them.

Zero-bubble schedules (``zb1``) split a backward into ``B`` (gradients of the
part's inputs, sent at once to the parts that wait for them) and ``W``
(gradients of the part's parameters, which nothing waits for), so ``W`` can
fill the time a part would otherwise idle.

:func:`simulate` runs the action lists against per-action seconds and a message delivery model; the
runtime's replay (``fusion.executors.runtime.replay``, alpha-beta links with queues) and the
compiler's schedule pricing (``fusion.cost.schedules``) both use it. Pure Python, no project imports:
it lives this low so that the compiler may price schedules without importing the executors.
"""
from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Mapping


class ActionKind(str, Enum):
    """What an action computes. Its text (``str(kind)``, :meth:`parse`) is the one letter that traces, node-times
    files (``{"F", "B", "W"}`` seconds) and the docs use; as a ``str`` it also equals that letter."""

    F = "F"  #: forward of a micro-batch
    B = "B"  #: backward (in a schedule with ``W`` actions only the gradients of the part's inputs)
    W = "W"  #: the parameter gradients of a split backward (zero-bubble schedules)

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def parse(cls, text: str) -> "ActionKind":
        """The kind written ``text`` (``"F"``, ``"B"`` or ``"W"``); ValueError names anything else."""
        try:
            return cls(text)
        except ValueError:
            raise ValueError(f"unknown action kind {str(text)[:40]!r}; one of {', '.join(k.value for k in cls)}") from None


F, B, W = ActionKind.F, ActionKind.B, ActionKind.W


class TailKind(str, Enum):
    """What the end of a step does after a part's F, B and W actions (:func:`step_tail` puts them in order). Both
    sides run the same list: the CompNode does each kind's part work, the coordinator the kinds it takes part in
    (marked *coordinator*); the parts of one process (interleaved 1F1B) run each kind over all of them before the
    next, so every send of a kind precedes every wait of a later one."""

    SEND_TIED = "send-tied"  #: the part's tied-parameter gradients to their co-owners (nothing waits)
    SUM_TIED = "sum-tied"  #: the tied gradients of every owner summed in plan part order
    REDUCE = "reduce"  #: the data-parallel sync after the backward (every-step: the all-reduce)
    #: the part's share of the squared global norm to the coordinator (*coordinator*: sums them)
    GRAD_NORM = "grad-norm"
    CLIP = "clip"  #: *coordinator*: sends each part its pipeline's global norm; the part scales its gradients
    REDUCED = "reduced"  #: failover runs: the part has its averaged gradients (*coordinator*: waits for every part's)
    COMMIT = "commit"  #: failover runs: *coordinator*: the go-ahead; the part waits for it (all step, or none)
    OPTIMIZER = "optimizer"  #: the part's optimizer step
    OUTER = "outer"  #: the data-parallel sync after the step (DiLoCo: the outer step when one is due)
    CHECKPOINT = "checkpoint"  #: the part's checkpoint files of the step
    #: losses and stats to the coordinator (*coordinator*: waits for every part's, then commits a checkpoint)
    DONE = "done"

    def __str__(self) -> str:
        return self.value


def step_tail(clip: bool, failover: bool, checkpoint: bool) -> list[TailKind]:
    """The end of one step, in order: ``clip`` (a global-norm clip), ``failover`` (a commit before anyone steps)
    and ``checkpoint`` (this step is saved) add their kinds."""
    k = TailKind
    tail = [k.SEND_TIED, k.SUM_TIED, k.REDUCE]
    tail += [k.GRAD_NORM, k.CLIP] if clip else []
    tail += [k.REDUCED, k.COMMIT] if failover else []
    tail += [k.OPTIMIZER, k.OUTER]
    tail += [k.CHECKPOINT] if checkpoint else []
    return tail + [k.DONE]


@dataclass(frozen=True)
class Action:
    """``kind`` (:class:`ActionKind`; a letter is parsed) of ``micro_batch``. Its text is kind and micro-batch,
    ``"F0"``, ``"W3"`` (trace events and simulated timelines use it; :meth:`parse` reads it back)."""

    kind: ActionKind
    micro_batch: int

    def __post_init__(self) -> None:
        if not isinstance(self.kind, ActionKind):
            object.__setattr__(self, "kind", ActionKind.parse(self.kind))

    def __str__(self) -> str:
        return f"{self.kind}{self.micro_batch}"

    @classmethod
    def parse(cls, text: str) -> "Action":
        """The action written ``text`` (``str(action)``); ValueError names anything else."""
        m = re.fullmatch(r"([A-Z])(0|[1-9][0-9]*)", text)
        if m is None:
            raise ValueError(f"{str(text)[:40]!r} is not an action (a kind F, B or W and a micro-batch, like 'F0')")
        return cls(ActionKind.parse(m.group(1)), int(m.group(2)))


def gpipe(n_micro: int, depth: int = 0) -> list[Action]:
    """All forwards, then all backwards (GPipe; Huang et al. 2019)."""
    return [Action(F, m) for m in range(n_micro)] + [Action(B, m) for m in range(n_micro)]


def one_f_one_b(n_micro: int, depth: int) -> list[Action]:
    """1F1B (PipeDream-flush): ``depth`` warm-up forwards, then alternate, then drain."""
    warm = min(depth, n_micro)
    acts = [Action(F, m) for m in range(warm)]
    f, b = warm, 0
    while f < n_micro:
        acts.append(Action(F, f))
        f += 1
        acts.append(Action(B, b))
        b += 1
    acts += [Action(B, m) for m in range(b, n_micro)]
    return acts


def zero_bubble(n_micro: int, depth: int) -> list[Action]:
    """ZB-H1-style zero bubble (Qi et al. 2023): 1F1B's order of F and B, with each backward split
    into B (input gradients, sent upstream at once) and W (parameter gradients, needed by nobody).

    Steady phase: a part ``depth`` stages from the end keeps up to ``depth`` Ws deferred
    (the last part runs each W right after its B). Cool-down: each B is preceded by a deferred
    W, which runs while the part would otherwise wait for that B's gradient; the rest follow
    the last B. Upstream parts get their gradients one W earlier per stage, and the Ws fill
    the drain bubble. Memory: up to ``depth + 1`` forward stashes as in 1F1B, and at most
    ``2 * depth + 1`` stashes (forward or awaiting a W) in all.
    """
    warm = min(depth, n_micro)
    acts = [Action(F, m) for m in range(warm)]
    f, b = warm, 0
    pending: deque[int] = deque()
    while f < n_micro:
        acts += [Action(F, f), Action(B, b)]
        pending.append(b)
        f, b = f + 1, b + 1
        if len(pending) > depth:
            acts.append(Action(W, pending.popleft()))
    while b < n_micro:
        if pending:
            acts.append(Action(W, pending.popleft()))
        acts.append(Action(B, b))
        pending.append(b)
        b += 1
    acts += [Action(W, m) for m in pending]
    return acts


def interleaved_1f1b(n_micro: int, n_devices: int, n_chunks: int, rank: int) -> list[tuple[int, Action]]:
    """Megatron-LM's interleaved 1F1B order for device ``rank`` of ``n_devices`` holding ``n_chunks``
    chunks: [(chunk, action)] over ``n_micro * n_chunks`` virtual micro-batches.

    Forwards go chunk-major in groups of D micro-batches (chunk ``(k % (D*v)) // D`` for the k-th
    forward), backwards the same with chunks reversed. Warm-up: ``2 * (D - rank - 1) + (v - 1) * D``
    forwards (all of them when ``n_micro == D``), then one forward and one backward alternate, then the
    remaining backwards drain. ``n_micro`` must be a multiple of D (as in Megatron-LM).
    """
    d, v = n_devices, n_chunks
    if n_micro % d:
        raise ValueError(f"interleaved 1F1B needs micro_batches a multiple of the devices ({d}), got {n_micro}")
    total = n_micro * v
    warm = total if n_micro == d else min(total, 2 * (d - rank - 1) + (v - 1) * d)
    done = {F: [0] * v, B: [0] * v}

    def act(kind: ActionKind, k: int) -> tuple[int, Action]:
        chunk = (k % (d * v)) // d
        if kind == B:
            chunk = v - 1 - chunk
        mb = done[kind][chunk]
        done[kind][chunk] += 1
        return chunk, Action(kind, mb)

    out = [act(F, k) for k in range(warm)]
    for i in range(total - warm):
        out += [act(F, warm + i), act(B, i)]
    out += [act(B, i) for i in range(total - warm, total)]
    return out


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "zb1": zero_bubble, "interleaved": interleaved_1f1b}
#: schedules whose parts share devices: one merged action list per device
LANE_SCHEDULES = ("interleaved",)


def splits_backward(actions: list[Action]) -> bool:
    """Whether a part's actions split backward into B and W."""
    return any(a.kind == W for a in actions)


def part_depths(order: list[str], edges: Mapping[tuple[str, str], object]) -> dict[str, int]:
    """Longest path (in parts) from each part to a sink of the part DAG."""
    succ: dict[str, set[str]] = {p: set() for p in order}
    for (a, b) in edges:
        succ[a].add(b)
    depth: dict[str, int] = {}
    for p in reversed(order):
        depth[p] = 1 + max((depth[s] for s in succ[p]), default=-1)
    return depth


def virtual_stages(order: list[str], devices: Mapping[str, str]) -> tuple[list[str], int]:
    """(the devices in rank order, chunks per device) of an interleaved placement: the part at position
    ``s`` of ``order`` must run on the ``s % D``-th device. ValueError names the first part that breaks it."""
    ranks: list[str] = []
    for p in order:
        if devices[p] in ranks:
            break
        ranks.append(devices[p])
    d = len(ranks)
    if len(order) % d:
        raise ValueError(f"interleaved: {len(order)} parts do not split evenly over {d} devices ({', '.join(ranks)})")
    for s, p in enumerate(order):
        if devices[p] != ranks[s % d]:
            raise ValueError(f"interleaved: part {p!r} (position {s} of the part order) runs on device "
                             f"{devices[p]!r}, but virtual stage {s} belongs on {ranks[s % d]!r} "
                             f"(parts go round-robin over {', '.join(ranks)})")
    return ranks, len(order) // d


def make_lanes(name: str, order: list[str], edges: Mapping[tuple[str, str], object], n_micro: int,
               devices: Mapping[str, str] | None = None) -> dict[str, list[tuple[str, Action]]]:
    """What each executor process runs, in order: lane -> [(part, action)].

    A lane is one part for ``gpipe``, ``1f1b`` and ``zb1`` (named by the part), and one device for
    ``interleaved`` (named by the device; its parts are the device's chunks, ``devices``: part -> device)."""
    if name not in LANE_SCHEDULES:
        return {p: [(p, a) for a in acts] for p, acts in make_schedule(name, order, edges, n_micro).items()}
    if n_micro < 1:
        raise ValueError(f"micro_batches must be >= 1, got {n_micro}")
    if devices is None:
        raise ValueError(f"schedule {name!r} needs each part's device")
    ranks, v = virtual_stages(order, devices)
    d = len(ranks)
    return {dev: [(order[c * d + r], a) for c, a in interleaved_1f1b(n_micro, d, v, r)] for r, dev in enumerate(ranks)}


def make_schedule(name: str, order: list[str], edges: Mapping[tuple[str, str], object], n_micro: int,
                  devices: Mapping[str, str] | None = None) -> dict[str, list[Action]]:
    """Actions per part for schedule ``name`` (``gpipe``, ``1f1b``, ``zb1`` or ``interleaved``; the last
    needs ``devices``, part -> device, and gives each part its projection of its device's lane)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    if n_micro < 1:
        raise ValueError(f"micro_batches must be >= 1, got {n_micro}")
    if name in LANE_SCHEDULES:
        out: dict[str, list[Action]] = {p: [] for p in order}
        for lane in make_lanes(name, order, edges, n_micro, devices).values():
            for p, a in lane:
                out[p].append(a)
        return out
    depth = part_depths(order, edges)
    return {p: SCHEDULES[name](n_micro, depth[p]) for p in order}


#: the share of a backward that is parameter gradients, when a split schedule's W is not measured
#: (a linear layer's backward is two matmuls of equal size: one for its input, one for its weight)
W_FRACTION = 0.5


def action_seconds(c: Mapping[str, float], kind: ActionKind, split: bool) -> float:
    """Seconds of one action: F, B (whole, or the input half when the schedule splits it), W.
    ``c``: {"F", "B"[, "W"]} seconds of one micro-batch; without "W" a split backward gives
    :data:`W_FRACTION` of "B" to W."""
    if not split or "W" in c:
        return float(c.get(kind, 0.0))
    b = float(c["B"])
    return b * W_FRACTION if kind == W else b * (1 - W_FRACTION) if kind == B else float(c[kind])


@dataclass
class Simulation:
    """end_s: part -> when its last action ends; timeline: part -> [(action, start, end)]."""

    end_s: dict[str, float]
    timeline: dict[str, list[tuple[str, float, float]]]


def simulate(actions: Mapping[str, list[Action]], compute: Mapping[str, Mapping[str, float]],
             sends: Mapping[tuple[str, ActionKind], list[tuple[str, object]]],
             deliver: Callable[[str, str, object, float], float],
             lanes: Mapping[str, list[tuple[str, Action]]] | None = None,
             tail: list[TailKind] | None = None) -> Simulation:
    """Run every part's action list the way the executors do: an action starts when its lane (its
    executor process) is free and every message it waits for has arrived.

    actions: part -> its actions (:func:`make_schedule`), in the parts' topological order.
    compute: part -> {"F", "B"[, "W"]} seconds of one micro-batch (see :func:`action_seconds`).
    sends:   (part, F or B) -> [(destination part, payload)]: the messages one such action sends
             (forward activations after F, input gradients after B); the destination's action of the
             same kind and micro-batch waits for them.
    deliver: (src, dst, payload, ready_s) -> arrival seconds of a message ready at ``ready_s``
             (a link model; it may keep queues).
    lanes:   lane -> [(part, action)] (:func:`make_lanes`) when parts share a device: a lane runs its
             actions in order on one clock. Default: each part is its own lane.
    tail:    the end of the step (:func:`step_tail`) each part runs on its lane after its last action; a kind
             costs ``compute[part][str(kind)]`` seconds (``"reduce"``, ``"optimizer"``, ...), and a kind without
             seconds there is left out of the timeline. Default: none.
    Raises RuntimeError on a deadlock (an action waits for a message nothing sends).
    """
    order = list(actions)
    if lanes is None:
        lanes = {p: [(p, a) for a in actions[p]] for p in order}
    n_micro = 1 + max((a.micro_batch for acts in actions.values() for a in acts), default=0)
    need: dict[tuple[str, ActionKind, int], int] = {}
    for (p, kind), msgs in sends.items():
        for dst, _ in msgs:
            for mb in range(n_micro):
                need[(dst, kind, mb)] = need.get((dst, kind, mb), 0) + 1
    split = {p: splits_backward(actions[p]) for p in order}
    arrived: dict[tuple[str, ActionKind, int], list[float]] = {}
    free = {lane: 0.0 for lane in lanes}
    end = {p: 0.0 for p in order}
    cursor = {lane: 0 for lane in lanes}
    timeline: dict[str, list[tuple[str, float, float]]] = {p: [] for p in order}
    while any(cursor[q] < len(lanes[q]) for q in lanes):
        progressed = False
        for q, acts in lanes.items():
            if cursor[q] >= len(acts):
                continue
            p, a = acts[cursor[q]]
            k = (p, a.kind, a.micro_batch)
            got = arrived.get(k, [])
            if len(got) < need.get(k, 0):
                continue
            start = max([free[q], *got])
            end[p] = free[q] = start + action_seconds(compute[p], a.kind, split[p])
            timeline[p].append((str(a), start, end[p]))
            if a.kind != W:
                for dst, payload in sends.get((p, a.kind), []):
                    arrived.setdefault((dst, a.kind, a.micro_batch), []).append(deliver(p, dst, payload, end[p]))
            cursor[q] += 1
            progressed = True
        if not progressed:
            raise RuntimeError(f"schedule deadlock at {[(q, cursor[q]) for q in lanes]}")
    for q, acts in lanes.items():  # the step's end, part by part in lane order, on the lane's clock
        for p in dict.fromkeys(p for p, _ in acts):
            for kind in tail or ():
                if str(kind) in compute[p]:
                    start = max(free[q], end[p])
                    end[p] = free[q] = start + float(compute[p][str(kind)])
                    timeline[p].append((str(kind), start, end[p]))
    return Simulation(end, timeline)

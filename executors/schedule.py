"""Micro-batch schedules as data: a list of actions per part.

As in torch.distributed.pipelining, a schedule is separate from the stage
that executes it, so a simulator can replay it without a model. A part's
*depth* is the length of the longest path from it to a sink of the part-level
DAG (the last stage has depth 0).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping


@dataclass(frozen=True)
class Action:
    """``kind`` is ``"F"`` (forward) or ``"B"`` (backward) of ``micro_batch``."""

    kind: str
    micro_batch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.micro_batch}"


def gpipe(n_micro: int, depth: int = 0) -> list[Action]:
    """All forwards, then all backwards (GPipe; Huang et al. 2019)."""
    return [Action("F", m) for m in range(n_micro)] + [Action("B", m) for m in range(n_micro)]


def one_f_one_b(n_micro: int, depth: int) -> list[Action]:
    """1F1B (PipeDream-flush): ``depth`` warm-up forwards, then alternate, then drain."""
    warm = min(depth, n_micro)
    acts = [Action("F", m) for m in range(warm)]
    f, b = warm, 0
    while f < n_micro:
        acts.append(Action("F", f))
        f += 1
        acts.append(Action("B", b))
        b += 1
    acts += [Action("B", m) for m in range(b, n_micro)]
    return acts


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


def part_depths(order: list[str], edges: Mapping[tuple[str, str], object]) -> dict[str, int]:
    """Longest path (in parts) from each part to a sink of the part DAG."""
    succ: dict[str, set[str]] = {p: set() for p in order}
    for (a, b) in edges:
        succ[a].add(b)
    depth: dict[str, int] = {}
    for p in reversed(order):
        depth[p] = 1 + max((depth[s] for s in succ[p]), default=-1)
    return depth


def make_schedule(name: str, order: list[str], edges: Mapping[tuple[str, str], object], n_micro: int) -> dict[str, list[Action]]:
    """Actions per part for schedule ``name`` (``gpipe`` or ``1f1b``)."""
    try:
        fn = SCHEDULES[name]
    except KeyError:
        raise ValueError(f"unknown schedule {name!r}; choose one of {sorted(SCHEDULES)}") from None
    if n_micro < 1:
        raise ValueError(f"micro_batches must be >= 1, got {n_micro}")
    depth = part_depths(order, edges)
    return {p: fn(n_micro, depth[p]) for p in order}

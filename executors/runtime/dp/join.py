"""A replica joins a running DiLoCo job at an outer boundary (issue 25, elasticity).

A plan compiled with R replicas may start with some of them held back (``CoordinatorConfig.joins``: the
step at which each late replica joins, ``fusion run|coordinator --join-at STEP:REPLICA``). The live
replicas split the global batch among themselves (``R n_b`` micro-batches over the live count). At the
join step S, an outer boundary (``S % H == 0``: every live replica has just applied the outer step, so its
local weights *are* the global weights), the coordinator, between steps S - 1 and S:

1. waits for the joiner's executors to say hello (started by ``fusion run``, or by hand with
   ``fusion executor PLAN --node r2.part0 --coordinator ADDR``), refusing one of another plan digest
   (a logged rejection naming both digests; the job goes on without it);
2. fetches from the first live part of each stage its global weights theta and outer momentum v
   (:func:`join_arrays`; ``Fetch {outer: true}``);
3. tells the live parts to take the joiner into their data-parallel group (``Admit``: its address, the new
   micro-batch count per replica);
4. sets the joiner up with that state (``Setup`` with ``members``, ``micro_batches``, ``start_it``,
   ``join_from`` and the arrays): its trainable weights and theta are the live replica's theta, v the live
   v, its error-feedback residual zeros (it has sent nothing yet), its inner optimizer fresh (a new
   replica has no inner state; DiLoCo keeps inner state per replica), its iteration the live parts' next.

From step S on the global batch is split over the new count, and the joiner's pseudo-gradient is in the
first outer average after it joined (step S + H). Joins need equal shares, one fragment, and a global
batch that divides over every membership; :func:`check_joins` says which rule a schedule breaks.
"""
from __future__ import annotations

import argparse
from typing import Mapping

import numpy as np

from fusion.ir.errors import FusionError


def join_at(text: str) -> tuple[int, int]:
    """An argparse type: ``STEP:REPLICA`` (replica REPLICA starts late and joins before step STEP)."""
    step, sep, rep = text.partition(":")
    if not sep or not step.isdigit() or not rep.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: expected STEP:REPLICA, e.g. 4:2 (replica 2 joins before step 4)")
    return int(step), int(rep)


def check_join_options(replicas: int, mode: str, late: list[int], source: str = "--join-at") -> None:
    """The checks of :func:`check_joins` that need only the replica count and sync mode (before compiling)."""
    if mode != "diloco" or replicas < 2:
        raise FusionError(f"{source}: a replica joins a DiLoCo run (--dp-sync diloco with --replicas 2 or more); "
                          f"this plan has {replicas} replica(s), dp_sync {mode!r}")
    for r in late:
        if not 0 <= r < replicas:
            raise FusionError(f"{source}: the plan has no replica {r} (replicas 0..{replicas - 1})")


def check_joins(plan, joins: Mapping[int, int], source: str = "--join-at") -> None:
    """FusionError (one line naming ``source``) when ``joins`` (replica -> step it joins at) cannot run on
    ``plan``: not DiLoCo, a replica the plan lacks, no replica left to start with, a step that is not an
    outer boundary, streaming fragments or unequal shares, or a global batch that does not divide over a
    membership of the schedule."""
    if not joins:
        return
    R, sync = plan.replicas, plan.dp_sync
    check_join_options(R, sync.mode, list(joins), source)
    for r, s in joins.items():
        if s < 1 or s % sync.inner_steps:
            raise FusionError(f"{source}: step {s} is not an outer boundary (a multiple of --inner-steps "
                              f"{sync.inner_steps}, at least {sync.inner_steps}): a replica joins only there")
    if len(joins) >= R:
        raise FusionError(f"{source}: every replica would start late; at least one must start the run")
    if sync.fragments > 1:
        raise FusionError(f"{source}: joining with streaming fragments (--sync-fragments {sync.fragments}) is not "
                          "built: the fragments' boundaries differ, so no step has every replica at the global weights")
    if sync.shares:
        raise FusionError(f"{source}: joining with unequal replica shares (--replica-shares) is not built")
    if sync.delay:
        raise FusionError(f"{source}: joining with the delayed outer step (--outer-delay 1) is not built: a round "
                          "is in flight at every boundary, so no step has every replica at the global weights")
    if any(len(ps) > 1 for ps in plan.lanes().values()):
        raise FusionError(f"{source}: joining under the interleaved schedule is not built")
    total = plan.micro_batches * R
    for s in sorted({0, *joins.values()}):
        live = R - sum(1 for t in joins.values() if t > s)
        if total % live:
            raise FusionError(f"{source}: the global batch of {total} micro-batches does not divide over the {live} "
                              f"replicas training from step {s}")


def join_arrays(outer) -> dict[str, np.ndarray]:
    """What a joiner takes from a live part of its stage (an :class:`~.outer.OuterLoop`): the global weights
    and the outer momentum, keyed as in its checkpoints (``theta::i:dtype``, ``momentum::i:dtype``)."""
    return {k: v for k, v in outer.state_arrays().items() if not k.startswith("residual::")}


def adopt(outer, arrays: Mapping[str, np.ndarray], source: str) -> dict[str, np.ndarray]:
    """Load a live replica's :func:`join_arrays` into a joiner's ``outer`` state (its residual stays zeros);
    returns the trainable weights to write into the joiner's engine (its theta). FusionError naming
    ``source`` when the arrays do not fit this part's buckets."""
    full = dict(arrays)
    for i, b in enumerate(outer.buckets):
        if outer.residual is not None:
            full[f"residual::{i}:{b.dtype}"] = np.zeros(b.total, dtype=outer.residual[i].dtype)
    outer.load_arrays(full, source)
    from fusion.executors.runtime.dp.allreduce import unflatten

    out: dict[str, np.ndarray] = {}
    for b, t in zip(outer.buckets, outer.theta):
        out.update(unflatten(b, t.copy()))
    return out

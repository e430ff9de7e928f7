"""``--join-at STEP:REPLICA`` (DiLoCo replicas that join a running job late): the checks of a join schedule, on
the options alone (:func:`check_join_options`, before compiling) and against the plan (:func:`check_joins`)."""
from __future__ import annotations

from typing import Mapping

from fusion.ir.errors import FusionError


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
    if sync.inner_steps_per_replica:
        raise FusionError(f"{source}: joining with per-replica inner steps (--inner-steps auto) is not built")
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



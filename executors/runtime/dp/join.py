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
batch that divides over every membership; :func:`fusion.options.joins.check_joins` says which rule a schedule
breaks (before anything starts).
"""
from __future__ import annotations

from typing import Mapping

import numpy as np


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

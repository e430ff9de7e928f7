"""Per-replica inner steps (``Plan.dp_sync.inner_steps_per_replica``, ``--inner-steps auto``): replica r takes H_r
inner steps per DiLoCo round, in proportion to its speed (Async Local-SGD, Liu et al. 2024, arXiv 2401.09135).

The semantics, one rule shared by the coordinator and every CompNode (both call :func:`steps_at`):

* A round is H = ``dp_sync.inner_steps`` global steps (H = max_r H_r, the fastest replica's), so the run's step
  counter, ``--steps``, checkpoints and metrics count global steps as without it, and outer boundaries stay at
  the multiples of H.
* Replica r takes its inner steps in the **last** H_r steps of each round (round positions H - H_r .. H - 1,
  0-based) and is idle in the first H - H_r: an idle replica's parts get the step's control message without
  data, run no forward, backward or optimizer step, and report no loss; its share of that global batch is not
  trained on (a slower replica sees fewer samples, as in Async Local-SGD). Every replica steps in the round's
  last step, so the outer step ends an active step everywhere.
* The outer average weighs replica r's pseudo-gradient by the samples it saw in the round,
  ``H_r x its micro-batches per step`` (:func:`round_weights`), renormalised over the group.
* A step's loss is the mean over the micro-batches of the replicas that stepped.

The wall-clock gain under the coordinator's lock-step loop (every global step waits for the replicas that
take it): a round costs about ``sum over positions of the slowest replica stepping there``, so a replica idle
in a step does not hold the others back there (docs/data-parallel.md, "Inner steps by speed").
"""
from __future__ import annotations

from typing import Sequence


def inner_steps_of(sync, replica: int) -> int:
    """H_r of ``replica`` under ``sync`` (a :class:`~fusion.plan.DPSync`): its own H, or ``inner_steps``."""
    return int(sync.inner_steps_per_replica.get(replica, sync.inner_steps)) if sync.inner_steps_per_replica \
        else int(sync.inner_steps)


def steps_at(sync, replica: int, steps_done: int) -> bool:
    """Whether ``replica`` takes an inner step in the global step that makes ``steps_done`` completed steps
    (``steps_done`` >= 1): its round position ``(steps_done - 1) % H`` is among the round's last H_r."""
    if not sync.inner_steps_per_replica or sync.mode != "diloco":
        return True
    h = int(sync.inner_steps)
    return (steps_done - 1) % h >= h - inner_steps_of(sync, replica)


def stepping_replicas(sync, replicas: Sequence[int], steps_done: int) -> list[int]:
    """The replicas of ``replicas`` that step in the global step making ``steps_done`` completed steps."""
    return [r for r in replicas if steps_at(sync, r, steps_done)]


def round_weights(sync, micro_batches: Sequence[int]) -> list[float]:
    """Each replica's samples per round in micro-batches: ``H_r x micro_batches[r]`` (its rows per step)."""
    return [float(inner_steps_of(sync, r) * m) for r, m in enumerate(micro_batches)]

"""The data-parallel sync methods by ``Plan.dp_sync.mode``: one registry. A new method is one module with a
:class:`~.sync.GradSync` subclass, its line here and its test (``DPSync.MODES`` in the plan format lists the
modes a plan may name)."""
from __future__ import annotations

from typing import Mapping, Sequence

from fusion.ir.errors import FusionError
from fusion.executors.runtime.dp.diloco import DiLoCo
from fusion.executors.runtime.dp.every_step import EveryStep
from fusion.executors.runtime.dp.sync import GradSync

SYNC_METHODS: dict[str, type[GradSync]] = {EveryStep.mode: EveryStep, DiLoCo.mode: DiLoCo}


def make_sync(plan, me: str, trainable: Mapping[str, tuple[Sequence[int], str]]) -> GradSync | None:
    """The sync of part ``me`` with its stage's replicas under the plan's ``dp_sync.mode``; None for a stage of
    one replica (a single pipeline keeps any dtype, bfloat16 included: only a group has buckets)."""
    if len(plan.dp_group(me)) < 2:
        return None
    cls = SYNC_METHODS.get(plan.dp_sync.mode)
    if cls is None:
        raise FusionError(f"plan.dp_sync.mode {plan.dp_sync.mode!r}: this runtime runs {sorted(SYNC_METHODS)}")
    return cls.build(plan, me, trainable)

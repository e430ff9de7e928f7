"""Synchronous data parallelism (``dp_sync.mode "every"``): the replicas average their gradients every step,
after the backward and before the optimizer, by a ring or tree all-reduce (:mod:`.allreduce`)."""
from __future__ import annotations

import time
from typing import Any

from fusion.executors.runtime.dp.allreduce import average, flatten, unflatten
from fusion.executors.runtime.dp.sync import GradSync, SyncLinks
from fusion.executors.runtime.limits import allreduce_message_limit


class EveryStep(GradSync):
    """Every step's gradients averaged over the live group (none while the group is this part alone)."""

    mode = "every"

    def message_limit(self, limit: int) -> int:
        return max(limit, allreduce_message_limit(self.ring.buckets, self.ring.chunks))

    def after_backward(self, it: int, steps_done: int, engine: Any, links: SyncLinks) -> dict:
        """Average the parameter gradients over the group (a parameter without a gradient keeps none)."""
        if self.ring is None:
            return {}
        return average_grads(self.ring, it, engine, links)


def average_grads(ring, it: int, engine: Any, links: SyncLinks) -> dict:
    """The parameter gradients of iteration ``it`` averaged over ``ring``'s group and written back into ``engine``
    (synchronous DP's step, and DiLoCo's synchronous warm-up); its stats."""
    t0 = time.perf_counter()
    with links.span("allreduce", "sync"):
        grads = engine.grads()
        buffers = [flatten(b, grads) for b in ring.buckets]
        average(ring, it, buffers, links.send, links.wait)
        for b, flat in zip(ring.buckets, buffers):
            for name, g in unflatten(b, flat).items():
                if grads.get(name) is not None:  # (on every replica alike)
                    engine.set_grad(name, g)
    return {"allreduce_s": time.perf_counter() - t0}

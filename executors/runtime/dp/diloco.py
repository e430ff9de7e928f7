"""DiLoCo (``dp_sync.mode "diloco"``): no per-step all-reduce; every H steps (per streaming fragment) an outer
step averages the replicas' pseudo-gradients and updates the global weights (:mod:`.outer`), exactly or under
a pseudo-gradient codec, at once or overlapping the next window (``dp_sync.delay`` 1)."""
from __future__ import annotations

import time
from typing import Any, Mapping, Sequence

import numpy as np

from fusion.ir.errors import WireError
from fusion.ir.wire import Message
from fusion.executors.runtime.dp.allreduce import Bucket
from fusion.executors.runtime.dp.header import ChunkHeader, DelayedHeader, PseudoHeader
from fusion.executors.runtime.dp.inner_steps import round_weights
from fusion.executors.runtime.dp.join import adopt, join_arrays
from fusion.executors.runtime.dp.outer import (DelayedInbox, OuterLoop, PseudoInbox, fragment_buckets,
                                               replica_micro_batches, write_params)
from fusion.executors.runtime.dp.sync import GradSync, Regroup, SyncLinks
from fusion.executors.runtime.dp.every_step import average_grads
from fusion.executors.runtime.limits import allreduce_message_limit


class DiLoCo(GradSync):
    """DiLoCo's outer loop over the live group.

    outer: the global weights, outer momentum and residual (built by :meth:`start` from the weights the part
    starts with); delayed: the inbox of delayed rounds (``dp_sync.delay`` 1; built with the sync, so a peer's
    round that arrives before this part's setup is kept; kept across regroups: the plan's group); shares:
    the micro-batches each replica runs per step under unequal shares (None: equal); per_round: each replica's
    samples per round in micro-batches under per-replica inner steps (``dp_sync.inner_steps_per_replica``,
    :mod:`.inner_steps`; None: every replica takes H steps)."""

    mode = "diloco"
    UNEQUAL_SHARES = True
    JOINABLE = True
    KEEPS_STATE = True

    def __init__(self, plan, me: str, buckets: Sequence[Bucket], fragments: Sequence[Sequence[int]] | None = None):
        super().__init__(plan, me, buckets)
        self.fragments = fragments
        self.shares = replica_micro_batches(plan) if plan.dp_sync.shares else None
        self.per_round = (round_weights(plan.dp_sync, replica_micro_batches(plan))
                          if plan.dp_sync.inner_steps_per_replica else None)
        self.outer: OuterLoop | None = None
        self._pseudo: PseudoInbox | None = None
        self.delayed = (DelayedInbox(me, self.stage, self.buckets, plan.dp_sync.codec)
                        if plan.dp_sync.delay else None)

    @classmethod
    def build(cls, plan, me: str, trainable: Mapping[str, tuple[Sequence[int], str]]) -> "DiLoCo":
        buckets, fragments = fragment_buckets(trainable, plan.dp_sync.fragments)
        return cls(plan, me, buckets, fragments)

    def message_limit(self, limit: int) -> int:
        one = allreduce_message_limit(self.buckets, 1)
        # a joiner's setup carries the global weights and the outer momentum (join.py)
        return max(limit, one, 2 * one * len(self.buckets))

    # -- receiving ----------------------------------------------------------------------------
    def routes(self):
        return {ChunkHeader: lambda sender, msg: self.ring.accept(sender, msg),
                PseudoHeader: self._accept_pseudo, DelayedHeader: self._accept_delayed}

    def _accept_pseudo(self, sender: str, msg: Message) -> None:
        if self.outer is None or self.plan.dp_sync.codec is None:
            raise WireError(f"pseudo-gradient from {sender!r}, but {self.me} runs no pseudo-gradient codec")
        self._pseudo_inbox().accept(sender, msg)

    def _accept_delayed(self, sender: str, msg: Message) -> None:
        if self.delayed is None:
            raise WireError(f"delayed pseudo-gradient from {sender!r}, but {self.me} runs no delayed outer step")
        self.delayed.accept(sender, msg)

    def _pseudo_inbox(self) -> PseudoInbox:
        """The inbox of encoded pseudo-gradients for the current group (rebuilt when a regroup changed the ring)."""
        if self._pseudo is None or self._pseudo.ring is not self.ring:
            self._pseudo = PseudoInbox(self.ring, self.plan.dp_sync.codec)
        return self._pseudo

    # -- the state ----------------------------------------------------------------------------
    def start(self, engine: Any) -> None:
        """DiLoCo's global weights and outer momentum, from the weights the part starts with."""
        names = {n for b in self.buckets for n in b.names}
        trainable = {n: a for n, a in engine.state().items() if n in names}
        self.outer = OuterLoop(self.plan.dp_sync, self.buckets, trainable, self.fragments)

    def state(self) -> dict[str, np.ndarray] | None:
        return self.outer.state_arrays() if self.outer is not None else None

    def load_state(self, arrays: Mapping[str, np.ndarray], source: str) -> None:
        self.outer.load_arrays(arrays, source)

    def join_state(self) -> dict[str, np.ndarray]:
        """What a joiner takes from this part (:func:`.join.join_arrays`)."""
        return join_arrays(self.outer)

    def join(self, engine: Any, arrays: Mapping[str, np.ndarray], source: str) -> None:
        """Start from a live replica's :meth:`join_state` (its global weights written into the engine)."""
        write_params(engine, adopt(self.outer, arrays, source))

    def announce(self, links: SyncLinks) -> None:
        if self.outer is not None and self.outer.pending:  # a checkpoint's rounds in flight: send ours again
            self.outer.announce(self.me, self.group, links.send)

    # -- the step -----------------------------------------------------------------------------
    def _weights(self) -> dict[str, float] | None:
        """Unequal shares or per-replica inner steps: part -> the samples its replica saw in the round (its
        micro-batches per step, times its H_r with per-replica inner steps); None: equal, the plain mean."""
        if self.ring is None or not (self.shares or self.per_round):
            return None
        per = self.per_round or self.shares
        return {p: per[self.plan.parts[p].replica] for p in self.ring.group}

    def _live(self) -> list[str]:
        """The replicas whose pseudo-gradients an outer step averages now (the survivors)."""
        return list(self.ring.group) if self.ring is not None else [self.me]

    def _trainable(self, state: Mapping[str, Any]) -> dict[str, Any]:
        names = {n for b in self.outer.buckets for n in b.names}
        return {n: a for n, a in state.items() if n in names}

    def after_backward(self, it: int, steps_done: int, engine: Any, links: SyncLinks) -> dict:
        """During the synchronous warm-up (``dp_sync.sync_warmup``: steps 1..N), the gradients averaged every step
        as synchronous DP does; after it, nothing (the replicas train apart until the outer step)."""
        if self.ring is None or not self.outer.warming(steps_done):
            return {}
        return average_grads(self.ring, it, engine, links)

    def after_step(self, it: int, steps_done: int, engine: Any, links: SyncLinks) -> dict:
        """The outer step due after ``steps_done`` completed steps (none due: no stats): average the
        pseudo-gradients over the group, update the global weights, continue from them; its stats as ``outer``.
        The step was committed (failover runs): a replica lost meanwhile makes the survivors regroup and average
        among themselves."""
        if self.outer.warmup and steps_done == self.outer.warmup:  # DiLoCo starts here, from the warm-up's weights
            self.outer.restart(self._trainable(engine.state()))
        fragment = self.outer.due(steps_done)
        if fragment is None:
            return {}
        params = self._trainable(engine.state())
        t0 = time.perf_counter()
        while True:
            try:
                with links.span("outer", "sync"):
                    if self.delayed is not None:  # the exchange overlapping the next window: eager or delayed
                        new, st = self.outer.overlapped_step(self.me, self._live(), self.delayed, steps_done, params,
                                                             links.send, links.wait, self._weights(), fragment)
                    else:
                        pseudo = self._pseudo_inbox() if self.ring is not None else None
                        n_it = self.ring.expected_iter if self.ring is not None else it
                        new, st = self.outer.step(self.me, self.ring, pseudo, n_it, params, links.send, links.wait,
                                                  self._weights(), fragment)
                break
            except Regroup:
                links.regroup()
        write_params(engine, new)
        return {"outer": {"step": steps_done, "s": round(time.perf_counter() - t0, 6), **st}}

    def final_state(self, state: dict[str, np.ndarray], links: SyncLinks) -> dict[str, np.ndarray]:
        """The engine's parameters with every delayed round still in flight collected and applied
        (:meth:`OuterLoop.flushed`; the training state itself is unchanged)."""
        if self.delayed is None or self.outer is None or not self.outer.pending:
            return state
        while True:
            try:
                new = self.outer.flushed(self.me, self._live(), self.delayed, self._trainable(state), links.wait,
                                         self._weights())
                break
            except Regroup:
                links.regroup()
        return {**state, **{n: v.astype(np.asarray(state[n]).dtype, copy=False) for n, v in new.items()}}

"""The group of a stage's replicas changing under a running CompNode: a replica joins (DiLoCo, at an outer boundary;
:mod:`.dp.join`) or is dropped (a regroup)."""
from __future__ import annotations

import logging
from collections import deque

from fusion.executors.runtime.control import Admit, Admitted, Clip, Commit, Regrouped, Setup, Step
from fusion.executors.runtime.node_common import COORDINATOR, ExecutorAbort

log = logging.getLogger(__name__)


class Membership:
    """A part of :class:`~.compnode.CompNode` (mixed in): the group of a stage's replicas changing under a running
    CompNode: a replica joins (DiLoCo, at an outer boundary; :mod:`.dp.join`) or is dropped (a regroup)."""

    def _join(self, engine, c: Setup, resume) -> None:
        """A joiner (``c.start_it``) starts from a live replica's state: the global weights and outer momentum
        (a resume's checkpoint has them already)."""
        if self.sync is None or not self.sync.JOINABLE:
            raise ExecutorAbort("setup: a part that runs no DiLoCo outer loop cannot join a running job")
        if resume is not None:
            return
        if c.join_from not in self.plan.dp_group(self.me) or c.join_from == self.me:
            raise ExecutorAbort(f"setup: join_from {str(c.join_from)[:80]!r} is not another replica of stage "
                                f"{self.plan.stage_of(self.me)!r}")
        self.sync.join(engine, c.arrays, f"outer state from {c.join_from}")
        log.info("%s: joining at iteration %d with %s's global weights and outer momentum (error feedback "
                 "zeros, a fresh inner optimizer); group %s, %d micro-batches", self.me, c.start_it,
                 c.join_from, self.dp_group, self.n_micro)

    def _set_members(self, group: list[str], n: int) -> None:
        """(Under ``_cv``) this stage's live replicas are ``group`` and each runs ``n`` micro-batches per step:
        the ring (or tree) over ``group``, the schedule and inbox for ``n``."""
        self.n_micro = n
        self.inbox.n_micro = n
        self.actions = self.spec.actions(self.plan, n)
        if self.sync is not None and self.sync.set_group(group, self.inbox.expected_iter):
            self._cv.notify_all()

    def _admit(self, c: Admit) -> None:
        """A replica joins before iteration ``c.it`` (an outer boundary; join.py): connect to its parts, take
        the one of this stage into the group, run the new micro-batch count; tell the coordinator."""
        if self.sync is None or not self.sync.JOINABLE:
            raise ExecutorAbort(f"admit: {self.me} runs no DiLoCo outer loop; a replica cannot join it")
        if c.it != self.inbox.expected_iter:
            raise ExecutorAbort(f"admit for iteration {c.it}, this part is at {self.inbox.expected_iter}")
        unknown = [p for p in c.add if p not in self.plan.parts or p in self.dp_group]
        if unknown:
            raise ExecutorAbort(f"admit: {unknown[0]!r} is not a part of the plan outside this part's group")
        for p in sorted(set(c.peers) & self._peers):
            self._connect(p, c.peers[p])
        with self._cv:
            self._set_members([p for p in self.plan.dp_group(self.me) if p in self.dp_group or p in c.add],
                              c.micro_batches)
        log.warning("%s: part(s) %s joined before iteration %d; group now %s, %d micro-batches", self.me,
                    ", ".join(c.add), c.it, self.dp_group, self.n_micro)
        self.transport.send(COORDINATOR, Admitted(it=self.inbox.expected_iter).frames())

    def _apply_regroup(self) -> None:
        """A replica was dropped: forget the abandoned attempt, shrink the ring, take the new micro-batch count."""
        with self._cv:
            c, self._regroup = self._regroup, None
        it, drop, n = c.it, set(c.drop), c.micro_batches
        if self.me in drop:
            raise ExecutorAbort(f"this part's replica was dropped at iteration {it}")
        if self.opt is not None:
            self.opt.zero_grad()  # gradients of the abandoned attempt (a committed one has stepped and zeroed them)
        if self.runtime is not None:
            self.runtime.engine.forget()  # the abandoned attempt's in-flight micro-batches
        with self._cv:
            # late messages and queued orders of the abandoned attempt are refused from here on
            self._ctrl = deque(x for x in self._ctrl if not (isinstance(x, (Step, Commit, Clip)) and x.it <= it))
            if self.inbox.expected_iter <= it:
                self.inbox.finish(it)
            self.n_micro = n
            self.inbox.n_micro = n
            self.actions = self.spec.actions(self.plan, n)
            if self.sync is not None and self.sync.set_group([p for p in self.dp_group if p not in drop],
                                                             self.inbox.expected_iter):
                self._cv.notify_all()
        log.warning("%s: replica part(s) %s dropped at iteration %d; group now %s, %d micro-batches", self.me,
                    ", ".join(sorted(drop)), it, self.dp_group, n)
        self.transport.send(COORDINATOR, Regrouped(it=self.inbox.expected_iter).frames())

"""The one interface a CompNode has to its stage's data-parallel replicas: :class:`GradSync`.

A sync method (``Plan.dp_sync.mode``; :mod:`.registry` maps each to its class) keeps what the group sent
(:meth:`GradSync.accept`, routed by the typed header, :mod:`.header`), acts at two points of a step
(:meth:`~GradSync.after_backward`: before the optimizer; :meth:`~GradSync.after_step`: after it), holds the
state a checkpoint saves (:meth:`~GradSync.state` / :meth:`~GradSync.load_state`) and follows the group as
replicas are dropped or join (:meth:`~GradSync.set_group`). The arithmetic lives in :mod:`.allreduce` and
:mod:`.outer`; this module keeps the protocol: the group, its ring (or tree) inbox and the messages a member
sent in a group this part has not regrouped into yet.

Not thread-safe: the CompNode calls ``accept``, ``set_group``, ``start_at`` and ``finish`` under its lock.
"""
from __future__ import annotations

import logging
from collections import deque
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Mapping, Sequence

import numpy as np

from fusion.ir.errors import FusionError, WireError
from fusion.ir.wire import Message
from fusion.executors.runtime.dp.allreduce import Bucket, NotYourTurn, RingInbox, make_buckets
from fusion.executors.runtime.dp.header import ChunkHeader, header_type

log = logging.getLogger(__name__)
#: all-reduce messages kept for the next ring after a regroup (:class:`NotYourTurn`), at most; a survivor sends at
#: most one step per bucket ahead of this part's regroup, so this bounds memory, not correctness, for sane groups
MAX_EARLY_RING = 256


class Regroup(Exception):
    """The coordinator dropped a replica: the current attempt is abandoned (a wait raises this)."""


@dataclass(frozen=True)
class SyncLinks:
    """How a sync reaches its group and its process, given by the CompNode for one call."""

    send: Callable[[str, list, str], None]  #: hand frames for a peer to the transport (peer, frames, label)
    wait: Callable[[Callable[[], Any], str], Any]  #: receive until ``ready()`` is not None; returns it (raises
    #: on abort, silence, timeout, and :class:`Regroup` when the coordinator dropped a replica)
    span: Callable[[str, str], AbstractContextManager]  #: a trace span (name, category)
    regroup: Callable[[], None]  #: apply the regroup a wait raised (the group shrinks), then the call retries


class GradSync:
    """The data-parallel sync of one part with the other replicas of its stage.

    me: this part; stage: every replica's part of its stage in the plan (rank order); group: the live members
    now (``stage`` until a regroup or a late join); buckets: this part's trainable gradients laid end to end
    (the same on every replica); ring: the ring (or tree) inbox over ``group``, None while the group is this
    part alone; plan: the plan (its ``dp_codec``, ``dp_algo_of``, ``dp_sync``)."""

    #: the plan's ``dp_sync.mode`` this class runs (its key in :data:`.registry.SYNC_METHODS`)
    mode: ClassVar[str] = ""
    #: replicas may take unequal shares of a step's micro-batches (``dp_sync.shares``)
    UNEQUAL_SHARES: ClassVar[bool] = False
    #: a replica may join a running job (``--join-at``): it has a state to hand to a joiner
    JOINABLE: ClassVar[bool] = False
    #: a checkpoint holds its state (:meth:`state`), which a resume loads (:meth:`load_state`)
    KEEPS_STATE: ClassVar[bool] = False

    def __init__(self, plan, me: str, buckets: Sequence[Bucket]):
        self.plan, self.me = plan, me
        self.stage = list(plan.dp_group(me))
        self.group = list(self.stage)
        self.buckets = list(buckets)
        self.ring: RingInbox | None = None
        #: all-reduce messages sent in a group this part has not regrouped into yet (NotYourTurn): a survivor that
        #: regrouped first already sends in the new group; offered to the next ring (:meth:`set_group`)
        self._early: deque = deque(maxlen=MAX_EARLY_RING)
        self.set_group(self.group, 0)

    @classmethod
    def build(cls, plan, me: str, trainable: Mapping[str, tuple[Sequence[int], str]]) -> "GradSync":
        """The sync of part ``me`` over the trainable parameters ``name -> (shape, dtype)`` (one bucket per dtype)."""
        return cls(plan, me, make_buckets(trainable))

    # -- the group --------------------------------------------------------------------------
    @property
    def neighbours(self) -> set[str]:
        """The parts this one may exchange data-parallel messages with: every other replica of the stage."""
        return set(self.stage) - {self.me}

    def message_limit(self, limit: int) -> int:
        """The receive limit this part needs, at least ``limit`` (the pipeline's)."""
        return limit

    def set_group(self, group: Sequence[str], it: int) -> bool:
        """The live members are ``group``: the ring (or tree) over them (None for one part) at iteration ``it``;
        the messages a member already sent in this group (kept as NotYourTurn) are offered to it, and those
        sent in yet another group of this iteration are kept again (two regroups in one step). True when some
        were offered (the waiting engine loop should look again)."""
        self.group = list(group)
        self.ring = (RingInbox(self.me, self.group, self.buckets, self.plan.dp_codec, self.plan.dp_algo_of(self.me),
                               self.stage) if len(self.group) > 1 else None)
        if self.ring is not None:
            self.ring.expected_iter = it
        early, self._early = list(self._early), deque(maxlen=MAX_EARLY_RING)
        for sender, msg in early:  # sent in this group by a member that regrouped before this part did
            try:
                if self.ring is None:
                    raise WireError(f"{self.me} has no data-parallel group now")
                self._route(sender, msg)
            except NotYourTurn:
                if msg.header.get("it") == it:
                    self._early.append((sender, msg))
            except WireError as e:
                log.warning("%s: dropped an all-reduce message of %s kept from before the regroup: %s", self.me,
                            sender, e)
        return bool(early)

    def start_at(self, it: int) -> None:
        """The first iteration this part runs (a resume's or a joiner's)."""
        if self.ring is not None:
            self.ring.expected_iter = it

    def finish(self, it: int) -> None:
        """Iteration ``it`` is over."""
        if self.ring is not None:
            self.ring.finish(it)

    # -- receiving ----------------------------------------------------------------------------
    def accept(self, sender: str, msg: Message) -> None:
        """Keep a data-parallel message from ``sender`` or raise WireError saying why not; one sent in a group this
        part has not regrouped into yet is kept for that group (and still refused here, so it is counted)."""
        if self.ring is None:
            raise WireError(f"all-reduce message from {sender!r}, but {self.me} has no data-parallel group")
        try:
            self._route(sender, msg)
        except NotYourTurn as e:
            self._early.append((sender, msg))
            raise WireError(f"{e} (kept in case this part regroups: a survivor may send first)") from None

    def routes(self) -> dict[type, Callable[[str, Message], None]]:
        """Header type -> the inbox that takes it (:func:`.header.header_type`)."""
        return {ChunkHeader: lambda sender, msg: self.ring.accept(sender, msg)}

    def _route(self, sender: str, msg: Message) -> None:
        kind = header_type(msg.header)
        take = self.routes().get(kind)
        if take is None:
            raise WireError(f"{kind.__name__} from {sender!r}: {self.me}'s {self.mode!r} data-parallel sync "
                            "takes none")
        take(sender, msg)

    # -- the step -----------------------------------------------------------------------------
    def after_backward(self, it: int, steps_done: int, engine: Any, links: SyncLinks) -> dict:
        """After this part's backward of iteration ``it`` (whose optimizer step makes ``steps_done`` completed
        steps), before the optimizer; the step's stats it adds."""
        return {}

    def after_step(self, it: int, steps_done: int, engine: Any, links: SyncLinks) -> dict:
        """After the optimizer step that makes ``steps_done`` completed steps; the step's stats it adds."""
        return {}

    # -- the state ----------------------------------------------------------------------------
    def start(self, engine: Any) -> None:
        """The engine exists (the part's setup): take what the sync keeps of its weights."""

    def state(self) -> dict[str, np.ndarray] | None:
        """What a checkpoint keeps of this sync (None: nothing)."""
        return None

    def load_state(self, arrays: Mapping[str, np.ndarray], source: str) -> None:
        """The state of :meth:`state`, as a checkpoint (named ``source``) holds it."""
        raise FusionError(f"{source}: the {self.mode!r} data-parallel sync keeps no state")

    def announce(self, links: SyncLinks) -> None:
        """After setup connected the peers: send again what a checkpoint restored in flight."""

    def final_state(self, state: dict[str, np.ndarray], links: SyncLinks) -> dict[str, np.ndarray]:
        """The parameters a fetch returns, from the engine's ``state`` (the training state unchanged)."""
        return state

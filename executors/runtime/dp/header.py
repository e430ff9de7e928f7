"""The typed headers of data-parallel messages (wire kind ``"allreduce"``, :data:`~.allreduce.KIND`).

Three messages share the kind; each is one frozen dataclass here, written to exactly the dict (same keys, same
order, so the same msgpack bytes) that the wire carried before these classes existed, and told apart on
arrival by :func:`header_type`, the one place that reads the flags ``gather`` and ``delayed``. A receiver
(:meth:`~.sync.GradSync.accept`) routes a message by the class :func:`header_type` gives, not by flags; the
inboxes (:class:`~.allreduce.RingInbox`, :class:`~.outer.PseudoInbox`, :class:`~.outer.DelayedInbox`) still
check every field of what came, since a header from the wire is untrusted.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from fusion.ir.wire import encode

KIND = "allreduce"


@dataclass(frozen=True)
class ChunkHeader:
    """One step of a ring or tree all-reduce (:mod:`.allreduce`)."""

    it: int  #: the iteration the gradients belong to
    bucket: int  #: the bucket (one dtype's gradients end to end) the chunk is of
    step: int  #: the step of the ring (reduce-scatter, then all-gather) or tree (reduce, then broadcast)
    chunk: int  #: the chunk of the bucket it carries (the tree: always 0, the whole bucket)
    src: str  #: the sending part
    dst: str  #: the receiving part
    group: tuple[str, ...]  #: the sender's data-parallel group in rank order (a regroup changes it)

    def fields(self) -> dict[str, Any]:
        return {"it": self.it, "bucket": self.bucket, "step": self.step, "chunk": self.chunk, "src": self.src,
                "dst": self.dst, "group": list(self.group)}

    def frames(self, payload: Mapping[str, Any], arrays: Sequence[Any]) -> list[Any]:
        """The message's frames: this header with the payload's header ``payload``, then its ``arrays``."""
        return encode(KIND, {**self.fields(), "payload": payload}, arrays)


@dataclass(frozen=True)
class PseudoHeader(ChunkHeader):
    """A DiLoCo pseudo-gradient under a codec, sent whole to every other member (:meth:`.outer.OuterLoop.step`);
    ``step`` and ``chunk`` are 0. On the wire: the chunk's fields and ``"gather": true``."""

    def fields(self) -> dict[str, Any]:
        return {**super().fields(), "gather": True}


@dataclass(frozen=True)
class DelayedHeader:
    """A delayed DiLoCo round's pseudo-gradient (``dp_sync.delay`` 1, :meth:`.outer.OuterLoop.delayed_step`).
    On the wire: these fields and ``"delayed": true``."""

    round: int  #: the completed-step count of the boundary that started the round
    bucket: int  #: the bucket the pseudo-gradient is of
    src: str  #: the sending part
    dst: str  #: the receiving part

    def frames(self, payload: Mapping[str, Any], arrays: Sequence[Any]) -> list[Any]:
        return encode(KIND, {"round": self.round, "bucket": self.bucket, "src": self.src, "dst": self.dst,
                             "delayed": True, "payload": payload}, arrays)


DPHeader = ChunkHeader | PseudoHeader | DelayedHeader


def header_type(header: Any) -> type:
    """Which of the three messages a received header says it is (its fields are checked by the inbox it goes to)."""
    h = header if isinstance(header, dict) else {}
    if h.get("delayed") is True:
        return DelayedHeader
    if h.get("gather") is True:
        return PseudoHeader
    return ChunkHeader

"""Control messages between the coordinator and the CompNode executors: one frozen dataclass per op.

A control message is a wire message of kind ``"ctrl"`` whose header has an ``op``, the names of its
tensors (``names``) and the op's fields, in the order its class declares them. Each op is a class
below (:data:`MESSAGES`: op -> class); ``msg.frames()`` gives its wire frames and
:func:`decode_ctrl` the typed message back, every field checked. The conversation of one run::

    executor -> coordinator   Hello {part, address, pid, engine, digest}
    coordinator -> executor   Setup {peers, emulate_links, resume_step, checkpoint_dir, [failover], digest, [resume_from]}
    executor -> coordinator   Ready {part}
    coordinator -> executor   Step {it, want_grads, checkpoint, [save_step]}   tensors "<micro-batch>/<placeholder>"
    executor -> coordinator   Done {it, losses: [[mb, loss]], stats}   tensors: parameter gradients if asked
    coordinator -> executor   Fetch {}                            executor -> coordinator  State {}  tensors: parameters
    coordinator -> executor   Stop {} | Abort {reason}
    with replica failover (Setup's ``failover=True``), between the all-reduce and the optimizer step:
    executor -> coordinator   Reduced {it}                        coordinator -> executor   Commit {it}
    with gradient clipping (``optimizer.clip_grad_norm``), after the all-reduce (before Reduced):
    executor -> coordinator   GradNorm {it, sq}                   coordinator -> executor   Clip {it, norm}
    between steps, evaluation (``--eval-every``): forwards only, the iteration the parts are at
    coordinator -> executor   Eval {it}  tensors as Step's           executor -> coordinator   Evaluated {it, losses}
    coordinator -> executor   Regroup {it, drop: [parts], micro_batches}   (a replica is dropped; iteration ``it``
                              is abandoned unless it was committed)   executor -> coordinator   Regrouped {it}
    a replica joining a DiLoCo run at an outer boundary (``executors/runtime/dp/join.py``), between two steps:
    coordinator -> live part  Fetch {outer: true}                 live part -> coordinator  State {}  tensors: outer state
    coordinator -> live part  Admit {it, add: [parts], peers, micro_batches}   live part -> coordinator  Admitted {it}
    coordinator -> joiner     Setup {..., members, micro_batches, start_it, join_from}  tensors: the outer state
    either way                Hb {}  (heartbeat; any message counts as a sign of life)
    executor -> coordinator   Error {reason}

``[field]``: optional, left off the wire when None. Unknown ops, missing fields, fields of the wrong
type and mismatched tensor names are rejected with :class:`~fusion.ir.errors.WireError` naming the op
and the field, like any other malformed message. A field's check is in its ``metadata["check"]``.
On the wire a message is the header map ``{"op", "names", *fields in declaration order}`` packed by
:func:`fusion.ir.wire.encode`, with its tensors as frames: the same bytes as the untyped header dicts
these classes replaced (``tests/executors/runtime/test_control.py`` compares them op by op).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Callable, ClassVar, Mapping

import numpy as np

from fusion.ir.errors import WireError
from fusion.ir.wire import Message, encode

Check = Callable[[Any], bool]


def _str(v: Any) -> bool:
    return isinstance(v, str)


def _bool(v: Any) -> bool:
    return isinstance(v, bool)


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _nat(v: Any) -> bool:
    return _int(v) and 0 <= v < 2**62


def _opt(check: Check) -> Check:
    return lambda v: v is None or check(v)


def _str_map(v: Any) -> bool:
    return isinstance(v, dict) and all(isinstance(k, str) and isinstance(x, str) for k, x in v.items())


def _str_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _losses(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(p, list) and len(p) == 2 and _nat(p[0])
                                       and isinstance(p[1], (int, float)) and not isinstance(p[1], bool) for p in v)


def _float(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _dict(v: Any) -> bool:
    return isinstance(v, dict)


def _at_least_1(v: Any) -> bool:
    return _nat(v) and v >= 1


def _wire(check: Check, **kw: Any) -> Any:
    """A header field that must be on the wire, and pass ``check`` there."""
    return field(metadata={"check": check}, **kw)


def _optional(check: Check) -> Any:
    """A header field that may be left off the wire (None here: not sent); when present it must pass ``check``."""
    return field(default=None, metadata={"check": check, "optional": True})


@dataclass(frozen=True, kw_only=True)
class Control:
    """A control message: its op (the class's :attr:`OP`), header fields (the subclass's dataclass fields)
    and named tensors (``arrays``: name -> array, sent in this order; equality compares the fields only)."""

    OP: ClassVar[str] = ""
    arrays: Mapping[str, np.ndarray] = field(default_factory=dict, repr=False, compare=False)

    @property
    def op(self) -> str:
        return self.OP

    @classmethod
    def _fields(cls):
        return [f for f in fields(cls) if f.name != "arrays"]

    def header(self) -> dict[str, Any]:
        """The wire header: ``op``, ``names``, then each field in declaration order (optional ones only when set)."""
        h: dict[str, Any] = {"op": self.OP, "names": list(self.arrays)}
        for f in self._fields():
            v = getattr(self, f.name)
            if v is not None or not f.metadata.get("optional"):
                h[f.name] = v
        return h

    def frames(self) -> list:
        """The message's wire frames (:func:`fusion.ir.wire.encode`)."""
        return encode("ctrl", self.header(), list(self.arrays.values()))

    @classmethod
    def check_header(cls, h: Mapping[str, Any]) -> None:
        """Every field of header ``h`` the op needs is there and every field passes its check; WireError
        names the op and the field."""
        missing = [f.name for f in cls._fields() if not f.metadata.get("optional") and f.name not in h]
        if missing:
            raise WireError(f"control message {cls.OP!r} lacks fields {missing}")
        for f in cls._fields():
            if f.name in h and not f.metadata["check"](h[f.name]):
                raise WireError(f"control message {cls.OP!r}: field {f.name!r} has a bad value {repr(h[f.name])[:80]}")

    @classmethod
    def from_header(cls, h: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> "Control":
        """The message of a checked header (:meth:`check_header`; other keys are ignored) and its tensors."""
        return cls(arrays=dict(arrays), **{f.name: h[f.name] for f in cls._fields() if f.name in h})


@dataclass(frozen=True, kw_only=True)
class Hello(Control):
    """An executor is up: its part, the address it listens on, its process id, engine and plan digest."""

    OP: ClassVar[str] = "hello"
    part: str = _wire(_str)
    address: str = _wire(_str)
    pid: int = _wire(_int)
    engine: str = _wire(_str)
    digest: str = _wire(_str)


@dataclass(frozen=True, kw_only=True)
class Setup(Control):
    """The coordinator's answer to every hello: each part's address (``peers``), whether to emulate the plan's
    links, the step to resume from (None: a fresh start) and the checkpoint folder, the plan digest.
    failover: replica failover is on (the Reduced/Commit handshake); resume_from: the replica of this
    part's stage whose checkpoint it loads (itself unless its replica was dropped before that step)."""

    OP: ClassVar[str] = "setup"
    peers: dict[str, str] = _wire(_str_map)
    emulate_links: bool = _wire(_bool)
    resume_step: int | None = _wire(_opt(_nat))
    checkpoint_dir: str | None = _wire(_opt(_str))
    failover: bool | None = _optional(_bool)
    digest: str = _wire(_str, default="")
    resume_from: str | None = _optional(_str)
    #: the parts training now (None: every part of the plan); a replica not listed has not joined yet
    members: list[str] | None = _optional(_str_list)
    #: micro-batches of each live replica per step (None: the plan's ``micro_batches``)
    micro_batches: int | None = _optional(_at_least_1)
    #: a joiner: the executor iteration it starts at (the live parts' next one)
    start_it: int | None = _optional(_nat)
    #: a joiner: the live part of its stage whose global weights and outer momentum are in ``arrays``
    join_from: str | None = _optional(_str)


@dataclass(frozen=True, kw_only=True)
class Ready(Control):
    """The executor built its part and loaded its weights."""

    OP: ClassVar[str] = "ready"
    part: str = _wire(_str)


@dataclass(frozen=True, kw_only=True)
class Step(Control):
    """Run iteration ``it`` (the executors' count: steps plus abandoned attempts) on the micro-batches in
    ``arrays`` (``"<micro-batch>/<placeholder>"``); want_grads: send the parameter gradients back in Done;
    checkpoint: save this part after the optimizer step, named by ``save_step`` (the completed-step count,
    1..it + 1; default it + 1)."""

    OP: ClassVar[str] = "step"
    it: int = _wire(_nat)
    want_grads: bool = _wire(_bool)
    checkpoint: bool = _wire(_bool)
    save_step: int | None = _optional(_int)

    def __post_init__(self) -> None:
        save = 1 if self.save_step is None else self.save_step
        if not (_int(save) and 1 <= save <= self.it + 1):
            raise WireError(f"step {self.it}: save_step {repr(save)[:40]} is not a step count in 1..{self.it + 1}")


@dataclass(frozen=True, kw_only=True)
class Done(Control):
    """Iteration ``it`` ran: [micro-batch, loss] of the micro-batches whose loss is on this part, timings and
    counters (``stats``); the parameter gradients in ``arrays`` when the step asked for them."""

    OP: ClassVar[str] = "done"
    it: int = _wire(_nat)
    losses: list = _wire(_losses)
    stats: dict = _wire(_dict)


@dataclass(frozen=True, kw_only=True)
class Fetch(Control):
    """Send the part's parameters (answered by :class:`State`); outer: its DiLoCo global weights and outer
    momentum instead (``join.join_arrays``: what a joining replica of its stage starts from)."""

    OP: ClassVar[str] = "fetch"
    outer: bool | None = _optional(_bool)


@dataclass(frozen=True, kw_only=True)
class State(Control):
    """The part's parameters, in ``arrays``."""

    OP: ClassVar[str] = "state"


@dataclass(frozen=True, kw_only=True)
class Stop(Control):
    """Finish: flush the trace and exit 0."""

    OP: ClassVar[str] = "stop"


@dataclass(frozen=True, kw_only=True)
class Abort(Control):
    """Stop now, for ``reason``."""

    OP: ClassVar[str] = "abort"
    reason: str = _wire(_str)


@dataclass(frozen=True, kw_only=True)
class Hb(Control):
    """Heartbeat (any message counts as a sign of life)."""

    OP: ClassVar[str] = "hb"


@dataclass(frozen=True, kw_only=True)
class Error(Control):
    """The executor stops, for ``reason``. ``lasting``: the cause would stop a restart the same way (a full or
    read-only disk: :func:`lasting_failure`), so the coordinator should not restart (optional; absent: False)."""

    OP: ClassVar[str] = "error"
    reason: str = _wire(_str)
    lasting: bool | None = _optional(_bool)


def lasting_failure(e: BaseException) -> bool:
    """Whether ``e`` (or what caused it) is an OSError a restart on the same disk would meet again."""
    import errno

    lasting = {errno.ENOSPC, errno.EROFS, getattr(errno, "EDQUOT", 122)}
    while e is not None:
        if isinstance(e, OSError) and e.errno in lasting:
            return True
        e = e.__cause__ or e.__context__
    return False


@dataclass(frozen=True, kw_only=True)
class Reduced(Control):
    """(Failover runs) this part has its averaged gradients of iteration ``it``."""

    OP: ClassVar[str] = "reduced"
    it: int = _wire(_nat)


@dataclass(frozen=True, kw_only=True)
class Commit(Control):
    """(Failover runs) every live part has its gradients: apply iteration ``it``."""

    OP: ClassVar[str] = "commit"
    it: int = _wire(_nat)


@dataclass(frozen=True, kw_only=True)
class Regroup(Control):
    """A replica was dropped at iteration ``it``: the parts in ``drop`` are gone, each surviving replica now runs
    ``micro_batches`` micro-batches; ``it`` is abandoned unless it was committed."""

    OP: ClassVar[str] = "regroup"
    it: int = _wire(_nat)
    drop: list[str] = _wire(_str_list)
    micro_batches: int = _wire(_at_least_1)


@dataclass(frozen=True, kw_only=True)
class Regrouped(Control):
    """The part took the regroup; ``it`` is the iteration it expects next."""

    OP: ClassVar[str] = "regrouped"
    it: int = _wire(_nat)


@dataclass(frozen=True, kw_only=True)
class Admit(Control):
    """(DiLoCo, between steps, at an outer boundary) the parts in ``add`` join at executor iteration ``it``:
    connect to them at ``peers`` (part -> address), take them into this part's data-parallel group, and run
    ``micro_batches`` micro-batches per step from ``it`` on (the global batch re-split)."""

    OP: ClassVar[str] = "admit"
    it: int = _wire(_nat)
    add: list[str] = _wire(_str_list)
    peers: dict[str, str] = _wire(_str_map)
    micro_batches: int = _wire(_at_least_1)


@dataclass(frozen=True, kw_only=True)
class Admitted(Control):
    """The part took the admit; ``it`` is the iteration it expects next."""

    OP: ClassVar[str] = "admitted"
    it: int = _wire(_nat)


@dataclass(frozen=True, kw_only=True)
class GradNorm(Control):
    """(``optimizer.clip_grad_norm`` set) The sum of squares of this part's gradients of iteration ``it``, after the
    tied-gradient sum and the data-parallel average (a tied parameter counted by its first owner only)."""

    OP: ClassVar[str] = "gradnorm"
    it: int = _wire(_nat)
    sq: float = _wire(_float)


@dataclass(frozen=True, kw_only=True)
class Clip(Control):
    """The global L2 norm of the gradients of this part's pipeline at iteration ``it`` (the square root of its
    parts' :class:`GradNorm` sums): every part scales its gradients by ``min(1, clip / (norm + 1e-6))``."""

    OP: ClassVar[str] = "clip"
    it: int = _wire(_nat)
    norm: float = _wire(_float)


@dataclass(frozen=True, kw_only=True)
class Eval(Control):
    """Evaluate (``--eval-every``): run the forwards of the micro-batches in ``arrays`` (as :class:`Step`'s) with no
    autograd graph, no optimizer step and no change to any state; iteration ``it`` is the one the part is at (an
    evaluation takes no iteration of its own), its messages dense whatever the edges' codecs."""

    OP: ClassVar[str] = "eval"
    it: int = _wire(_nat)


@dataclass(frozen=True, kw_only=True)
class Evaluated(Control):
    """The evaluation at iteration ``it`` ran: [micro-batch, loss] of the micro-batches whose loss is on this part."""

    OP: ClassVar[str] = "evaluated"
    it: int = _wire(_nat)
    losses: list = _wire(_losses)


#: op -> its message class
MESSAGES: dict[str, type[Control]] = {c.OP: c for c in (Hello, Setup, Ready, Step, Done, Fetch, State, Stop, Abort, Hb,
                                                       Error, Reduced, Commit, Regroup, Regrouped, Admit, Admitted,
                                                       GradNorm, Clip, Eval, Evaluated)}
OPS = frozenset(MESSAGES)
#: ops each side may receive: an executor takes these from the coordinator, the coordinator the others
TO_EXECUTOR = frozenset({"setup", "step", "fetch", "stop", "abort", "hb", "commit", "regroup", "admit", "clip", "eval"})
TO_COORDINATOR = frozenset({"hello", "ready", "done", "state", "error", "hb", "reduced", "regrouped", "admitted",
                            "gradnorm", "evaluated"})


def decode_ctrl(msg: Message, allowed_ops: frozenset[str] | None = None) -> Control:
    """The typed control message in ``msg``; raises WireError when malformed.

    Every field the op needs must be present with the right type;
    ``allowed_ops`` (:data:`TO_EXECUTOR`, :data:`TO_COORDINATOR`) rejects ops
    meant for the other side.
    """
    if msg.kind != "ctrl":
        raise WireError(f"message kind {msg.kind!r} is not a control message")
    h = dict(msg.header)
    op = h.pop("op", None)
    if not isinstance(op, str) or op not in OPS:
        raise WireError(f"unknown control op {repr(op)[:80]}")
    if allowed_ops is not None and op not in allowed_ops:
        raise WireError(f"control op {op!r} is not one this process receives")
    cls = MESSAGES[op]
    cls.check_header(h)
    names = h.pop("names", [])
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
        raise WireError(f"control message {op!r}: 'names' must be a list of distinct strings")
    if len(names) != len(msg.arrays):
        raise WireError(f"control message {op!r} names {len(names)} tensors but carries {len(msg.arrays)}")
    return cls.from_header(h, dict(zip(names, msg.arrays)))

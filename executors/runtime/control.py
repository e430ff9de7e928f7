"""Control messages between the coordinator and the CompNode executors.

A control message is a wire message of kind ``"ctrl"`` whose header has an
``op`` and whose tensors are named by the header's ``names`` list. The
conversation of one run::

    executor -> coordinator   hello {part, address, pid, engine, digest}
    coordinator -> executor   setup {peers: {part: address}, emulate_links, resume_step, checkpoint_dir, digest}
                              (optional resume_from: the replica of this part's stage whose checkpoint it loads)
    executor -> coordinator   ready {part}
    coordinator -> executor   step {it, want_grads, checkpoint}   tensors "<micro-batch>/<placeholder>"
                              (optional save_step: the completed-step count a checkpoint is named by)
    executor -> coordinator   done {it, losses: [[mb, loss]], stats}   tensors: parameter gradients if asked
    coordinator -> executor   fetch {}                            executor -> coordinator  state {}  tensors: parameters
    coordinator -> executor   stop {} | abort {reason}
    with replica failover (setup's optional ``failover: true``), between the all-reduce and the optimizer step:
    executor -> coordinator   reduced {it}                        coordinator -> executor   commit {it}
    coordinator -> executor   regroup {it, drop: [parts], micro_batches}   (a replica is dropped; iteration ``it``
                              is abandoned unless it was committed)   executor -> coordinator   regrouped {it}
    either way                hb {}  (heartbeat; any message counts as a sign of life)
    executor -> coordinator   error {reason}

Unknown ops, missing fields and mismatched tensor names are rejected with
:class:`~fusion.ir.errors.WireError`, like any other malformed message.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from fusion.ir.errors import WireError
from fusion.ir.wire import Message, encode

#: op -> header fields it must carry, each with the check its value must pass (a type name or a predicate)
_STR, _BOOL = (str,), (bool,)


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _nat(v: Any) -> bool:
    return _int(v) and 0 <= v < 2**62


def _opt(check):
    return lambda v: v is None or check(v)


def _str_map(v: Any) -> bool:
    return isinstance(v, dict) and all(isinstance(k, str) and isinstance(x, str) for k, x in v.items())


def _losses(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(p, list) and len(p) == 2 and _nat(p[0])
                                       and isinstance(p[1], (int, float)) and not isinstance(p[1], bool) for p in v)


FIELDS: dict[str, dict[str, Any]] = {
    "hello": {"part": _STR, "address": _STR, "pid": _int, "engine": _STR, "digest": _STR},
    "setup": {"peers": _str_map, "emulate_links": _BOOL, "resume_step": _opt(_nat), "checkpoint_dir": _opt(lambda v: isinstance(v, str)),
              "digest": _STR},
    "ready": {"part": _STR},
    "step": {"it": _nat, "want_grads": _BOOL, "checkpoint": _BOOL},
    "done": {"it": _nat, "losses": _losses, "stats": lambda v: isinstance(v, dict)},
    "fetch": {},
    "state": {},
    "stop": {},
    "abort": {"reason": _STR},
    "hb": {},
    "error": {"reason": _STR},
    "reduced": {"it": _nat},
    "commit": {"it": _nat},
    "regroup": {"it": _nat, "drop": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
                "micro_batches": lambda v: _nat(v) and v >= 1},
    "regrouped": {"it": _nat},
}
OPS: dict[str, tuple[str, ...]] = {op: tuple(f) for op, f in FIELDS.items()}
#: ops each side may receive: an executor takes these from the coordinator, the coordinator the others
TO_EXECUTOR = frozenset({"setup", "step", "fetch", "stop", "abort", "hb", "commit", "regroup"})
TO_COORDINATOR = frozenset({"hello", "ready", "done", "state", "error", "hb", "reduced", "regrouped"})


@dataclass
class Control:
    """A decoded control message: ``op``, its header fields and named tensors."""

    op: str
    fields: dict[str, Any]
    arrays: dict[str, np.ndarray] = field(default_factory=dict)


def encode_ctrl(op: str, arrays: Mapping[str, Any] | None = None, **fields: Any) -> list:
    """Frames of a control message."""
    if op not in OPS:
        raise WireError(f"unknown control op {op!r}")
    arrays = dict(arrays or {})
    return encode("ctrl", {"op": op, "names": list(arrays), **fields}, list(arrays.values()))


def _ok(check, v: Any) -> bool:
    return isinstance(v, check) and (bool in check or not isinstance(v, bool)) if isinstance(check, tuple) else bool(check(v))


def decode_ctrl(msg: Message, allowed_ops: frozenset[str] | None = None) -> Control:
    """The control message in ``msg``; raises WireError when malformed.

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
    missing = [f for f in OPS[op] if f not in h]
    if missing:
        raise WireError(f"control message {op!r} lacks fields {missing}")
    for f, check in FIELDS[op].items():
        if not _ok(check, h[f]):
            raise WireError(f"control message {op!r}: field {f!r} has a bad value {repr(h[f])[:80]}")
    names = h.pop("names", [])
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
        raise WireError(f"control message {op!r}: 'names' must be a list of distinct strings")
    if len(names) != len(msg.arrays):
        raise WireError(f"control message {op!r} names {len(names)} tensors but carries {len(msg.arrays)}")
    return Control(op, h, dict(zip(names, msg.arrays)))

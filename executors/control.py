"""Control messages between the coordinator and the CompNode executors.

A control message is a wire message of kind ``"ctrl"`` whose header has an
``op`` and whose tensors are named by the header's ``names`` list. The
conversation of one run::

    executor -> coordinator   hello {part, address, pid, engine}
    coordinator -> executor   setup {peers: {part: address}, emulate_links, resume_step, checkpoint_dir}
    executor -> coordinator   ready {part}
    coordinator -> executor   step {it, want_grads, checkpoint}   tensors "<micro-batch>/<placeholder>"
    executor -> coordinator   done {it, losses: [[mb, loss]], stats}   tensors: parameter gradients if asked
    coordinator -> executor   fetch {}                            executor -> coordinator  state {}  tensors: parameters
    coordinator -> executor   stop {} | abort {reason}
    either way                hb {}  (heartbeat; any message counts as a sign of life)
    executor -> coordinator   error {reason}

Unknown ops, missing fields and mismatched tensor names are rejected with
:class:`~fusion.ir.errors.WireError`, like any other malformed message.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from ..ir.errors import WireError
from ..ir.wire import Message, encode

#: op -> header fields it must carry
OPS: dict[str, tuple[str, ...]] = {
    "hello": ("part", "address", "pid", "engine"),
    "setup": ("peers", "emulate_links", "resume_step", "checkpoint_dir"),
    "ready": ("part",),
    "step": ("it", "want_grads", "checkpoint"),
    "done": ("it", "losses", "stats"),
    "fetch": (),
    "state": (),
    "stop": (),
    "abort": ("reason",),
    "hb": (),
    "error": ("reason",),
}


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


def decode_ctrl(msg: Message) -> Control:
    """The control message in ``msg``; raises WireError when malformed."""
    if msg.kind != "ctrl":
        raise WireError(f"message kind {msg.kind!r} is not a control message")
    h = dict(msg.header)
    op = h.pop("op", None)
    if op not in OPS:
        raise WireError(f"unknown control op {op!r}")
    missing = [f for f in OPS[op] if f not in h]
    if missing:
        raise WireError(f"control message {op!r} lacks fields {missing}")
    names = h.pop("names", [])
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
        raise WireError(f"control message {op!r}: 'names' must be a list of distinct strings")
    if len(names) != len(msg.arrays):
        raise WireError(f"control message {op!r} names {len(names)} tensors but carries {len(msg.arrays)}")
    return Control(op, h, dict(zip(names, msg.arrays)))

"""One message per destination part per action (issue 35): everything one forward or backward action of a part
sends to one other part travels as one message, so a message's fixed costs (its header, the transport's per-message
work, and on a link that serialises messages its latency) are paid once per (action, destination), not once per
tensor.

A subspace cut (``fusion compile --subspace``) sends the stream's k coordinates *and* the token ids the receiver
rebuilds the fixed table's share from: two OP-Data of one micro-batch from the same part to the same part. On the
studies' serial clock the ids' own message cost a second latency per micro-batch (0.16 s of the subspace study's
0.524 s step on an 80 ms link); on the runtime's links the latency of back-to-back messages overlaps, so there it
was one message's overhead (docs/compression.md, "Subspace: measured"). A group of one is the plain ``opdata`` message, byte for byte as before; a group of several is one
``opbatch`` message (:func:`fusion.ir.wire.encode_opbatch`) whose items keep their payloads' bytes.
"""
from __future__ import annotations

from typing import Any, Sequence

from fusion.ir.opdata import OpData
from fusion.ir.wire import encode_opbatch, encode_opdata


def by_destination(out: Sequence[OpData]) -> list[list[OpData]]:
    """``out`` (what one action sends) grouped by destination part, groups in the order of their first OP-Data and
    the OP-Data of a group in their order in ``out``."""
    groups: dict[str, list[OpData]] = {}
    for od in out:
        groups.setdefault(od.dst, []).append(od)
    return list(groups.values())


def message_frames(group: Sequence[OpData]) -> list[Any]:
    """The wire frames of one group: an ``opdata`` message for one OP-Data, an ``opbatch`` message for several."""
    return encode_opdata(group[0]) if len(group) == 1 else encode_opbatch(group)


def message_label(prefix: str, group: Sequence[OpData]) -> str:
    """The transport's label of a group's message (traces, link emulation): ``"F0 add_2_coords+idx"``."""
    return f"{prefix} {'+'.join(od.name for od in group)}"

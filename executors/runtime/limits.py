"""Message size limits derived from the plan: a link accepts what the plan says it carries, plus headroom.

A CompNode receives activations and gradients of its boundary tensors, the
gradients of tied parameters, and the coordinator's ``step`` (its
placeholders for every micro-batch); the coordinator receives each part's
``done`` (its parameter gradients when asked) and ``state`` (its parameters).
What one forward or backward action of a peer sends this part is one message (``packing.py``), so an
activation's or gradient's share is the sum of the tensors one peer sends per action. The largest of these, times
:data:`HEADROOM` (data batches larger than the
plan's example, header overhead), floored at :data:`FLOOR_BYTES`, is the
receiver's limit, for a whole message: a 2 GiB frame to a part whose
largest tensor is 64 KiB is dropped by ZeroMQ when it reads the frame's
length (``ZMQ_MAXMSGSIZE`` is per frame), and a message of many frames each
under the limit is refused by the transport by its total
(:func:`fusion.executors.runtime.transport.recv_bounded`), which also bounds
its frame count. ZeroMQ assembles a multipart message whole before handing
it over; the process never keeps more than one message's bound of it.
"""
from __future__ import annotations

import math

from fusion.ir.boundary import partition
from fusion.ir.node import NodeKind, TensorMeta
from fusion.plan import Plan

HEADROOM = 4
FLOOR_BYTES = 8 << 20
_ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2, "int8": 1,
             "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16}
VALUE_BYTES = 64 << 10  # a non-tensor value (ints, shapes) travels in the header


def _bytes(meta) -> int:
    if not isinstance(meta, TensorMeta):
        return VALUE_BYTES
    return math.prod(meta.shape) * _ITEMSIZE.get(meta.dtype, 8)


def _limit(n: int) -> int:
    return max(FLOOR_BYTES, HEADROOM * n)


def part_message_limit(plan: Plan, part: str) -> int:
    """The largest message ``part`` should receive, with headroom (bytes)."""
    g = plan.graph
    sub = partition(g, plan.assignment)[part]
    b = sub.boundary
    # activations in, gradients of what it sends back in: what one action of one peer sends here is one message
    # (packing.py), so per peer the sum of the distinct tensors it sends
    per_peer: dict[tuple[str, bool], dict] = {}
    for e in b.required_acts:
        per_peer.setdefault((plan.assignment[e.producer], False), {})[e.key] = _bytes(g.output_meta(e.producer, e.index))
    for e in b.sent_acts:
        per_peer.setdefault((plan.assignment[e.actual_user], True), {})[e.key] = _bytes(g.output_meta(e.producer, e.index))
    biggest = max((sum(t.values()) for t in per_peer.values()), default=0)
    for n in sub.nodes:
        for p in g[n].param_names():  # a tied parameter's gradient from a co-owner
            biggest = max(biggest, _bytes(TensorMeta(tuple(g.params[p].shape), g.params[p].dtype)))
    feeds = sum(_bytes(g[n].meta.outputs[0]) if g[n].meta and g[n].meta.outputs else VALUE_BYTES
                for n in sub.nodes if g[n].kind in (NodeKind.INPUT, NodeKind.LABEL))
    biggest = max(biggest, feeds * plan.micro_batches)
    return _limit(biggest)


def coordinator_message_limit(plan: Plan) -> int:
    """The largest ``done``/``state`` message a part should send the coordinator: all its parameters, with headroom."""
    g = plan.graph
    biggest = 0
    for part, sub in partition(g, plan.assignment).items():
        names = {p for n in sub.nodes for p in g[n].param_names()}
        biggest = max(biggest, sum(_bytes(TensorMeta(tuple(g.params[p].shape), g.params[p].dtype)) for p in names))
    return _limit(biggest)


def allreduce_message_limit(buckets, group_size: int) -> int:
    """The largest ring all-reduce chunk a part of a data-parallel group of ``group_size`` receives, with headroom."""
    biggest = max((-(-b.total // group_size)) * _ITEMSIZE.get(b.dtype, 8) for b in buckets) if buckets else 0
    return _limit(biggest)

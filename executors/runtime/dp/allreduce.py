"""Ring or tree all-reduce of parameter gradients between a stage's data-parallel replicas (NumPy, over the transport).

The G CompNodes of one stage (one per replica, ordered by replica: ``Plan.dp_group``) average their
parameter gradients every step before the optimizer steps, so every replica applies the same
update and training equals single-process training on the global batch. The gradients of the
part's trainable parameters are laid end to end in one flat buffer per dtype (a *bucket*, names in
sorted order), each bucket split into G chunks, and reduced by the ring algorithm
(Patarasuk & Yuan 2009; what NCCL and Horovod do): ``G - 1`` reduce-scatter steps, in which rank i
sends chunk ``(i - k) mod G`` to rank ``i + 1`` and adds the chunk ``(i - k - 1) mod G`` it gets from
rank ``i - 1``, leave rank i holding the full sum of chunk ``(i + 1) mod G``; it divides that by G and
``G - 1`` all-gather steps pass the averaged chunks round. Each rank sends ``2 (G - 1) / G`` of the
buffer whatever G is. Every rank ends with the
same bits (each chunk is summed once, on its owner, then copied).

Two replicas skip the ring: each sends its whole buffer to the other and both compute
``(a + b) / 2`` (IEEE addition is commutative, so the two get the same bits). On full-duplex links
that moves the same bytes as the two-step ring in one step: one latency instead of two.

Messages are wire messages of kind ``"allreduce"`` (header ``it, bucket, step, chunk, src, dst, group``,
``payload``: the chunk as the wire carries any payload, :func:`fusion.ir.wire.encode_payload`; dense, one
1-D tensor). ``group`` is the sender's group (its members in rank order): after a replica is dropped (or
joins) the members rebuild the ring one after another, and a member that did so first may already send in
the new group while this one still runs the old (the same iteration, the same step numbers). A message for
another group that names both the sender and this part raises :class:`NotYourTurn`: the CompNode keeps it
for the group it regroups into next. For this group, a receiver accepts one only from its ring predecessor
(the tree: the rank the step names), for the current iteration, with the chunk, dtype and length that step
must carry, and not twice; anything else raises :class:`~fusion.ir.errors.WireError` (the transport logs and
drops it, nothing is applied). In particular a message from a CompNode outside the group is rejected by name.

Codec (``Plan.dp_codec``, ``--dp-codec quant:bits=8``): every chunk travels encoded by a codec of the
registry that may serve data-parallel gradients (``Role.DP_GRADIENT``: block quantisation,
:mod:`fusion.kernels.codecs.quant`, or a user codec; host paths, NumPy, so NumPy CompNodes take part);
the receiver adds the decoded chunk. The averaged chunks are quantised once, by their owner, which keeps the *decoded* values
itself, and forwarded unchanged round the ring, so the replicas still hold the same bits; the
gradient is then the average to within the codec's step (lossy: not equal to single-process
training). Two replicas each send ``quant(own)`` and both average the two decoded buffers.

Tree (``Plan.dp_algo[stage] == "tree"``, ``--dp-allreduce tree|auto``): a binomial-tree reduce to
rank 0 followed by a binomial-tree broadcast from it (Thakur, Rabenseifner & Gropp 2005, the
short-message algorithm of MPICH), any group size. With ``L = ceil(log2 G)``, reduce step k
(0 .. L-1): rank r with ``r mod 2^(k+1) == 2^k`` sends its partial sum to ``r - 2^k``, which adds it;
rank 0 then holds the sum, in one fixed order (``((x0 + x1) + (x2 + x3)) + ...``), divides it by G,
and broadcast step ``L + j`` (k = L-1-j) sends it from r to ``r + 2^k``. Every message is the whole
bucket (chunk 0), so a rank sends at most ``L + 1`` buffers and the step costs ``2 L`` latencies
instead of the ring's ``2 (G - 1)``: the cheaper choice when latency dominates (many replicas,
small gradients, far links), the dearer one when bandwidth does. Every rank ends with rank 0's
bits (summed once there, then copied). A receiver accepts a step's message only from the rank
the schedule names for that step (:func:`tree_steps`). With the codec the partial sums travel
quantised, rank 0 quantises the average once and keeps the decoded values, and the broadcast
forwards those bytes unchanged: the replicas still hold the same bits.

Overlap: the stages finish their backward one after the other (the last stage first), so a
stage's all-reduce runs while the stages before it still compute their backward; ZeroMQ's I/O
thread moves each chunk while the engine loop adds the previous one.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from fusion.ir.errors import FusionError, WireError
from fusion.ir.wire import Message, decode_payload, encode_payload
from fusion.executors.runtime.dp.header import KIND, ChunkHeader
from fusion.executors.runtime.step_ahead import accepts, expected_text
from fusion.kernels.codecs.base import Role
from fusion.kernels.codecs.registry import FlatCodec

log = logging.getLogger(__name__)

#: the all-reduce algorithms (``Plan.dp_algo``); a group without an entry runs the ring
ALGOS = ("ring", "tree")
#: gradient dtypes the ring adds (bfloat16 travels as raw bits and cannot be added as such)
REDUCIBLE = frozenset({"float16", "float32", "float64"})


def chunk_bounds(total: int, g: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` of each of ``g`` chunks of a ``total``-long buffer (sizes differ by at most one)."""
    base, extra = divmod(total, g)
    out, lo = [], 0
    for c in range(g):
        hi = lo + base + (1 if c < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


def ring_steps(g: int, rank: int) -> list[tuple[int, int, bool]]:
    """Rank ``rank``'s steps: ``(chunk it sends, chunk it receives, add (reduce-scatter) or copy (all-gather))``."""
    rs = [((rank - k) % g, (rank - k - 1) % g, True) for k in range(g - 1)]
    ag = [((rank + 1 - k) % g, (rank - k) % g, False) for k in range(g - 1)]
    return rs + ag


def tree_depth(g: int) -> int:
    """L = ceil(log2 g): the steps of a binomial-tree reduce (and of its broadcast)."""
    return max(0, (g - 1).bit_length())


def tree_steps(g: int, rank: int) -> list[tuple[str, int, bool] | None]:
    """Rank ``rank``'s ``2 L`` tree steps: ``("send" | "recv", peer rank, add (reduce) or copy (broadcast))``
    or None where it is idle. Steps 0 .. L-1 reduce towards rank 0, steps L .. 2L-1 broadcast from it."""
    depth = tree_depth(g)
    out: list[tuple[str, int, bool] | None] = []
    for k in range(depth):  # reduce: the rank 2^k above a multiple of 2^(k+1) hands its partial sum down
        half = 1 << k
        if rank % (2 * half) == half:
            out.append(("send", rank - half, True))
        elif rank % (2 * half) == 0 and rank + half < g:
            out.append(("recv", rank + half, True))
        else:
            out.append(None)
    for k in reversed(range(depth)):  # broadcast: the same edges the other way, widest first
        half = 1 << k
        if rank % (2 * half) == 0 and rank + half < g:
            out.append(("send", rank + half, False))
        elif rank % (2 * half) == half:
            out.append(("recv", rank - half, False))
        else:
            out.append(None)
    return out


@dataclass(frozen=True)
class Bucket:
    """The gradients of one dtype laid end to end: ``names`` (sorted) with their shapes and offsets."""

    dtype: str
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    @property
    def sizes(self) -> list[int]:
        return [int(np.prod(s, dtype=np.int64)) for s in self.shapes]

    @property
    def total(self) -> int:
        return sum(self.sizes)


def make_buckets(params: Mapping[str, tuple[Sequence[int], str]]) -> list[Bucket]:
    """Buckets for trainable parameters ``name -> (shape, dtype)``; raises FusionError for a dtype the ring cannot add."""
    by: dict[str, list[str]] = {}
    for name in sorted(params):
        shape, dtype = params[name]
        if dtype not in REDUCIBLE:
            raise FusionError(f"parameter {name!r} is {dtype}: data-parallel gradient averaging needs one of "
                              f"{sorted(REDUCIBLE)}")
        by.setdefault(dtype, []).append(name)
    return [Bucket(d, tuple(ns), tuple(tuple(int(x) for x in params[n][0]) for n in ns)) for d, ns in sorted(by.items())]


def encode_chunk(it: int, bucket: int, step: int, chunk: int, src: str, dst: str, data: Any,
                 group: Sequence[str]) -> list[Any]:
    """Frames of one ring message; ``data`` a 1-D array or any payload the wire carries (a codec's, as
    :class:`~fusion.kernels.codecs.registry.FlatCodec` made it); ``group`` the sender's group in rank order."""
    meta, arrays = encode_payload(data)
    return ChunkHeader(it, bucket, step, chunk, src, dst, tuple(group)).frames(meta, arrays)


def _payload(msg: Message) -> Any:
    """The chunk a ring message carries, as the wire decodes it (WireError for a malformed one)."""
    try:
        return decode_payload(msg.header.get("payload", {"type": "dense"}), list(msg.arrays))
    except WireError as e:
        raise WireError(f"all-reduce message: {e}") from None


def _nat(h: dict, key: str) -> int:
    v = h.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise WireError(f"all-reduce message: field {key!r} must be an integer >= 0, got {repr(v)[:40]}")
    return v


class NotYourTurn(WireError):
    """An all-reduce message sent in another group than this part's (its header's ``group``), naming both its
    sender and this part: after a replica is dropped, a survivor that regrouped first sends in the new group
    before this part has regrouped. The CompNode keeps it for its next group (:meth:`CompNode._new_ring`)
    instead of losing it."""


def check_group(header: Mapping[str, Any], group: Sequence[str], me: str, sender: str, what: str,
                stage: Sequence[str] | None = None) -> None:
    """Raise unless ``sender`` is a member of ``group`` (this part's, rank order) and ``header`` says it was sent
    in it: :class:`NotYourTurn` for another group of ``stage``'s parts (the plan's replicas of this part's stage;
    default ``group``) holding ``sender`` and ``me``, a regroup this part has not made yet; WireError for
    anything else."""
    g = header.get("group")
    names = isinstance(g, list) and all(isinstance(x, str) for x in g)
    if names and g != list(group) and sender in g and me in g and set(g) <= set(stage or group):
        raise NotYourTurn(f"{what} from {sender!r} sent in the group {g}; {me}'s group is {list(group)}")
    if sender not in group:
        raise WireError(f"{what} from {sender!r}, which is not in {me}'s data-parallel group {list(group)}")
    if g != list(group):
        raise WireError(f"{what} from {sender!r} says it was sent in the group {repr(g)[:80]}; {me}'s group is "
                        f"{list(group)}")


class RingInbox:
    """What one CompNode accepts of its group's all-reduce messages (not thread-safe: the CompNode locks it).

    me: this part; group: its data-parallel group in rank order (replica order), ``me`` included;
    buckets: as :func:`make_buckets` of this part's parameters (the same on every replica);
    codec: the plan's ``dp_codec`` (``{"algo": "quant", "bits": 8, ...}``, any codec serving ``Role.DP_GRADIENT``)
           or None (dense chunks);
    algo: ``"ring"`` (two replicas: one exchange) or ``"tree"`` (binomial reduce + broadcast);
    stage: every replica's part of this stage in the plan, the members any later group may have (default: group).
    """

    def __init__(self, me: str, group: Sequence[str], buckets: Sequence[Bucket], codec: Mapping[str, Any] | None = None,
                 algo: str = "ring", stage: Sequence[str] | None = None):
        if algo not in ALGOS:
            raise FusionError(f"all-reduce algorithm {algo!r}: expected one of {list(ALGOS)}")
        self.me, self.group, self.buckets = me, list(group), list(buckets)
        self.stage = list(stage) if stage is not None else self.group
        self.codec = dict(codec) if codec else None
        self.flat = FlatCodec(self.codec, Role.DP_GRADIENT)  # the chunks' codec (dense: a copy)
        self.algo = algo
        self.g = len(self.group)
        self.rank = self.group.index(me)
        self.prev = self.group[(self.rank - 1) % self.g]
        self.next = self.group[(self.rank + 1) % self.g]
        self.exchange = algo == "ring" and self.g == 2  # two replicas: one whole-buffer exchange, not a two-step ring
        if algo == "tree":
            self.steps: list = tree_steps(self.g, self.rank)
            self.chunks = 1
        else:
            self.steps = [(0, 0, True)] if self.exchange else ring_steps(self.g, self.rank)
            self.chunks = 1 if self.exchange else self.g
        self.bounds = [chunk_bounds(b.total, self.chunks) for b in self.buckets]
        self.expected_iter = 0
        self._got: dict[tuple[int, int, int], np.ndarray] = {}

    @property
    def neighbours(self) -> set[str]:
        """The parts this one links to: every other member of the group, for the ring as for the tree. A
        dropped replica makes the survivors rebuild the ring or tree over themselves, and its new edges
        join parts that were not neighbours before (in a ring of four that loses one, the dropped part's
        predecessor now sends to its successor); :meth:`accept` still takes each step only from the one
        rank the schedule names."""
        return set(self.group) - {self.me}

    def _expected_chunk(self, sender: str, step: int) -> int:
        """The chunk ``sender``'s message of ``step`` must carry (WireError when it may not send one)."""
        if step >= len(self.steps):
            raise WireError(f"all-reduce message for step {step}; a {self.algo} of {self.g} has {len(self.steps)}")
        if self.algo == "ring":
            return self.steps[step][1]
        s = self.steps[step]
        if s is None or s[0] != "recv":
            raise WireError(f"all-reduce message from {sender!r} for step {step}; in the tree {self.me} receives "
                            "nothing at that step")
        if self.group[s[1]] != sender:
            raise WireError(f"all-reduce message from {sender!r} for step {step}; in the tree {self.me} takes that "
                            f"step from {self.group[s[1]]!r} only")
        return 0

    def accept(self, sender: str, msg: Message) -> None:
        """Keep an all-reduce message from ``sender`` or raise WireError saying why not (NotYourTurn: sent in
        another group, see :func:`check_group`)."""
        check_group(msg.header, self.group, self.me, sender, "all-reduce message", self.stage)
        if self.algo == "ring" and sender != self.prev:
            raise WireError(f"all-reduce message from {sender!r}; in the ring {self.me} takes them from {self.prev!r} only")
        h = msg.header
        if h.get("src") != sender or h.get("dst") != self.me:
            raise WireError(f"all-reduce message says {h.get('src')!r}->{h.get('dst')!r} but came {sender!r}->{self.me!r}")
        it, b, step, chunk = (_nat(h, k) for k in ("it", "bucket", "step", "chunk"))
        if not accepts(it, self.expected_iter):  # (a replica one step ahead: ..step_ahead)
            raise WireError(f"all-reduce message for iteration {it}, {expected_text(self.expected_iter)}")
        if b >= len(self.buckets):
            raise WireError(f"all-reduce message for bucket {b}; this part has {len(self.buckets)}")
        want = self._expected_chunk(sender, step)
        if chunk != want:
            raise WireError(f"all-reduce step {step} carries chunk {want}, not {chunk}")
        a = _payload(msg)
        what = f"all-reduce chunk {chunk} of bucket {b}"
        if isinstance(a, np.ndarray) == bool(self.codec):
            raise WireError(f"{what} is {'dense' if isinstance(a, np.ndarray) else 'encoded'}; this group "
                            f"sends {'encoded' if self.codec else 'dense'} chunks")
        lo, hi = self.bounds[b][chunk]
        # a payload that says its shape is checked as it came; a user codec's says it by decoding (a refused or
        # foreign one: WireError); either is kept as it came
        seen = a if hasattr(a, "shape") and self.flat.owns(a) else self.flat.decode(a, what)
        shape, dtype = (tuple(seen.shape), seen.dtype if isinstance(seen.dtype, str) else seen.dtype.name)
        if len(shape) != 1 or shape[0] != hi - lo or dtype != self.buckets[b].dtype:
            raise WireError(f"all-reduce chunk {chunk} of bucket {b} is {dtype}{list(shape)}, expected "
                            f"{self.buckets[b].dtype}[{hi - lo}]")
        key = (it, b, step)
        if key in self._got:
            raise WireError(f"duplicate all-reduce message (iteration {it}, bucket {b}, step {step})")
        self._got[key] = a

    def take(self, it: int, bucket: int, step: int) -> np.ndarray | None:
        return self._got.pop((it, bucket, step), None)

    def finish(self, it: int) -> None:
        """Iteration ``it`` is over: messages of ``it + 1`` (and the step after it, :mod:`..step_ahead`) are accepted
        from now on; what arrived early for ``it + 1`` is kept."""
        self.expected_iter = it + 1
        for k in [k for k in self._got if k[0] <= it]:
            del self._got[k]


def flatten(bucket: Bucket, grads: Mapping[str, Any]) -> np.ndarray:
    """The bucket's gradients end to end (a missing gradient counts as zeros)."""
    out = np.zeros(bucket.total, dtype=bucket.dtype)
    lo = 0
    for name, size in zip(bucket.names, bucket.sizes):
        g = grads.get(name)
        if g is not None:
            out[lo:lo + size] = np.asarray(g, dtype=bucket.dtype).reshape(-1)
        lo += size
    return out


def unflatten(bucket: Bucket, flat: np.ndarray) -> dict[str, np.ndarray]:
    out, lo = {}, 0
    for name, size, shape in zip(bucket.names, bucket.sizes, bucket.shapes):
        out[name] = flat[lo:lo + size].reshape(shape)
        lo += size
    return out


def ring_average(inbox: RingInbox, it: int, buffers: list[np.ndarray], send: Callable[[str, list, str], None],
                 wait: Callable[[Callable[[], Any], str], Any], only: Sequence[int] | None = None) -> None:
    """Average ``buffers`` (one per bucket, changed in place) over the ring of ``inbox``.

    send(peer, frames, label) hands a message to the transport; wait(ready, what) receives until
    ``ready()`` is not None and returns it (raising on abort, silence or timeout). only: the bucket
    indices ``buffers`` are (default: every bucket, in order; DiLoCo's streaming fragments average a few).
    """
    g = inbox.g
    if g == 1:
        return
    codec = inbox.codec
    enc, dec = inbox.flat.encode, inbox.flat.decode
    index = list(range(len(buffers)) if only is None else only)

    if inbox.exchange:
        mine = [enc(buf) for buf in buffers]
        for b, q in zip(index, mine):
            send(inbox.next, encode_chunk(it, b, 0, 0, inbox.me, inbox.next, q, inbox.group), f"allreduce b{b}")
        for i, (b, buf) in enumerate(zip(index, buffers)):
            got = wait(lambda: inbox.take(it, b, 0), f"all-reduce of bucket {b} from {inbox.prev}")
            if codec:  # both sides average the two decoded buffers: the same bits on both
                buf[:] = dec(mine[i], "own chunk")
            buf += dec(got, f"all-reduce of bucket {b}")
            buf /= 2
        return
    for b, buf in zip(index, buffers):
        bounds = inbox.bounds[b]
        forward = None  # in the all-gather, what arrived is passed on as it came (no re-encoding)
        for step, (send_c, recv_c, reduce) in enumerate(inbox.steps):
            lo, hi = bounds[send_c]
            if forward is not None:
                payload = forward
            else:
                payload = enc(buf[lo:hi])
                if codec and not reduce:  # the owner's averaged chunk: keep what the others will decode
                    buf[lo:hi] = dec(payload, "own chunk")
            send(inbox.next, encode_chunk(it, b, step, send_c, inbox.me, inbox.next, payload, inbox.group), f"allreduce b{b} s{step}")
            got = wait(lambda: inbox.take(it, b, step), f"all-reduce step {step} of bucket {b} from {inbox.prev}")
            lo, hi = bounds[recv_c]
            if reduce:
                buf[lo:hi] += dec(got, f"all-reduce step {step} of bucket {b}")
                if step == g - 2:  # the last reduce-scatter step: this rank now holds the full sum of recv_c
                    buf[lo:hi] /= g
            else:
                buf[lo:hi] = dec(got, f"all-reduce step {step} of bucket {b}")
                forward = got


def tree_average(inbox: RingInbox, it: int, buffers: list[np.ndarray], send: Callable[[str, list, str], None],
                 wait: Callable[[Callable[[], Any], str], Any], only: Sequence[int] | None = None) -> None:
    """Average ``buffers`` (one per bucket, changed in place) by the binomial tree of ``inbox`` (module docstring).

    send, wait and only as :func:`ring_average`. At each step this rank sends (or receives) every bucket whole.
    """
    g = inbox.g
    if g == 1:
        return
    codec = inbox.codec
    enc, dec = inbox.flat.encode, inbox.flat.decode
    index = list(range(len(buffers)) if only is None else only)

    depth = tree_depth(g)
    forward: list[Any] | None = None  # in the broadcast, what this rank passes on (the bytes it got, unchanged)
    for step, act in enumerate(inbox.steps):
        if step == depth and inbox.rank == 0:  # rank 0 holds the sum of every rank: average it, once
            forward = []
            for buf in buffers:
                buf /= g
                payload = enc(buf)
                if codec:  # keep what the others will decode
                    buf[:] = dec(payload, "own chunk")
                forward.append(payload)
        if act is None:
            continue
        kind, peer, reduce = act
        name = inbox.group[peer]
        if kind == "send":
            for i, (b, buf) in enumerate(zip(index, buffers)):
                payload = enc(buf) if reduce else forward[i]
                send(name, encode_chunk(it, b, step, 0, inbox.me, name, payload, inbox.group), f"allreduce b{b} t{step}")
            continue
        got_all = []
        for b, buf in zip(index, buffers):
            got = wait(lambda: inbox.take(it, b, step), f"all-reduce tree step {step} of bucket {b} from {name}")
            if reduce:
                buf += dec(got, f"all-reduce tree step {step} of bucket {b}")
            else:
                buf[:] = dec(got, f"all-reduce tree step {step} of bucket {b}")
                got_all.append(got)
        if not reduce:
            forward = got_all


def average(inbox: RingInbox, it: int, buffers: list[np.ndarray], send: Callable[[str, list, str], None],
            wait: Callable[[Callable[[], Any], str], Any], only: Sequence[int] | None = None) -> None:
    """Average ``buffers`` (the buckets ``only``, default all) over the group of ``inbox`` by its algorithm."""
    (tree_average if inbox.algo == "tree" else ring_average)(inbox, it, buffers, send, wait, only)

"""DiLoCo's outer loop over a stage's data-parallel replicas (Douillard et al. 2023, Algorithm 1; ``Plan.dp_sync``).

With ``dp_sync.mode == "diloco"`` the replicas of a stage do not average gradients every step. Each takes
its inner steps with the plan's optimizer (its own state, kept across outer steps, as in DiLoCo), and after
every H-th step (H = ``dp_sync.inner_steps``, counted in completed global steps, so a resumed run meets the
same boundaries) each replica r forms its *pseudo-gradient*

    Delta_r = theta_global - theta_r                  (parameter dtype, float32 for float32 parameters,
                                                       as the reference implementations compute it)

the group averages it, weighted by the samples each replica saw since the last outer step (equal shares:
the plain mean), and every replica applies the *outer* optimizer, SGD with (Nesterov) momentum in
``torch.optim.SGD``'s formulas, to its copy of the global weights, in NumPy (so torch and NumPy CompNodes
take part alike)::

    v = mu * v + Delta
    step = Delta + mu * v   if nesterov   else   v
    theta_global -= outer_lr * step

and continues its inner steps from the new global weights. Every replica holds the same bits of
theta_global and v (the averaged Delta is the same bits everywhere, and the update is the same arithmetic).

Exact averaging runs the stage's ring or tree all-reduce (:mod:`.allreduce`) on the flat pseudo-gradient
buckets, on the same wire. With a lossy pseudo-gradient codec (``dp_sync.codec``: ``quant`` of 8 or 4 bits,
or ``topk``), each replica encodes its own pseudo-gradient (plus, with ``error_feedback``, the residual it
did not send last time, weighted by the codec's ``feedback_decay``: SparseLoCo's beta, 1 for the others) once
and sends the same payload to every other member of its group; every replica
decodes all payloads and sums them in replica order, so all apply the same bits (as ``TiedCodec`` does for
tied gradients). These messages are wire messages of kind ``"allreduce"`` whose header carries
``"gather": true`` and the sender's ``group`` (:class:`PseudoInbox` accepts them: from a member of the group,
sent in this group, for the current iteration, of the bucket's dtype and length, once each; one sent in a
group this part has not regrouped into yet is kept for it, as the ring's are).

Streaming fragments (``dp_sync.fragments`` F, :func:`fragment_buckets`): the parameters in F runs, fragment
f's outer step after the steps t with ``t % H == (f H) // F``; unequal shares (``dp_sync.shares``,
:func:`share_micro_batches`): each replica takes its share of every global batch's micro-batches and the
average weighs its pseudo-gradient by the samples it saw.

Overlapped outer steps (``dp_sync.delay`` 1): the exchange of a round runs while the next H inner steps
compute, as in Kale, Douillard and Donchev 2025 ("Eager Updates For Overlapped Communication and Computation
in DiLoCo", arXiv 2502.12996) and Streaming DiLoCo's overlap (Douillard et al. 2025, arXiv 2501.18512) with
tau = H. ``dp_sync.overlap`` picks how the round in flight is used; with ``x_r`` this replica's weights,
``a_r`` their value at the start of its window and ``w`` the group's sample shares (1/R each when equal), at
the boundary that ends window t (per fragment):

* ``"eager"`` (:meth:`OuterLoop.eager_step`, the paper's eager updates; ``fusion compile``'s default for delay 1,
  with outer momentum 0: with Nesterov momentum and the one-round lag it converged worse than the delayed step,
  without it better, docs/data-parallel.md "Eager by default"): each
  replica keeps its own copy theta_r of the global weights and its own momentum, and applies its own fresh
  pseudo-gradient at once as a proxy for the round still in flight::

      Delta_r^t = a_r - x_r,   a_r = theta_r                       (the window's own progress)
      theta_r   = outer(theta_r, w_r Delta_r^t + sum_{k != r} w_k Delta_k^{t-1})   (none at t = 1: zero)
      send Delta_r^t (+ residual, encoded) to the group, without waiting
      x_r = a_r = theta_r

  The replicas' theta_r are no longer the same bits (each sees its own round t beside the others' t-1).
* ``"delayed"`` (:meth:`OuterLoop.delayed_step`, the naive delayed outer gradients, the default; what every
  plan with delay 1 written before ``overlap`` existed runs)::

      Delta_r^t     = a_r - x_r
      theta_global  = outer(theta_global, sum_k w_k Delta_k^{t-1})  (round t-1, received during window t)
      send Delta_r^t (+ residual, encoded) to the group, without waiting
      x_r = a_r = theta_global - Delta_r^t        (rebase: the new global weights plus own progress)

  so every replica's weights are the global weights (one round behind, the same bits everywhere) plus its
  own latest window. Kale et al. report that it converges worse than the eager variant
  (docs/data-parallel.md has this repository's measurement).

Nothing waits for the slow link as long as a round's exchange takes less than H inner steps. After a
regroup the shares are renormalised over the survivors (a dropped replica's round is left out). The
exchange is an all-gather of each replica's (encoded) pseudo-gradient, also when exact (dense float32, summed in group
order): a ring would need the engine loop at every hop; each message is handed to the transport's send
queue (ZeroMQ's I/O thread or the link's sender thread moves it, :mod:`.transport`) and the peers'
messages wait in :class:`DelayedInbox` until the next boundary. A round still in flight when the run
ends is collected and applied when the coordinator fetches the weights (:meth:`OuterLoop.flushed`: delayed,
the group's average, so a run that ends at a boundary returns the global weights; eager, the others' terms
alone, so it returns the fetched replica's copy of them, replica 0's for a coordinator's fetch); a
checkpoint holds each fragment's round in flight (the encoded input and the round number) and the anchors,
and a resumed replica sends its round again as soon as it is set up (the eager step needs no more state:
its own term is the fresh window's, the others' come from their rounds).

:func:`encode_pseudo` / :func:`decode_pseudo` are the one place pseudo-gradients are encoded and decoded: by
the codec registry's unit of ``dp_sync.codec`` (any codec serving the pseudo-gradient role: quant,
hadamard-quant, topk or a user codec), its payload carried as the wire carries OP-Data payloads.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from fusion.ir.errors import FusionError, WireError
from fusion.ir.wire import Message, decode_payload, encode_payload
from fusion.executors.runtime.dp.header import DelayedHeader, PseudoHeader
from fusion.executors.runtime.step_ahead import accepts, expected_text
from fusion.executors.runtime.dp.allreduce import (Bucket, RingInbox, average, check_group, flatten, make_buckets,
                                                unflatten)
from fusion.kernels.codecs.base import Role
from fusion.kernels.codecs.registry import FlatCodec

log = logging.getLogger(__name__)

def pseudo_feedback_decay(cfg: Mapping[str, Any] | None) -> float:
    """The weight of a replica's unsent residual in its next pseudo-gradient under ``cfg``'s codec (its
    ``feedback_decay``: SparseLoCo's beta; 1 for the others and for dense averaging)."""
    if cfg is None:
        return 1.0
    from fusion.kernels.codecs import CODECS

    return float(CODECS.unit(cfg["algo"]).feedback_decay(cfg))


def fragment_buckets(params: Mapping[str, tuple[Sequence[int], str]], fragments: int
                     ) -> tuple[list[Bucket], list[list[int]]]:
    """Streaming DiLoCo's fragments of a part's trainable parameters ``name -> (shape, dtype)``: the names in
    sorted order cut into ``fragments`` contiguous runs of about equal size (a name goes to fragment
    ``floor(F * elements before it / all elements)``), each run bucketed by dtype (:func:`make_buckets`).
    Returns (every fragment's buckets, fragment 0's first; fragment -> its bucket indices). One fragment is
    ``make_buckets(params)`` itself."""
    names = sorted(params)
    sizes = [int(np.prod(params[n][0], dtype=np.int64)) for n in names]
    total = max(1, sum(sizes))
    groups: list[list[str]] = [[] for _ in range(fragments)]
    before = 0
    for n, size in zip(names, sizes):
        groups[min(fragments - 1, before * fragments // total)].append(n)
        before += size
    buckets: list[Bucket] = []
    index: list[list[int]] = []
    for g in groups:
        bs = make_buckets({n: params[n] for n in g})
        index.append(list(range(len(buckets), len(buckets) + len(bs))))
        buckets += bs
    return buckets, index


def share_micro_batches(total: int, replicas: int, shares: Mapping[int, float]) -> list[int]:
    """Micro-batches of each replica per step when ``dp_sync.shares`` (replica -> relative share, 1 where
    absent) splits a global batch of ``total`` micro-batches unequally: proportional, the remainder to the
    largest fractional parts (ties: lower replica). FusionError when a replica would get none."""
    w = [float(shares.get(r, 1.0)) for r in range(replicas)]
    exact = [total * x / sum(w) for x in w]
    n = [int(e) for e in exact]
    for r in sorted(range(replicas), key=lambda r: (-(exact[r] - n[r]), r))[:total - sum(n)]:
        n[r] += 1
    if min(n) < 1:
        r = n.index(min(n))
        raise FusionError(f"plan.dp_sync.shares: replica {r}'s share {w[r]:g} of {total} micro-batches per step "
                          "gives it none; raise its share or the global batch")
    return n


def replica_micro_batches(plan) -> list[int]:
    """Each replica's micro-batches per step under ``plan.dp_sync`` (equal: ``plan.micro_batches`` each)."""
    if not plan.dp_sync.shares:
        return [plan.micro_batches] * plan.replicas
    return share_micro_batches(plan.micro_batches * plan.replicas, plan.replicas, plan.dp_sync.shares)


def encode_pseudo(flat: np.ndarray, codec: Mapping[str, Any]) -> tuple[dict, list]:
    """One flat pseudo-gradient bucket under ``codec`` (through the codec registry, role pseudo-gradient):
    ``(payload header, frames)`` as the wire carries payloads."""
    return encode_payload(FlatCodec(codec, Role.PSEUDO_GRADIENT).encode(flat))


def decode_pseudo(meta: Any, frames: Sequence[Any], codec: Mapping[str, Any]) -> np.ndarray:
    """The dense flat array of a payload of :func:`encode_pseudo` under ``codec`` (WireError for a malformed one
    or one another codec made)."""
    payload = decode_payload(meta, list(frames))
    return FlatCodec(codec, Role.PSEUDO_GRADIENT).decode(payload, "pseudo-gradient payload").reshape(-1)


def payload_nbytes(frames: Sequence[Any]) -> int:
    """Bytes of a payload's tensor frames (what :func:`encode_pseudo` puts on the wire besides its header)."""
    return int(sum(np.asarray(f).nbytes if isinstance(f, np.ndarray) else len(f) for f in frames))


def outer_update(theta: np.ndarray, v: np.ndarray, delta: np.ndarray, lr: float, mu: float, nesterov: bool) -> None:
    """torch.optim.SGD's step on ``theta`` with gradient ``delta`` and momentum buffer ``v`` (both changed in place).

    The first step sets ``v = delta`` (torch's buffer starts as a copy of the gradient); ``mu == 0`` skips it."""
    if mu:
        v *= mu
        v += delta
        step = delta + mu * v if nesterov else v
    else:
        step = delta
    theta -= lr * step


class PseudoInbox:
    """The encoded pseudo-gradients one CompNode accepts from its group (codec runs; not thread-safe: the
    CompNode locks it). ``ring`` gives the group and the current iteration (``ring.expected_iter``)."""

    def __init__(self, ring: RingInbox, codec: Mapping[str, Any] | None):
        self.ring, self.codec = ring, (dict(codec) if codec else None)
        self._got: dict[tuple[int, int, str], np.ndarray] = {}

    def accept(self, sender: str, msg: Message) -> None:
        r = self.ring
        if sender == r.me:
            raise WireError(f"pseudo-gradient from {sender!r} to itself")
        check_group(msg.header, r.group, r.me, sender, "pseudo-gradient", r.stage)  # NotYourTurn: another group
        h = msg.header
        if h.get("src") != sender or h.get("dst") != r.me:
            raise WireError(f"pseudo-gradient says {h.get('src')!r}->{h.get('dst')!r} but came {sender!r}->{r.me!r}")
        it, b = h.get("it"), h.get("bucket")
        if type(it) is not int or not accepts(it, r.expected_iter):  # (a replica one step ahead: ..step_ahead)
            raise WireError(f"pseudo-gradient for iteration {it!r}, {expected_text(r.expected_iter)}")
        if not isinstance(b, int) or isinstance(b, bool) or not 0 <= b < len(r.buckets):
            raise WireError(f"pseudo-gradient for bucket {b!r}; this part has {len(r.buckets)}")
        if self.codec is None:
            raise WireError(f"encoded pseudo-gradient from {sender}, but {r.me}'s group averages them exactly "
                            "(no dp_sync.codec)")
        key = (it, b, sender)
        if key in self._got:
            raise WireError(f"duplicate pseudo-gradient (iteration {it}, bucket {b}) from {sender}")
        a = decode_pseudo(h.get("payload"), msg.arrays, self.codec)
        want = r.buckets[b]
        if a.shape != (want.total,) or a.dtype.name != want.dtype:
            raise WireError(f"pseudo-gradient of bucket {b} is {a.dtype.name}{list(a.shape)}, expected "
                            f"{want.dtype}[{want.total}]")
        for k in [k for k in self._got if k[0] < r.expected_iter]:  # rounds that are over
            del self._got[k]
        self._got[key] = a

    def take(self, it: int, bucket: int, sender: str) -> np.ndarray | None:
        return self._got.pop((it, bucket, sender), None)


#: a delayed round's pseudo-gradients (``dp_sync.delay`` 1) one sender may have in the inbox per bucket: the
#: round this replica collects next and the one a sender a step ahead has already started
MAX_ROUNDS_HELD = 2


class DelayedInbox:
    """The pseudo-gradients of delayed outer rounds (``dp_sync.delay`` 1, :meth:`OuterLoop.delayed_step`), which
    arrive while this replica takes the next window's inner steps: kept by (round, bucket, sender) until the
    round is collected at its fragment's next boundary (not thread-safe: the CompNode locks it).

    round: the completed-step count of the boundary that started it (the same number on every replica and
    after a resume). group: the stage's whole data-parallel group of the plan (a replica dropped later is
    left out when the round is collected, not here, so a regroup keeps what the survivors sent). Accepted:
    from a member of ``group``, addressed to ``me``, a known bucket, a round not yet collected, at most
    :data:`MAX_ROUNDS_HELD` rounds per sender and bucket, the bucket's dtype and length (the dense buffer
    without a codec, the codec's payload with one), once."""

    def __init__(self, me: str, group: Sequence[str], buckets: Sequence[Bucket], codec: Mapping[str, Any] | None):
        self.me, self.group, self.buckets = me, list(group), list(buckets)
        self.codec = dict(codec) if codec else None
        self._got: dict[tuple[int, int, str], np.ndarray] = {}
        self.collected = [0] * len(self.buckets)  # bucket -> the last round collected (0: none)

    def accept(self, sender: str, msg: Message) -> None:
        if sender not in self.group or sender == self.me:
            raise WireError(f"delayed pseudo-gradient from {sender!r}, which is not in {self.me}'s data-parallel "
                            f"group {self.group}")
        h = msg.header
        if h.get("src") != sender or h.get("dst") != self.me:
            raise WireError(f"delayed pseudo-gradient says {h.get('src')!r}->{h.get('dst')!r} but came "
                            f"{sender!r}->{self.me!r}")
        rnd, b = h.get("round"), h.get("bucket")
        if not isinstance(b, int) or isinstance(b, bool) or not 0 <= b < len(self.buckets):
            raise WireError(f"delayed pseudo-gradient for bucket {b!r}; this part has {len(self.buckets)}")
        if not isinstance(rnd, int) or isinstance(rnd, bool) or rnd <= self.collected[b]:
            raise WireError(f"delayed pseudo-gradient for round {rnd!r}; bucket {b} has collected round "
                            f"{self.collected[b]}")
        key = (rnd, b, sender)
        if key in self._got:
            raise WireError(f"duplicate delayed pseudo-gradient (round {rnd}, bucket {b}) from {sender}")
        if sum(1 for k in self._got if k[1:] == (b, sender)) >= MAX_ROUNDS_HELD:
            raise WireError(f"delayed pseudo-gradient of round {rnd} from {sender}: {MAX_ROUNDS_HELD} rounds of bucket "
                            f"{b} from it are waiting already")
        if self.codec is None:
            a = decode_payload(h.get("payload"), msg.arrays)
            if not isinstance(a, np.ndarray):
                raise WireError(f"delayed pseudo-gradient of bucket {b}: a {type(a).__name__}, not a dense buffer "
                                "(this group averages them exactly: no dp_sync.codec)")
            a = a.reshape(-1)
        else:
            a = decode_pseudo(h.get("payload"), msg.arrays, self.codec)
        want = self.buckets[b]
        if a.shape != (want.total,) or a.dtype.name != want.dtype:
            raise WireError(f"delayed pseudo-gradient of bucket {b} is {a.dtype.name}{list(a.shape)}, expected "
                            f"{want.dtype}[{want.total}]")
        self._got[key] = a

    def take(self, rnd: int, bucket: int, sender: str) -> np.ndarray | None:
        """The pseudo-gradient of ``sender`` for the round, kept until :meth:`close` (a flush may read it first)."""
        return self._got.get((rnd, bucket, sender))

    def close(self, rnd: int, buckets: Sequence[int]) -> None:
        """Round ``rnd`` of ``buckets`` was applied: forget it and refuse it from here on."""
        for b in buckets:
            self.collected[b] = max(self.collected[b], rnd)
        for k in [k for k in self._got if k[1] in buckets and k[0] <= rnd]:
            del self._got[k]


@dataclass
class Round:
    """One fragment's delayed outer round in flight (``dp_sync.delay`` 1)."""

    number: int  #: the completed-step count of the boundary that started it
    sent: list[np.ndarray]  #: per bucket of the fragment: what this replica encoded (Delta + residual), its
    #: pseudo-gradient as it goes on the wire (kept for a checkpoint: re-encoded, it gives the same payload)
    own: list[np.ndarray]  #: per bucket: what the others decode of ``sent`` (``sent`` itself without a codec)
    announced: bool = True  #: sent to the group (False after a resume until :meth:`OuterLoop.announce` re-sends it)


class OuterLoop:
    """One CompNode's DiLoCo state: the global weights theta (one flat buffer per bucket of
    :func:`~.allreduce.make_buckets`), the outer momentum v, and, with error feedback, the residual e of its
    own pseudo-gradient that the codec did not deliver. ``sync``: the plan's :class:`~fusion.plan.DPSync`."""

    def __init__(self, sync, buckets: Sequence[Bucket], params: Mapping[str, np.ndarray],
                 fragments: Sequence[Sequence[int]] | None = None):
        self.sync, self.buckets = sync, list(buckets)
        #: fragment -> its bucket indices (:func:`fragment_buckets`; one fragment: every bucket)
        self.fragments = [list(f) for f in fragments] if fragments is not None else [list(range(len(self.buckets)))]
        self.theta = [flatten(b, params) for b in self.buckets]
        self.v = [np.zeros_like(t) for t in self.theta]
        self.residual = [np.zeros_like(t) for t in self.theta] if sync.error_feedback else None
        #: the residual's weight in the next message (SparseLoCo's beta, Algorithm 1 line 1; 1 for other codecs)
        self.decay = pseudo_feedback_decay(sync.codec)
        #: dp_sync.delay 1: each bucket's weights at the start of this replica's current window (the pseudo-
        #: gradient is ``anchor - theta_r``, the window's own progress) and each fragment's round in flight
        self.delay = int(getattr(sync, "delay", 0))
        if self.delay not in (0, 1):
            raise FusionError(f"plan.dp_sync.delay {self.delay}: the runtime applies an outer step at once (0) "
                              "or one outer step late (1)")
        self.anchor = [t.copy() for t in self.theta] if self.delay else None
        #: dp_sync.overlap (delay 1): the eager step (its own pseudo-gradient at once) or the naive delayed one
        self.eager = bool(self.delay) and getattr(sync, "overlap", "delayed") == "eager"
        self.pending: dict[int, Round] = {}
        #: dp_sync.sync_warmup N: steps 1..N are synchronous DP (the CompNode all-reduces their gradients);
        #: :meth:`restart` at N, and the outer boundaries count from there
        self.warmup = int(getattr(sync, "sync_warmup", 0))

    def warming(self, steps_done: int) -> bool:
        """Whether the step that makes ``steps_done`` completed steps is one of the synchronous warm-up's."""
        return steps_done <= self.warmup

    def restart(self, params: Mapping[str, np.ndarray]) -> None:
        """DiLoCo's start at the end of the synchronous warm-up: the global weights are ``params`` (every replica
        holds the same after an all-reduced step), outer momentum, residual and anchors start afresh."""
        self.theta = [flatten(b, params) for b in self.buckets]
        self.v = [np.zeros_like(t) for t in self.theta]
        if self.residual is not None:
            self.residual = [np.zeros_like(t) for t in self.theta]
        if self.anchor is not None:
            self.anchor = [t.copy() for t in self.theta]
        self.pending = {}

    def _fed_back(self, b: int) -> np.ndarray:
        """Bucket ``b``'s residual as it enters the next message: ``decay * e`` (``e`` itself at decay 1)."""
        e = self.residual[b]
        return e if self.decay == 1.0 else e * np.asarray(self.decay, dtype=e.dtype)

    def due(self, steps_done: int) -> int | None:
        """The fragment whose outer step ends the step that makes ``steps_done`` completed steps, or None:
        fragment f at ``steps_done % H == (f H) // F`` (staggered; one fragment: every H-th step)."""
        h, f = self.sync.inner_steps, len(self.fragments)
        if steps_done <= self.warmup:
            return None
        steps_done -= self.warmup
        return next((i for i in range(f) if steps_done % h == (i * h) // f), None)

    # -- checkpoints ---------------------------------------------------------------------
    def state_arrays(self) -> dict[str, np.ndarray]:
        out = {}
        for i, (b, t, v) in enumerate(zip(self.buckets, self.theta, self.v)):
            out[f"theta::{i}:{b.dtype}"], out[f"momentum::{i}:{b.dtype}"] = t, v
        for i, (b, e) in enumerate(zip(self.buckets, self.residual or [])):
            out[f"residual::{i}:{b.dtype}"] = e
        for i, (b, a) in enumerate(zip(self.buckets, self.anchor or [])):
            out[f"anchor::{i}:{b.dtype}"] = a
        for f, rnd in self.pending.items():  # the rounds in flight: resumed, each replica sends its own again
            out[f"round::{f}"] = np.array([rnd.number], dtype=np.int64)
            for i, x in zip(self.fragments[f], rnd.sent):
                out[f"pending::{i}:{self.buckets[i].dtype}"] = x
        return out

    def load_arrays(self, arrays: Mapping[str, np.ndarray], source: str) -> None:
        """The state of :meth:`state_arrays` (CheckpointError-like FusionError naming ``source`` when it does not fit)."""
        keys = [("theta", self.theta), ("momentum", self.v)] + ([("residual", self.residual)] if self.residual else [])
        keys += [("anchor", self.anchor)] if self.anchor is not None else []
        for name, bufs in keys:
            for i, (b, buf) in enumerate(zip(self.buckets, bufs)):
                a = arrays.get(f"{name}::{i}:{b.dtype}")
                if a is None or a.shape != buf.shape or a.dtype != buf.dtype:
                    raise FusionError(f"{source}: outer state {name}::{i}:{b.dtype} is missing or not "
                                      f"{b.dtype}[{b.total}]")
                buf[:] = a
        self.pending = {}
        for f, only in enumerate(self.fragments if self.delay else []):
            n = arrays.get(f"round::{f}")
            if n is None:
                continue
            sent = [arrays.get(f"pending::{i}:{self.buckets[i].dtype}") for i in only]
            if n.shape != (1,) or any(x is None or x.shape != (self.buckets[i].total,) for i, x in zip(only, sent)):
                raise FusionError(f"{source}: outer state of fragment {f}'s round in flight is malformed")
            sent = [np.array(x, dtype=self.buckets[i].dtype) for i, x in zip(only, sent)]
            self.pending[f] = Round(int(n[0]), sent, [self._pack(x)[2] for x in sent], announced=False)

    # -- one outer step ------------------------------------------------------------------
    def step(self, me: str, ring: RingInbox | None, pseudo: PseudoInbox | None, it: int,
             params: Mapping[str, np.ndarray], send: Callable[[str, list, str], None],
             wait: Callable[[Callable[[], Any], str], Any], weights: Mapping[str, float] | None = None,
             fragment: int = 0) -> tuple[dict, dict]:
        """Average the pseudo-gradients over ``ring``'s group (None: this replica is the last of its stage) and
        apply the outer optimizer.

        params: this replica's trainable parameters after its H-th inner step. Returns the new global
        weights (name -> array, to be written into the engine) and stats: ``payload_bytes`` (bytes of this
        replica's pseudo-gradient frames, once; dense: the float buffers), ``sent_bytes`` (the tensor bytes it
        sent in all), ``replicas``. State changes only once the average is complete, so a call abandoned
        by a regroup can be repeated over the survivors. weights: part -> the samples its replica saw since
        the last outer step (unequal shares; None: equal, the plain mean). fragment: the streaming fragment
        whose buckets this outer step averages and updates (the others keep their global weights)."""
        only = self.fragments[fragment]
        deltas = [self.theta[i] - flatten(self.buckets[i], params) for i in only]
        codec = self.sync.codec
        group = ring.group if ring is not None else [me]
        sent = [0]

        def counted(peer: str, frames: list, label: str) -> None:
            sent[0] += payload_nbytes(frames[1:])  # frames[0] is the message header
            send(peer, frames, label)

        frac = None
        if weights is not None:  # each replica's pseudo-gradient weighs the samples it saw
            total_w = float(sum(weights[p] for p in group))
            frac = {p: weights[p] / total_w for p in group}
        payload_bytes = 0
        residual = self.residual
        if codec is None:
            payload_bytes = sum(d.nbytes for d in deltas)
            if frac is not None:  # the average divides by G: G w_r Delta_r averages to sum_r w_r Delta_r
                deltas = [d * np.asarray(frac[me] * len(group), dtype=d.dtype) for d in deltas]
            if ring is not None:
                average(ring, it, deltas, counted, wait, only)
        else:
            own: list[np.ndarray] = []
            residual = []
            for b, d in zip(only, deltas):
                if self.residual is not None:
                    d = d + self._fed_back(b)
                meta, frames = encode_pseudo(d, codec)
                got = decode_pseudo(meta, frames, codec)
                residual.append(d - got)  # what the codec did not deliver goes with the next pseudo-gradient
                own.append(got)
                payload_bytes += payload_nbytes(frames)
                for p in group:
                    if p != me:
                        counted(p, PseudoHeader(it, b, 0, 0, me, p, tuple(group)).frames(meta, frames),
                                f"pseudo-gradient b{b}")
            for j, b in enumerate(only):
                parts = [own[j] if p == me else
                         wait(lambda p=p: pseudo.take(it, b, p), f"pseudo-gradient of bucket {b} from {p}")
                         for p in group]
                total = np.zeros_like(deltas[j])
                for p, x in zip(group, parts):  # replica order: the same sum, the same bits, on every replica
                    total += x if frac is None else x * np.asarray(frac[p], dtype=x.dtype)
                deltas[j] = total / np.asarray(len(parts), dtype=total.dtype) if frac is None else total
        if self.residual is not None and codec is not None:
            for b, e in zip(only, residual):
                self.residual[b] = e
        s = self.sync
        out: dict[str, np.ndarray] = {}
        for b, d in zip(only, deltas):
            outer_update(self.theta[b], self.v[b], d, s.outer_lr, s.outer_momentum, s.nesterov)
            out.update(unflatten(self.buckets[b], self.theta[b].copy()))
        return out, {"payload_bytes": payload_bytes, "sent_bytes": sent[0], "replicas": len(group),
                     "fragment": fragment}


    # -- the delayed outer step (dp_sync.delay 1) ------------------------------------------
    def _pack(self, x: np.ndarray) -> tuple[dict, list, np.ndarray]:
        """``(payload header, frames, what the receivers decode)`` of one bucket's pseudo-gradient ``x``."""
        if self.sync.codec is None:
            meta, frames = encode_payload(x)
            return meta, frames, x
        meta, frames = encode_pseudo(x, self.sync.codec)
        return meta, frames, decode_pseudo(meta, frames, self.sync.codec)

    def _send_round(self, me: str, group: Sequence[str], fragment: int, number: int, packs: Sequence[tuple],
                    send: Callable[[str, list, str], None]) -> int:
        """Send one round's buckets to every other member of ``group``; the tensor bytes sent."""
        sent = 0
        for b, (meta, frames, _) in zip(self.fragments[fragment], packs):
            for p in group:
                if p != me:
                    sent += payload_nbytes(frames)
                    send(p, DelayedHeader(number, b, me, p).frames(meta, frames), f"delayed pseudo-gradient b{b}")
        return sent

    def announce(self, me: str, group: Sequence[str], send: Callable[[str, list, str], None]) -> int:
        """Send again the rounds in flight a checkpoint restored (each replica its own); the tensor bytes sent."""
        sent = 0
        for f, rnd in sorted(self.pending.items()):
            if not rnd.announced:
                sent += self._send_round(me, group, f, rnd.number, [self._pack(x) for x in rnd.sent], send)
                rnd.announced = True
        return sent

    @staticmethod
    def _shares(group: Sequence[str], weights: Mapping[str, float] | None) -> dict[str, float] | None:
        """Each member's share w_p of the group's average (unequal shares: the samples it saw over the group's,
        renormalised over the members live now; None: equal shares, the plain mean)."""
        if weights is None:
            return None
        total_w = float(sum(weights[p] for p in group))
        return {p: weights[p] / total_w for p in group}

    def _collect(self, me: str, group: Sequence[str], rnd: Round | None, fragment: int, inbox: DelayedInbox,
                 wait: Callable[[Callable[[], Any], str], Any], weights: Mapping[str, float] | None,
                 own: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Per bucket of ``fragment``: ``sum_p w_p x_p`` over ``group`` in group order (the same bits wherever
        the same parts are summed), with ``x_me = own`` and every other member's decoded pseudo-gradient of
        round ``rnd`` (None: no round yet, the others' terms are zero). The delayed step passes ``rnd.own``
        (the group's average of round ``rnd``), the eager step this window's own progress, and its flush
        zeros (the others' terms alone)."""
        frac = self._shares(group, weights)
        out = []
        for j, b in enumerate(self.fragments[fragment]):
            total = np.zeros_like(own[j])
            for p in group:
                if p == me:
                    x = own[j]
                elif rnd is None:
                    continue
                else:
                    x = wait(lambda p=p: inbox.take(rnd.number, b, p),
                             f"delayed pseudo-gradient of round {rnd.number}, bucket {b} from {p}")
                total += x if frac is None else x * np.asarray(frac[p], dtype=x.dtype)
            out.append(total / np.asarray(len(group), dtype=total.dtype) if frac is None else total)
        return out

    def _start_round(self, me: str, group: Sequence[str], fragment: int, steps_done: int,
                     deltas: Sequence[np.ndarray], send: Callable[[str, list, str], None]) -> tuple[list, int]:
        """Round ``steps_done`` of ``fragment``: this replica's pseudo-gradients ``deltas`` (+ residual, encoded;
        the residual updated) kept in flight and sent to every other member of ``group`` without waiting.
        Returns (the packs sent, the tensor bytes sent)."""
        only, s = self.fragments[fragment], self.sync
        ef = self.residual is not None and s.codec is not None
        ins = [d + self._fed_back(b) if ef else d for b, d in zip(only, deltas)]
        packs = [self._pack(x) for x in ins]
        if ef:
            for b, x, (_, _, got) in zip(only, ins, packs):
                self.residual[b] = x - got  # what the codec did not deliver goes with the next pseudo-gradient
        self.pending[fragment] = Round(steps_done, ins, [p[2] for p in packs])
        return packs, self._send_round(me, group, fragment, steps_done, packs, send)

    def overlapped_step(self, *args, **kwargs) -> tuple[dict, dict]:
        """The outer boundary under ``dp_sync.delay`` 1: :meth:`eager_step` or :meth:`delayed_step` as
        ``dp_sync.overlap`` says (same arguments)."""
        return (self.eager_step if self.eager else self.delayed_step)(*args, **kwargs)

    def delayed_step(self, me: str, group: Sequence[str], inbox: DelayedInbox, steps_done: int,
                     params: Mapping[str, np.ndarray], send: Callable[[str, list, str], None],
                     wait: Callable[[Callable[[], Any], str], Any], weights: Mapping[str, float] | None = None,
                     fragment: int = 0) -> tuple[dict, dict]:
        """The outer boundary of ``fragment`` after ``steps_done`` completed steps, one outer step late
        (``dp_sync.delay`` 1; see the module's docstring for the algorithm and its sources):

        1. ``Delta_r = anchor - theta_r``, this replica's progress over the window just finished;
        2. round t-1 of this fragment (started at the previous boundary, its exchange overlapped with this
           window's inner steps): collect the group's average and apply the outer optimizer to theta_global;
        3. start round t: send ``Delta_r`` (+ residual, encoded) to every other member without waiting;
        4. rebase: ``theta_r = theta_global - Delta_r`` (the new global weights plus this window's own
           progress), which is also the next window's anchor.

        group: the members whose pseudo-gradients round t-1 averages (the current group: a replica dropped
        meanwhile is left out), and whom round t is sent to. Nothing changes before the collection is
        complete (a regroup raised by ``wait`` lets the caller repeat the call over the survivors), except
        that a restored round is re-sent once. Returns (this replica's new local weights, stats)."""
        only = self.fragments[fragment]
        deltas = [self.anchor[b] - flatten(self.buckets[b], params) for b in only]
        sent_bytes = self.announce(me, group, send)
        rnd, s = self.pending.get(fragment), self.sync
        if rnd is not None:
            avg = self._collect(me, group, rnd, fragment, inbox, wait, weights, rnd.own)
            for b, d in zip(only, avg):
                outer_update(self.theta[b], self.v[b], d, s.outer_lr, s.outer_momentum, s.nesterov)
            inbox.close(rnd.number, only)
        packs, sent = self._start_round(me, group, fragment, steps_done, deltas, send)
        out: dict[str, np.ndarray] = {}
        for b, d in zip(only, deltas):
            self.anchor[b] = self.theta[b] - d
            out.update(unflatten(self.buckets[b], self.anchor[b].copy()))
        return out, self._round_stats(packs, sent_bytes + sent, group, fragment, steps_done, rnd)

    def eager_step(self, me: str, group: Sequence[str], inbox: DelayedInbox, steps_done: int,
                   params: Mapping[str, np.ndarray], send: Callable[[str, list, str], None],
                   wait: Callable[[Callable[[], Any], str], Any], weights: Mapping[str, float] | None = None,
                   fragment: int = 0) -> tuple[dict, dict]:
        """The eager outer boundary of ``fragment`` after ``steps_done`` completed steps (``dp_sync.delay`` 1,
        ``overlap`` "eager"): the "eager updates" of Kale, Douillard and Donchev 2025 (arXiv 2502.12996),
        the whole outer step overlapped with the next inner phase. Replica r keeps its own copy of the global
        weights theta_r (``self.theta``) and outer momentum v_r; at the boundary ending window t:

        1. ``Delta_r^t = theta_r - x_r`` (``anchor`` is theta_r as the window started), its own progress;
        2. the proxy outer gradient ``g_r = w_r Delta_r^t + sum_{k != r} w_k Delta_k^{t-1}``: its own fresh
           pseudo-gradient (exact, before any codec) for its share, the others' of the previous round
           (exchanged while window t computed; none at the first boundary: zero) for theirs, w the group's
           sample shares (``1/R`` each with equal shares), renormalised over the survivors after a regroup;
        3. ``theta_r = outer(theta_r, v_r, g_r)`` (Nesterov SGD, :func:`outer_update`);
        4. start round t: send ``Delta_r^t`` (+ residual, encoded) to the group without waiting;
        5. the next window starts from ``x_r = theta_r``, which is also its anchor.

        The replicas' copies of the global weights are not the same bits (each mixes its own round t with the
        others' round t-1, and its momentum sees that order); their rounds' sums are. Nothing changes before
        the collection is complete (a regroup raised by ``wait`` lets the caller repeat the call), except that
        a restored round is re-sent once. Returns (this replica's new weights, stats)."""
        only = self.fragments[fragment]
        deltas = [self.anchor[b] - flatten(self.buckets[b], params) for b in only]
        sent_bytes = self.announce(me, group, send)
        rnd, s = self.pending.get(fragment), self.sync
        proxy = self._collect(me, group, rnd, fragment, inbox, wait, weights, deltas)
        for b, g in zip(only, proxy):
            outer_update(self.theta[b], self.v[b], g, s.outer_lr, s.outer_momentum, s.nesterov)
        if rnd is not None:
            inbox.close(rnd.number, only)
        packs, sent = self._start_round(me, group, fragment, steps_done, deltas, send)
        out: dict[str, np.ndarray] = {}
        for b in only:
            self.anchor[b] = self.theta[b].copy()
            out.update(unflatten(self.buckets[b], self.theta[b].copy()))
        return out, self._round_stats(packs, sent_bytes + sent, group, fragment, steps_done, rnd)

    @staticmethod
    def _round_stats(packs, sent_bytes: int, group, fragment: int, steps_done: int, applied: Round | None) -> dict:
        return {"payload_bytes": sum(payload_nbytes(p[1]) for p in packs), "sent_bytes": sent_bytes,
                "replicas": len(group), "fragment": fragment, "round": steps_done,
                "applied_round": None if applied is None else applied.number}

    def flushed(self, me: str, group: Sequence[str], inbox: DelayedInbox, params: Mapping[str, np.ndarray],
                wait: Callable[[Callable[[], Any], str], Any], weights: Mapping[str, float] | None = None
                ) -> dict[str, np.ndarray]:
        """This replica's weights with every round in flight collected and applied (the end of a run,
        ``dp_sync.delay`` 1), per pending fragment ``theta' = outer(theta, g)`` and ``x' = theta' - (anchor - x)``
        (this replica's progress since the boundary kept), where g is the group's average of the round
        (delayed) or, eager, the others' terms alone ``sum_{k != r} w_k Delta_k^t`` (its own was applied at
        the boundary). A run that ends at a boundary gets theta': delayed, the global weights, the same on
        every replica; eager, this replica's copy of them. Computed on copies: the state (and a run that goes
        on after a fetch) is unchanged."""
        s, out = self.sync, {}
        for f, rnd in sorted(self.pending.items()):
            own = [np.zeros_like(x) for x in rnd.own] if self.eager else rnd.own
            avg = self._collect(me, group, rnd, f, inbox, wait, weights, own)
            for b, d in zip(self.fragments[f], avg):
                theta, v = self.theta[b].copy(), self.v[b].copy()
                outer_update(theta, v, d, s.outer_lr, s.outer_momentum, s.nesterov)
                out.update(unflatten(self.buckets[b], theta - (self.anchor[b] - flatten(self.buckets[b], params))))
        return out


def write_params(engine: Any, values: Mapping[str, np.ndarray]) -> None:
    """Set the engine's trainable parameters to ``values`` in place (the inner optimizer keeps its state and
    its references to them)."""
    tr = engine.trainable()
    for name, v in values.items():
        p = tr[name]
        if isinstance(p, np.ndarray):
            p[...] = v
        else:  # a torch parameter (a NumPy CompNode never gets here, so never imports torch)
            import torch

            with torch.no_grad():
                p.copy_(torch.from_numpy(np.ascontiguousarray(v)).to(p.device))

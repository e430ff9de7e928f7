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
did not send last time) once and sends the same payload to every other member of its group; every replica
decodes all payloads and sums them in replica order, so all apply the same bits (as ``TiedCodec`` does for
tied gradients). These messages are wire messages of kind ``"allreduce"`` whose header carries
``"gather": true`` (:class:`PseudoInbox` accepts them: from a member of the group, for the current
iteration, of the bucket's dtype and length, once each).

Streaming fragments (``dp_sync.fragments`` F, :func:`fragment_buckets`): the parameters in F runs, fragment
f's outer step after the steps t with ``t % H == (f H) // F``; unequal shares (``dp_sync.shares``,
:func:`share_micro_batches`): each replica takes its share of every global batch's micro-batches and the
average weighs its pseudo-gradient by the samples it saw.

:func:`encode_pseudo` / :func:`decode_pseudo` are the one place pseudo-gradients are encoded and decoded: by
the codec registry's unit of ``dp_sync.codec`` (any codec serving the pseudo-gradient role: quant,
hadamard-quant, topk or a user codec), its payload carried as the wire carries OP-Data payloads.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from fusion.ir.errors import FusionError, WireError
from fusion.ir.wire import Message, decode_payload, encode, encode_payload
from fusion.executors.runtime.allreduce import KIND, Bucket, RingInbox, average, flatten, make_buckets, unflatten
from fusion.kernels.codecs.base import Role
from fusion.kernels.codecs.registry import FlatCodec

log = logging.getLogger(__name__)

def check_pseudo_codec(cfg: Mapping[str, Any] | None, source: str = "dp_sync.codec") -> None:
    """FusionError (one line naming ``source``) for a codec cfg a pseudo-gradient may not travel under: one the
    codec registry lacks, one that does not serve the pseudo-gradient role, or a bad cfg."""
    if cfg is None:
        return
    from fusion.kernels.codecs import CODECS, Role

    CODECS.check_role(cfg, Role.PSEUDO_GRADIENT, source)


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
        if sender not in r.group or sender == r.me:
            raise WireError(f"pseudo-gradient from {sender!r}, which is not in {r.me}'s data-parallel group {r.group}")
        h = msg.header
        if h.get("src") != sender or h.get("dst") != r.me:
            raise WireError(f"pseudo-gradient says {h.get('src')!r}->{h.get('dst')!r} but came {sender!r}->{r.me!r}")
        it, b = h.get("it"), h.get("bucket")
        if it != r.expected_iter:
            raise WireError(f"pseudo-gradient for iteration {it!r}, this part is at iteration {r.expected_iter}")
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
        for k in [k for k in self._got if k[0] < it]:
            del self._got[k]
        self._got[key] = a

    def take(self, it: int, bucket: int, sender: str) -> np.ndarray | None:
        return self._got.pop((it, bucket, sender), None)


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

    def due(self, steps_done: int) -> int | None:
        """The fragment whose outer step ends the step that makes ``steps_done`` completed steps, or None:
        fragment f at ``steps_done % H == (f H) // F`` (staggered; one fragment: every H-th step)."""
        h, f = self.sync.inner_steps, len(self.fragments)
        return next((i for i in range(f) if steps_done % h == (i * h) // f), None)

    # -- checkpoints ---------------------------------------------------------------------
    def state_arrays(self) -> dict[str, np.ndarray]:
        out = {}
        for i, (b, t, v) in enumerate(zip(self.buckets, self.theta, self.v)):
            out[f"theta::{i}:{b.dtype}"], out[f"momentum::{i}:{b.dtype}"] = t, v
        for i, (b, e) in enumerate(zip(self.buckets, self.residual or [])):
            out[f"residual::{i}:{b.dtype}"] = e
        return out

    def load_arrays(self, arrays: Mapping[str, np.ndarray], source: str) -> None:
        """The state of :meth:`state_arrays` (CheckpointError-like FusionError naming ``source`` when it does not fit)."""
        keys = [("theta", self.theta), ("momentum", self.v)] + ([("residual", self.residual)] if self.residual else [])
        for name, bufs in keys:
            for i, (b, buf) in enumerate(zip(self.buckets, bufs)):
                a = arrays.get(f"{name}::{i}:{b.dtype}")
                if a is None or a.shape != buf.shape or a.dtype != buf.dtype:
                    raise FusionError(f"{source}: outer state {name}::{i}:{b.dtype} is missing or not "
                                      f"{b.dtype}[{b.total}]")
                buf[:] = a

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
                    d = d + self.residual[b]
                meta, frames = encode_pseudo(d, codec)
                got = decode_pseudo(meta, frames, codec)
                residual.append(d - got)  # what the codec did not deliver goes with the next pseudo-gradient
                own.append(got)
                payload_bytes += payload_nbytes(frames)
                for p in group:
                    if p != me:
                        counted(p, encode(KIND, {"it": it, "bucket": b, "step": 0, "chunk": 0, "src": me, "dst": p,
                                                 "gather": True, "payload": meta}, frames), f"pseudo-gradient b{b}")
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

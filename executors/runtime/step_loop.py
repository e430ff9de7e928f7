"""One iteration on one part: the schedule's actions (F, B, W) as their inputs arrive, then the end of the step phase
by phase (tied gradients, data-parallel sync, clipping, the coordinator's go-ahead, the optimizer, the outer step, a
checkpoint, ``done``); and evaluations."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from fusion.executors.runtime import checkpoint, delta_edges, faults
from fusion.executors.runtime.control import Abort, Clip, Commit, Done, Eval, Evaluated, GradNorm, Reduced, Step
from fusion.executors.runtime.dp.clip import clip_coef, part_sq_norm, scale_grads
from fusion.executors.runtime.dp.inner_steps import steps_at
from fusion.executors.runtime.node_common import COORDINATOR, ExecutorAbort
from fusion.executors.runtime.packing import by_destination, message_frames, message_label
from fusion.executors.runtime.schedule import ActionKind, TailKind, splits_backward, step_tail
from fusion.executors.runtime.trace_events import now_us

#: what a part of a replica idle in a step (per-replica inner steps, :mod:`.dp.inner_steps`) runs of its end: the
#: protocol with the coordinator (the failover's go-ahead, a checkpoint, ``done``), no gradient, optimizer or sync
IDLE_TAIL = frozenset({TailKind.REDUCED, TailKind.COMMIT, TailKind.CHECKPOINT, TailKind.DONE})


@dataclass
class _Step:
    """One iteration in progress on one part: the coordinator's step, its feeds per micro-batch, the losses
    and timings gathered so far, and the phases' hand-overs (tied gradients sent, sync start)."""

    c: Step
    it: int
    feeds: list[dict[str, np.ndarray]]
    losses: list[list]
    stats: dict
    t_start: float
    split: bool
    own: dict = field(default_factory=dict)
    t_sync: float = 0.0
    grads: dict = field(default_factory=dict)  #: the gradients the coordinator asked for (``want_grads``)

    @property
    def done(self) -> int:
        """The completed steps after this one (the coordinator's count, which redone attempts put behind ``it``)."""
        return self.it + 1 if self.c.save_step is None else self.c.save_step


class StepLoop:
    """A part of :class:`~.compnode.CompNode` (mixed in): one iteration on one part: the schedule's actions (F, B, W)
    as their inputs arrive, then the end of the step phase by phase (tied gradients, data-parallel sync,
    clipping, the coordinator's go-ahead, the optimizer, the outer step, a checkpoint, ``done``); and
    evaluations."""

    def _iteration(self, c: Step) -> None:
        """Run one step: this part's actions, then the end of the step (:meth:`_tail`), kind by kind. A replica
        idle in this step (per-replica inner steps: :func:`.dp.inner_steps.steps_at`) runs no action and only
        :data:`IDLE_TAIL` of the end."""
        st = self._begin(c)
        idle = not steps_at(self.plan.dp_sync, self.spec.replica, st.done)
        if idle:
            st.stats["idle_step"] = True
        for a in [] if idle else self.actions:
            self._act(st, a)
        for kind in self._tail(st):
            if not idle or kind in IDLE_TAIL:
                self._run_tail(st, kind)

    def _evaluate(self, c: Eval) -> None:
        """An evaluation (``--eval-every``): this part's forwards of the micro-batches in ``c``, in schedule order,
        with no autograd graph and dense messages (:meth:`PartRuntime.evaluate`); the losses go to the coordinator.
        No optimizer step, no gradient, no codec state changes; the iteration stays the one expected."""
        it = c.it
        if it != self.inbox.expected_iter:
            raise ExecutorAbort(f"coordinator asked to evaluate at iteration {it}, this part is at {self.inbox.expected_iter}")
        feeds: list[dict[str, np.ndarray]] = [{} for _ in range(self.n_micro)]
        for name, arr in c.arrays.items():
            mb, _, ph = name.partition("/")
            feeds[int(mb)][ph] = arr
        losses = []
        for a in self.actions:
            if a.kind != ActionKind.F:
                continue
            mb = a.micro_batch
            box, _ = self._wait(lambda: self.inbox.activations(it, mb), f"activations of eval F{mb}",
                                self.cfg.data_timeout_s)
            t0 = now_us()
            out, loss = self.runtime.evaluate(it, mb, feeds[mb], box)
            if loss is not None:
                losses.append([mb, loss])
            with self._cv:
                self.inbox.consume(it, ActionKind.F, mb)
            self.tracer.add(f"eval F{mb}", "eval", t0, now_us())
            for group in by_destination(out):
                self.transport.send(group[0].dst, message_frames(group), label=message_label(f"eval F{mb}", group))
        with self._cv:
            self.inbox.discard(it)
        self.transport.send(COORDINATOR, Evaluated(it=it, losses=losses).frames())

    def _begin(self, c: Step) -> "_Step":
        it = c.it
        faults.maybe_fail(self.me, it)  # FUSION_TEST_FAULT (tests, benchmarks/chaos.py); nothing when unset
        if it != self.inbox.expected_iter:
            raise ExecutorAbort(f"coordinator asked for iteration {it}, this part is at {self.inbox.expected_iter}")
        feeds: list[dict[str, np.ndarray]] = [{} for _ in range(self.n_micro)]
        for name, arr in c.arrays.items():
            mb, _, ph = name.partition("/")
            feeds[int(mb)][ph] = arr
        stats = {"forward_s": [], "backward_s": [], "idle_s": 0.0, "weight_s": [], "codec_s": 0.0}
        return _Step(c, it, feeds, [], stats, time.time(), splits_backward(self.actions))

    def _act(self, st: "_Step", a) -> None:
        """Run one action of the schedule: wait for its inputs, compute, hand its outputs to the transport."""
        rt, it, mb, stats = self.runtime, st.it, a.micro_batch, st.stats
        if a.kind == ActionKind.W:  # the parameter half of a split backward: nothing to wait for, nothing to send
            t0 = now_us()
            rt.weight(it, mb)
            t1 = now_us()
            self.tracer.add(f"W{mb}", "backward", t0, t1)
            stats["weight_s"].append((t1 - t0) / 1e6)
            return
        table = rt.compression
        c0 = table.codec_s if table is not None else 0.0
        if a.kind == ActionKind.F:
            box, idle = self._wait(lambda: self.inbox.activations(it, mb), f"activations of F{mb}", self.cfg.data_timeout_s)
            t0 = now_us()
            out, loss = rt.forward(it, mb, st.feeds[mb], box)
            if loss is not None:
                st.losses.append([mb, loss])
        else:
            box, idle = self._wait(lambda: self.inbox.gradients(it, mb), f"gradients of B{mb}", self.cfg.data_timeout_s)
            t0 = now_us()
            out = rt.backward(it, mb, box, 1.0 / self.n_micro, split=st.split)
        t1 = now_us()
        with self._cv:
            self.inbox.consume(it, a.kind, mb)
        self.tracer.add(str(a), "forward" if a.kind == ActionKind.F else "backward", t0, t1)
        stats["forward_s" if a.kind == ActionKind.F else "backward_s"].append((t1 - t0) / 1e6)
        stats["idle_s"] += idle
        if table is not None:  # the codecs' CPU time inside this action (part of its forward or backward time)
            stats["codec_s"] += table.codec_s - c0
        for group in by_destination(out):  # one message per destination part (packing.py)
            self.transport.send(group[0].dst, message_frames(group), label=message_label(f"{a.kind}{mb}", group))

    def _tail(self, st: "_Step") -> list[TailKind]:
        """The end of this step (:func:`~fusion.ir.schedule.step_tail`), as the coordinator runs it too."""
        return step_tail(self.optcfg.clip_grad_norm is not None, self.failover, bool(st.c.checkpoint))

    def _tail_handlers(self) -> dict[TailKind, Callable[["_Step"], None]]:
        """What this part does for each kind of the step's end."""
        k = TailKind
        return {k.SEND_TIED: self._send_tied, k.SUM_TIED: self._sum_tied, k.REDUCE: self._reduce,
                k.GRAD_NORM: self._grad_norm, k.CLIP: self._clip, k.REDUCED: self._reduced, k.COMMIT: self._commit,
                k.OPTIMIZER: self._optimizer, k.OUTER: self._outer, k.CHECKPOINT: self._checkpoint, k.DONE: self._done}

    def _run_tail(self, st: "_Step", kind: TailKind) -> None:
        self._tail_handlers()[kind](st)

    def _send_tied(self, st: "_Step") -> None:
        """Send this part's tied-parameter gradients to their co-owners (nothing waits here, so the parts of one
        process may all send before any of them waits)."""
        st.t_sync = time.perf_counter()
        with self.tracer.span("grad-sync", "sync"):
            st.own = self._sync_send(st.it)

    def _sum_tied(self, st: "_Step") -> None:
        with self.tracer.span("grad-sync", "sync"):
            self._sync_wait(st.it, st.own)
        # an owner of a tied parameter: the exchange's seconds; a part that holds none exchanges nothing
        st.stats["sync_s"] = time.perf_counter() - st.t_sync if self.spec.shared else 0.0

    def _reduce(self, st: "_Step") -> None:
        if self.sync is not None:  # every-step DP: the gradients averaged over the group
            st.stats.update(self.sync.after_backward(st.it, st.done, self.runtime.engine, self._links()))

    def _grad_norm(self, st: "_Step") -> None:
        """This part's share of the global norm, to the coordinator (a tied parameter: its first owner counts it)."""
        counted = {n for n, owners in self.spec.shared.items() if owners[0] != self.me}
        sq = part_sq_norm(self.runtime.engine.grads(), skip=counted, dtypes=self.spec.param_dtypes)
        self.transport.send(COORDINATOR, GradNorm(it=st.it, sq=sq).frames())

    def _coordinator_says(self, cls: type, it: int, what: str, before_regroup: bool = False):
        """The coordinator's next control message, which must be a ``cls`` of iteration ``it``."""
        c, _ = self._wait(lambda: self._ctrl.popleft() if self._ctrl else None, f"{what} of iteration {it}",
                          self.cfg.data_timeout_s, before_regroup=before_regroup)
        if isinstance(c, Abort):
            raise ExecutorAbort(f"aborted by the coordinator: {c.reason}")
        if not isinstance(c, cls) or c.it != it:
            raise ExecutorAbort(f"expected {what} of iteration {it} from the coordinator, got {c.op!r}")
        return c

    def _clip(self, st: "_Step") -> None:
        """The pipeline's global norm, from every part's GradNorm: scale the gradients."""
        c = self._coordinator_says(Clip, st.it, "the gradient norm")
        scale_grads(self.runtime.engine, clip_coef(self.optcfg.clip_grad_norm, c.norm), self.spec.param_dtypes)
        st.stats["grad_norm"] = c.norm

    def _reduced(self, st: "_Step") -> None:
        """Every live part has its averaged gradients before anyone steps: all step, or none."""
        self.transport.send(COORDINATOR, Reduced(it=st.it).frames())

    def _commit(self, st: "_Step") -> None:
        self._coordinator_says(Commit, st.it, "commit", before_regroup=True)

    def _optimizer(self, st: "_Step") -> None:
        """The optimizer step (the gradients, when the coordinator wants them, kept first)."""
        engine = self.runtime.engine
        if st.c.want_grads:
            st.grads = {n: np.array(g) for n, g in engine.grads().items() if g is not None}
        t_opt = time.perf_counter()
        if self._scheduled:  # optimizer step k (completed steps before it, the coordinator's count) runs at lr_at(k)
            k = st.done - 1  # (a DiLoCo replica's base lr: dp_sync.inner_lr once the synchronous warm-up is over)
            self.opt.set_lr(self.optcfg.lr_at(k, self.plan.dp_sync.base_lr(k, self.optcfg.lr)))
        with self.tracer.span("optimizer", "optimizer"):
            self.opt.step()
            self.opt.zero_grad()
        st.stats["optimizer_s"] = time.perf_counter() - t_opt

    def _outer(self, st: "_Step") -> None:
        if self.sync is not None:  # DiLoCo: the outer step when one is due
            st.stats.update(self.sync.after_step(st.it, st.done, self.runtime.engine,
                                                 self._links(self._outer_send(st.done))))

    def _checkpoint(self, st: "_Step") -> None:
        """This part's files of the step, named by completed steps (the coordinator's count, which redone
        attempts put behind the iteration)."""
        rt = self.runtime
        with self.tracer.span("checkpoint", "checkpoint"):
            checkpoint.save_part(self.checkpoint_dir, st.done, self.me, rt.engine.state(), *self.opt.state(),
                                 delta=delta_edges.checkpoint_arrays(rt),
                                 outer=self.sync.state() if self.sync is not None else None)
            checkpoint.prune_part(self.checkpoint_dir, self.me, keep=2)
        st.stats["checkpoint_step"] = st.done

    def _done(self, st: "_Step") -> None:
        """The iteration is over: its stats (bytes sent per peer since the last step) and losses to the coordinator."""
        it, stats = st.it, st.stats
        with self._cv:
            self.inbox.finish(it)
            if self.sync is not None:
                self.sync.finish(it)
        sent = {}
        for p, s in self.transport.stats().items():
            prev = self._prev_sent.get(p, (0, 0, 0.0))
            sent[p] = {"bytes": s.bytes - prev[0], "messages": s.messages - prev[1], "busy_s": s.busy_s - prev[2]}
            self._prev_sent[p] = (s.bytes, s.messages, s.busy_s)
        stats.update(t_start=st.t_start, t_end=time.time(), rejected=self.transport.rejected,
                     escaped=self.transport.escaped, sent=sent)
        self.transport.send(COORDINATOR, Done(arrays=st.grads, it=it, losses=st.losses, stats=stats).frames())

"""One iteration on one part: the schedule's actions (F, B, W) as their inputs arrive, then the end of the step phase
by phase (tied gradients, data-parallel sync, clipping, the coordinator's go-ahead, the optimizer, the outer step, a
checkpoint, ``done``); and evaluations."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from fusion.executors.runtime import checkpoint, delta_edges, faults
from fusion.executors.runtime.control import Abort, Clip, Commit, Done, Eval, Evaluated, GradNorm, Reduced, Step
from fusion.executors.runtime.dp.clip import clip_coef, part_sq_norm, scale_grads
from fusion.executors.runtime.node_common import COORDINATOR, ExecutorAbort
from fusion.executors.runtime.schedule import ActionKind, splits_backward
from fusion.executors.runtime.trace_events import now_us
from fusion.ir.wire import encode_opdata


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


class StepLoop:
    """A part of :class:`~.compnode.CompNode` (mixed in): one iteration on one part: the schedule's actions (F, B, W)
    as their inputs arrive, then the end of the step phase by phase (tied gradients, data-parallel sync,
    clipping, the coordinator's go-ahead, the optimizer, the outer step, a checkpoint, ``done``); and
    evaluations."""

    def _iteration(self, c: Step) -> None:
        """Run one step: this part's actions, then the end of the step (:meth:`_end_send` .. :meth:`_end_commit`)."""
        st = self._begin(c)
        for a in self.actions:
            self._act(st, a)
        self._end_send(st)
        self._end_reduce(st)
        self._end_commit(st)

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
            for msg in out:
                self.transport.send(msg.dst, encode_opdata(msg), label=f"eval F{mb} {msg.name}")
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
        stats = {"forward_s": [], "backward_s": [], "idle_s": 0.0, "weight_s": []}
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
        for msg in out:
            self.transport.send(msg.dst, encode_opdata(msg), label=f"{a.kind}{a.micro_batch} {msg.name}")

    def _end_send(self, st: "_Step") -> None:
        """End of a step, first phase: send this part's tied-parameter gradients to their co-owners (nothing
        waits here, so the parts of one process may all send before any of them waits)."""
        st.t_sync = time.perf_counter()
        with self.tracer.span("grad-sync", "sync"):
            st.own = self._sync_send(st.it)

    def _end_reduce(self, st: "_Step") -> None:
        """Second phase: sum the tied gradients, average over the data-parallel group, and (failover runs) tell
        the coordinator this part has its gradients."""
        it, stats = st.it, st.stats
        with self.tracer.span("grad-sync", "sync"):
            self._sync_wait(it, st.own)
        stats["sync_s"] = time.perf_counter() - st.t_sync
        if self.sync is not None:  # every-step DP: the gradients averaged over the group
            stats.update(self.sync.after_backward(it, self.runtime.engine, self._links()))
        if self.optcfg.clip_grad_norm is not None:  # this part's share of the global norm, to the coordinator
            counted = {n for n, owners in self.spec.shared.items() if owners[0] != self.me}  # tied: its first owner counts it
            sq = part_sq_norm(self.runtime.engine.grads(), skip=counted, dtypes=self.spec.param_dtypes)
            self.transport.send(COORDINATOR, GradNorm(it=it, sq=sq).frames())
        if self.failover:  # every live part has its averaged gradients before anyone steps: all step, or none
            self.transport.send(COORDINATOR, Reduced(it=it).frames())

    def _end_commit(self, st: "_Step") -> None:
        """Last phase: (failover runs) the coordinator's go-ahead, the optimizer step, a checkpoint, ``done``."""
        c, it, stats, rt = st.c, st.it, st.stats, self.runtime
        if self.optcfg.clip_grad_norm is not None:  # the pipeline's global norm, from every part's GradNorm
            c1, _ = self._wait(lambda: self._ctrl.popleft() if self._ctrl else None, f"the gradient norm of iteration {it}",
                               self.cfg.data_timeout_s)
            if isinstance(c1, Abort):
                raise ExecutorAbort(f"aborted by the coordinator: {c1.reason}")
            if not isinstance(c1, Clip) or c1.it != it:
                raise ExecutorAbort(f"expected the gradient norm of iteration {it} from the coordinator, got {c1.op!r}")
            scale_grads(rt.engine, clip_coef(self.optcfg.clip_grad_norm, c1.norm), self.spec.param_dtypes)
            stats["grad_norm"] = c1.norm
        if self.failover:
            c2, _ = self._wait(lambda: self._ctrl.popleft() if self._ctrl else None, f"the go-ahead of iteration {it}",
                               self.cfg.data_timeout_s, before_regroup=True)
            if isinstance(c2, Abort):
                raise ExecutorAbort(f"aborted by the coordinator: {c2.reason}")
            if not isinstance(c2, Commit) or c2.it != it:
                raise ExecutorAbort(f"expected commit of iteration {it} from the coordinator, got {c2.op!r}")
        engine = rt.engine
        grads = {n: g for n, g in engine.grads().items() if g is not None} if c.want_grads else {}
        grads = {n: np.array(g) for n, g in grads.items()}
        t_opt = time.perf_counter()
        if self._scheduled:  # optimizer step k (completed steps before it, the coordinator's count) runs at lr_at(k)
            self.opt.set_lr(self.optcfg.lr_at((it + 1 if c.save_step is None else c.save_step) - 1))
        with self.tracer.span("optimizer", "optimizer"):
            self.opt.step()
            self.opt.zero_grad()
        stats["optimizer_s"] = time.perf_counter() - t_opt
        done = it + 1 if c.save_step is None else c.save_step  # completed steps (the coordinator's count)
        if self.sync is not None:  # DiLoCo: the outer step when one is due
            stats.update(self.sync.after_step(it, done, engine, self._links(self._outer_send(done))))
        if c.checkpoint:
            # named by completed steps (the coordinator's count), which redone attempts put behind ``it``
            save = it + 1 if c.save_step is None else c.save_step
            with self.tracer.span("checkpoint", "checkpoint"):
                checkpoint.save_part(self.checkpoint_dir, save, self.me, engine.state(), *self.opt.state(),
                                     delta=delta_edges.checkpoint_arrays(rt),
                                     outer=self.sync.state() if self.sync is not None else None)
                checkpoint.prune_part(self.checkpoint_dir, self.me, keep=2)
            stats["checkpoint_step"] = save
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
        self.transport.send(COORDINATOR, Done(arrays=grads, it=it, losses=st.losses, stats=stats).frames())

"""The coordinator: starts iterations, feeds data, collects losses, checkpoints, detects failures.

It is the rendezvous of a run: every executor knows only the coordinator's
address; it says hello with its own address, and the coordinator answers
with the address book (``setup``). Each iteration, the coordinator splits the
batch into micro-batches and sends each part the placeholders (inputs and
labels) the plan places on it, then waits for every part's ``done``. The
loss of the iteration is the mean over micro-batches of the summed loss
nodes, as in single-process training.

Every ``checkpoint_every`` steps the executors save their own parameters and
optimizer state; once all have, the coordinator marks the checkpoint
complete (:mod:`fusion.executors.runtime.checkpoint`). A DiLoCo plan may start with replicas held back
(``CoordinatorConfig.joins``), each admitted at its outer boundary (:meth:`Coordinator._admit`,
:mod:`fusion.executors.runtime.dp.join`). After a replica was
dropped the survivors alone save (their copy of each stage stands for the
dropped one), and a resume of the full plan loads every part of a dropped
replica from the saved copy of its stage. A part that reports an error,
whose process exits, or that sends nothing (not even a heartbeat) for
``peer_timeout_s`` is reported by name as a :class:`CompNodeFailure`; the
others are told to abort.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

import numpy as np

from fusion.ir.errors import FusionError, WireError
from fusion.ir.node import NodeKind
from fusion.ir.wire import Message
from fusion.executors.runtime import checkpoint, faults
from fusion.executors.runtime.feeds import feed_problem, feed_specs
from fusion.executors.runtime.limits import coordinator_message_limit, part_message_limit
from fusion.executors.runtime.logtail import last_error
from fusion.executors.runtime.dp.inner_steps import steps_at
from fusion.executors.runtime.dp.outer import replica_micro_batches
from fusion.executors.runtime.dp.clip import total_norm
from fusion.executors.runtime.control import (TO_COORDINATOR, Abort, Admit, Clip, Commit, Control, Done, Error, Eval,
                                              Fetch, GradNorm, Hb, Hello, Regroup, Setup, Step, Stop, decode_ctrl)
from fusion.executors.runtime.keys import Security
from fusion.executors.runtime.liveness import Heartbeat
from fusion.executors.runtime.plandigest import digest_mismatch
from fusion.executors.runtime.sample_ids import batch_ids, per_sample_edges
from fusion.executors.runtime.schedule import TailKind, step_tail
from fusion.executors.runtime.step_ahead import MAX_AHEAD, Ahead, lock_step_reason
from fusion.executors.runtime.transport import Transport
from fusion.plan import OptimizerConfig, Plan

log = logging.getLogger(__name__)

COORDINATOR = "coordinator"
#: control messages from one part waiting to be collected (a part sends one or two per step; more is a flood)
MAX_QUEUED_PER_PART = 64


#: after a part says hello with another plan's digest, how long the other parts' hellos are still awaited (so that
#: the abort that names it reaches them too) before the start fails
HELLO_GRACE_S = 5.0

#: how long a part's exited process is watched before its exit counts as its failure: what it sent before it exited
#: (a ``done`` of the step it finished, read by this process's I/O thread a moment after ``poll()`` already sees the
#: exit) is still taken, so a part killed as a step sent ahead starts fails in that step, not in the one it finished
EXIT_DRAIN_S = 0.3


class CompNodeFailure(FusionError):
    """A CompNode failed or stopped answering; ``part`` names it (the first cause when several failed)."""

    def __init__(self, part: str, reason: str, lasting: bool = False, parts: tuple[str, ...] = ()):
        """lasting: the part said its cause would stop a restart the same way (a full disk: ``Error.lasting``);
        parts: every part found failed, the first cause first (``reason`` then names the others' causes too)."""
        super().__init__(f"CompNode {part!r} failed: {reason}")
        self.part, self.reason, self.lasting = part, reason, lasting
        self.parts = tuple(parts) or (part,)


class Process(Protocol):
    """What the coordinator needs of a locally started executor process."""

    pid: int

    def poll(self) -> int | None: ...


@dataclass
class CoordinatorConfig:
    """bind: the coordinator's address; checkpoint_every: 0 = never; timeouts in seconds."""

    bind: str = "tcp://127.0.0.1:*"
    emulate_links: bool = False
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    heartbeat_s: float = 0.5
    peer_timeout_s: float = 10.0
    #: the most seconds from a CompNode's death, stop or cut-off to its failure being detected on a quiet host:
    #: ZeroMQ heartbeats on the coordinator's link to each part (executors/runtime/liveness.py); 0: off (only the
    #: process's exit and ``peer_timeout_s`` of silence tell)
    link_timeout_s: float = 2.0
    startup_timeout_s: float = 120.0
    step_timeout_s: float = 3600.0
    max_message_bytes: int | None = None  # None: derived from the plan (limits.coordinator_message_limit)
    #: a replicated plan survives the loss of a replica: its CompNodes are stopped, the step is redone (or, when
    #: it was already committed, kept) with the global batch re-split over the surviving replicas
    drop_failed_replicas: bool = False
    security: Security | None = None  # CURVE keys (executors.runtime.keys); None: plain TCP (--insecure)
    plan_digest: str = ""  # the plan's digest (plandigest.plan_digest); executors with another one are refused
    #: DiLoCo replicas that start late: replica -> the step (an outer boundary) before which it joins
    #: (``fusion run|coordinator --join-at STEP:REPLICA``; executors/runtime/dp/join.py)
    joins: dict[int, int] = field(default_factory=dict)
    #: steps sent before the previous one's ``done`` arrived (:mod:`.step_ahead`; ``--steps-ahead``, whose default is 1):
    #: 0 lock step (this config's default, for code that builds a coordinator itself), at most :data:`~.step_ahead.MAX_AHEAD`; :meth:`Coordinator.step` sends one ahead only when given the next batch
    steps_ahead: int = 0


@dataclass
class StepReport:
    """One iteration as the coordinator saw it.

    loss: mean over micro-batches of the summed loss nodes; iteration_s: from
    sending ``step`` to the last ``done``; parts: each part's stats
    (forward/backward seconds per micro-batch, the optimizer step's seconds, idle, bytes sent per peer);
    grads: parameter gradients (when asked for), shared ones once.
    """

    step: int
    loss: float
    iteration_s: float
    samples: int
    parts: dict[str, dict] = field(default_factory=dict)
    grads: dict[str, np.ndarray] = field(default_factory=dict)
    dropped: list[dict] = field(default_factory=list)  # replicas dropped during this step: {replica, step, part, reason}
    joined: list[dict] = field(default_factory=list)  # replicas that joined before this step: {replica, step, parts, ...}
    #: with gradient clipping (``optimizer.clip_grad_norm``): each live replica's global gradient norm before
    #: clipping (synchronous DP: all equal), in replica order; empty without clipping
    grad_norms: list[float] = field(default_factory=list)
    #: the learning rate this step's optimizer step ran with (``OptimizerConfig.lr_at``: the schedule's value;
    #: DiLoCo's inner steps); None when the plan names no optimizer
    lr: float | None = None

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.iteration_s if self.iteration_s > 0 else float("nan")

    def metrics_line(self) -> dict:
        """The step's line of ``metrics.jsonl`` (also kept in the ``COMPLETE.json`` of a checkpoint it ends, so
        that a crash between the commit and the line loses nothing: ``rundir.restore_committed_line``)."""
        parts = {p: {"forward_s": round(sum(s["forward_s"]), 6), "backward_s": round(sum(s["backward_s"]), 6),
                     # a split backward's parameter halves (zb1's W actions): compute that backward_s leaves out
                     **({"weight_s": round(sum(s["weight_s"]), 6)} if s.get("weight_s") else {}),
                     # an owner of a tied parameter: from sending its gradient to holding every owner's (the wait)
                     **({"tied_sync_s": round(s["sync_s"], 6)} if s.get("sync_s") else {}),
                     "idle_s": round(s["idle_s"], 6), "rejected": s["rejected"],
                     "bytes_sent": sum(v["bytes"] for v in s["sent"].values()),
                     **({"codec_s": round(s["codec_s"], 6)} if s.get("codec_s") else {}),
                     # the optimizer step's seconds (compute, as forward_s and backward_s: benchmarks/diloco_wan.py)
                     **({"optimizer_s": round(s["optimizer_s"], 6)} if "optimizer_s" in s else {})}
                 for p, s in self.parts.items()}
        line = {"step": self.step, "loss": self.loss, "iteration_s": round(self.iteration_s, 6),
                "samples_per_s": round(self.samples_per_s, 3), "time": time.time(), "parts": parts}
        if self.lr is not None:
            line["lr"] = self.lr
        if self.dropped:
            line["dropped"] = self.dropped  # replicas lost during this step: which one, why, redone or not
        if self.joined:
            line["joined"] = self.joined  # replicas that joined before this step: which, from whom, the new split
        if self.grad_norms:  # with --clip-grad-norm: the norm before clipping
            line["grad_norm"] = self.grad_norms[0]
            if len(set(self.grad_norms)) > 1:  # DiLoCo replicas clip their own inner steps
                line["grad_norm_replicas"] = self.grad_norms
        idle = [p for p, s in self.parts.items() if s.get("idle_step")]
        if idle:  # per-replica inner steps: the parts of replicas that took no inner step in this step
            line["idle_parts"] = idle
        outer = {p: s["outer"] for p, s in self.parts.items() if "outer" in s}
        if outer:  # a DiLoCo outer step ended this step: what each part sent and how long it took
            line["outer"] = {"sync_bytes": sum(o["sent_bytes"] for o in outer.values()),
                             "sync_s": max(o["s"] for o in outer.values()),
                             "replicas": max(o["replicas"] for o in outer.values()), "parts": outer}
        return line


def _names(parts: list[str], first: int = 5) -> str:
    """``part0, part1`` or ``7 parts (part0, part1, part2, ...)``: one short line however many."""
    if len(parts) <= first:
        return ", ".join(parts)
    return f"{len(parts)} parts ({', '.join(parts[:first])}, ...)"


def split_micro_batches(batch: Mapping[str, Any], n: int) -> list[dict[str, np.ndarray]]:
    """Split every placeholder value along dim 0 into ``n`` equal micro-batches (NumPy)."""
    out: list[dict[str, np.ndarray]] = [{} for _ in range(n)]
    for name, v in batch.items():
        a = np.asarray(v)
        if a.ndim == 0 or a.shape[0] % n:
            raise FusionError(f"batch field {name!r} has shape {list(a.shape)}, not divisible into {n} micro-batches")
        for i, c in enumerate(np.split(a, n, axis=0)):
            out[i][name] = np.ascontiguousarray(c)
    return out


class Coordinator:
    """Drives the executors of one plan."""

    def __init__(self, plan: Plan, cfg: CoordinatorConfig, processes: Mapping[str, Process] | None = None,
                 report: Callable[[str], None] | None = None):
        """report: called with one line per start-up event (a CompNode says hello, is ready, is still awaited)."""
        self.plan, self.cfg = plan, cfg
        self.report = report or (lambda line: log.info("%s", line))
        self.parts = list(plan.parts)
        self.processes = processes if processes is not None else {}  # by reference: a launcher may fill it later
        #: part -> the log file its process writes (set by a local launcher): a dead process's reason is quoted
        self.logs: dict[str, Path] = {}
        g = plan.graph
        self.replica_of = {p: plan.parts[p].replica for p in self.parts}
        self.feeds_of = {p: [n for n, q in plan.assignment.items()
                             if q == plan.stage_of(p) and g[n].kind in (NodeKind.INPUT, NodeKind.LABEL)]
                         for p in self.parts}
        self.feed_specs = feed_specs(plan, sorted({n for ns in self.feeds_of.values() for n in ns}))
        self._cv = threading.Condition()
        self._inbox: dict[str, list[Control]] = {p: [] for p in self.parts}
        self._last_seen: dict[str, float] = {}
        self._errors: dict[str, str] = {}
        #: part -> when its failure was first known (an error report's arrival, else the first look that saw it)
        self._failed_at: dict[str, float] = {}
        #: (part, pid) -> when a look first saw that process exited (EXIT_DRAIN_S)
        self._exited_at: dict[tuple[str, int], float] = {}
        self._lasting: set[str] = set()  # parts whose Error said a restart would fail the same way (a full disk)
        #: part -> (pid, address) of the executor whose hello this coordinator took. The same again is that executor
        #: repeating its hello until answered (``process.HELLO_REPEAT_S``), a heartbeat, not a new executor; anything
        #: else from a part not in here is a late message of an executor of a previous coordinator at this address
        #: (``--max-restarts``): dropped
        self._hello_of: dict[str, tuple[int, str]] = {}
        #: parts whose executor said hello a second time: a new executor replaces one that stopped (a supervisor
        #: restarted it); it is not sent this coordinator's abort, and its hello waits for the next coordinator
        self._replaced: set[str] = set()
        #: parts told at their hello that they run another plan (digest): they exit when told, which is not a
        #: failure of its own while the start waits out the others' hellos to name the mismatch to them too
        self._refused: set[str] = set()
        self.addresses: dict[str, str] = {}
        self.step_index = 0
        self.transport = Transport(COORDINATOR, cfg.bind, self.parts, self._on_message,
                                   max_message_bytes=cfg.max_message_bytes or coordinator_message_limit(plan), on_error=self._on_send_error,
                                   security=cfg.security,
                                   heartbeat=Heartbeat(cfg.link_timeout_s) if cfg.link_timeout_s > 0 else None)
        self.address = ""
        self._hb_stop = threading.Event()
        self.live = list(self.parts)  # parts of the replicas still training
        self.n_micro = plan.micro_batches  # micro-batches per live replica (grows when a replica is dropped)
        #: micro-batches of each replica per step: equal, or unequal DiLoCo shares (``plan.dp_sync.shares``)
        self.shares = replica_micro_batches(plan) if plan.dp_sync.shares else None
        self.iter_offset = 0  # executor iteration = step + abandoned attempts
        self.dropped: list[dict] = []
        self.joined: list[dict] = []
        #: replicas not started yet: replica -> the step before which it joins (set by :meth:`start`)
        self.pending: dict[int, int] = {}
        #: called with a late replica's parts when it is due (a local launcher starts their processes); None: they
        #: are started by hand (``fusion executor``) and the coordinator waits for their hellos
        self.spawn: Callable[[list[str]], None] | None = None
        self.id_edges = per_sample_edges(plan.compression)  # edges whose codec keys state by sample (delta)
        self._drops: list[dict] = []  # replicas dropped during the step in progress
        self._joins: list[dict] = []  # replicas that joined before the step in progress
        self.clip = (plan.optimizer or {}).get("clip_grad_norm") is not None  # the GradNorm/Clip exchange each step
        #: the plan's optimizer (its schedule gives each step's lr for the metrics line); None without one
        self.optimizer = OptimizerConfig.from_dict(plan.optimizer) if plan.optimizer else None
        self._norms: dict[int, float] = {}
        self._ahead: Ahead | None = None  # the step sent before the one in progress was done (:mod:`.step_ahead`)
        self._ahead_batch: Mapping[str, Any] | None = None  # the next step's batch, given to :meth:`step`
        self._reported: dict[str, Done] = {}  # the ``done`` reports of the step in progress collected so far
        self.sent_ahead = 0  # steps sent before the previous one was done (:mod:`.step_ahead`)
        self._t_done = 0.0  # when the previous step's last ``done`` was collected (a step sent ahead counts from it)

    # -- receiving ------------------------------------------------------------------
    def _on_message(self, sender: str, msg: Message) -> None:
        if msg.kind != "ctrl":
            raise WireError(f"{msg.kind} message sent to the coordinator")
        c = decode_ctrl(msg, TO_COORDINATOR)
        with self._cv:
            if c.op == "hello" and self._hello_of.get(sender) == (c.pid, c.address):
                self._last_seen[sender] = time.monotonic()  # a repeat: the executor has not heard us yet
                return
            if c.op == "hello":
                if sender in self._hello_of:  # a new executor of a part that is set up: the previous one is gone
                    self._replaced.add(sender)
                    self._errors.setdefault(sender, f"a new executor said hello (pid {c.pid}): "
                                                    "the one it replaces has stopped")
                    self._failed_at.setdefault(sender, time.monotonic())
                self._hello_of[sender] = (c.pid, c.address)
            elif sender not in self._hello_of:
                return  # from an executor of a previous coordinator at this address, not of this run's parts
            self._last_seen[sender] = time.monotonic()
            if isinstance(c, Error):
                self._errors.setdefault(sender, c.reason)
                self._failed_at.setdefault(sender, time.monotonic())
                if c.lasting:
                    self._lasting.add(sender)
            elif c.op != "hb":
                if len(self._inbox[sender]) >= MAX_QUEUED_PER_PART:
                    raise WireError(f"{len(self._inbox[sender])} messages from {sender} already wait; dropping {c.op!r}")
                self._inbox[sender].append(c)
            self._cv.notify_all()

    def _on_send_error(self, peer: str, reason: str) -> None:
        with self._cv:
            self._errors.setdefault(peer, reason)
            self._failed_at.setdefault(peer, time.monotonic())
            self._cv.notify_all()

    def _part_limit(self, p: str) -> int | None:
        """What part ``p`` receives at most (its ``--max-message-bytes``, the run's; else the plan's bound of its
        stage): a larger step is refused here, naming it, instead of dropped by the part while both sides wait.
        None (unchecked here) for a data-parallel part without that option, whose bound its group's buckets raise."""
        if self.cfg.max_message_bytes:
            return self.cfg.max_message_bytes
        return part_message_limit(self.plan, self.plan.stage_of(p)) if len(self.plan.dp_group(p)) == 1 else None

    def _failure(self, parts: list[str]) -> CompNodeFailure | None:
        """The failure among ``parts`` and the live ones, if any: every failed part named, the first cause first
        (the part whose failure was known first; :meth:`_failures` says what counts)."""
        found = self._failures(parts)
        if not found:
            return None
        now = time.monotonic()
        for p, _, _ in found:
            self._failed_at.setdefault(p, now)
        found.sort(key=lambda f: self._failed_at[f[0]])  # (stable: seen in one look, in the order of the kinds)
        p, reason, lasting = found[0]
        if len(found) > 1:
            reason += "; also failed: " + "; ".join(f"CompNode {q!r}: {r}" for q, r, _ in found[1:])
        return CompNodeFailure(p, reason, lasting=lasting, parts=tuple(q for q, _, _ in found))

    def _failures(self, parts: list[str]) -> list[tuple[str, str, bool]]:
        """``(part, reason, lasting)`` of each failed part, one cause each: an error report or a dead process (of
        any live part and ``parts``), a failed link (``link_timeout_s``, liveness.py) or silence
        (``peer_timeout_s``) of one of ``parts``, the parts still awaited."""
        now = time.monotonic()
        watched = list(dict.fromkeys([*self.live, *parts]))  # (parts: a joining replica's too)
        out: dict[str, tuple[str, str, bool]] = {}
        draining: set[str] = set()
        for p in watched:
            if p in self._errors:
                out[p] = (p, self._errors[p], p in self._lasting)
        for p in watched:
            proc = self.processes.get(p)
            rc = proc.poll() if proc is not None and p not in self._refused and p not in out else None
            if rc is not None:
                seen = self._exited_at.setdefault((p, proc.pid), now)
                self._failed_at.setdefault(p, seen)  # known since the first look saw it (named in that order)
                if now - seen < EXIT_DRAIN_S:
                    draining.add(p)
                why = last_error(self.logs.get(p))
                out[p] = (p, f"its process (pid {proc.pid}) exited with status {rc}"
                             + (f" ({why}; log {self.logs[p]})" if why else ""), False)
        links = self.transport.links
        for p in parts:
            if p in out or p in self._refused:
                continue
            down = links.down(p, now) if links is not None else None
            seen = self._last_seen.get(p)
            if down is not None:
                out[p] = (p, down, False)
            elif seen is not None and now - seen > self.cfg.peer_timeout_s:
                out[p] = (p, f"stopped answering (nothing received for {now - seen:.1f} s)", False)
        if out and set(out) <= draining:  # only exits seen under EXIT_DRAIN_S ago: what they sent last comes in first
            return []
        return list(out.values())

    def _collect(self, op: str, parts: list[str], timeout_s: float, what: str,
                 on_each: Callable[[str, Control], None] | None = None, remind_s: float = 0.0,
                 got: dict[str, Control] | None = None, abort: bool = True,
                 until: Callable[[], bool] | None = None) -> dict[str, Control]:
        """Wait for one ``op`` message from each of ``parts``; failures raise CompNodeFailure.

        on_each(part, message) is called as each arrives; every ``remind_s`` seconds (0: never) the
        report callback is told which parts are still awaited. got: collects into this dict (what
        arrived before a failure stays there); abort: tell every executor to abort on a failure;
        until: stop waiting (returning what arrived) once it returns True.
        """
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        next_remind = t0 + remind_s
        got = {} if got is None else got
        with self._cv:
            while True:
                for p in parts:
                    if p not in got:
                        box = self._inbox[p]
                        for i, c in enumerate(box):
                            if c.op == op:
                                got[p] = box.pop(i)
                                if on_each is not None:
                                    on_each(p, got[p])
                                break
                waiting = [p for p in parts if p not in got]
                if not waiting or (until is not None and until()):  # (got may hold more: a dropped replica's
                    return got                                         # reports collected before the drop)
                if remind_s and time.monotonic() >= next_remind:
                    next_remind += remind_s
                    self.report(f"still waiting for {_names(waiting)} ({what}, {time.monotonic() - t0:.0f} s of "
                                f"{timeout_s:.0f} s)")
                fail = self._failure(waiting)
                if fail is None and time.monotonic() > deadline:
                    fail = CompNodeFailure(waiting[0], f"no {op!r} within {timeout_s:.0f} s while {what} "
                                                       f"(still waiting for {_names(waiting)})")
                if fail is not None:
                    if abort:
                        self._abort_locked(f"{fail} (during {what})")
                    raise CompNodeFailure(fail.part, f"{fail.reason} (during {what})", fail.lasting, fail.parts)
                self._cv.wait(0.05)

    # -- lifecycle ------------------------------------------------------------------
    def bind(self) -> str:
        """Bind the coordinator's address (executors need it to say hello)."""
        if not self.address:
            self.address = self.transport.start()
        return self.address

    def start(self, resume: bool = False) -> int:
        """Wait for every executor's hello, send setup, wait until all are ready.

        Returns the first step to run: 0, or the step of the latest complete
        checkpoint when ``resume``.
        """
        self.bind()
        threading.Thread(target=self._heartbeat, name="coordinator-heartbeat", daemon=True).start()
        t0 = time.monotonic()

        def hello(p: str, c: Hello) -> None:
            # checked as each part says hello, not once all have: a part with another copy of the plan is named at
            # once, and the parts already up are connected (heartbeats tell them the coordinator is alive; an abort
            # reaches them naming the part that is late or mismatched, instead of their own start-up timeout)
            if c.part != p:
                raise CompNodeFailure(p, f"says hello as {c.part!r}")
            self.addresses[p] = c.address
            self.transport.connect(p, c.address, max_bytes=self._part_limit(p))
            bad = digest_mismatch(self.cfg.plan_digest, c.digest, f"CompNode {p!r}", "the coordinator's")
            if bad:  # told at once; the start fails once the others have said hello, or HELLO_GRACE_S later
                self._refused.add(p)
                self.transport.send(p, Abort(reason=bad).frames())
                self.report(bad)
                mismatched.append((time.monotonic(), bad))
                return
            self.report(f"{p} up: pid {c.pid}, {c.engine} engine, listening on {c.address} "
                        f"({time.monotonic() - t0:.1f} s after launch)")

        def ready(p: str, c: Control) -> None:
            self.report(f"{p} ready: part built and weights loaded ({time.monotonic() - t0:.1f} s after launch)")

        self.pending = self.late_replicas(checkpoint.latest(self.cfg.checkpoint_dir) if resume and self.cfg.checkpoint_dir
                                          else None)
        if self.pending:
            self.live = [p for p in self.parts if self.replica_of[p] not in self.pending]
            self.n_micro = self.plan.micro_batches * self.plan.replicas // len(self.live_replicas())
            self.report("replica(s) " + ", ".join(f"{r} join(s) before step {s}" for r, s in sorted(self.pending.items()))
                        + f"; starting with {len(self.live_replicas())} of {self.plan.replicas}, {self.n_micro} "
                          "micro-batches each")
        mismatched: list[tuple[float, str]] = []
        hellos = self._collect("hello", self.live, self.cfg.startup_timeout_s, "starting up", hello, remind_s=10.0,
                               until=lambda: bool(mismatched) and time.monotonic() > mismatched[0][0] + HELLO_GRACE_S)
        if mismatched:  # every part that said hello is connected: the abort names the mismatched part to all
            self._abort_locked(mismatched[0][1])
            raise FusionError(mismatched[0][1])
        resume_step, sources = None, {p: p for p in self.parts}
        if resume:
            if not self.cfg.checkpoint_dir:
                raise FusionError("resume needs a checkpoint directory")
            # files on this disk are verified here, before any executor loads them; a newest checkpoint that
            # does not verify is skipped (one line) for the previous complete one
            resume_step, found = checkpoint.newest_verified(self.cfg.checkpoint_dir,
                                                            {p: self.plan.stage_of(p) for p in self.parts},
                                                            self._skipped_checkpoint)
            if resume_step is not None:
                self._check_checkpoint_plan(resume_step)
                sources = found
                copied = {p: q for p, q in sources.items() if p != q and p in self.live}
                if copied:
                    self.report(f"step {resume_step} was saved without replica(s) "
                                f"{', '.join(str(r) for r in sorted({self.replica_of[p] for p in copied}))}: "
                                + ", ".join(f"{p} loads {q}'s copy" for p, q in copied.items()))
            if resume_step is None:
                log.warning("no complete checkpoint in %s; starting from step 0", self.cfg.checkpoint_dir)
        ckpt = str(Path(self.cfg.checkpoint_dir).resolve()) if self.cfg.checkpoint_dir else None
        late = {"members": list(self.live), "micro_batches": self.n_micro} if self.pending else {}
        for p in self.live:
            self.transport.send(p, Setup(peers=self.addresses, emulate_links=self.cfg.emulate_links,
                                         resume_step=resume_step, checkpoint_dir=ckpt, failover=self._failover,
                                         digest=self.cfg.plan_digest, resume_from=sources[p], **late).frames())
        self._collect("ready", self.live, self.cfg.startup_timeout_s, "setting up", ready, remind_s=10.0)
        self.step_index = resume_step or 0
        log.info("coordinator %s: %d CompNodes ready, starting at step %d", self.address, len(self.live), self.step_index)
        return self.step_index

    def _skipped_checkpoint(self, step: int | None, reason: str) -> None:
        what = f"checkpoint step {step}" if step is not None else "the latest-checkpoint pointer"
        self.report(f"skipping {what}: {reason}")  # one line, on the run's own output

    def late_replicas(self, resume_step: int | None) -> dict[int, int]:
        """The replicas that have not joined at ``resume_step`` (None: a fresh start): replica -> its join step.
        A checkpoint of step S is written before the join at S, so a replica joining at S is still late there."""
        first = resume_step or 0
        return {r: s for r, s in self.cfg.joins.items() if s >= first}

    # -- a replica joins (DiLoCo, at an outer boundary; executors/runtime/dp/join.py) --------------------
    def _admit_due(self) -> list[dict]:
        """Admit the late replicas due before the current step; their records (a refused one is logged)."""
        out = []
        for r, s in sorted(self.pending.items()):
            if s == self.step_index:
                del self.pending[r]
                rec = self._admit(r)
                if rec is not None:
                    out.append(rec)
        return out

    def _refuse_joiner(self, r: int, parts: list[str], why: str) -> None:
        """A joiner that cannot join: logged, told to abort (when it said hello), the job goes on without it."""
        for p in parts:
            if p in self.transport.senders:
                self.transport.send(p, Abort(reason=f"refused to join: {why}").frames())
        self.report(f"replica {r} refused at step {self.step_index}: {why}; going on with "
                    f"{len(self.live_replicas())} replica(s)")
        log.warning("replica %d refused at step %d: %s", r, self.step_index, why)

    def _admit(self, r: int) -> dict | None:
        """Replica ``r`` joins before the current step: its hellos (digest checked), the global weights and
        outer momentum fetched from a live part of each stage, the live parts told (``Admit``), the joiner set
        up with that state (``Setup`` with ``start_it``). Returns the record for metrics.jsonl, or None when the
        joiner was refused (it never said hello, said it as another part, or runs another plan digest)."""
        parts = [p for p in self.parts if self.replica_of[p] == r]
        reps = self.live_replicas()
        total = self.n_micro * len(reps)
        if total % (len(reps) + 1):
            self._refuse_joiner(r, [], f"the global batch of {total} micro-batches does not divide over "
                                       f"{len(reps) + 1} replicas")
            return None
        if self.spawn is not None:
            self.spawn(parts)
        self.report(f"replica {r} joins before step {self.step_index}: waiting for {_names(parts)}")
        try:
            hellos = self._collect("hello", parts, self.cfg.startup_timeout_s, f"replica {r} joining", remind_s=10.0,
                                   abort=False)
        except CompNodeFailure as e:
            if e.part in self.live:
                raise
            self._refuse_joiner(r, [], str(e))
            return None
        for p, h in hellos.items():
            self.transport.connect(p, h.address, max_bytes=self._part_limit(p))
        for p, h in hellos.items():
            bad = (f"CompNode {p!r} says hello as {h.part!r}" if h.part != p else
                   digest_mismatch(self.cfg.plan_digest, h.digest, f"joining CompNode {p!r}", "the coordinator's"))
            if bad:
                self._refuse_joiner(r, parts, bad)
                return None
        n_new = total // (len(reps) + 1)
        exec_it = self.step_index + self.iter_offset
        src = {p: next(q for q in self.plan.dp_group(p) if q in self.live) for p in parts}
        sources = sorted(set(src.values()), key=self.parts.index)
        for q in sources:
            self.transport.send(q, Fetch(outer=True).frames())
        state = self._collect("state", sources, self.cfg.startup_timeout_s, f"fetching the outer state for replica {r}")
        addr = {p: h.address for p, h in hellos.items()}
        for q in self.live:
            self.transport.send(q, Admit(it=exec_it, add=parts, peers=addr, micro_batches=n_new).frames())
        self._collect("admitted", self.live, self.cfg.startup_timeout_s, f"admitting replica {r}")
        self.addresses.update(addr)
        members = [p for p in self.parts if p in self.live or p in parts]
        ckpt = str(Path(self.cfg.checkpoint_dir).resolve()) if self.cfg.checkpoint_dir else None
        for p in parts:
            self.transport.send(p, Setup(arrays=state[src[p]].arrays, peers={q: self.addresses[q] for q in members},
                                         emulate_links=self.cfg.emulate_links, resume_step=None, checkpoint_dir=ckpt,
                                         failover=self._failover, digest=self.cfg.plan_digest, members=members,
                                         micro_batches=n_new, start_it=exec_it, join_from=src[p]).frames())
        # the live parts have taken the joiner in: a joiner failing now fails the run (as a failed part does)
        self._collect("ready", parts, self.cfg.startup_timeout_s, f"setting up replica {r}", remind_s=10.0)
        self.live, self.n_micro = members, n_new
        rec = {"replica": r, "step": self.step_index, "parts": parts, "from": sources,
               "replicas": len(reps) + 1, "micro_batches": n_new}
        self.joined.append(rec)
        self.report(f"replica {r} joined at step {self.step_index} (global weights and outer momentum from "
                    f"{', '.join(sources)}); {len(reps) + 1} replicas of {n_new} micro-batches")
        log.info("replica %d joined at step %d", r, self.step_index)
        return rec

    def _heartbeat(self) -> None:
        while not self._hb_stop.wait(self.cfg.heartbeat_s):
            for p in list(self.transport.senders):
                self.transport.send(p, Hb().frames())

    @property
    def _failover(self) -> bool:
        return bool(self.cfg.drop_failed_replicas and self.plan.replicas > 1)

    def _check_checkpoint_plan(self, step: int) -> None:
        """FusionError when complete checkpoint ``step`` was written by another plan than this run's (its
        ``COMPLETE.json`` names the digest of the plan that wrote it): resuming another cut's or another
        optimizer's state on these weights would train silently wrong. Checkpoints that name no digest (written
        before they did) are not judged."""
        import json

        try:
            written = json.loads((checkpoint.step_dir(self.cfg.checkpoint_dir, step) / checkpoint.COMPLETE)
                                 .read_text()).get("plan_digest")
        except (OSError, ValueError, AttributeError):
            return
        if written and self.cfg.plan_digest and written != self.cfg.plan_digest:
            raise FusionError(f"{checkpoint.step_dir(self.cfg.checkpoint_dir, step)}: the checkpoint was written by "
                              f"another plan (digest {written[:16]}) than this run's ({self.cfg.plan_digest[:16]}); "
                              "resume it with the plan that wrote it, or start a new run")

    def _lr_at(self, step: int) -> float | None:
        """The learning rate of optimizer step ``step`` as the plan's schedule gives it, a DiLoCo replica's inner lr
        (``dp_sync.inner_lr``) once the warm-up is over (None: no optimizer)."""
        if self.optimizer is None:
            return None
        return self.optimizer.lr_at(step, self.plan.dp_sync.base_lr(step, self.optimizer.lr))

    def live_replicas(self) -> list[int]:
        return sorted({self.replica_of[p] for p in self.live})

    def stepping(self, step: int | None = None) -> list[str]:
        """The live parts whose replica takes an inner step in step ``step`` (default: the one in progress; all of
        them unless the plan gives replicas their own inner steps: :func:`~.dp.inner_steps.steps_at`); the others
        are idle in it."""
        step = self.step_index if step is None else step
        return [p for p in self.live if steps_at(self.plan.dp_sync, self.replica_of[p], step + 1)]

    def step(self, batch: Mapping[str, Any], want_grads: bool = False,
             ahead: Mapping[str, Any] | None = None) -> StepReport:
        """Run one iteration on ``batch`` (placeholder -> array with all micro-batches).

        ahead: the next step's batch, when the caller runs it right after this one (no evaluation between, not the
        last step): it is sent to the CompNodes now, before this step's ``done`` arrives, where the run allows it
        (:mod:`.step_ahead`), and the next call (with that same batch) only collects it.

        With ``drop_failed_replicas``, a CompNode failure drops its replica (:meth:`_drop_replica`) and the
        step goes on with the surviving replicas; the report lists the drops in ``dropped``.
        """
        self._ahead_batch = ahead
        joined = self._admit_due() if self.pending else []
        drops: list[dict] = []
        self._drops = drops  # (the same list: a checkpoint's metrics line lists the drops of its step)
        self._joins = joined  # (and the joins before it)
        while True:
            committed: list[bool] = [False, False]  # [go-ahead sent, checkpoint asked for]
            done: dict[str, Done] = {}
            try:
                r = self._step_once(batch, want_grads, committed, done)
                r.dropped, r.joined = drops, joined
                return r
            except CompNodeFailure as e:
                if not self._failover:
                    raise
                why = self._cannot_drop(e.part)
                if why:  # e.g. the last replica of every stage is gone: the run ends here
                    with self._cv:
                        self._abort_locked(str(e))
                    raise CompNodeFailure(e.part, f"{e.reason}; {why}", e.lasting, e.parts) from None
                try:
                    drops.append(self._drop_replica(e, abandoned=not committed[0]))
                except CompNodeFailure as e2:  # a second failure while regrouping: give up as without failover
                    with self._cv:
                        self._abort_locked(str(e2))
                    raise
                if committed[0]:  # every survivor applied this step: collect the rest of its reports
                    r = self._finish_committed(batch, done, drops, committed[1])
                    r.joined = joined
                    return r

    def _cannot_drop(self, part: str) -> str:
        """Why the failed ``part``'s replica cannot be dropped ('' when it can)."""
        reps = self.live_replicas()
        total = self.n_micro * len(reps)
        if part not in self.live:
            return f"{part} is not in a live replica"
        if self.shares:
            return "the replicas have unequal shares (plan.dp_sync.shares), which a drop cannot re-split yet"
        if self.plan.dp_sync.inner_steps_per_replica:
            return ("the replicas take their own inner steps (plan.dp_sync.inner_steps_per_replica), which a drop "
                    "cannot re-weigh yet")
        if len(reps) == 1:
            return (f"replica {self.replica_of[part]} was the last one with a copy of stage "
                    f"{self.plan.stage_of(part)!r}: no replica is left to train on")
        if total % (len(reps) - 1):
            return (f"the global batch of {total} micro-batches does not divide over the {len(reps) - 1} "
                    f"surviving replicas")
        return ""

    def _drop_replica(self, e: CompNodeFailure, abandoned: bool) -> dict:
        """Stop the failed part's replica, tell the survivors to regroup, wait until they have."""
        r = self.replica_of[e.part]
        reps = self.live_replicas()
        gone = [p for p in self.live if self.replica_of[p] == r]
        self.live = [p for p in self.live if self.replica_of[p] != r]
        self.n_micro = self.n_micro * len(reps) // (len(reps) - 1)
        exec_it = self.step_index + self.iter_offset
        for p in gone:
            self.transport.send(p, Abort(reason=f"replica {r} dropped: {e}").frames())
        for p in self.live:
            self.transport.send(p, Regroup(it=exec_it, drop=gone, micro_batches=self.n_micro).frames())
        self._collect("regrouped", self.live, self.cfg.startup_timeout_s, f"regrouping without replica {r}", abort=False)
        if abandoned:
            self.iter_offset += 1
        rec = {"replica": r, "step": self.step_index, "part": e.part, "reason": e.reason, "redone": abandoned,
               "replicas_left": len(reps) - 1, "micro_batches": self.n_micro}
        self.dropped.append(rec)
        self.report(f"dropped replica {r} at step {self.step_index} ({e}); "
                    f"{'redoing the step' if abandoned else 'the step was already applied'} on {len(reps) - 1} replica(s) "
                    f"of {self.n_micro} micro-batches")
        log.warning("dropped replica %d at step %d: %s", r, self.step_index, e)
        return rec

    def _send_step(self, batch: Mapping[str, Any], want_grads: bool, ckpt: bool, step: int | None = None) -> int:
        """Send step ``step`` (default: the one in progress) to every live part; its rows."""
        step = self.step_index if step is None else step
        exec_it = step + self.iter_offset
        rows, arrays = self._part_arrays(batch, step)
        for p in self.live:
            # save_step: the files are named by completed steps, which redone attempts have put behind exec_it
            self.transport.send(p, Step(arrays=arrays[p], it=exec_it, want_grads=want_grads, checkpoint=ckpt,
                                        save_step=step + 1).frames())
        return rows

    def _checkpoints(self, step: int) -> bool:
        """Whether the parts save after step ``step`` (after a drop only the survivors save; their copy of each
        stage resumes the dropped replica's parts)."""
        every = self.cfg.checkpoint_every
        return bool(self.cfg.checkpoint_dir and every and (step + 1) % every == 0)

    def lock_step_reason(self, want_grads: bool = False) -> str | None:
        """Why this run's next step may not be sent before the current one is done (None: it may;
        :mod:`.step_ahead`)."""
        if self.cfg.steps_ahead < 1:
            return "--steps-ahead 0"
        return lock_step_reason(clip=self.clip, failover=self._failover, joining=bool(self.pending),
                                interleaved=any(len(ps) > 1 for ps in self.plan.lanes().values()),
                                want_grads=want_grads, checkpoint=self._checkpoints(self.step_index))

    def _send_ahead(self, want_grads: bool) -> None:
        """Send the next step (:attr:`_ahead_batch`) now, where the run allows it (:mod:`.step_ahead`)."""
        batch, self._ahead_batch = self._ahead_batch, None
        if batch is None or self.lock_step_reason(want_grads) is not None:
            return
        nxt = self.step_index + 1
        ckpt = self._checkpoints(nxt)
        rows = self._send_step(batch, False, ckpt, nxt)
        self._ahead = Ahead(nxt, rows, ckpt, time.monotonic())
        self.sent_ahead += 1

    def failed_step(self, part: str) -> int:
        """The step ``part`` failed in: the one in progress, or the next one when that was sent ahead
        (:mod:`.step_ahead`) and ``part`` had already reported the one in progress."""
        a = self._ahead
        if a is not None and a.step == self.step_index + 1 and part in self._reported:
            return a.step
        return self.step_index

    def settle(self) -> StepReport | None:
        """The report of a step sent ahead whose ``done`` was not collected (the loop stopped before running it,
        e.g. on Ctrl-C): the parts run it anyway, so it is collected and counted here; None when there is none."""
        if self._ahead is None or self._ahead.step != self.step_index:
            return None
        done: dict[str, Done] = {}
        self._collect("done", self.live, self.cfg.step_timeout_s, f"step {self.step_index}", got=done)
        a, self._ahead = self._ahead, None
        return self._report(a.step, a.step + self.iter_offset, a.rows, done, max(a.sent_at, self._t_done),
                            a.checkpoint)

    def evaluate(self, batch: Mapping[str, Any]) -> float:
        """The loss of ``batch`` forward only (``--eval-every``): every live replica's share of it through its
        pipeline with no gradient, no optimizer step and no state changed; the mean over micro-batches of the
        summed loss nodes, as :meth:`step`'s loss. Runs between steps, at the iteration the parts are at."""
        if any(len(ps) > 1 for ps in self.plan.lanes().values()):
            raise FusionError("evaluation (--eval-every) does not run under the interleaved schedule yet")
        exec_it = self.step_index + self.iter_offset
        _, arrays = self._part_arrays(batch)
        for p in self.live:
            self.transport.send(p, Eval(arrays=arrays[p], it=exec_it).frames())
        got = self._collect("evaluated", self.live, self.cfg.step_timeout_s, f"evaluating at step {self.step_index}")
        losses, covered = [], set()
        for p in self.live:
            if got[p].it != exec_it:
                raise CompNodeFailure(p, f"answered the evaluation at iteration {got[p].it} to one at {exec_it}")
            losses += [float(v) for _, v in got[p].losses]
            covered |= {(self.replica_of[p], int(mb)) for mb, _ in got[p].losses}
        if not covered:
            raise FusionError("evaluation: no part computed a loss (the model has no loss node)")
        return float(np.sum(losses) / len(covered))

    def _part_arrays(self, batch: Mapping[str, Any], step: int | None = None
                     ) -> tuple[int, dict[str, dict[str, np.ndarray]]]:
        """The rows of ``batch`` and each live part's tensors of it for step ``step`` (default: the one in
        progress): its placeholders of its replica's micro-batches (``"<micro-batch>/<placeholder>"``), and the
        sample ids where the plan has per-sample edges."""
        step = self.step_index if step is None else step
        from fusion.ir.opdata import SAMPLE_IDS

        n, reps = self.n_micro, self.live_replicas()
        ids = batch_ids(batch, self.id_edges)  # None unless the plan has per-sample (delta) edges
        batch = {k: v for k, v in batch.items() if k != SAMPLE_IDS}
        rows = next(iter(batch.values())).shape[0] if batch else 0
        if self.plan.global_batch and rows != self.plan.global_batch:
            raise FusionError(f"batch has {rows} rows; the plan's global_batch is {self.plan.global_batch}")
        # the global batch: one contiguous share per live replica, each n micro-batches (or its unequal share)
        counts = self.shares if self.shares else [n] * len(reps)
        starts = [sum(counts[:k]) for k in range(len(counts))]
        mbs = split_micro_batches(batch, sum(counts))
        for m, mb in enumerate(mbs):  # before anything is sent: a bad field is one line naming it and its node
            for ph, spec in self.feed_specs.items():
                why = feed_problem(spec, np.asarray(mb[ph])) if ph in mb else None
                if why:
                    raise FusionError(f"step {step}: batch field {ph!r} (micro-batch {m}) {why}")
        mb_ids = None if ids is None else split_micro_batches({SAMPLE_IDS: ids}, sum(counts))
        out: dict[str, dict[str, np.ndarray]] = {}
        stepping = set(self.stepping(step))
        if len(stepping) < len(self.live):  # per-replica inner steps: the idle replicas' shares are not trained on
            rows = rows * sum(counts[reps.index(r)] for r in {self.replica_of[p] for p in stepping}) // sum(counts)
        for p in self.live:
            if p not in stepping:
                out[p] = {}
                continue
            missing = [ph for ph in self.feeds_of[p] if ph not in mbs[0]]
            if missing:
                raise FusionError(f"batch has no field {missing[0]!r} (the plan places it on part {p!r})")
            k = reps.index(self.replica_of[p])
            lo, nk = starts[k], counts[k]
            share = mbs[lo:lo + nk]
            arrays = {f"{m}/{ph}": share[m][ph] for m in range(nk) for ph in self.feeds_of[p]}
            if mb_ids is not None:  # every part: a part sending over a delta edge keys its buffers by them
                arrays.update({f"{m}/{SAMPLE_IDS}": mb_ids[lo + m][SAMPLE_IDS] for m in range(nk)})
            out[p] = arrays
        return rows, out

    def _step_once(self, batch: Mapping[str, Any], want_grads: bool, committed: list[bool],
                   done: dict[str, Done]) -> StepReport:
        it = self.step_index
        exec_it = it + self.iter_offset
        a, self._ahead = self._ahead, None
        if a is not None and a.step == it:  # sent with the previous step (:mod:`.step_ahead`)
            t0, rows, ckpt = max(a.sent_at, self._t_done), a.rows, a.checkpoint
        else:
            ckpt = self._checkpoints(it)
            t0 = time.monotonic()
            rows = self._send_step(batch, want_grads, ckpt)
        self._send_ahead(want_grads)
        self._reported = done
        committed[1] = ckpt
        self._norms = {}
        # the end of the step as every part runs it (fusion.ir.schedule.step_tail); the coordinator's kinds
        handlers = {TailKind.GRAD_NORM: self._tail_grad_norm, TailKind.CLIP: self._tail_clip,
                    TailKind.REDUCED: self._tail_reduced, TailKind.COMMIT: self._tail_commit}
        for kind in step_tail(self.clip, self._failover, ckpt):
            if kind in handlers:
                handlers[kind](it, exec_it, committed)
        self._collect("done", self.live, self.cfg.step_timeout_s, f"step {it}", got=done, abort=not self._failover)
        return self._report(it, exec_it, rows, done, t0, ckpt)

    def _tail_grad_norm(self, it: int, exec_it: int, committed: list[bool]) -> None:
        """The global norm: every live part's sum of squares, summed per replica (pipeline)."""
        with self._cv:  # an abandoned attempt's (a dropped replica) norms arrived before its regroup: not this one's
            for p in self.live:
                self._inbox[p] = [c for c in self._inbox[p] if not (isinstance(c, GradNorm) and c.it != exec_it)]
        stepping = self.stepping()  # a replica idle in this step has no gradient
        got = self._collect("gradnorm", stepping, self.cfg.step_timeout_s, f"step {it}", abort=not self._failover)
        for r in sorted({self.replica_of[p] for p in stepping}):
            self._norms[r] = total_norm(got[p].sq for p in stepping if self.replica_of[p] == r)

    def _tail_clip(self, it: int, exec_it: int, committed: list[bool]) -> None:
        for p in self.stepping():
            self.transport.send(p, Clip(it=exec_it, norm=self._norms[self.replica_of[p]]).frames())

    def _tail_reduced(self, it: int, exec_it: int, committed: list[bool]) -> None:
        """Commit only when every live part has its averaged gradients: all step or none."""
        self._collect("reduced", self.live, self.cfg.step_timeout_s, f"step {it}", abort=False)

    def _tail_commit(self, it: int, exec_it: int, committed: list[bool]) -> None:
        for p in self.live:
            self.transport.send(p, Commit(it=exec_it).frames())
        committed[0] = True

    def _finish_committed(self, batch, done: dict[str, Done], drops: list[dict], ckpt: bool) -> StepReport:
        """A replica was lost after the go-ahead: the survivors applied (and, if asked, saved) the step."""
        it = self.step_index
        t0 = time.monotonic()
        self._collect("done", self.live, self.cfg.step_timeout_s, f"step {it}", got=done, abort=False)
        rows = next(iter(batch.values())).shape[0] if batch else 0
        r = self._report(it, it + self.iter_offset, rows, {p: done[p] for p in self.live}, t0, ckpt)
        r.dropped = drops
        return r

    def _report(self, it: int, exec_it: int, rows: int, done: dict[str, Done], t0: float, ckpt: bool) -> StepReport:
        self._t_done = time.monotonic()
        dt = self._t_done - t0
        n, R = self.n_micro, len(self.live_replicas())
        losses = []
        covered: set[tuple[int, int]] = set()  # (replica, micro-batch) whose losses arrived
        grads: dict[str, np.ndarray] = {}
        for p in self.live:  # plan part order
            c = done[p]
            if c.it != exec_it:
                raise CompNodeFailure(p, f"answered iteration {c.it} to iteration {exec_it}")
            losses += [float(v) for _, v in c.losses]
            covered |= {(self.replica_of[p], int(mb)) for mb, _ in c.losses}
            for name, g in c.arrays.items():
                grads.setdefault(name, np.array(g))
        # each replica's loss is the mean of its micro-batches; the step's is the mean over equal shares. A step
        # committed before a replica was lost reports the survivors' shares only (the lost one's losses are gone)
        r = StepReport(it, float(np.sum(losses) / (len(covered) or n * R)), dt, rows, {p: done[p].stats for p in self.live},
                       grads, list(self._drops), list(self._joins),
                       grad_norms=[self._norms[r] for r in self.live_replicas() if r in self._norms],
                       lr=self._lr_at(it))
        if ckpt:
            unsaved = [p for p in self.live if done[p].stats.get("checkpoint_step") != it + 1]
            if unsaved:
                raise CompNodeFailure(unsaved[0], f"did not confirm its checkpoint of step {it + 1}")
            # each executor wrote its own files (on its own host); their confirmations make the step complete.
            # After a drop the live parts hold every stage: a resume gives the dropped parts their copies
            # The step's metrics line goes into COMPLETE.json: a crash before train() writes it loses nothing
            extra = {"time": time.time(), **({"dropped": self.dropped} if self.dropped else {}),
                     **({"joined": self.joined} if self.joined else {}), "metrics": r.metrics_line(),
                     **({"plan_digest": self.cfg.plan_digest} if self.cfg.plan_digest else {})}
            checkpoint.commit(self.cfg.checkpoint_dir, it + 1, list(self.live), extra, check_files=False)
            faults.maybe_fail(COORDINATOR, it + 1)  # FUSION_TEST_FAULT: a crash before the metrics line
        self.step_index = it + 1
        return r

    def fetch_state(self, timeout_s: float = 60.0, replica: int | None = None) -> dict[str, np.ndarray]:
        """Every parameter's current value, gathered from the parts of ``replica`` (default: the first
        live one; shared ones once)."""
        if replica is None:
            replica = self.live_replicas()[0]
        parts = [p for p in self.live if self.replica_of[p] == replica]
        for p in parts:
            self.transport.send(p, Fetch().frames())
        got = self._collect("state", parts, timeout_s, "fetching parameters")
        out: dict[str, np.ndarray] = {}
        for p in parts:
            for k, v in got[p].arrays.items():
                out.setdefault(k, np.array(v))
        return out

    def _abort_locked(self, reason: str) -> None:
        for p in list(self.transport.senders):
            if p not in self._replaced:  # (the link may reach the new executor at the same address)
                self.transport.send(p, Abort(reason=reason).frames())

    def abort(self, reason: str) -> None:
        """Tell every executor to stop (exit status 1), except one that has already been replaced."""
        with self._cv:
            self._abort_locked(reason)

    def pending_hellos(self) -> list[tuple[str, Control]]:
        """(sender, hello) of each hello received and not taken: of new executors that replace stopped ones
        (``--max-restarts`` of a standalone coordinator hands them to the next coordinator at this address)."""
        with self._cv:
            return [(p, c) for p, box in self._inbox.items() for c in box if c.op == "hello"]

    def take_hellos(self, hellos: list[tuple[str, Control]]) -> None:
        """Hellos received by a previous coordinator at this address (:meth:`pending_hellos`), as if sent here."""
        with self._cv:
            for p, c in hellos:
                self._hello_of[p] = (c.pid, c.address)
                self._last_seen[p] = time.monotonic()
                self._inbox[p].append(c)
            self._cv.notify_all()

    def stop(self) -> None:
        """Tell every executor to finish (they flush traces and exit 0; a dropped replica's were aborted)."""
        for p in list(self.transport.senders):
            self.transport.send(p, Stop().frames())

    def close(self, linger_s: float = 0.5) -> None:
        """Release the sockets; queued messages (stop, abort) get ``linger_s`` to leave."""
        self._hb_stop.set()
        self.transport.close(timeout_s=2.0, linger_s=linger_s)

"""The CompNode executor: one process that runs one part of a plan (FusionLLM §3.3).

It loads its part of the plan (sub-DAG, parameters, engine), then runs
iterations when the coordinator says so. Within an iteration it follows its
schedule (a list of F/B actions, :mod:`fusion.executors.runtime.schedule`) in one
engine loop: an action runs as soon as everything it needs has arrived —
activations from producer parts for a forward, gradients from every consumer
part for a backward. Outputs go to remote users as OP-Data: the engine loop
hands them to ZeroMQ, whose I/O thread transmits them while the next action
computes (with link emulation, a sender thread per link holds them for
alpha + beta * M first); while it waits, the engine loop receives.
Parameter gradients accumulate over micro-batches; gradients of parameters
held by several parts (tied weights) are exchanged between their owners and
summed in plan order, then the optimizer steps locally (synchronous
semantics). Received messages are checked against the part's boundary
tables before they are accepted; a bad one is logged and dropped.

Nothing here imports torch: the engine module is imported through
:mod:`fusion.executors.engines.select` only when the part's engine needs it.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fusion.ir.boundary import part_links, part_order, partition
from fusion.ir.errors import FusionError, WireError
from fusion.ir.opdata import SAMPLE_IDS, OpData
from fusion.ir.wire import Message, encode_opdata, opdata_from_message
from fusion.executors.runtime import checkpoint, delta_edges, faults
from fusion.executors.runtime.allreduce import NotYourTurn, RingInbox, average, flatten, make_buckets, unflatten
from fusion.executors.runtime.clip import clip_coef, part_sq_norm, scale_grads
from fusion.executors.runtime.control import (TO_EXECUTOR, Abort, Admit, Admitted, Clip, Commit, Control, Done, Error, Eval,
                                              Evaluated, Fetch, GradNorm, Hb, Hello, Ready, Reduced,
                                              Regroup as RegroupMsg, Regrouped, Setup, State, Step, decode_ctrl,
                                              lasting_failure)
from fusion.executors.engines.select import check_optimizer, engine_options_for, make_engine_part, make_optimizer
from fusion.executors.runtime.linkemu import EmulatedLink, link_model
from fusion.executors.runtime.compression import CompressionTable, TiedCodec, sum_in_order
from fusion.executors.runtime.outer import (DelayedInbox, OuterLoop, PseudoInbox, fragment_buckets, replica_micro_batches,
                                            write_params)
from fusion.executors.runtime.inbox import Inbox
from fusion.executors.runtime.join import adopt, join_arrays
from fusion.executors.runtime.feeds import feed_problem, feed_specs
from fusion.executors.runtime.limits import allreduce_message_limit, coordinator_message_limit, part_message_limit
from fusion.plan import OptimizerConfig, Plan
from fusion.executors.runtime.part import PartRuntime, make_routes
from fusion.executors.runtime.schedule import ActionKind, make_lanes, make_schedule, splits_backward
from fusion.executors.runtime.trace_events import Tracer, now_us
from fusion.executors.runtime.keys import Security, insecure_warning
from fusion.executors.runtime.plandigest import digest_mismatch
from fusion.executors.runtime.transport import Transport, pump_any

log = logging.getLogger(__name__)
#: all-reduce messages kept for the next ring after a regroup (:class:`NotYourTurn`), at most; a survivor sends at
#: most one step per bucket ahead of this part's regroup, so this bounds memory, not correctness, for sane groups
MAX_EARLY_RING = 256

COORDINATOR = "coordinator"
#: control messages waiting for the engine loop (the coordinator sends one at a time; more is a flood)
MAX_QUEUED_CTRL = 64


class ExecutorAbort(FusionError):
    """The executor stops: told to abort, coordinator gone, or a wait timed out."""


class Regroup(Exception):
    """The coordinator dropped a replica: the current attempt is abandoned (a wait raises this)."""


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


@dataclass
class ExecutorConfig:
    """How one CompNode process runs.

    part:            the part (CompNode) name in the plan.
    coordinator:     the coordinator's address, e.g. ``tcp://10.0.0.1:5555``.
    bind:            the address to bind (``tcp://127.0.0.1:*`` picks a free port).
    advertise:       the address peers should connect to (default: the bound one).
    device:          engine device, e.g. ``cpu`` or ``cuda:0``.
    heartbeat_s:     seconds between heartbeats to the coordinator.
    peer_timeout_s:  the coordinator silent this long means it is gone: exit.
    data_timeout_s:  the longest wait for one action's inputs before giving up.
    startup_timeout_s: the longest wait for the coordinator's first answer (setup) before giving up.
    trace_path:      where to write the Chrome trace at exit (None: no trace).
    engine_options:  options of the part's engine where it has them (torch: ``compiled``,
                     ``compile``, ``recompute``; :func:`~fusion.executors.engines.select.make_engine_part`).
    trust_plugins:   import the plugin files the plan lists (``--trust-plugins``); refused otherwise.
    """

    part: str
    coordinator: str
    bind: str = "tcp://127.0.0.1:*"
    advertise: str | None = None
    device: str = "cpu"
    max_message_bytes: int | None = None  # None: derived from the plan (limits.part_message_limit)
    heartbeat_s: float = 0.5
    peer_timeout_s: float = 10.0
    data_timeout_s: float = 300.0
    startup_timeout_s: float = 120.0
    trace_path: str | None = None
    engine_options: dict = field(default_factory=dict)
    trust_plugins: bool = False  # import the plan's plugin files (code): only for plans the user trusts
    security: Security | None = None  # CURVE keys (executors.runtime.keys); None: plain TCP (--insecure)
    plan_digest: str = ""  # this host's plan digest (plandigest.plan_digest), compared with the coordinator's


class CompNode:
    """One part of a plan, driven by control messages from the coordinator."""

    #: seconds between "still waiting for ..." log lines of a long wait
    remind_s = 10.0

    def __init__(self, plan: Plan, plan_dir: str | Path, cfg: ExecutorConfig):
        if cfg.part not in plan.parts:
            raise FusionError(f"plan has no part {cfg.part!r} (parts: {sorted(plan.parts)})")
        self.plan, self.plan_dir, self.cfg, self.me = plan, Path(plan_dir), cfg, cfg.part
        from fusion.ir.registry import import_plugins

        # before any socket opens: refused (untrusted) plugins stop the process with the reason
        import_plugins(plan.graph.plugins, base=str(self.plan_dir if self.plan_dir.is_dir() else self.plan_dir.parent),
                       trusted=cfg.trust_plugins)
        g = plan.graph
        self.graph = g
        # the pipeline of this part's replica: node -> its part (replica 0: the plan's assignment)
        self.replica = plan.parts[self.me].replica
        self.assignment = plan.replica_assignment(self.replica)
        self.order = part_order(g, self.assignment)
        # micro-batches of this replica per step: plan.micro_batches, or its part under unequal shares (DiLoCo)
        self.shares = replica_micro_batches(plan) if plan.dp_sync.shares else None
        self.n_micro = self.shares[self.replica] if self.shares else plan.micro_batches
        self.devices = {p: plan.parts[p].device for p in self.order}
        self.actions = make_schedule(plan.schedule, self.order, part_links(g, self.assignment), self.n_micro,
                                     self.devices)[self.me]
        self.engine_name = plan.parts[self.me].engine
        subs = partition(g, self.assignment)
        self.sub = subs[self.me]
        owners: dict[str, list[str]] = {}
        for p in self.order:
            for n in subs[p].nodes:
                for pname in g[n].param_names():
                    if g.params[pname].trainable and p not in owners.setdefault(pname, []):
                        owners[pname].append(p)
        self.shared = {n: ps for n, ps in owners.items() if len(ps) > 1 and self.me in ps}
        # codecs are checked before any socket opens: an unknown one (say, a plugin not listed) or a torch-only
        # user codec on a NumPy part stops the process with one line naming the edge and codec
        table = CompressionTable.build(self.me, plan.replica_compression(self.replica) or (), g, self.engine_name,
                                       autocast=plan.precision == "bf16")
        self.tied = TiedCodec.from_cfg(getattr(plan, "tied_codec", None)) if self.shared else None
        if self.tied is not None:
            self.tied.check_engine(self.me, self.engine_name)
        self.param_names = sorted({p for n in self.sub.nodes for p in g[n].param_names()})
        self._param_dtypes = {p: g.params[p].dtype for p in self.param_names}
        self.tracer = Tracer(f"CompNode {self.me}", list(plan.parts).index(self.me), enabled=cfg.trace_path is not None,
                             spill=f"{cfg.trace_path}.events.jsonl" if cfg.trace_path else None)
        self.runtime: PartRuntime | None = None
        self.opt = None
        self._cv = threading.Condition()
        self._ctrl: deque[Control] = deque()
        self.inbox = Inbox(g, self.me, make_routes(self.sub, self.assignment), self.n_micro, self.shared)
        self.inbox.autocast = plan.precision == "bf16"
        self.inbox.codecs = table.incoming_codecs()
        self.feed_specs = feed_specs(plan, [n for n in self.sub.nodes if g[n].kind.value in ("input", "label")])
        if self.tied is not None:
            self.inbox.decode_pgrad = self._decode_tied
        # data parallelism: this stage's replicas average their gradients over a ring or a tree (allreduce.py)
        self.dp_group = plan.dp_group(self.me)
        trainable = {p: (tuple(g.params[p].shape), g.params[p].dtype) for p in self.param_names if g.params[p].trainable}
        # DiLoCo's buckets: one run per streaming fragment (one fragment: make_buckets itself)
        # (only a group of 2 or more has buckets: a single pipeline keeps any dtype, bfloat16 included)
        self.ring, self._fragments, self._dp_buckets = None, None, []
        # all-reduce messages sent in a group this part has not regrouped into yet (NotYourTurn): a survivor that
        # regrouped first already sends in the new group; offered to the next ring (_new_ring)
        self._early_ring: deque = deque(maxlen=MAX_EARLY_RING)
        if len(self.dp_group) > 1:
            # (kept for every later ring: a group that shrinks to one part has none, and may grow again by a join)
            self._dp_buckets, self._fragments = (fragment_buckets(trainable, plan.dp_sync.fragments)
                                                 if plan.dp_sync.mode == "diloco" else (make_buckets(trainable), None))
            self._new_ring()
        # DiLoCo (plan.dp_sync.mode "diloco"): no per-step all-reduce; an outer step every H steps (outer.py)
        self.diloco = self.ring is not None and plan.dp_sync.mode == "diloco"
        if self.shares and not self.diloco:
            raise FusionError("plan.dp_sync.shares: unequal replica shares need DiLoCo (dp_sync.mode 'diloco'); "
                              "synchronous DP splits the global batch equally")
        self.outer: OuterLoop | None = None  # built in _setup, from the weights the part starts with
        self._pseudo: PseudoInbox | None = None
        # delayed outer steps (dp_sync.delay 1): the rounds in flight, kept across regroups (the plan's group);
        # built before any socket opens, so a peer's round that arrives before this part's setup is kept
        self._delayed = (DelayedInbox(self.me, self.dp_group, self.ring.buckets, plan.dp_sync.codec)
                         if self.diloco and plan.dp_sync.delay else None)
        self._aborted: str | None = None
        self._regroup: RegroupMsg | None = None  # a replica was dropped: abandon the attempt (failover runs)
        self.failover = False
        self._last_coord = time.monotonic()
        self._heard_coord = False  # before first contact only the startup timeout applies
        self._peers = self._peer_parts()
        # only the coordinator and the parts this one exchanges OP-Data with may send to it
        limit = cfg.max_message_bytes or part_message_limit(plan, plan.stage_of(self.me))
        if self.ring is not None and not cfg.max_message_bytes:
            limit = max(limit, allreduce_message_limit(self.ring.buckets, 1 if self.diloco else self.ring.chunks))
            if self.diloco:  # a joiner's setup carries the global weights and the outer momentum (join.py)
                limit = max(limit, 2 * allreduce_message_limit(self.ring.buckets, 1) * len(self.ring.buckets))
        self.transport = Transport(self.me, cfg.bind, self._peers | {COORDINATOR}, self._on_message,
                                   max_message_bytes=limit, tracer=self.tracer,
                                   on_error=self._on_send_error, recv_thread=False,  # the engine loop receives
                                   security=cfg.security)
        self._hb_stop = threading.Event()
        #: the other parts of this process (interleaved 1F1B: the device's other virtual stages); waits pump their
        #: sockets too, so their messages and the coordinator's words to them are handled while this part waits
        self._siblings: list[CompNode] = []
        self._prev_sent: dict[str, tuple[int, int, float]] = {}
        #: test hook (tests/executors/runtime/test_diloco.py): "PART:STEPS" makes part PART's process exit
        #: (status 17) right after it hands the first message of its outer exchange after STEPS completed steps
        #: to the transport, so a replica dies in the middle of an exchange deterministically; unset in real runs
        self._die_in_outer = os.environ.get("FUSION_TEST_DIE_IN_OUTER")
        self._weights: dict[str, np.ndarray] | None = None

    def _peer_parts(self) -> set[str]:
        """Parts this one exchanges OP-Data with: producers, consumers, co-owners of tied parameters."""
        b, a = self.sub.boundary, self.assignment
        peers = {a[e.actual_user] for e in b.sent_acts} | {a[e.producer] for e in b.required_acts}
        for owners in self.shared.values():
            peers.update(owners)
        if self.ring is not None:  # all-reduce neighbours in the data-parallel group (ring or tree)
            peers.update(self.ring.neighbours)
        peers.discard(self.me)
        return peers

    # -- receiving (called by the transport from the engine loop's waits) ----------------
    def _on_message(self, sender: str, msg: Message) -> None:
        if sender == COORDINATOR:
            self._last_coord = time.monotonic()
            self._heard_coord = True
        if msg.kind == "ctrl":
            if sender != COORDINATOR:
                raise WireError(f"control message from {sender!r}; only the coordinator sends those")
            c = decode_ctrl(msg, TO_EXECUTOR)
            if c.op == "hb":
                return
            if isinstance(c, (Step, Eval)):  # (a step's save_step was checked when decoded)
                self._check_feeds(c)
            if isinstance(c, RegroupMsg):
                with self._cv:
                    self._regroup = c
                    self._cv.notify_all()
                return
            with self._cv:
                if len(self._ctrl) >= MAX_QUEUED_CTRL and c.op != "abort":
                    raise WireError(f"{len(self._ctrl)} control messages already queued; dropping {c.op!r}")
                if isinstance(c, Abort):
                    self._aborted = f"aborted by the coordinator: {c.reason}"
                self._ctrl.append(c)
                self._cv.notify_all()
            return
        if msg.kind == "allreduce":
            with self._cv:
                if self.ring is None:
                    raise WireError(f"all-reduce message from {sender!r}, but {self.me} has no data-parallel group")
                if msg.header.get("delayed") is True:  # a delayed round's pseudo-gradient (outer.py, delay 1)
                    if self._delayed is None:
                        raise WireError(f"delayed pseudo-gradient from {sender!r}, but {self.me} runs no delayed "
                                        "outer step")
                    self._delayed.accept(sender, msg)
                else:
                    try:
                        self._accept_ring(sender, msg)
                    except NotYourTurn as e:  # refused by this group (logged and counted), kept for the next
                        self._early_ring.append((sender, msg))
                        raise WireError(f"{e} (kept in case this part regroups: a survivor may send first)") from None
                self._cv.notify_all()
            return
        try:
            od = opdata_from_message(msg)
        except WireError as e:  # (its payload, say): what the header says it is may still be an input this part awaits
            self._refused_input(sender, msg.kind == "pgrad", msg.header if isinstance(msg.header, dict) else {}, str(e))
            raise
        with self._cv:
            try:
                self.inbox.accept(sender, od, param_grad=msg.kind == "pgrad")
            except WireError as e:
                self._refused_input(sender, msg.kind == "pgrad", od, str(e))
                raise
            self._cv.notify_all()

    def _refused_input(self, sender: str, pgrad: bool, od: "OpData | dict", reason: str) -> None:
        """A refused OP-Data message that this part's schedule waits for stops the part at once, naming the message,
        its sender and why (the coordinator then ends the step with that line) instead of waiting ``--data-timeout``
        for a message its sender believes delivered. It is one when it comes from the part that sends it (``src`` is
        the sender), to this part, for the iteration under way or the next (one that arrives early is lost as well),
        on a route this part takes (a producer's activation, a consumer's gradient, a co-owner's tied gradient), and
        is not a second copy. Anything else is only logged and counted, as before: a stranger's packets, another
        part's claims, stale messages of an iteration that is over."""
        get = od.get if isinstance(od, dict) else (lambda k: getattr(od, k, None))
        src, dst, name, index = get("src"), get("dst"), get("name"), get("index")
        it, mb, is_grad = get("local_iter"), get("micro_batch"), get("is_grad")
        if not (isinstance(src, str) and src == sender and dst == self.me and isinstance(name, str)
                and type(it) is int and type(mb) is int and type(is_grad) is bool
                and (index is None or type(index) is int)):
            return
        if reason.startswith("duplicate "):  # the first copy arrived: nothing is missing
            return
        with self._cv:
            inbox = self.inbox
            if not inbox.open or it not in (inbox.expected_iter, inbox.expected_iter + 1):
                return
            if pgrad:
                ours = sender in inbox.shared.get(name, ())
                what = f"gradient of tied parameter {name!r}"
            else:
                key = (name, index)
                ours = 0 <= mb < inbox.n_micro and (sender in inbox.routes.grads_from.get(key, ()) if is_grad
                                                    else inbox.routes.recv_from.get(key) == sender)
                what = (f"{'gradient' if is_grad else 'activation'} {name}{'' if index is None else f'[{index}]'} "
                        f"of micro-batch {mb}")
            if not ours:
                return
            why = f"refused the {what} of iteration {it} from {sender}, which this part waits for: {reason}"
            log.error("%s: %s", self.me, why)
            self._aborted = self._aborted or why
            self._cv.notify_all()

    def _check_feeds(self, c: "Step | Eval") -> None:
        """A step's tensors are named ``<micro-batch>/<placeholder>`` for placeholders of this part, and each is what
        the plan says that placeholder takes (:mod:`.feeds`: dimensions, dtype kind, finite, index range). A step
        that fails is refused and this part stops naming the field and node: the coordinator checked the same
        before sending, so a step that fails here cannot be trained on, and waiting for another would hang."""
        mine = {n for n in self.sub.nodes if self.graph[n].kind.value in ("input", "label")}
        for name, arr in c.arrays.items():
            mb, _, ph = name.partition("/")
            if ph == SAMPLE_IDS and (arr.ndim != 1 or arr.dtype != np.int64):  # every part gets the sample ids
                raise WireError(f"step {c.it}: {name!r} must be a 1-D int64 array, got {arr.dtype}{list(arr.shape)}")
            if not (mb.isdigit() and int(mb) < self.n_micro and (ph in mine or ph == SAMPLE_IDS)):
                raise WireError(f"step {c.it}: tensor {name[:80]!r} is not '<micro-batch>/<placeholder>' "
                                f"of this part (micro-batches 0..{self.n_micro - 1}, placeholders {sorted(mine)})")
            why = feed_problem(self.feed_specs[ph], arr) if ph != SAMPLE_IDS else None
            if why:
                reason = f"step {c.it}: feed {ph!r} (micro-batch {mb}) {why}"
                with self._cv:
                    self._aborted = self._aborted or reason
                    self._cv.notify_all()
                raise WireError(reason)

    def _on_send_error(self, peer: str, reason: str) -> None:
        with self._cv:
            self._aborted = self._aborted or reason
            self._cv.notify_all()

    # -- waiting (engine loop) ---------------------------------------------------------
    def _wait(self, ready, what: str, timeout_s: float, before_regroup: bool = False, while_heard: bool = False):
        """Receive messages until ``ready()`` returns non-None; abort, silence and timeout raise.

        before_regroup: a ``ready()`` already satisfied wins over a regroup that arrived with it (the go-ahead
        of a step: the coordinator sent it before any regroup, so the step was committed and must be applied).
        while_heard: once the coordinator has been heard (its heartbeats), wait on past ``timeout_s`` as long as it
        keeps talking: the wait for setup, which the coordinator sends once every part has said hello; it owns
        that start-up timeout and, when a part is late or runs another plan, aborts the others naming that part."""
        deadline = time.monotonic() + timeout_s
        remind = time.monotonic() + self.remind_s
        t0 = now_us()
        while True:
            with self._cv:
                aborted = self._aborted or next((s._aborted for s in self._siblings if s._aborted), None)
                if aborted:
                    raise ExecutorAbort(aborted)
                if self._regroup is not None and not before_regroup:
                    raise Regroup()
                v = ready()
                if v is not None:
                    break
                if self._regroup is not None:
                    raise Regroup()
            if self._pump(0):  # what arrived while this loop was busy counts before any silence check
                continue
            now = time.monotonic()
            if self._heard_coord and now - self._last_coord > self.cfg.peer_timeout_s:
                raise ExecutorAbort(f"the coordinator sent nothing for {now - self._last_coord:.1f} s "
                                    f"(it is at {self.cfg.coordinator}; --peer-timeout {self.cfg.peer_timeout_s:g})")
            if now > deadline and not (while_heard and self._heard_coord):
                if not self._heard_coord:
                    raise ExecutorAbort(f"no answer from the coordinator at {self.cfg.coordinator} within {timeout_s:g} s "
                                        f"(--startup-timeout); is it running, and is that its address?")
                raise ExecutorAbort(f"timed out after {timeout_s:g} s waiting for {what}")
            if now >= remind:
                remind = now + self.remind_s
                log.info("%s: still waiting for %s (%.0f s of %g s)", self.me, what, now - (deadline - timeout_s), timeout_s)
            self._pump(min(0.1, deadline - now))
        t1 = now_us()
        if t1 - t0 > 50:
            self.tracer.add(f"idle: {what}", "idle", t0, t1)
        return v, (t1 - t0) / 1e6

    def _pump(self, timeout_s: float) -> int:
        if not self._siblings:
            return self.transport.pump(timeout_s)
        return pump_any([self.transport, *(s.transport for s in self._siblings)], timeout_s)

    def _next_ctrl(self, timeout_s: float, while_heard: bool = False) -> Control:
        c, _ = self._wait(lambda: self._ctrl.popleft() if self._ctrl else None, "the coordinator", timeout_s,
                          while_heard=while_heard)
        if isinstance(c, Abort):
            raise ExecutorAbort(f"aborted by the coordinator: {c.reason}")
        return c

    # -- setup --------------------------------------------------------------------------
    def _setup(self, c: Setup) -> None:
        bad = digest_mismatch(self.cfg.plan_digest, c.digest, "the coordinator", f"CompNode {self.me}'s")
        if bad:
            raise ExecutorAbort(bad)
        resume = c.resume_step
        faults.maybe_fail(self.me, int(resume or 0), "start")  # FUSION_TEST_FAULT start-N: a crash at start-up
        source = self._resume_source(self.me if c.resume_from is None else c.resume_from) if resume is not None else self.me
        if resume is not None:
            # a part whose replica was dropped before this checkpoint loads its stage's surviving copy
            params, opt_arrays, opt_meta = checkpoint.load_part(c.checkpoint_dir, int(resume), source)
            if source != self.me:
                log.warning("%s: resuming step %s from %s's copy of stage %r (this replica was dropped before it)",
                            self.me, resume, source, self.plan.stage_of(self.me))
        else:
            params, opt_arrays, opt_meta = self._plan_weights(), None, None
        chosen = {"recompute": True} if self.plan.parts[self.me].recompute else {}  # by the compiler, to fit
        if self.plan.precision != "fp32":  # mixed precision (Plan.precision): autocast in the torch engine
            chosen["precision"] = self.plan.precision
        options = engine_options_for(self.me, self.engine_name, {"*": {**chosen, **self.cfg.engine_options}})
        engine = make_engine_part(self.engine_name, self.graph, self.sub, params, self.cfg.device, options=options)
        log.info("%s: %s engine on %s%s", self.me, self.engine_name, self.cfg.device,
                 "".join(f", {k}={v}" for k, v in sorted(options.items())))
        self.runtime = PartRuntime(self.graph, self.me, self.sub, self.assignment, engine,
                                   self.plan.replica_compression(self.replica))
        self.optcfg = OptimizerConfig.from_dict(self.plan.optimizer or {})
        check_optimizer(self.optcfg.name, {self.me: self.engine_name})
        self.opt = make_optimizer(self.engine_name, engine, self.optcfg)
        self._scheduled = self.optcfg.lr_schedule != "constant" or self.optcfg.warmup_steps > 0
        if self._scheduled and not hasattr(self.opt, "set_lr"):
            raise FusionError(f"the {self.engine_name} engine's optimizer has no set_lr: it cannot follow the plan's "
                              f"optimizer.lr_schedule {self.optcfg.lr_schedule!r}")
        if opt_arrays is not None:
            self.opt.load_state(opt_arrays, opt_meta)
        if c.members is not None or c.micro_batches is not None:  # replicas that have not joined yet (join.py)
            with self._cv:
                self._set_members([p for p in self.plan.dp_group(self.me) if c.members is None or p in c.members],
                                  c.micro_batches or self.n_micro)
        if self.diloco:  # DiLoCo's global weights and outer momentum: the start, or the checkpoint's
            names = {n for b in self._dp_buckets for n in b.names}
            trainable = {n: a for n, a in engine.state().items() if n in names}
            self.outer = OuterLoop(self.plan.dp_sync, self._dp_buckets, trainable, self._fragments)
            if resume is not None:
                arrays = checkpoint.load_outer(c.checkpoint_dir, int(resume), source)
                self.outer.load_arrays(arrays, f"checkpoint step {resume} of {source}")
            elif c.start_it is not None:  # a joiner: the live replica's global weights and outer momentum
                if c.join_from not in self.plan.dp_group(self.me) or c.join_from == self.me:
                    raise ExecutorAbort(f"setup: join_from {str(c.join_from)[:80]!r} is not another replica of stage "
                                        f"{self.plan.stage_of(self.me)!r}")
                write_params(engine, adopt(self.outer, c.arrays, f"outer state from {c.join_from}"))
                log.info("%s: joining at iteration %d with %s's global weights and outer momentum (error feedback "
                         "zeros, a fresh inner optimizer); group %s, %d micro-batches", self.me, c.start_it,
                         c.join_from, self.dp_group, self.n_micro)
        elif c.start_it is not None:
            raise ExecutorAbort("setup: a part that runs no DiLoCo outer loop cannot join a running job")
        # a copied replica starts its delta buffers afresh, at both ends of each edge (both are copies)
        delta_edges.attach(self.runtime, self.inbox, c.checkpoint_dir, resume if source == self.me else None)
        first = int(resume or 0) if c.start_it is None else int(c.start_it)
        with self._cv:
            self.inbox.expected_iter = first
            if self.ring is not None:
                self.ring.expected_iter = first
            self.inbox.open = True
        self.checkpoint_dir = c.checkpoint_dir
        self.failover = c.failover is True
        self._emulate = c.emulate_links
        peers = c.peers
        for p in sorted(self._peers):
            if c.members is not None and p not in c.members and p not in peers:
                continue  # a replica that has not joined yet: connected when it does (Admit)
            if p not in peers:
                raise FusionError(f"setup gives no address for peer {p!r}")
            self._connect(p, peers[p])
        if self.outer is not None and self.outer.pending:  # a checkpoint's rounds in flight: send ours again
            self.outer.announce(self.me, self.ring.group, self._send)

    def _connect(self, p: str, address: str) -> None:
        """Connect to peer ``p`` (through the emulated link of the plan's devices when the run emulates them)."""
        link = None
        if self._emulate:
            m = link_model(self.plan.cluster, self.plan.parts[self.me].device, self.plan.parts[p].device)
            link = EmulatedLink(m) if (m.alpha_s > 0 or m.beta_s_per_byte > 0) else None
        # only the engine loop sends to peers; a message over the peer's receive limit is refused before it is sent
        self.transport.connect(p, address, link, direct=True, max_bytes=self._peer_limit(p))

    def _peer_limit(self, p: str) -> int:
        """The receive limit of peer ``p`` as ``p`` computes it (the plan's, or ``--max-message-bytes`` of the run):
        a replica of this part's stage has this part's own limit (the same buckets); another stage at least
        :func:`part_message_limit` of its stage (its own data-parallel group only adds to it)."""
        if self.cfg.max_message_bytes or self.plan.stage_of(p) == self.plan.stage_of(self.me):
            return self.transport.max_message_bytes
        return part_message_limit(self.plan, self.plan.stage_of(p))

    def _set_members(self, group: list[str], n: int) -> None:
        """(Under ``_cv``) this stage's live replicas are ``group`` and each runs ``n`` micro-batches per step:
        the ring (or tree) over ``group``, the schedule and inbox for ``n``."""
        self.n_micro = n
        self.inbox.n_micro = n
        self.actions = make_schedule(self.plan.schedule, self.order, part_links(self.graph, self.assignment), n,
                                     self.devices)[self.me]
        self.dp_group = group
        self._new_ring()

    def _accept_ring(self, sender: str, msg) -> None:
        """(Under ``_cv``, ``self.ring`` set) an all-reduce message of the group: a ring or tree step, or (header
        ``gather``) an encoded DiLoCo pseudo-gradient (outer.py). NotYourTurn: sent in another group."""
        if msg.header.get("gather") is True:
            if self.outer is None or self.plan.dp_sync.codec is None:
                raise WireError(f"pseudo-gradient from {sender!r}, but {self.me} runs no pseudo-gradient codec")
            self._pseudo_inbox().accept(sender, msg)
        else:
            self.ring.accept(sender, msg)

    def _new_ring(self) -> None:
        """(Under ``_cv``) the ring (or tree) over ``self.dp_group`` (None for one part), at this part's
        iteration; the messages a member already sent in this group (kept as NotYourTurn) are offered to it, and
        those sent in yet another group of this iteration are kept again (two regroups in one step)."""
        self.ring = (RingInbox(self.me, self.dp_group, self._dp_buckets, self.plan.dp_codec,
                               self.plan.dp_algo_of(self.me), self.plan.dp_group(self.me))
                     if len(self.dp_group) > 1 else None)
        if self.ring is not None:
            self.ring.expected_iter = self.inbox.expected_iter
        early, self._early_ring = list(self._early_ring), deque(maxlen=MAX_EARLY_RING)
        for sender, msg in early:  # sent in this group by a member that regrouped before this part did
            try:
                if self.ring is None:
                    raise WireError(f"{self.me} has no data-parallel group now")
                self._accept_ring(sender, msg)
            except NotYourTurn:
                if msg.header.get("it") == self.inbox.expected_iter:
                    self._early_ring.append((sender, msg))
            except WireError as e:
                log.warning("%s: dropped an all-reduce message of %s kept from before the regroup: %s", self.me,
                            sender, e)
        if early:
            self._cv.notify_all()

    def _admit(self, c: Admit) -> None:
        """A replica joins before iteration ``c.it`` (an outer boundary; join.py): connect to its parts, take
        the one of this stage into the group, run the new micro-batch count; tell the coordinator."""
        if self.outer is None:
            raise ExecutorAbort(f"admit: {self.me} runs no DiLoCo outer loop; a replica cannot join it")
        if c.it != self.inbox.expected_iter:
            raise ExecutorAbort(f"admit for iteration {c.it}, this part is at {self.inbox.expected_iter}")
        unknown = [p for p in c.add if p not in self.plan.parts or p in self.dp_group]
        if unknown:
            raise ExecutorAbort(f"admit: {unknown[0]!r} is not a part of the plan outside this part's group")
        for p in sorted(set(c.peers) & self._peers):
            self._connect(p, c.peers[p])
        with self._cv:
            self._set_members([p for p in self.plan.dp_group(self.me) if p in self.dp_group or p in c.add],
                              c.micro_batches)
        log.warning("%s: part(s) %s joined before iteration %d; group now %s, %d micro-batches", self.me,
                    ", ".join(c.add), c.it, self.dp_group, self.n_micro)
        self.transport.send(COORDINATOR, Admitted(it=self.inbox.expected_iter).frames())

    def _resume_source(self, source) -> str:
        """The part whose checkpoint files this one loads: itself, or a replica of its stage (its DP group)."""
        if not isinstance(source, str) or source not in self.plan.dp_group(self.me):
            raise ExecutorAbort(f"setup: resume_from {str(source)[:80]!r} is not a replica of stage "
                                f"{self.plan.stage_of(self.me)!r} ({', '.join(self.plan.dp_group(self.me))})")
        return source

    def _plan_weights(self) -> dict[str, np.ndarray]:
        if self._weights is not None:
            w, self._weights = self._weights, None  # the engine holds them from here on
            return w
        return self.check_weights()

    def check_weights(self) -> dict[str, np.ndarray]:
        """This part's parameters from the plan's weights file, each checked against the graph's shape.

        Raises FusionError (file missing, truncated, a parameter missing or of another shape): a broken plan
        is noticed before the executor listens, not when the coordinator says hello.
        """
        from fusion.plan import load_weights

        if not self.param_names:
            return {}
        path = self.plan_dir / "weights.safetensors"
        w = load_weights(path, self.param_names)
        for name in self.param_names:
            want = tuple(self.graph.params[name].shape)
            if name not in w:
                raise FusionError(f"{path}: no weights for parameter {name!r} of part {self.me!r}")
            if tuple(w[name].shape) != want:
                raise FusionError(f"{path}: parameter {name!r} has shape {list(w[name].shape)}, the plan's graph "
                                  f"says {list(want)}")
        return w

    # -- one iteration ----------------------------------------------------------------
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
        done = it + 1 if st.c.save_step is None else st.c.save_step  # completed steps after this one
        if self.ring is not None and (self.outer is None or self.outer.warming(done)):  # (DiLoCo's warm-up too)
            t_ar = time.perf_counter()
            with self.tracer.span("allreduce", "sync"):
                self._allreduce(it)
            stats["allreduce_s"] = time.perf_counter() - t_ar
        if self.optcfg.clip_grad_norm is not None:  # this part's share of the global norm, to the coordinator
            counted = {n for n, owners in self.shared.items() if owners[0] != self.me}  # tied: its first owner counts it
            sq = part_sq_norm(self.runtime.engine.grads(), skip=counted, dtypes=self._param_dtypes)
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
            scale_grads(rt.engine, clip_coef(self.optcfg.clip_grad_norm, c1.norm), self._param_dtypes)
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
        if self.outer is not None and self.outer.warmup and done == self.outer.warmup:  # DiLoCo starts here
            names = {n for b in self.outer.buckets for n in b.names}
            self.outer.restart({n: a for n, a in engine.state().items() if n in names})
        frag = self.outer.due(done) if self.outer is not None else None
        if frag is not None:
            stats["outer"] = self._outer_step(it, done, frag)
        if c.checkpoint:
            # named by completed steps (the coordinator's count), which redone attempts put behind ``it``
            save = it + 1 if c.save_step is None else c.save_step
            with self.tracer.span("checkpoint", "checkpoint"):
                checkpoint.save_part(self.checkpoint_dir, save, self.me, engine.state(), *self.opt.state(),
                                     delta=delta_edges.checkpoint_arrays(rt),
                                     outer=self.outer.state_arrays() if self.outer is not None else None)
                checkpoint.prune_part(self.checkpoint_dir, self.me, keep=2)
            stats["checkpoint_step"] = save
        with self._cv:
            self.inbox.finish(it)
            if self.ring is not None:
                self.ring.finish(it)
        sent = {}
        for p, s in self.transport.stats().items():
            prev = self._prev_sent.get(p, (0, 0, 0.0))
            sent[p] = {"bytes": s.bytes - prev[0], "messages": s.messages - prev[1], "busy_s": s.busy_s - prev[2]}
            self._prev_sent[p] = (s.bytes, s.messages, s.busy_s)
        stats.update(t_start=st.t_start, t_end=time.time(), rejected=self.transport.rejected,
                     escaped=self.transport.escaped, sent=sent)
        self.transport.send(COORDINATOR, Done(arrays=grads, it=it, losses=st.losses, stats=stats).frames())

    def _decode_tied(self, od: OpData) -> np.ndarray:
        """A co-owner's tied gradient under ``plan.tied_codec``, decoded on arrival (WireError: rejected)."""
        spec = self.graph.params[od.name]
        return self.tied.decode(od.payload, tuple(spec.shape), spec.dtype, f"gradient of parameter {od.name!r} from {od.src}")

    def _sync_send(self, it: int) -> dict[str, np.ndarray | None]:
        """Send this part's gradients of parameters held by several parts to their co-owners; returns its own
        (as the co-owners will decode it, under ``plan.tied_codec``) for :meth:`_sync_wait`.

        With ``plan.tied_codec`` each owner sends its gradient encoded once and sums the decoded gradients of
        every owner, its own included (:class:`~.compression.TiedCodec`), so all owners still apply one sum."""
        if not self.shared:
            return {}
        mine = self.runtime.engine.grads()
        users = self.graph.param_users()
        own: dict[str, np.ndarray | None] = {}
        for name, owners in sorted(self.shared.items()):
            local = tuple(n for n in users.get(name, ()) if n in self.sub.nodes)
            payload = mine.get(name)
            own[name] = payload
            if self.tied is not None and payload is not None:
                spec = self.graph.params[name]
                payload = self.tied.encode(np.asarray(payload), spec.dtype, name, self.me, it)
                own[name] = self.tied.decode(payload, tuple(spec.shape), spec.dtype, f"own gradient of {name!r}")
            for o in owners:
                if o != self.me:
                    od = OpData(name=name, index=None, op_users=tuple(users.get(name, ())), actual_user=local, is_grad=True,
                                local_iter=it, micro_batch=-1, src=self.me, dst=o, payload=payload)
                    self.transport.send(o, encode_opdata(od, kind="pgrad"), label=f"grad {name}")
        return own

    def _sync_wait(self, it: int, own: dict[str, np.ndarray | None]) -> None:
        """Sum the tied gradients of every owner in plan part order (the same bits on every owner)."""
        if not self.shared:
            return
        got_all, _ = self._wait(lambda: self.inbox.param_grads(it), "tied-parameter gradients", self.cfg.data_timeout_s)
        for name, owners in self.shared.items():
            got = got_all[name]
            gs = [own[name] if o == self.me else got[o] for o in owners]
            gs = [np.asarray(g) for g in gs if g is not None]
            if gs:
                self.runtime.engine.set_grad(name, sum_in_order(gs))

    def _apply_regroup(self) -> None:
        """A replica was dropped: forget the abandoned attempt, shrink the ring, take the new micro-batch count."""
        with self._cv:
            c, self._regroup = self._regroup, None
        it, drop, n = c.it, set(c.drop), c.micro_batches
        if self.me in drop:
            raise ExecutorAbort(f"this part's replica was dropped at iteration {it}")
        if self.opt is not None:
            self.opt.zero_grad()  # gradients of the abandoned attempt (a committed one has stepped and zeroed them)
        if self.runtime is not None:
            self.runtime.engine.forget()  # the abandoned attempt's in-flight micro-batches
        with self._cv:
            # late messages and queued orders of the abandoned attempt are refused from here on
            self._ctrl = deque(x for x in self._ctrl if not (isinstance(x, (Step, Commit, Clip)) and x.it <= it))
            if self.inbox.expected_iter <= it:
                self.inbox.finish(it)
            self.n_micro = n
            self.inbox.n_micro = n
            self.actions = make_schedule(self.plan.schedule, self.order, part_links(self.graph, self.assignment), n,
                                         self.devices)[self.me]
            self.dp_group = [p for p in self.dp_group if p not in drop]
            self._new_ring()
        log.warning("%s: replica part(s) %s dropped at iteration %d; group now %s, %d micro-batches", self.me,
                    ", ".join(sorted(drop)), it, self.dp_group, n)
        self.transport.send(COORDINATOR, Regrouped(it=self.inbox.expected_iter).frames())

    def _pseudo_inbox(self) -> PseudoInbox:
        """The inbox of encoded pseudo-gradients for the current group (rebuilt when a regroup changed the ring)."""
        if self._pseudo is None or self._pseudo.ring is not self.ring:
            self._pseudo = PseudoInbox(self.ring, self.plan.dp_sync.codec)
        return self._pseudo

    def _outer_step(self, it: int, steps_done: int, fragment: int = 0) -> dict:
        """DiLoCo's outer step after this part's inner step of iteration ``it`` (:mod:`.outer`): average the
        pseudo-gradients over the group, update the global weights, continue from them. The step was committed
        (failover runs): a replica lost meanwhile makes the survivors regroup and average among themselves."""
        engine = self.runtime.engine
        names = {n for b in self.outer.buckets for n in b.names}
        params = {n: a for n, a in engine.state().items() if n in names}

        def send(peer: str, frames: list, label: str) -> None:
            self._send(peer, frames, label)
            if self._die_in_outer == f"{self.me}:{steps_done}":  # the test hook (see __init__)
                time.sleep(1.0)  # the message leaves; then this replica is gone in mid-exchange
                log.error("%s: FUSION_TEST_DIE_IN_OUTER: exiting in the outer exchange after step %d", self.me,
                          steps_done)
                os._exit(17)

        t0 = time.perf_counter()
        while True:
            try:
                with self.tracer.span("outer", "sync"):
                    with self._cv:
                        pseudo = self._pseudo_inbox() if self.ring is not None else None
                    n_it = self.ring.expected_iter if self.ring is not None else it
                    weights = self._outer_weights()
                    wait = self._outer_wait
                    if self._delayed is not None:  # the exchange overlapping the next window: eager or delayed
                        new, st = self.outer.overlapped_step(self.me, self._outer_group(), self._delayed,
                                                             steps_done, params, send, wait, weights, fragment)
                    else:
                        new, st = self.outer.step(self.me, self.ring, pseudo, n_it, params, send, wait, weights,
                                                  fragment)
                break
            except Regroup:
                self._apply_regroup()
        write_params(engine, new)
        return {"step": steps_done, "s": round(time.perf_counter() - t0, 6), **st}

    def _send(self, peer: str, frames: list, label: str) -> None:
        self.transport.send(peer, frames, label=label)

    def _outer_wait(self, ready, what: str):
        return self._wait(ready, what, self.cfg.data_timeout_s)[0]

    def _outer_group(self) -> list[str]:
        """The replicas of this stage whose pseudo-gradients an outer step averages now (the survivors)."""
        return list(self.ring.group) if self.ring is not None else [self.me]

    def _outer_weights(self) -> dict[str, float] | None:
        """Unequal shares: part -> the samples its replica sees per step (None: equal shares, the plain mean)."""
        if not self.shares or self.ring is None:
            return None
        return {p: self.shares[self.plan.parts[p].replica] for p in self.ring.group}

    def _final_state(self) -> dict[str, np.ndarray]:
        """The parameters a fetch returns: the engine's, with every delayed round still in flight collected and
        applied (:meth:`OuterLoop.flushed`; the training state itself is unchanged)."""
        state = self.runtime.engine.state()
        if self._delayed is None or self.outer is None or not self.outer.pending:
            return state
        names = {n for b in self.outer.buckets for n in b.names}
        while True:
            try:
                new = self.outer.flushed(self.me, self._outer_group(), self._delayed,
                                         {n: a for n, a in state.items() if n in names}, self._outer_wait,
                                         self._outer_weights())
                break
            except Regroup:
                self._apply_regroup()
        return {**state, **{n: v.astype(np.asarray(state[n]).dtype, copy=False) for n, v in new.items()}}

    def _allreduce(self, it: int) -> None:
        """Average the parameter gradients over this stage's replicas (ring or tree all-reduce, NumPy)."""
        engine = self.runtime.engine
        grads = engine.grads()
        buffers = [flatten(b, grads) for b in self.ring.buckets]

        def send(peer: str, frames: list, label: str) -> None:
            self.transport.send(peer, frames, label=label)

        def wait(ready, what: str):
            return self._wait(ready, what, self.cfg.data_timeout_s)[0]

        average(self.ring, it, buffers, send, wait)
        for b, flat in zip(self.ring.buckets, buffers):
            for name, g in unflatten(b, flat).items():
                if grads.get(name) is not None:  # a parameter without a gradient keeps none (on every replica)
                    engine.set_grad(name, g)

    # -- the process ------------------------------------------------------------------
    def _heartbeat(self) -> None:
        while not self._hb_stop.wait(self.cfg.heartbeat_s):
            self.transport.send(COORDINATOR, Hb().frames())

    def _listen(self) -> str:
        """Check the plan's weights for this part and bind its socket. FusionError: the user's to fix (exit 2)."""
        self._t0 = time.monotonic()
        # a broken plan, and an address already in use, are the user's to fix: FusionError (one line, exit 2)
        self._weights = self.check_weights()
        try:
            return self.transport.start()
        except FusionError:
            self.transport.close(timeout_s=1.0, linger_s=0.0)
            raise

    def _hello(self, address: str) -> None:
        """Say hello to the coordinator (this part's name and address) and start heartbeating."""
        log.info("%s: plan and %d weights checked (%s engine); listening on %s", self.me, len(self._weights),
                 self.engine_name, self.cfg.advertise or address)
        if self.cfg.security is None:
            log.warning("%s", insecure_warning(self.me, address))
        self.transport.connect(COORDINATOR, self.cfg.coordinator,
                               max_bytes=self.cfg.max_message_bytes or coordinator_message_limit(self.plan))
        self.transport.send(COORDINATOR, Hello(part=self.me, address=self.cfg.advertise or address,
                                                pid=os.getpid(), engine=self.engine_name,
                                                digest=self.cfg.plan_digest).frames())
        threading.Thread(target=self._heartbeat, name="heartbeat", daemon=True).start()
        log.info("%s: said hello to the coordinator at %s; waiting for its setup (gives up after %g s)",
                 self.me, self.cfg.coordinator, self.cfg.startup_timeout_s)

    def _ready(self) -> None:
        """Take the coordinator's setup (peers, resume), load the part, say ready."""
        c = self._next_ctrl(self.cfg.startup_timeout_s, while_heard=True)
        if not isinstance(c, Setup):
            raise ExecutorAbort(f"expected setup from the coordinator, got {c.op!r}")
        self._setup(c)
        self.transport.send(COORDINATOR, Ready(part=self.me).frames())
        log.info("%s: ready after %.1f s (%d peers: %s); waiting for steps", self.me, time.monotonic() - self._t0,
                 len(self._peers), ", ".join(sorted(self._peers)) or "none")

    def _report(self, e: BaseException) -> None:
        """Tell the coordinator why this part stops (unless the coordinator told it to)."""
        if isinstance(e, ExecutorAbort):
            log.error("%s: stopping: %s", self.me, e)
            reason = str(e)
            if reason.startswith("aborted by the coordinator"):
                return
        else:  # run_lane logged it with its traceback
            reason = f"{type(e).__name__}: {e}"
        if COORDINATOR in self.transport.senders:
            self.transport.send(COORDINATOR, Error(reason=reason, lasting=lasting_failure(e) or None).frames())

    def _close(self, status: int) -> None:
        self._hb_stop.set()
        if self.cfg.trace_path:
            try:
                self.tracer.write(self.cfg.trace_path)
            except OSError as e:
                log.error("%s: cannot write trace %s: %s", self.me, self.cfg.trace_path, e)
        self.transport.close(timeout_s=5.0 if status == 0 else 1.0)
        log.info("%s: exiting with status %d", self.me, status)

    def run(self) -> int:
        """Serve the coordinator until told to stop. Returns the process exit status."""
        lane = self.plan.lane_of(self.me)
        if len(lane) > 1:
            raise FusionError(f"part {self.me!r} shares device {self.plan.parts[self.me].device!r} with "
                              f"{', '.join(p for p in lane if p != self.me)} under the interleaved schedule: run them in "
                              f"one process (fusion executor --node {','.join(lane)})")
        return run_lane([self])

    def _fetched(self, c: Fetch) -> dict[str, np.ndarray]:
        """What a fetch asks for: the parameters, or (``outer``) the DiLoCo state a joiner starts from."""
        if not c.outer:
            return self._final_state()
        if self.outer is None:
            raise ExecutorAbort(f"fetch of the outer state: {self.me} runs no DiLoCo outer loop")
        return join_arrays(self.outer)

    def _serve(self) -> int:
        """Steps, fetches and the stop, one control message at a time; the exit status."""
        while True:
            try:
                c = self._next_ctrl(float("inf"))
                if c.op == "step":
                    self._iteration(c)
                    continue
                if c.op == "eval":
                    self._evaluate(c)
                    continue
            except Regroup:
                self._apply_regroup()
                continue
            if c.op == "fetch":
                self.transport.send(COORDINATOR, State(arrays=self._fetched(c)).frames())
            elif c.op == "admit":
                self._admit(c)
            elif c.op == "stop":
                log.info("%s: told to stop after %d steps", self.me, self.inbox.expected_iter)
                return 0
            else:
                log.warning("%s: ignoring control op %r", self.me, c.op)


def _serve_lane(nodes: list[CompNode]) -> int:
    """Several parts in one process (the virtual stages of one device under interleaved 1F1B): each step
    runs the device's merged action list (:func:`fusion.ir.schedule.make_lanes`), one action at a time on
    the part it belongs to; the end of a step goes phase by phase over the parts, so that no part waits for
    a tied gradient its neighbour in this process has not sent yet."""
    first = nodes[0]
    plan = first.plan
    devices = {p: plan.parts[p].device for p in first.order}
    lane = make_lanes(plan.schedule, first.order, part_links(first.graph, first.assignment), first.n_micro,
                      devices)[devices[first.me]]
    by_part = {n.me: n for n in nodes}
    while True:
        steps: dict[str, Step] = {}
        stopped: list[str] = []
        while len(steps) + len(stopped) < len(nodes):  # every part's next step (or stop); fetches answered as they come
            (n, c), _ = first._wait(lambda: next(((m, m._ctrl.popleft()) for m in nodes if m._ctrl), None),
                                    "the coordinator", float("inf"))
            if isinstance(c, Abort):
                raise ExecutorAbort(f"aborted by the coordinator: {c.reason}")
            if c.op == "fetch":
                n.transport.send(COORDINATOR, State(arrays=n._final_state()).frames())
            elif c.op == "step" and n.me not in steps:
                steps[n.me] = c
            elif c.op == "stop" and n.me not in stopped:
                stopped.append(n.me)
            else:
                log.warning("%s: ignoring control op %r", n.me, c.op)
        if stopped:
            if steps:
                raise ExecutorAbort(f"the coordinator stopped {', '.join(stopped)} but sent a step to "
                                    f"{', '.join(sorted(steps))} of the same process")
            log.info("%s: told to stop after %d steps", ", ".join(by_part), first.inbox.expected_iter)
            return 0
        sts = {p: by_part[p]._begin(c) for p, c in steps.items()}
        for p, a in lane:
            by_part[p]._act(sts[p], a)
        for phase in (CompNode._end_send, CompNode._end_reduce, CompNode._end_commit):
            for n in nodes:
                phase(n, sts[n.me])


def run_lane(nodes: list[CompNode]) -> int:
    """Run the CompNode(s) of one executor process until the coordinator stops them; the exit status.

    One node is the usual CompNode process. Several are the parts of one device under interleaved 1F1B
    (``Plan.lanes``): each keeps its own socket, inbox and engine, and the process runs the device's
    merged action list."""
    if len(nodes) > 1:
        lanes = nodes[0].plan.lanes()
        want = next((ps for ps in lanes.values() if nodes[0].me in ps), [])
        if sorted(n.me for n in nodes) != sorted(want):
            raise FusionError(f"parts {', '.join(n.me for n in nodes)} are not one device's parts; the plan's processes "
                              f"run {'; '.join(','.join(ps) for ps in lanes.values())}")
        nodes = sorted(nodes, key=lambda n: want.index(n.me))
    for n in nodes:
        n._siblings = [m for m in nodes if m is not n]
    addresses: list[str] = []
    try:
        for n in nodes:
            addresses.append(n._listen())
    except FusionError:
        for n in nodes[:len(addresses)]:
            n.transport.close(timeout_s=1.0, linger_s=0.0)
        raise
    status = 1
    try:
        for n, address in zip(nodes, addresses):
            n._hello(address)
        for n in nodes:
            n._ready()
        status = nodes[0]._serve() if len(nodes) == 1 else _serve_lane(nodes)
    except Exception as e:
        if not isinstance(e, ExecutorAbort):
            log.exception("%s: failed", ", ".join(n.me for n in nodes))
        for n in nodes:
            n._report(e)
    finally:
        for n in nodes:
            n._close(status)
    return status


def run_executor(plan_dir: str | Path, cfg: "ExecutorConfig | list[ExecutorConfig]") -> int:
    """Load the plan at ``plan_dir`` and serve part ``cfg.part`` (a list: the parts of one device under
    interleaved 1F1B, in one process); returns the exit status."""
    from fusion.plan import load_plan

    plan = load_plan(plan_dir)
    cfgs = cfg if isinstance(cfg, list) else [cfg]
    if len(cfgs) == 1:
        return CompNode(plan, plan_dir, cfgs[0]).run()
    return run_lane([CompNode(plan, plan_dir, c) for c in cfgs])

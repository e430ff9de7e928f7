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
from typing import Any, Callable

import numpy as np

from fusion.ir.errors import FusionError
from fusion.executors.runtime.control import Abort, Admit, Control, Eval, Fetch, Regroup as RegroupMsg, State, Step, Stop
from fusion.executors.runtime.compression import CompressionTable, TiedCodec
from fusion.executors.runtime.dp.registry import make_sync
from fusion.executors.runtime.dp.sync import GradSync, Regroup, SyncLinks
from fusion.executors.runtime.inbox import Inbox
from fusion.executors.runtime.lane import run_lane
from fusion.executors.runtime.limits import part_message_limit
from fusion.executors.runtime.membership import Membership
from fusion.executors.runtime.node_common import COORDINATOR, MAX_QUEUED_CTRL, ExecutorAbort
from fusion.executors.runtime.part import PartRuntime, make_routes
from fusion.executors.runtime.part_spec import PartSpec
from fusion.executors.runtime.process import Process
from fusion.executors.runtime.receiving import Receiving
from fusion.executors.runtime.startup import Startup
from fusion.executors.runtime.step_loop import StepLoop
from fusion.executors.runtime.tied_exchange import TiedExchange
from fusion.executors.runtime.trace_events import Tracer, now_us
from fusion.executors.runtime.keys import Security
from fusion.executors.runtime.transport import Transport, pump_any
from fusion.plan import Plan

log = logging.getLogger(__name__)
__all__ = ["COORDINATOR", "MAX_QUEUED_CTRL", "CompNode", "ExecutorAbort", "ExecutorConfig", "Regroup", "run_executor",
           "run_lane"]


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


class CompNode(Receiving, Startup, Membership, TiedExchange, StepLoop, Process):
    """One part of a plan, driven by control messages from the coordinator."""

    #: seconds between "still waiting for ..." log lines of a long wait
    remind_s = 10.0

    def __init__(self, plan: Plan, plan_dir: str | Path, cfg: ExecutorConfig):
        if cfg.part not in plan.parts:  # (before the plugins load)
            raise FusionError(f"plan has no part {cfg.part!r} (parts: {sorted(plan.parts)})")
        self.plan, self.plan_dir, self.cfg, self.me = plan, Path(plan_dir), cfg, cfg.part
        from fusion.ir.registry import import_plugins

        # before any socket opens: refused (untrusted) plugins stop the process with the reason
        import_plugins(plan.graph.plugins, base=str(self.plan_dir if self.plan_dir.is_dir() else self.plan_dir.parent),
                       trusted=cfg.trust_plugins)
        self.spec = spec = PartSpec.derive(plan, cfg.part)
        g = self.graph = plan.graph
        self.n_micro = spec.micro_batches  # (a join or a regroup changes it; so the schedule's actions)
        self.actions = spec.actions(plan, self.n_micro)
        # codecs are checked before any socket opens: an unknown one (say, a plugin not listed) or a torch-only
        # user codec on a NumPy part stops the process with one line naming the edge and codec
        table = CompressionTable.build(self.me, plan.replica_compression(spec.replica) or (), g, spec.engine,
                                       autocast=plan.precision == "bf16")
        self.tied = TiedCodec.from_cfg(getattr(plan, "tied_codec", None)) if spec.shared else None
        if self.tied is not None:
            self.tied.check_engine(self.me, spec.engine)
        self.tracer = Tracer(f"CompNode {self.me}", list(plan.parts).index(self.me), enabled=cfg.trace_path is not None,
                             spill=f"{cfg.trace_path}.events.jsonl" if cfg.trace_path else None)
        self.runtime: PartRuntime | None = None
        self.opt = None
        self._cv = threading.Condition()
        self._ctrl: deque[Control] = deque()
        self.inbox = Inbox(g, self.me, make_routes(spec.sub, spec.assignment), self.n_micro, spec.shared)
        self.inbox.autocast = plan.precision == "bf16"
        self.inbox.codecs = table.incoming_codecs()
        if self.tied is not None:
            self.inbox.decode_pgrad = self._decode_tied
        # data parallelism: this stage's replicas sync their gradients (dp/: the plan's dp_sync.mode); a stage of one
        # replica has none
        self.sync: GradSync | None = make_sync(plan, self.me, spec.trainable)
        if spec.shares and not (self.sync is not None and self.sync.UNEQUAL_SHARES):
            raise FusionError("plan.dp_sync.shares: unequal replica shares need DiLoCo (dp_sync.mode 'diloco'); "
                              "synchronous DP splits the global batch equally")
        self._aborted: str | None = None
        self._regroup: RegroupMsg | None = None  # a replica was dropped: abandon the attempt (failover runs)
        self.failover = False
        self._last_coord = time.monotonic()
        self._heard_coord = False  # before first contact only the startup timeout applies
        self._peers = self._peer_parts()
        self.transport = self._make_transport()
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

    @property
    def param_names(self) -> tuple[str, ...]:
        """The parameters this part's nodes use (:attr:`PartSpec.param_names`)."""
        return self.spec.param_names

    @property
    def ring(self):
        """The ring (or tree) inbox of this stage's live replicas (None: no group now)."""
        return self.sync.ring if self.sync is not None else None

    @property
    def dp_group(self) -> list[str]:
        """This stage's live replicas, rank order (this part alone without data parallelism)."""
        return self.sync.group if self.sync is not None else list(self.plan.dp_group(self.me))

    def _links(self, send=None) -> SyncLinks:
        """How the data-parallel sync reaches the group from the engine loop (``send``: the transport's)."""
        return SyncLinks(send=send or self._send, wait=self._outer_wait, span=self.tracer.span,
                         regroup=self._apply_regroup)

    def _make_transport(self) -> Transport:
        """This part's socket: only the coordinator and the parts it exchanges messages with may send to it."""
        limit = self.cfg.max_message_bytes or part_message_limit(self.plan, self.plan.stage_of(self.me))
        if self.sync is not None and not self.cfg.max_message_bytes:
            limit = self.sync.message_limit(limit)
        return Transport(self.me, self.cfg.bind, self._peers | {COORDINATOR}, self._on_message,
                         max_message_bytes=limit, tracer=self.tracer,
                         on_error=self._on_send_error, recv_thread=False,  # the engine loop receives
                         security=self.cfg.security)

    def _peer_parts(self) -> set[str]:
        """Parts this one exchanges OP-Data with: producers, consumers, co-owners of tied parameters."""
        b, a = self.spec.sub.boundary, self.spec.assignment
        peers = {a[e.actual_user] for e in b.sent_acts} | {a[e.producer] for e in b.required_acts}
        for owners in self.spec.shared.values():
            peers.update(owners)
        if self.sync is not None:  # the other replicas of this stage (ring or tree neighbours, outer exchange)
            peers.update(self.sync.neighbours)
        peers.discard(self.me)
        return peers

    # -- receiving (called by the transport from the engine loop's waits) ----------------

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
                log.info("%s: still waiting for %s (%.0f s%s)", self.me, what, (now_us() - t0) / 1e6,
                         f" of {timeout_s:g} s" if timeout_s != float("inf") else "")  # (no limit between steps)
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

    # -- one iteration ----------------------------------------------------------------

    def _outer_send(self, steps_done: int):
        """The send of an outer exchange after ``steps_done`` steps, with the test hook of ``__init__``."""
        def send(peer: str, frames: list, label: str) -> None:
            self._send(peer, frames, label)
            if self._die_in_outer == f"{self.me}:{steps_done}":
                time.sleep(1.0)  # the message leaves; then this replica is gone in mid-exchange
                log.error("%s: FUSION_TEST_DIE_IN_OUTER: exiting in the outer exchange after step %d", self.me,
                          steps_done)
                os._exit(17)
        return send

    def _send(self, peer: str, frames: list, label: str) -> None:
        self.transport.send(peer, frames, label=label)

    def _outer_wait(self, ready, what: str):
        return self._wait(ready, what, self.cfg.data_timeout_s)[0]

    def _final_state(self) -> dict[str, np.ndarray]:
        """The parameters a fetch returns: the engine's, as the sync completes them (DiLoCo: every delayed round
        still in flight collected and applied; the training state itself is unchanged)."""
        state = self.runtime.engine.state()
        return state if self.sync is None else self.sync.final_state(state, self._links())

    # -- the process ------------------------------------------------------------------

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
        if self.sync is None or not self.sync.JOINABLE:
            raise ExecutorAbort(f"fetch of the outer state: {self.me} runs no DiLoCo outer loop")
        return self.sync.join_state()

    def _handlers(self) -> dict[type, Callable[[Any], int | None]]:
        """What the engine loop does with each control message between steps, by its class (:mod:`.control`);
        a handler that returns an int ends the loop with that exit status."""
        return {Step: self._iteration, Eval: self._evaluate, Fetch: self._send_state, Admit: self._admit,
                Stop: self._stop}

    def _send_state(self, c: Fetch) -> None:
        self.transport.send(COORDINATOR, State(arrays=self._fetched(c)).frames())

    def _stop(self, c: Stop) -> int:
        log.info("%s: told to stop after %d steps", self.me, self.inbox.expected_iter)
        return 0

    def _serve(self) -> int:
        """Steps, evaluations, fetches, joins and the stop, one control message at a time; the exit status."""
        handlers = self._handlers()
        while True:
            try:
                c = self._next_ctrl(float("inf"))
                handle = handlers.get(type(c))
                if handle is None:
                    log.warning("%s: ignoring control op %r", self.me, c.op)
                    continue
                status = handle(c)
            except Regroup:
                self._apply_regroup()
                continue
            if status is not None:
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

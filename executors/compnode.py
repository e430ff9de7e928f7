"""The CompNode executor: one process that runs one part of a plan (FusionLLM §3.3).

It loads its part of the plan (sub-DAG, parameters, engine), then runs
iterations when the coordinator says so. Within an iteration it follows its
schedule (a list of F/B actions, :mod:`fusion.executors.schedule`) in one
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
:mod:`fusion.executors.engines` only when the part's engine needs it.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..ir.boundary import part_links, part_order, partition
from ..ir.errors import FusionError, WireError
from ..ir.opdata import OpData
from ..ir.wire import DEFAULT_MAX_MESSAGE_BYTES, Message, encode_opdata, opdata_from_message
from . import checkpoint
from .control import Control, decode_ctrl, encode_ctrl
from .engines import make_engine_part, make_optimizer
from .linkemu import EmulatedLink, link_model
from .inbox import Inbox
from .optim import OptimizerConfig
from .part import PartRuntime, make_routes
from .schedule import make_schedule
from .trace_events import Tracer, now_us
from .transport import Transport

log = logging.getLogger(__name__)

COORDINATOR = "coordinator"


class ExecutorAbort(FusionError):
    """The executor stops: told to abort, coordinator gone, or a wait timed out."""


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
    trace_path:      where to write the Chrome trace at exit (None: no trace).
    """

    part: str
    coordinator: str
    bind: str = "tcp://127.0.0.1:*"
    advertise: str | None = None
    device: str = "cpu"
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    heartbeat_s: float = 0.5
    peer_timeout_s: float = 10.0
    data_timeout_s: float = 300.0
    startup_timeout_s: float = 120.0
    trace_path: str | None = None


class CompNode:
    """One part of a plan, driven by control messages from the coordinator."""

    def __init__(self, plan, plan_dir: str | Path, cfg: ExecutorConfig):
        if cfg.part not in plan.parts:
            raise FusionError(f"plan has no part {cfg.part!r} (parts: {sorted(plan.parts)})")
        self.plan, self.plan_dir, self.cfg, self.me = plan, Path(plan_dir), cfg, cfg.part
        g = plan.graph
        self.graph = g
        self.order = part_order(g, plan.assignment)
        self.n_micro = plan.micro_batches
        self.actions = make_schedule(plan.schedule, self.order, part_links(g, plan.assignment), self.n_micro)[self.me]
        self.engine_name = plan.parts[self.me].engine
        subs = partition(g, plan.assignment)
        self.sub = subs[self.me]
        owners: dict[str, list[str]] = {}
        for p in self.order:
            for n in subs[p].nodes:
                for pname in g[n].param_names():
                    if g.params[pname].trainable and p not in owners.setdefault(pname, []):
                        owners[pname].append(p)
        self.shared = {n: ps for n, ps in owners.items() if len(ps) > 1 and self.me in ps}
        self.param_names = sorted({p for n in self.sub.nodes for p in g[n].param_names()})
        self.tracer = Tracer(f"CompNode {self.me}", self.order.index(self.me), enabled=cfg.trace_path is not None)
        self.runtime: PartRuntime | None = None
        self.opt = None
        self._cv = threading.Condition()
        self._ctrl: deque[Control] = deque()
        self.inbox = Inbox(g, self.me, make_routes(self.sub, plan.assignment), self.n_micro, self.shared)
        self._aborted: str | None = None
        self._last_coord = time.monotonic()
        self._heard_coord = False  # before first contact only the startup timeout applies
        self._peers = self._peer_parts()
        # only the coordinator and the parts this one exchanges OP-Data with may send to it
        self.transport = Transport(self.me, cfg.bind, self._peers | {COORDINATOR}, self._on_message,
                                   max_message_bytes=cfg.max_message_bytes, tracer=self.tracer,
                                   on_error=self._on_send_error, recv_thread=False)  # the engine loop receives
        self._hb_stop = threading.Event()
        self._prev_sent: dict[str, tuple[int, int, float]] = {}

    def _peer_parts(self) -> set[str]:
        """Parts this one exchanges OP-Data with: producers, consumers, co-owners of tied parameters."""
        b, a = self.sub.boundary, self.plan.assignment
        peers = {a[e.actual_user] for e in b.sent_acts} | {a[e.producer] for e in b.required_acts}
        for owners in self.shared.values():
            peers.update(owners)
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
            c = decode_ctrl(msg)
            if c.op == "hb":
                return
            with self._cv:
                if c.op == "abort":
                    self._aborted = f"aborted by the coordinator: {c.fields['reason']}"
                self._ctrl.append(c)
                self._cv.notify_all()
            return
        od = opdata_from_message(msg)
        with self._cv:
            self.inbox.accept(sender, od, param_grad=msg.kind == "pgrad")
            self._cv.notify_all()

    def _on_send_error(self, peer: str, reason: str) -> None:
        with self._cv:
            self._aborted = self._aborted or reason
            self._cv.notify_all()

    # -- waiting (engine loop) ---------------------------------------------------------
    def _wait(self, ready, what: str, timeout_s: float):
        """Receive messages until ``ready()`` returns non-None; abort, silence and timeout raise."""
        deadline = time.monotonic() + timeout_s
        t0 = now_us()
        while True:
            with self._cv:
                v = ready()
                if v is not None:
                    break
                if self._aborted:
                    raise ExecutorAbort(self._aborted)
            if self.transport.pump(0):  # what arrived while this loop was busy counts before any silence check
                continue
            now = time.monotonic()
            if self._heard_coord and now - self._last_coord > self.cfg.peer_timeout_s:
                raise ExecutorAbort(f"the coordinator sent nothing for {now - self._last_coord:.1f} s")
            if now > deadline:
                raise ExecutorAbort(f"timed out after {timeout_s:.0f} s waiting for {what}")
            self.transport.pump(min(0.1, deadline - now))
        t1 = now_us()
        if t1 - t0 > 50:
            self.tracer.add(f"idle: {what}", "idle", t0, t1)
        return v, (t1 - t0) / 1e6

    def _next_ctrl(self, timeout_s: float) -> Control:
        c, _ = self._wait(lambda: self._ctrl.popleft() if self._ctrl else None, "the coordinator", timeout_s)
        if c.op == "abort":
            raise ExecutorAbort(f"aborted by the coordinator: {c.fields['reason']}")
        return c

    # -- setup --------------------------------------------------------------------------
    def _setup(self, c: Control) -> None:
        from ..ir.registry import import_plugins

        import_plugins(self.graph.plugins)
        f = c.fields
        resume = f["resume_step"]
        if resume is not None:
            params, opt_arrays, opt_meta = checkpoint.load_part(f["checkpoint_dir"], int(resume), self.me)
        else:
            params, opt_arrays, opt_meta = self._plan_weights(), None, None
        engine = make_engine_part(self.engine_name, self.graph, self.sub, params, self.cfg.device)
        self.runtime = PartRuntime(self.graph, self.me, self.sub, self.plan.assignment, engine, self.plan.compression)
        self.opt = make_optimizer(self.engine_name, engine, OptimizerConfig.from_dict(self.plan.optimizer or {}))
        if opt_arrays is not None:
            self.opt.load_state(opt_arrays, opt_meta)
        with self._cv:
            self.inbox.expected_iter = int(resume or 0)
            self.inbox.open = True
        self.checkpoint_dir = f["checkpoint_dir"]
        peers = f["peers"]
        for p in sorted(self._peers):
            if p not in peers:
                raise FusionError(f"setup gives no address for peer {p!r}")
            link = None
            if f["emulate_links"]:
                m = link_model(self.plan.cluster, self.plan.parts[self.me].device, self.plan.parts[p].device)
                link = EmulatedLink(m) if (m.alpha_s > 0 or m.beta_s_per_byte > 0) else None
            self.transport.connect(p, peers[p], link, direct=True)  # only the engine loop sends to peers

    def _plan_weights(self) -> dict[str, np.ndarray]:
        from ..plan import load_weights

        return load_weights(self.plan_dir / "weights.safetensors", self.param_names) if self.param_names else {}

    # -- one iteration ----------------------------------------------------------------
    def _iteration(self, c: Control) -> None:
        it = int(c.fields["it"])
        if it != self.inbox.expected_iter:
            raise ExecutorAbort(f"coordinator asked for iteration {it}, this part is at {self.inbox.expected_iter}")
        feeds: list[dict[str, np.ndarray]] = [{} for _ in range(self.n_micro)]
        for name, arr in c.arrays.items():
            mb, _, ph = name.partition("/")
            feeds[int(mb)][ph] = arr
        rt, scale = self.runtime, 1.0 / self.n_micro
        losses: list[list] = []
        stats = {"forward_s": [], "backward_s": [], "idle_s": 0.0}
        t_start = time.time()
        for a in self.actions:
            mb = a.micro_batch
            if a.kind == "F":
                box, idle = self._wait(lambda: self.inbox.activations(it, mb), f"activations of F{mb}", self.cfg.data_timeout_s)
                t0 = now_us()
                out, loss = rt.forward(it, mb, feeds[mb], box)
                if loss is not None:
                    losses.append([mb, loss])
            else:
                box, idle = self._wait(lambda: self.inbox.gradients(it, mb), f"gradients of B{mb}", self.cfg.data_timeout_s)
                t0 = now_us()
                out = rt.backward(it, mb, box, scale)
            t1 = now_us()
            with self._cv:
                self.inbox.consume(it, a.kind, mb)
            self.tracer.add(f"{a.kind}{a.micro_batch}", "forward" if a.kind == "F" else "backward", t0, t1)
            stats["forward_s" if a.kind == "F" else "backward_s"].append((t1 - t0) / 1e6)
            stats["idle_s"] += idle
            for msg in out:
                self.transport.send(msg.dst, encode_opdata(msg), label=f"{a.kind}{a.micro_batch} {msg.name}")
        t_sync = time.perf_counter()
        with self.tracer.span("grad-sync", "sync"):
            self._sync_shared(it)
        stats["sync_s"] = time.perf_counter() - t_sync
        engine = rt.engine
        grads = {n: g for n, g in engine.grads().items() if g is not None} if c.fields["want_grads"] else {}
        grads = {n: np.array(g) for n, g in grads.items()}
        t_opt = time.perf_counter()
        with self.tracer.span("optimizer", "optimizer"):
            self.opt.step()
            self.opt.zero_grad()
        stats["optimizer_s"] = time.perf_counter() - t_opt
        if c.fields["checkpoint"]:
            with self.tracer.span("checkpoint", "checkpoint"):
                checkpoint.save_part(self.checkpoint_dir, it + 1, self.me, engine.state(), *self.opt.state())
                checkpoint.prune_part(self.checkpoint_dir, self.me, keep=2)
            stats["checkpoint_step"] = it + 1
        with self._cv:
            self.inbox.finish(it)
        sent = {}
        for p, s in self.transport.stats().items():
            prev = self._prev_sent.get(p, (0, 0, 0.0))
            sent[p] = {"bytes": s.bytes - prev[0], "messages": s.messages - prev[1], "busy_s": s.busy_s - prev[2]}
            self._prev_sent[p] = (s.bytes, s.messages, s.busy_s)
        stats.update(t_start=t_start, t_end=time.time(), rejected=self.transport.rejected, sent=sent)
        self.transport.send(COORDINATOR, encode_ctrl("done", grads, it=it, losses=losses, stats=stats))

    def _sync_shared(self, it: int) -> None:
        """Sum gradients of parameters held by several parts, in plan part order (same bits on every owner)."""
        if not self.shared:
            return
        engine = self.runtime.engine
        mine = engine.grads()
        users = self.graph.param_users()
        for name, owners in sorted(self.shared.items()):
            local = tuple(n for n in users.get(name, ()) if n in self.sub.nodes)
            for o in owners:
                if o != self.me:
                    od = OpData(name=name, index=None, op_users=tuple(users.get(name, ())), actual_user=local, is_grad=True,
                                local_iter=it, micro_batch=-1, src=self.me, dst=o, payload=mine.get(name))
                    self.transport.send(o, encode_opdata(od, kind="pgrad"), label=f"grad {name}")

        got_all, _ = self._wait(lambda: self.inbox.param_grads(it), "tied-parameter gradients", self.cfg.data_timeout_s)
        for name, owners in self.shared.items():
            got = got_all[name]
            gs = [mine.get(name) if o == self.me else got[o] for o in owners]
            gs = [np.asarray(g) for g in gs if g is not None]
            if gs:
                total = gs[0].copy()
                for g in gs[1:]:
                    total = total + g
                engine.set_grad(name, total)

    # -- the process ------------------------------------------------------------------
    def _heartbeat(self) -> None:
        while not self._hb_stop.wait(self.cfg.heartbeat_s):
            self.transport.send(COORDINATOR, encode_ctrl("hb"))

    def run(self) -> int:
        """Serve the coordinator until told to stop. Returns the process exit status."""
        status = 1
        try:
            address = self.transport.start()
            self.transport.connect(COORDINATOR, self.cfg.coordinator)
            self.transport.send(COORDINATOR, encode_ctrl("hello", part=self.me, address=self.cfg.advertise or address,
                                                         pid=os.getpid(), engine=self.engine_name))
            threading.Thread(target=self._heartbeat, name="heartbeat", daemon=True).start()
            log.info("%s: listening on %s, coordinator %s", self.me, address, self.cfg.coordinator)
            c = self._next_ctrl(self.cfg.startup_timeout_s)
            if c.op != "setup":
                raise ExecutorAbort(f"expected setup from the coordinator, got {c.op!r}")
            self._setup(c)
            self.transport.send(COORDINATOR, encode_ctrl("ready", part=self.me))
            while True:
                c = self._next_ctrl(float("inf"))
                if c.op == "step":
                    self._iteration(c)
                elif c.op == "fetch":
                    self.transport.send(COORDINATOR, encode_ctrl("state", self.runtime.engine.state()))
                elif c.op == "stop":
                    status = 0
                    break
                else:
                    log.warning("%s: ignoring control op %r", self.me, c.op)
        except ExecutorAbort as e:
            log.error("%s: stopping: %s", self.me, e)
            if not str(e).startswith("aborted by the coordinator") and COORDINATOR in self.transport.senders:
                self.transport.send(COORDINATOR, encode_ctrl("error", reason=str(e)))
        except Exception as e:
            log.exception("%s: failed", self.me)
            if COORDINATOR in self.transport.senders:
                self.transport.send(COORDINATOR, encode_ctrl("error", reason=f"{type(e).__name__}: {e}"))
        finally:
            self._hb_stop.set()
            if self.cfg.trace_path:
                try:
                    self.tracer.write(self.cfg.trace_path)
                except OSError as e:
                    log.error("%s: cannot write trace %s: %s", self.me, self.cfg.trace_path, e)
            self.transport.close(timeout_s=5.0 if status == 0 else 1.0)
            log.info("%s: exiting with status %d", self.me, status)
        return status


def run_executor(plan_dir: str | Path, cfg: ExecutorConfig) -> int:
    """Load the plan at ``plan_dir`` and serve part ``cfg.part``; returns the exit status."""
    from ..plan import load_plan

    return CompNode(load_plan(plan_dir), plan_dir, cfg).run()

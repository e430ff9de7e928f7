"""A CompNode's start: the plan's weights checked, the coordinator's setup taken (the engine, the optimizer, a
checkpoint to resume from, the data-parallel sync's state), the peers connected."""
from __future__ import annotations

import logging

import numpy as np

from fusion.executors.engines.select import check_optimizer, engine_options_for, make_engine_part, make_optimizer
from fusion.executors.runtime import checkpoint, delta_edges, faults
from fusion.executors.runtime.control import Setup
from fusion.executors.runtime.limits import part_message_limit
from fusion.executors.runtime.linkemu import EmulatedLink, link_model
from fusion.executors.runtime.node_common import ExecutorAbort
from fusion.executors.runtime.part import PartRuntime
from fusion.executors.runtime.plandigest import digest_mismatch
from fusion.ir.errors import FusionError
from fusion.plan import OptimizerConfig

log = logging.getLogger(__name__)


class Startup:
    """A part of :class:`~.compnode.CompNode` (mixed in): a CompNode's start: the plan's weights checked, the
    coordinator's setup taken (the engine, the optimizer, a checkpoint to resume from, the data-parallel sync's
    state), the peers connected."""

    def _setup(self, c: Setup) -> None:
        """Take the coordinator's setup: the weights (the plan's, or a checkpoint's), the engine, the sync's state,
        the first iteration, the peers."""
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
        engine = self._make_engine(params, opt_arrays, opt_meta)
        if c.members is not None or c.micro_batches is not None:  # replicas that have not joined yet (join.py)
            with self._cv:
                self._set_members([p for p in self.plan.dp_group(self.me) if c.members is None or p in c.members],
                                  c.micro_batches or self.n_micro)
        if self.sync is not None:  # what the sync keeps of the weights (DiLoCo: the global weights, outer momentum)
            self.sync.start(engine)
            if resume is not None and self.sync.KEEPS_STATE:
                arrays = checkpoint.load_outer(c.checkpoint_dir, int(resume), source)
                self.sync.load_state(arrays, f"checkpoint step {resume} of {source}")
        if c.start_it is not None:
            self._join(engine, c, resume)
        # a copied replica starts its delta buffers afresh, at both ends of each edge (both are copies)
        delta_edges.attach(self.runtime, self.inbox, c.checkpoint_dir, resume if source == self.me else None)
        first = int(resume or 0) if c.start_it is None else int(c.start_it)
        with self._cv:
            self.inbox.expected_iter = first
            if self.sync is not None:
                self.sync.start_at(first)
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
        if self.sync is not None:
            self.sync.announce(self._links())

    def _make_engine(self, params, opt_arrays, opt_meta):
        """The part's engine over ``params``, its runtime and its optimizer (with a checkpoint's state)."""
        chosen = {"recompute": True} if self.plan.parts[self.me].recompute else {}  # by the compiler, to fit
        if self.plan.precision != "fp32":  # mixed precision (Plan.precision): autocast in the torch engine
            chosen["precision"] = self.plan.precision
        options = engine_options_for(self.me, self.spec.engine, {"*": {**chosen, **self.cfg.engine_options}})
        engine = make_engine_part(self.spec.engine, self.graph, self.spec.sub, params, self.cfg.device, options=options)
        log.info("%s: %s engine on %s%s", self.me, self.spec.engine, self.cfg.device,
                 "".join(f", {k}={v}" for k, v in sorted(options.items())))
        self.runtime = PartRuntime(self.graph, self.me, self.spec.sub, self.spec.assignment, engine,
                                   self.plan.replica_compression(self.spec.replica))
        self.optcfg = OptimizerConfig.from_dict(self.plan.optimizer or {})
        check_optimizer(self.optcfg.name, {self.me: self.spec.engine})
        self.opt = make_optimizer(self.spec.engine, engine, self.optcfg)
        # the lr changes over the run: a schedule, or a DiLoCo replica's inner lr (dp_sync.inner_lr) after the warm-up
        self._scheduled = (self.optcfg.lr_schedule != "constant" or self.optcfg.warmup_steps > 0
                           or self.plan.dp_sync.inner_lr is not None)
        if self._scheduled and not hasattr(self.opt, "set_lr"):
            raise FusionError(f"the {self.spec.engine} engine's optimizer has no set_lr: it cannot follow the plan's "
                              f"optimizer.lr_schedule {self.optcfg.lr_schedule!r} or dp_sync.inner_lr")
        if opt_arrays is not None:
            self.opt.load_state(opt_arrays, opt_meta)
        return engine

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

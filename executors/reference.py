"""The single-process reference executor.

Runs an OpGraph in one process: forward, backward, optimizer step, gradient
accumulation over micro-batches. Given an assignment node -> part, it runs
the graph *as partitioned*: each part executes only its sub-DAG and parts
exchange nothing but :class:`~fusion.ir.opdata.OpData` at their boundaries,
forward and backward, in the order a schedule (GPipe, 1F1B) dictates. This is
remote autodiff without sockets; the distributed runtime drives the same
:class:`~fusion.executors.part.PartRuntime`.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from ..ir.boundary import partition, part_links, part_order
from ..ir.errors import FusionError
from ..ir.model import Model
from ..ir.opdata import OpData
from .compression import check_edges
from .engines import check_engines, make_engine_part, make_optimizer
from .optim import OptimizerConfig
from .part import PartRuntime
from .schedule import Action, make_schedule

log = logging.getLogger(__name__)


def split_micro_batches(batch: Mapping[str, Any], n: int) -> list[dict[str, Any]]:
    """Split every placeholder value along dim 0 into ``n`` equal micro-batches."""
    out: list[dict[str, Any]] = [{} for _ in range(n)]
    for name, v in batch.items():
        t = torch.as_tensor(v)
        if t.shape[0] % n:
            raise FusionError(f"batch field {name!r} has {t.shape[0]} rows, not divisible into {n} micro-batches")
        for i, c in enumerate(torch.chunk(t, n, dim=0)):
            out[i][name] = c
    return out


@dataclass
class StepResult:
    """loss: mean over micro-batches of the summed loss nodes; grads: parameter
    gradients as applied by the optimizer (shared parameters already summed)."""

    loss: float
    grads: dict[str, np.ndarray]


class ReferenceExecutor:
    """Train a :class:`Model` in one process, optionally as partitioned.

    engines: part -> engine name (``"torch"``, ``"numpy"``); parts not named run torch.
    compression: the plan's ``EdgeCompression`` list (part names as in ``assignment``);
                 those edges carry Top-K sparse payloads as in a distributed run.
    """

    def __init__(self, model: Model, assignment: Mapping[str, str] | None = None,
                 optimizer: OptimizerConfig = OptimizerConfig(), micro_batches: int = 1,
                 schedule: str = "gpipe", engines: Mapping[str, str] | None = None,
                 compression: Sequence[Any] | None = None):
        g = model.graph
        self.graph = g
        self.assignment = dict(assignment) if assignment else {n: "p0" for n in g.nodes}
        subs = partition(g, self.assignment)
        self.order = part_order(g, self.assignment)
        links = part_links(g, self.assignment)
        self.micro_batches = micro_batches
        self.schedule = make_schedule(schedule, self.order, links, micro_batches)
        names = dict(engines or {})
        check_engines(g, self.assignment, names)
        self.engines = {p: make_engine_part(names.get(p, "torch"), g, subs[p], model.params) for p in self.order}
        check_edges(compression or (), self.assignment)
        self.parts = {p: PartRuntime(g, p, subs[p], self.assignment, self.engines[p], compression) for p in self.order}
        self.optimizers = {p: make_optimizer(names.get(p, "torch"), e, optimizer) for p, e in self.engines.items()}
        owners: dict[str, list[str]] = {}
        for p, e in self.engines.items():
            for name in e.trainable():
                owners.setdefault(name, []).append(p)
        self.shared = {n: ps for n, ps in owners.items() if len(ps) > 1}
        self.iteration = 0

    # -- one training step ---------------------------------------------------------
    def forward_backward(self, batch: Mapping[str, Any]) -> float:
        """Forward and backward of every micro-batch by the schedule; returns the loss."""
        mbs = split_micro_batches(batch, self.micro_batches)
        scale = 1.0 / self.micro_batches
        inbox: dict[tuple[str, str, int], list[OpData]] = {}
        cursor = {p: 0 for p in self.order}
        losses: list[float] = []
        it = self.iteration
        total = sum(len(a) for a in self.schedule.values())
        done = 0
        while done < total:
            progressed = False
            for p in self.order:
                acts = self.schedule[p]
                if cursor[p] >= len(acts):
                    continue
                a: Action = acts[cursor[p]]
                box = inbox.get((p, a.kind, a.micro_batch), [])
                part = self.parts[p]
                if a.kind == "F":
                    if {m.key for m in box} != part.needs_acts():
                        continue
                    out, loss = part.forward(it, a.micro_batch, mbs[a.micro_batch], box)
                    if loss is not None:
                        losses.append(loss)
                    kind = "F"
                else:
                    want = part.needs_grads()
                    have: dict = {}
                    for m in box:
                        have.setdefault(m.key, set()).add(m.src)
                    if have != want:
                        continue
                    out = part.backward(it, a.micro_batch, box, scale)
                    kind = "B"
                inbox.pop((p, a.kind, a.micro_batch), None)
                for msg in out:
                    inbox.setdefault((msg.dst, kind, msg.micro_batch), []).append(msg)
                cursor[p] += 1
                done += 1
                progressed = True
            if not progressed:
                stuck = {p: str(self.schedule[p][cursor[p]]) for p in self.order if cursor[p] < len(self.schedule[p])}
                raise RuntimeError(f"schedule deadlock at {stuck}")
        return float(np.sum(losses) * scale)

    def sync_shared_grads(self) -> None:
        """Sum the gradients of parameters held by several parts (tied weights)."""
        for name, owners in self.shared.items():
            gs = [self.engines[p].grads()[name] for p in owners]
            total = sum(g for g in gs if g is not None)
            for p in owners:
                self.engines[p].set_grad(name, total)

    def step(self, batch: Mapping[str, Any]) -> StepResult:
        """One iteration: forward/backward over micro-batches, then the optimizer step."""
        loss = self.forward_backward(batch)
        self.sync_shared_grads()
        # views, not copies: zero_grad(set_to_none=True) below drops the tensors,
        # so the arrays stay valid and unchanged (the optimizers do not write grads)
        grads = self.grads(copy=False)
        for opt in self.optimizers.values():
            if opt is not None:
                opt.step()
                opt.zero_grad()
        self.iteration += 1
        return StepResult(loss, grads)

    # -- state -----------------------------------------------------------------------
    def grads(self, copy: bool = True) -> dict[str, np.ndarray]:
        """Current parameter gradients by name (shared ones from their first owner)."""
        out: dict[str, np.ndarray] = {}
        for e in self.engines.values():
            for n, g in e.grads().items():
                if g is not None and n not in out:
                    out[n] = g.copy() if copy else g
        return out

    def state(self) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for e in self.engines.values():
            for n, v in e.state().items():
                out.setdefault(n, v)
        return out

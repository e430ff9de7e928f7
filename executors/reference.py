"""The single-process reference executor.

Runs an OpGraph in one process: forward, backward, optimizer step, gradient
accumulation over micro-batches. Given an assignment node -> part, it runs
the graph *as partitioned*: each part executes only its sub-DAG and parts
exchange nothing but :class:`~fusion.ir.opdata.OpData` at their boundaries,
forward and backward, in the order a schedule (GPipe, 1F1B) dictates. This is
remote autodiff without sockets; the distributed runtime drives the same
:class:`~fusion.executors.runtime.part.PartRuntime`.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from fusion.ir.boundary import partition, part_links, part_order
from fusion.ir.errors import FusionError
from fusion.ir.model import Model
from fusion.ir.opdata import OpData
from fusion.executors.runtime.dp.clip import clip_coef, part_sq_norm, scale_grads, total_norm
from fusion.executors.runtime.compression import check_edges
from fusion.executors.runtime.dp.tied import TiedCodec, sum_in_order
from fusion.executors.engines.select import (check_engines, check_optimizer, engine_options_for, make_engine_part,
                                             make_optimizer)
from fusion.plan import OptimizerConfig
from fusion.executors.runtime.part import PartRuntime
from fusion.executors.runtime.schedule import LANE_SCHEDULES, ActionKind, make_lanes, make_schedule, splits_backward

log = logging.getLogger(__name__)


def split_micro_batches(batch: Mapping[str, Any], n: int) -> list[dict[str, Any]]:
    """Split every placeholder value along dim 0 into ``n`` equal micro-batches."""
    if n == 1:  # nothing to split (and 0-d values, such as an ONNX scalar input, cannot be)
        return [{k: torch.as_tensor(np.array(v) if isinstance(v, np.ndarray) and not v.flags.writeable else v)
                 for k, v in batch.items()}]
    out: list[dict[str, Any]] = [{} for _ in range(n)]
    for name, v in batch.items():
        t = torch.as_tensor(v)
        if t.shape[0] % n:
            raise FusionError(f"batch field {name!r} has {t.shape[0]} rows, not divisible into {n} micro-batches")
        for i, c in enumerate(torch.chunk(t, n, dim=0)):
            out[i][name] = c
    return out


def contiguous_parts(graph, n: int) -> dict[str, str]:
    """Cut ``graph`` (an OpGraph, or a Model) into ``n`` parts ``p0`` .. ``p{n-1}`` for in-process checks.

    Contiguous ranges of compute nodes in the graph's (topological) order, of
    equal node count; each placeholder goes with its first user. The result
    is the ``assignment`` :class:`ReferenceExecutor` takes::

        ex = ReferenceExecutor(model, contiguous_parts(model, 4), OptimizerConfig("adamw", lr=1e-3))
    """
    from fusion.ir.node import PLACEHOLDER_KINDS

    graph = getattr(graph, "graph", graph)
    compute = [name for name, node in graph.nodes.items() if node.kind not in PLACEHOLDER_KINDS]
    if not 1 <= n <= len(compute):
        raise FusionError(f"cannot cut {len(compute)} compute nodes into {n} parts")
    bounds = np.linspace(0, len(compute), n + 1).round().astype(int)
    assign = {name: f"p{p}" for p in range(n) for name in compute[bounds[p]:bounds[p + 1]]}
    order = {name: i for i, name in enumerate(compute)}
    users = graph.users()
    for node in graph.nodes.values():
        if node.kind in PLACEHOLDER_KINDS:
            readers = [u for u in users[node.name] if u in order]
            assign[node.name] = assign[min(readers, key=order.__getitem__)] if readers else "p0"
    return assign


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
    engine_options: ``{part or "*": {option: value}}``, e.g. ``{"*": {"compiled": False}}`` runs every
                 torch part interpreted, ``{"p1": {"recompute": True}}`` recomputes p1's activations.
    devices:     part -> device; needed by ``schedule="interleaved"`` (parts on one device are its virtual
                 stages, each part runs its projection of the device's order, :func:`~fusion.ir.schedule.make_lanes`).
    tied_codec:  the plan's ``tied_codec`` (None: tied-parameter gradients summed exactly); as in a
                 distributed run, every owner's gradient is encoded and the decoded gradients summed
                 in part order (:class:`~fusion.executors.runtime.compression.TiedCodec`).
    """

    def __init__(self, model: Model, assignment: Mapping[str, str] | None = None,
                 optimizer: OptimizerConfig = OptimizerConfig(), micro_batches: int = 1,
                 schedule: str = "gpipe", engines: Mapping[str, str] | None = None,
                 compression: Sequence[Any] | None = None, engine_options: Mapping[str, Mapping[str, Any]] | None = None,
                 tied_codec: dict | None = None, devices: Mapping[str, str] | None = None):
        g = model.graph
        self.graph = g
        self.assignment = dict(assignment) if assignment else {n: "p0" for n in g.nodes}
        subs = partition(g, self.assignment)
        self.order = part_order(g, self.assignment)
        links = part_links(g, self.assignment)
        self.micro_batches = micro_batches
        self.schedule = make_schedule(schedule, self.order, links, micro_batches, devices)
        self._device_lanes = (make_lanes(schedule, self.order, links, micro_batches, devices)
                              if schedule in LANE_SCHEDULES else None)
        names = dict(engines or {})
        check_engines(g, self.assignment, names)
        check_optimizer(optimizer.name, {p: names.get(p, "torch") for p in self.order})
        self.engines = {p: make_engine_part(names.get(p, "torch"), g, subs[p], model.params,
                                            options=engine_options_for(p, names.get(p, "torch"), engine_options))
                        for p in self.order}
        check_edges(compression or (), self.assignment)
        self.parts = {p: PartRuntime(g, p, subs[p], self.assignment, self.engines[p], compression) for p in self.order}
        self.optimizers = {p: make_optimizer(names.get(p, "torch"), e, optimizer) for p, e in self.engines.items()}
        self.optimizer = optimizer  # its lr schedule and gradient clipping apply in step(), as in the runtime
        owners: dict[str, list[str]] = {}
        for p, e in self.engines.items():
            for name in e.trainable():
                owners.setdefault(name, []).append(p)
        self.shared = {n: ps for n, ps in owners.items() if len(ps) > 1}
        self.tied = TiedCodec.from_cfg(tied_codec, "tied_codec")
        if self.tied is not None:
            for ps in self.shared.values():
                for p in ps:
                    self.tied.check_engine(p, names.get(p, "torch"))
        self.iteration = 0

    @property
    def lanes(self) -> dict[str, list[tuple[str, Any]]]:
        """What each executor process would run, in order: [(part, action)] per part (its :attr:`schedule`),
        or per device under ``interleaved`` (its virtual stages in Megatron-LM's order)."""
        if self._device_lanes is not None:
            return self._device_lanes
        return {p: [(p, a) for a in acts] for p, acts in self.schedule.items()}

    # -- one training step ---------------------------------------------------------
    def forward_backward(self, batch: Mapping[str, Any]) -> float:
        """Forward and backward of every micro-batch by the schedule; returns the loss."""
        mbs = split_micro_batches(batch, self.micro_batches)
        scale = 1.0 / self.micro_batches
        inbox: dict[tuple[str, str, int], list[OpData]] = {}
        lanes = self.lanes
        cursor = {q: 0 for q in lanes}
        losses: list[float] = []
        it = self.iteration
        total = sum(len(a) for a in lanes.values())
        done = 0
        while done < total:
            progressed = False
            for q, lane in lanes.items():
                if cursor[q] >= len(lane):
                    continue
                p, a = lane[cursor[q]]
                box = inbox.get((p, a.kind, a.micro_batch), [])
                part = self.parts[p]
                if a.kind == ActionKind.W:  # the parameter half of a split backward: local, waits for nothing
                    part.weight(it, a.micro_batch)
                    cursor[q] += 1
                    done += 1
                    progressed = True
                    continue
                if a.kind == ActionKind.F:
                    if {m.key for m in box} != part.needs_acts():
                        continue
                    out, loss = part.forward(it, a.micro_batch, mbs[a.micro_batch], box)
                    if loss is not None:
                        losses.append(loss)
                    kind = ActionKind.F
                else:
                    want = part.needs_grads()
                    have: dict = {}
                    for m in box:
                        have.setdefault(m.key, set()).add(m.src)
                    if have != want:
                        continue
                    out = part.backward(it, a.micro_batch, box, scale, split=splits_backward(self.schedule[p]))
                    kind = ActionKind.B
                inbox.pop((p, a.kind, a.micro_batch), None)
                for msg in out:
                    inbox.setdefault((msg.dst, kind, msg.micro_batch), []).append(msg)
                cursor[q] += 1
                done += 1
                progressed = True
            if not progressed:
                stuck = {q: str(lanes[q][cursor[q]][1]) for q in lanes if cursor[q] < len(lanes[q])}
                raise RuntimeError(f"schedule deadlock at {stuck}")
        if len(losses) == 1:  # the same float as np.sum of one element, without NumPy's call overhead
            return float(losses[0] * scale)
        return float(np.sum(losses) * scale)

    def forward_outputs(self, batch: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """Inference: forward only (no backward, no optimizer step, no gradient kept).

        Returns the value of every OUTPUT and LOSS node by node name, for the
        whole ``batch``: per-micro-batch tensors are concatenated along dim 0,
        scalar losses averaged over micro-batches. Parts exchange activations
        exactly as in training (only what crosses their boundaries).
        """
        from fusion.ir.node import NodeKind

        wanted = {n for n, node in self.graph.nodes.items() if node.kind in (NodeKind.OUTPUT, NodeKind.LOSS)}
        per_mb: dict[str, list[np.ndarray]] = {n: [] for n in wanted}
        for mb, feeds in enumerate(split_micro_batches(batch, self.micro_batches)):
            acts: dict[Any, Any] = {}
            for p in self.order:
                part, engine = self.parts[p], self.engines[p]
                if not engine.RECORDS_OUTPUTS:
                    raise FusionError(f"part {p}: its engine cannot report node outputs (forward_outputs needs the torch engine)")
                got: dict[str, Any] = {}

                def record(name, value, got=got):
                    if name in wanted:
                        got[name] = value
                key = ("forward_outputs", mb)
                with torch.no_grad():
                    sent, _ = engine.forward(key, {k: acts[k] for k in part.needs_acts()},
                                             {k: feeds[k] for k in part.placeholders if k in feeds}, record=record)
                engine.forget(key)
                acts.update(sent)
                for name, v in got.items():
                    if isinstance(v, torch.Tensor):
                        v = v.detach().cpu()
                        per_mb[name].append((v.float() if v.dtype == torch.bfloat16 else v).numpy())
                    else:
                        per_mb[name].append(np.asarray(v))
        out = {}
        for name, vs in per_mb.items():
            out[name] = vs[0] if len(vs) == 1 else np.mean(vs, axis=0) if vs[0].ndim == 0 else np.concatenate(vs, axis=0)
        return out

    def sync_shared_grads(self) -> None:
        """Sum the gradients of parameters held by several parts (tied weights)."""
        for name, owners in self.shared.items():
            gs = [self.engines[p].grads()[name] for p in owners]
            if self.tied is not None:
                spec = self.graph.params[name]
                gs = [None if g is None else self.tied.decode(
                    self.tied.encode(np.asarray(g), spec.dtype, name, p, self.iteration), tuple(spec.shape), spec.dtype,
                    f"gradient of {name!r} on {p}") for p, g in zip(owners, gs)]
            gs = [np.asarray(g) for g in gs if g is not None]
            if not gs:
                continue
            total = sum_in_order(gs)
            for p in owners:
                self.engines[p].set_grad(name, total)

    def step(self, batch: Mapping[str, Any]) -> StepResult:
        """One iteration: forward/backward over micro-batches, then the optimizer step."""
        loss = self.forward_backward(batch)
        self.sync_shared_grads()
        cfg = self.optimizer
        if cfg.clip_grad_norm is not None:  # the global norm over every part, tied parameters once (runtime/dp/clip.py)
            dtypes = {n: s.dtype for n, s in self.graph.params.items()}
            norm = total_norm(part_sq_norm(self.engines[p].grads(), dtypes=dtypes,
                                           skip={n for n, ps in self.shared.items() if ps[0] != p}) for p in self.order)
            for p in self.order:
                scale_grads(self.engines[p], clip_coef(cfg.clip_grad_norm, norm), dtypes)
        if cfg.lr_schedule != "constant" or cfg.warmup_steps:
            for opt in self.optimizers.values():
                if opt is not None:
                    opt.set_lr(cfg.lr_at(self.iteration))
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

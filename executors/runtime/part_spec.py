"""What a CompNode computes from the plan at start, derived once from (plan, part): :class:`PartSpec`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from fusion.ir.boundary import part_links, part_order, partition
from fusion.ir.errors import FusionError
from fusion.executors.runtime.dp.outer import replica_micro_batches
from fusion.executors.runtime.feeds import feed_specs
from fusion.executors.runtime.schedule import make_schedule


@dataclass(frozen=True)
class PartSpec:
    """One part of a plan as its CompNode runs it (nothing here changes while it runs; the micro-batch count
    and the data-parallel group may, by joins and regroups, and live on the CompNode)."""

    part: str  #: the part's name in the plan
    replica: int  #: the pipeline replica the part belongs to (0 without data parallelism)
    assignment: Mapping[str, str]  #: node -> its part in this replica's pipeline (replica 0: the plan's)
    order: tuple[str, ...]  #: this replica's parts in pipeline order
    devices: Mapping[str, str]  #: part of ``order`` -> its device in the cluster
    engine: str  #: the part's engine name (``torch``, ``numpy``, ...)
    sub: Any  #: the part's sub-DAG (:func:`fusion.ir.boundary.partition`): its nodes and boundary tables
    shared: Mapping[str, tuple[str, ...]]  #: tied parameter this part holds -> every owner, in part order
    param_names: tuple[str, ...]  #: the parameters the part's nodes use, sorted
    param_dtypes: Mapping[str, str]  #: parameter -> its dtype
    trainable: Mapping[str, tuple[tuple[int, ...], str]]  #: trainable parameter -> (shape, dtype)
    shares: tuple[int, ...] | None  #: micro-batches per step of each replica under unequal shares (None: equal)
    micro_batches: int  #: this replica's micro-batches per step at the start
    feed_specs: Mapping[str, Any]  #: placeholder of this part -> what its feeds must be (:mod:`.feeds`)

    def actions(self, plan, micro_batches: int) -> list:
        """This part's schedule (its actions, :mod:`.schedule`) for ``micro_batches`` per step."""
        return make_schedule(plan.schedule, list(self.order), part_links(plan.graph, self.assignment),
                             micro_batches, dict(self.devices))[self.part]

    @classmethod
    def derive(cls, plan, part: str) -> "PartSpec":
        """The spec of ``part`` (FusionError when the plan has no such part)."""
        if part not in plan.parts:
            raise FusionError(f"plan has no part {part!r} (parts: {sorted(plan.parts)})")
        g = plan.graph
        replica = plan.parts[part].replica
        assignment = plan.replica_assignment(replica)
        order = tuple(part_order(g, assignment))
        subs = partition(g, assignment)
        sub = subs[part]
        owners: dict[str, list[str]] = {}
        for p in order:
            for n in subs[p].nodes:
                for pname in g[n].param_names():
                    if g.params[pname].trainable and p not in owners.setdefault(pname, []):
                        owners[pname].append(p)
        param_names = tuple(sorted({p for n in sub.nodes for p in g[n].param_names()}))
        shares = tuple(replica_micro_batches(plan)) if plan.dp_sync.shares else None
        return cls(
            part=part, replica=replica, assignment=assignment, order=order,
            devices={p: plan.parts[p].device for p in order}, engine=plan.parts[part].engine, sub=sub,
            shared={n: tuple(ps) for n, ps in owners.items() if len(ps) > 1 and part in ps},
            param_names=param_names, param_dtypes={p: g.params[p].dtype for p in param_names},
            trainable={p: (tuple(g.params[p].shape), g.params[p].dtype) for p in param_names
                       if g.params[p].trainable},
            shares=shares, micro_batches=shares[replica] if shares else plan.micro_batches,
            feed_specs=feed_specs(plan, [n for n in sub.nodes if g[n].kind.value in ("input", "label")]))

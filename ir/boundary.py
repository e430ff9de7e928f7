"""Sub-DAG extraction and boundary tables (FusionLLM §3.3, Table 3).

A sub-DAG is a set of nodes executed by one CompNode. Its boundary says what
crosses it: activations it requires and sends in forward, gradients it
requires and sends in backward. Each crossing is a :class:`BoundaryEdge`
tagged with its producer, output index and actual user, which is how a
gradient finds its way back to the producer it belongs to.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping

from fusion.ir.errors import GraphError
from fusion.ir.graph import CycleError, topo_sort
from fusion.ir.node import PLACEHOLDER_KINDS, TensorMeta

PartId = str


@dataclass(frozen=True)
class BoundaryEdge:
    """One tensor that crosses a sub-DAG boundary.

    producer:      node computing the tensor (FusionLLM OP-Data "name").
    index:         output index of a multi-output producer; None for the whole output.
    actual_user:   consumer node on the other side (FusionLLM "actual OP user").
    requires_grad: whether a gradient flows back along this edge in BP.
    """

    producer: str
    index: int | None
    actual_user: str
    requires_grad: bool

    @property
    def key(self) -> tuple[str, int | None]:
        """The tensor this edge carries: ``(producer, index)``."""
        return (self.producer, self.index)

    def label(self) -> str:
        """``"Conv-Add"`` style label of Table 3."""
        idx = "" if self.index is None else f"[{self.index}]"
        return f"{self.producer}{idx}-{self.actual_user}"


@dataclass
class Boundary:
    """What a sub-DAG requires and sends (the four columns of Table 3)."""

    required_acts: list[BoundaryEdge] = field(default_factory=list)
    sent_acts: list[BoundaryEdge] = field(default_factory=list)
    required_grads: list[BoundaryEdge] = field(default_factory=list)
    sent_grads: list[BoundaryEdge] = field(default_factory=list)


@dataclass
class SubGraph:
    """A sub-DAG: its nodes in topological order plus its boundary."""

    nodes: list[str]
    boundary: Boundary


def edge_requires_grad(graph, producer: str, index: int | None) -> bool:
    """Whether the tensor ``(producer, index)`` carries a gradient in BP.

    Uses shapes metadata when present; without it, every non-placeholder
    tensor is assumed to require grad (the safe choice).
    """
    node = graph[producer]
    if node.kind in PLACEHOLDER_KINDS:
        return False
    outs = node.meta.outputs
    if not outs:
        return True
    if index is None:
        return any(isinstance(o, TensorMeta) and o.requires_grad for o in outs)
    if index >= len(outs):
        raise GraphError(f"output index {index} out of range ({len(outs)} outputs)", producer)
    o = outs[index]
    return isinstance(o, TensorMeta) and o.requires_grad


def _edges(graph, inside: set[str]) -> tuple[list[BoundaryEdge], list[BoundaryEdge]]:
    required, sent = [], []
    seen: set[tuple] = set()
    for node in graph.nodes.values():
        for ref in node.refs():
            a, b = ref.node in inside, node.name in inside
            if a == b:
                continue
            key = (ref.node, ref.index, node.name)
            if key in seen:
                continue
            seen.add(key)
            e = BoundaryEdge(ref.node, ref.index, node.name, edge_requires_grad(graph, ref.node, ref.index))
            (sent if a else required).append(e)
    return required, sent


def subgraph(graph, names: Iterable[str]) -> SubGraph:
    """The sub-DAG on ``names`` (any order) with its boundary tables."""
    inside = set(names)
    for n in inside:
        if n not in graph.nodes:
            raise GraphError("subgraph names a node that is not in the graph", n)
    required, sent = _edges(graph, inside)
    boundary = Boundary(
        required_acts=required,
        sent_acts=sent,
        required_grads=[e for e in sent if e.requires_grad],
        sent_grads=[e for e in required if e.requires_grad],
    )
    order = [n for n in graph.nodes if n in inside]
    return SubGraph(order, boundary)


def check_assignment(graph, assignment: Mapping[str, PartId]) -> None:
    """Every node assigned to a part, and no assignment for a node not in the graph."""
    missing = [n for n in graph.nodes if n not in assignment]
    if missing:
        raise GraphError("node is not assigned to any part", missing[0])
    unknown = [n for n in assignment if n not in graph.nodes]
    if unknown:
        raise GraphError("assignment names a node that is not in the graph", unknown[0])


def partition(graph, assignment: Mapping[str, PartId]) -> dict[PartId, SubGraph]:
    """Split ``graph`` by ``assignment`` (node -> part). Every node must be assigned."""
    check_assignment(graph, assignment)
    parts: dict[PartId, list[str]] = {}
    for n in graph.nodes:
        parts.setdefault(assignment[n], []).append(n)
    return {p: subgraph(graph, names) for p, names in parts.items()}


def part_order(graph, assignment: Mapping[str, PartId]) -> list[PartId]:
    """Parts in a topological order of the part-level (quotient) graph.

    The runtime runs each part's sub-DAG as a whole, so the quotient graph
    must be acyclic: a part may not both feed and consume another part.
    OP-Fence always produces such assignments; a hand-written one that does
    not is rejected here with the parts named.
    """
    check_assignment(graph, assignment)
    parts = list(dict.fromkeys(assignment[n] for n in graph.nodes))
    links = {(assignment[p], assignment[node.name]) for node in graph.nodes.values() for p in node.producers()}
    try:
        return topo_sort(parts, ((a, b) for a, b in links if a != b))
    except CycleError as e:
        raise GraphError(
            f"parts {e.cycle} form a cycle (a part both feeds and consumes another); "
            "assign nodes so that data flows one way between parts"
        ) from None


def part_links(graph, assignment: Mapping[str, PartId]) -> dict[tuple[PartId, PartId], list[BoundaryEdge]]:
    """(src part, dst part) -> activation edges crossing that way."""
    out: dict[tuple[PartId, PartId], list[BoundaryEdge]] = {}
    for p, sg in partition(graph, assignment).items():
        for e in sg.boundary.sent_acts:
            out.setdefault((p, assignment[e.actual_user]), []).append(e)
    return out

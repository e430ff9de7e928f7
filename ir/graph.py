"""OpGraph: the OP-DAG (FusionLLM §3.3).

Operators are nodes, tensors are edges. Parameters are graph-level entities
(:class:`ParamSpec`) that nodes reference by name, so a parameter used by two
nodes (tied input/output embeddings) exists once in the graph.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Iterable, TypeVar

from fusion.ir.errors import GraphError
from fusion.ir.node import NodeKind, OpNode, PLACEHOLDER_KINDS, TensorMeta
from fusion.ir.registry import REGISTRY, OpRegistry

H = TypeVar("H", bound=Hashable)


@dataclass(frozen=True)
class ParamSpec:
    """A named parameter or buffer of the model.

    name: the original name in the user's module (``state_dict`` key), so
          weights and optimizer state map back to it.
    trainable: False for buffers (BatchNorm running statistics).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    trainable: bool = True

    @property
    def nbytes(self) -> int:
        return TensorMeta(self.shape, self.dtype).nbytes


class CycleError(ValueError):
    """A cycle among the items :func:`topo_sort` was given; ``cycle`` lists them along the cycle."""

    def __init__(self, cycle: list):
        super().__init__(f"cycle through {cycle}")
        self.cycle = cycle


def topo_sort(items: list[H], edges: Iterable[tuple[H, H]]) -> list[H]:
    """``items`` in a topological order of ``edges`` (``(before, after)`` pairs), each item as early
    as its position in ``items`` allows (the smallest-position ready item goes first). The one
    topological sort of the project: graph nodes and parts (``ir.boundary.part_order``) both use it.
    Raises :class:`CycleError` naming the items along a cycle.
    """
    import networkx as nx

    position = {x: i for i, x in enumerate(items)}
    dag = nx.DiGraph()
    dag.add_nodes_from(items)
    dag.add_edges_from(edges)
    try:
        return list(nx.lexicographical_topological_sort(dag, key=position.__getitem__))
    except nx.NetworkXUnfeasible:
        raise CycleError([e[0] for e in nx.find_cycle(dag)]) from None


@dataclass
class OpGraph:
    """The OP-DAG.

    nodes:   name -> node, kept in a topological order once validated.
    params:  name -> parameter spec (weights travel separately).
    plugins: Python modules that register user-defined op types used here.
    """

    nodes: dict[str, OpNode] = field(default_factory=dict)
    params: dict[str, ParamSpec] = field(default_factory=dict)
    plugins: list[str] = field(default_factory=list)

    # -- construction ---------------------------------------------------------
    def add(self, node: OpNode) -> OpNode:
        if node.name in self.nodes:
            raise GraphError("duplicate node name", node.name)
        self.nodes[node.name] = node
        return node

    def add_param(self, spec: ParamSpec) -> ParamSpec:
        old = self.params.get(spec.name)
        if old is not None and old != spec:
            raise GraphError(f"parameter {spec.name!r} declared twice with different specs: {old} vs {spec}")
        self.params[spec.name] = spec
        return spec

    # -- queries -----------------------------------------------------------------
    def __getitem__(self, name: str) -> OpNode:
        try:
            return self.nodes[name]
        except KeyError:
            raise GraphError("no such node", name) from None

    def __contains__(self, name: str) -> bool:
        return name in self.nodes

    def __len__(self) -> int:
        return len(self.nodes)

    def __iter__(self):
        return iter(self.nodes.values())

    def output_meta(self, node: str, index: int | None):
        """Metadata of what a ``Ref(node, index)`` carries: output ``index``, or the single
        output when ``index`` is None; None when the node has no such (single) output."""
        outs = self[node].meta.outputs
        i = index or 0
        return outs[i] if i < len(outs) and (index is not None or len(outs) == 1) else None

    def users(self) -> dict[str, list[str]]:
        """Node name -> names of the nodes that consume its output (FusionLLM "OP users")."""
        out: dict[str, list[str]] = {n: [] for n in self.nodes}
        for node in self.nodes.values():
            for p in node.producers():
                if p in out:
                    out[p].append(node.name)
        return out

    def placeholders(self, kind: NodeKind | None = None) -> list[OpNode]:
        kinds = (kind,) if kind else PLACEHOLDER_KINDS
        return [n for n in self.nodes.values() if n.kind in kinds]

    def loss_nodes(self) -> list[OpNode]:
        return [n for n in self.nodes.values() if n.kind == NodeKind.LOSS]

    def param_users(self) -> dict[str, list[str]]:
        """Parameter name -> nodes that read it (more than one: a tied parameter)."""
        out: dict[str, list[str]] = {p: [] for p in self.params}
        for node in self.nodes.values():
            for p in node.param_names():
                out.setdefault(p, []).append(node.name)
        return out

    def topo_order(self) -> list[str]:
        """Node names in a topological order, each as early as its insertion position allows. Raises on cycles."""
        try:
            return topo_sort(list(self.nodes), ((p, n.name) for n in self.nodes.values()
                                                for p in n.producers() if p in self.nodes))
        except CycleError as e:
            raise GraphError(f"the graph has a cycle through {e.cycle}", e.cycle[0]) from None

    # -- validation ----------------------------------------------------------------
    def validate(self, registry: OpRegistry = REGISTRY, check_targets: bool = True) -> "OpGraph":
        """Check the DAG and reorder nodes topologically. Returns self.

        Errors name the node: dangling argument, unknown op type, wrong arity,
        placeholder with arguments, unknown parameter, cycle. (Duplicate
        names are rejected by :meth:`add` and by deserialisation.)
        """
        for node in self.nodes.values():
            self._check_node(node, registry, check_targets)
        order = self.topo_order()
        self.nodes = {n: self.nodes[n] for n in order}
        return self

    def _check_node(self, node: OpNode, registry: OpRegistry, check_targets: bool) -> None:
        if not isinstance(node.kind, NodeKind):
            raise GraphError(f"unknown node kind {node.kind!r}", node.name)
        for ref in node.refs():
            if ref.node not in self.nodes:
                raise GraphError(f"argument refers to missing node {ref.node!r}", node.name)
            if ref.node == node.name:
                raise GraphError("node uses its own output (a cycle)", node.name)
        for p in node.param_names():
            if p not in self.params:
                raise GraphError(f"uses unknown parameter {p!r}", node.name)
        if node.kind in PLACEHOLDER_KINDS:
            if node.args or node.kwargs or node.target:
                raise GraphError(f"{node.kind.value} placeholder takes no target or arguments", node.name)
            return
        if node.kind == NodeKind.OUTPUT:
            if len(node.args) != 1:
                raise GraphError("an output node takes exactly one argument", node.name)
            return
        if not node.target:
            raise GraphError(f"{node.kind.value} node has no target op", node.name)
        if not check_targets:
            return
        spec = registry.lookup(node.target)
        if spec is None:
            raise GraphError(f"unknown op type {node.target!r} (register it with fusion.register_module/register_function)", node.name)
        if node.kind == NodeKind.MODULE and spec.call != "module":
            raise GraphError(f"target {node.target!r} is a {spec.call}, not a module type", node.name)
        if node.kind == NodeKind.FUNCTION and spec.call == "module":
            raise GraphError(f"target {node.target!r} is a module type; use a module node", node.name)
        if spec.call != "module" and node.params:
            raise GraphError("only module nodes own parameters; pass ParamRef arguments instead", node.name)
        n = len(node.args)
        if spec.min_args is not None and n < spec.min_args:
            missing = spec.min_args - n
            # keyword arguments may fill positional slots
            if len(node.kwargs) < missing:
                raise GraphError(f"wrong arity for {node.target!r}: takes at least {spec.min_args} arguments, got {n}", node.name)
        if spec.max_args is not None and n > spec.max_args:
            raise GraphError(f"wrong arity for {node.target!r}: takes at most {spec.max_args} arguments, got {n}", node.name)

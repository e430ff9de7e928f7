"""The OP-DAG intermediate representation: nodes, graphs, boundaries, OP-Data."""
from .boundary import Boundary, BoundaryEdge, SubGraph, partition, part_order, subgraph
from .errors import FusionError, GraphError, WireError
from .graph import OpGraph, ParamSpec
from .node import NodeKind, NodeMeta, OpNode, ParamRef, Ref, TensorMeta, ValueMeta
from .opdata import OpData
from .registry import REGISTRY, OpRegistry, register_function, register_module
from .serialize import graph_from_dict, graph_to_dict, load_graph, save_graph

__all__ = [
    "Boundary", "BoundaryEdge", "SubGraph", "partition", "part_order", "subgraph",
    "FusionError", "GraphError", "WireError", "OpGraph", "ParamSpec",
    "NodeKind", "NodeMeta", "OpNode", "ParamRef", "Ref", "TensorMeta", "ValueMeta", "OpData",
    "REGISTRY", "OpRegistry", "register_function", "register_module",
    "graph_from_dict", "graph_to_dict", "load_graph", "save_graph",
]

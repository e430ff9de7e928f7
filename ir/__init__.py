"""The OP-DAG intermediate representation: nodes, graphs, boundaries, OP-Data."""
from fusion.ir.boundary import Boundary, BoundaryEdge, SubGraph, partition, part_order, subgraph
from fusion.ir.errors import FusionError, GraphError, WireError
from fusion.ir.graph import OpGraph, ParamSpec
from fusion.ir.node import NodeKind, NodeMeta, OpNode, ParamRef, Ref, TensorMeta, ValueMeta
from fusion.ir.opdata import OpData
from fusion.ir.registry import REGISTRY, OpRegistry, register_function, register_module
from fusion.ir.serialize import graph_from_dict, graph_to_dict, load_graph, save_graph

__all__ = [
    "Boundary", "BoundaryEdge", "SubGraph", "partition", "part_order", "subgraph",
    "FusionError", "GraphError", "WireError", "OpGraph", "ParamSpec",
    "NodeKind", "NodeMeta", "OpNode", "ParamRef", "Ref", "TensorMeta", "ValueMeta", "OpData",
    "REGISTRY", "OpRegistry", "register_function", "register_module",
    "graph_from_dict", "graph_to_dict", "load_graph", "save_graph",
]

"""``fusion graph MODEL``: print a model's OP-DAG (nodes, shapes, parameters)."""
from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    p = sub.add_parser("graph", help="print the OP-DAG of a model (file.py:function)",
                       description="Load MODEL (file.py:function returning a fusion Model, an OpGraph, or (module, example inputs)) and print its nodes.")
    p.add_argument("model", help="file.py:function")
    p.add_argument("-o", "--output", help="also save the graph as JSON here")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..loader import load_model
    from ..ir.serialize import save_graph

    model = load_model(args.model)
    g = model.graph
    print(f"{len(g.nodes)} nodes, {len(g.params)} parameters ({sum(p.nbytes for p in g.params.values()) / 1e6:.2f} MB)")
    for n in g.nodes.values():
        shapes = ", ".join(str(list(o.shape)) if hasattr(o, "shape") else repr(o.value) for o in n.meta.outputs)
        print(f"  {n.name:30s} {n.kind.value:8s} {n.target:40s} {shapes}")
    if args.output:
        save_graph(g, args.output)
    return 0

"""Validity checks of a DPPlacement shared by the DP x PP planner tests."""
from __future__ import annotations

import networkx as nx
import numpy as np

from fusion.cost.dp import dp_estimate
from fusion.cost.estimate import CostModel


def check_placement(cm: CostModel, pl, micro_batches: int) -> None:
    """Disjoint devices, one cut with stages 0..S-1, connected acyclic stages, memory fits, prediction reproduced."""
    from fusion.cost.dp import replica_cost_model
    from fusion.ir.boundary import part_order

    R, S = pl.replicas, pl.stages
    flat = [d for row in pl.devices for d in row]
    assert len(flat) == len(set(flat)) == R * S
    assert all(len(row) == S for row in pl.devices)
    assert set(pl.cut) == set(cm.names) and set(pl.cut.values()) == set(range(S))
    assign = {n: f"part{s}" for n, s in pl.cut.items()}
    assert part_order(cm.graph, assign) == [f"part{s}" for s in range(S)]  # stages in pipeline order
    g = nx.Graph()
    for node in cm.graph.nodes.values():
        g.add_node(node.name)
        for prod in node.producers():
            if pl.cut[prod] == pl.cut[node.name]:
                g.add_edge(prod, node.name)
    for s in range(S):
        assert nx.is_connected(g.subgraph([n for n, p in pl.cut.items() if p == s])), s
    rcm = replica_cost_model(cm, micro_batches)
    node_part = np.array([pl.cut[n] for n in cm.names])
    devs = [[cm.cluster.index(d) for d in row] for row in pl.devices]
    est = dp_estimate(rcm, node_part, devs)
    assert est.feasible, est.violations
    for key in ("iteration_s", "pipeline_s", "dp_sync_s", "samples_per_s"):
        assert pl.predicted[key] == est.predicted()[key]

"""Device topology for OP-Fence: high-bandwidth clusters (Louvain) and a pipeline order.

**Clusters** (FusionLLM §4, Observation 2). Louvain modularity
(``community.best_partition`` from python-louvain, fixed ``random_state``) runs
on the undirected device graph with edge weight ``(b_ij / b_max) ** 6``, where
``b_ij`` is the harmonic mean of the two directions' bandwidths. Why a power:
modularity compares each edge with what a random graph of the same degrees
would have, so on a complete graph where a region's 2 Gbit/s links face
1.1 Gbit/s links to the next region (DT-FM's world-wide case) raw bandwidths
leave too little contrast and neighbouring regions merge. A power keeps the
order of links and sharpens their ratios (2x becomes 64x). Measured on
the shipped scenarios (``fusion/cluster/data``): exponents 2 and 3 merge regions of dtfm-5, 4 is the
first that recovers all eight, 6 leaves margin; dtfm-3/4, fusionllm-24/48 and
the data-center cases are recovered at every exponent from 1 to 8. Above
``dense_limit`` devices each device keeps only its ``knn`` strongest links, so
Louvain stays fast on 1024 devices.

**Pipeline order.** The pipeline crosses from one cluster to the next, so
clusters are chained as a path that greedily keeps the strongest
inter-cluster bandwidth between consecutive clusters, starting from a given
cluster; inside a cluster devices go fastest first. OP-Fence then fills a
prefix of this device order (:mod:`fusion.partition.chain`), so a path that starts at a
strong cluster uses it first and reaches weaker or far-away clusters only if
memory or compute demands it.
"""
from __future__ import annotations

import logging

import numpy as np

from fusion.cluster.model import Cluster

log = logging.getLogger(__name__)

LOUVAIN_EXPONENT = 6.0


def symmetric_bandwidth(cluster: Cluster) -> np.ndarray:
    """Bytes/s of each undirected pair: harmonic mean of both directions (0 on the diagonal)."""
    b = cluster.beta + cluster.beta.T
    out = np.zeros_like(b)
    off = ~np.eye(len(cluster), dtype=bool)
    out[off] = 2.0 / b[off]
    return out


def device_clusters(cluster: Cluster, seed: int = 0, exponent: float = LOUVAIN_EXPONENT,
                    dense_limit: int = 256, knn: int = 32) -> list[list[int]]:
    """Louvain communities of device indices, each sorted, ordered by first member."""
    import community
    import networkx as nx

    n = len(cluster)
    if n == 1:
        return [[0]]
    bw = symmetric_bandwidth(cluster)
    w = (bw / bw.max()) ** exponent
    g = nx.Graph()
    g.add_nodes_from(range(n))
    if n <= dense_limit:
        iu, ju = np.triu_indices(n, 1)
        g.add_weighted_edges_from(zip(iu.tolist(), ju.tolist(), w[iu, ju].tolist()))
    else:
        k = min(knn, n - 1)
        w_no_self = w.copy()
        np.fill_diagonal(w_no_self, -1.0)
        nbrs = np.argpartition(-w_no_self, k - 1, axis=1)[:, :k]
        rows = np.repeat(np.arange(n), k)
        cols = nbrs.ravel()
        g.add_weighted_edges_from(zip(rows.tolist(), cols.tolist(), w[rows, cols].tolist()))
    if g.size(weight="weight") <= 0:
        return [list(range(n))]
    part = community.best_partition(g, weight="weight", random_state=seed)
    groups: dict[int, list[int]] = {}
    for dev in range(n):
        groups.setdefault(part[dev], []).append(dev)
    out = sorted((sorted(v) for v in groups.values()), key=lambda v: v[0])
    log.info("Louvain found %d device clusters among %d devices", len(out), n)
    return out


def cluster_bandwidth(cluster: Cluster, clusters: list[list[int]]) -> np.ndarray:
    """Mean symmetric bandwidth between every two clusters (bytes/s); diagonal: inside the cluster."""
    bw = symmetric_bandwidth(cluster)
    m = len(clusters)
    out = np.zeros((m, m))
    for a in range(m):
        for b in range(m):
            block = bw[np.ix_(clusters[a], clusters[b])]
            if a == b:
                k = len(clusters[a])
                out[a, b] = block.sum() / (k * (k - 1)) if k > 1 else np.inf
            else:
                out[a, b] = block.mean()
    return out


def cluster_path(cbw: np.ndarray, start: int) -> list[int]:
    """Greedy path over clusters from ``start``: always step to the best-connected unvisited one."""
    m = len(cbw)
    path, left = [start], set(range(m)) - {start}
    while left:
        cur = path[-1]
        nxt = max(left, key=lambda c: (cbw[cur, c], -c))
        path.append(nxt)
        left.remove(nxt)
    return path


def device_order(cluster: Cluster, clusters: list[list[int]], path: list[int]) -> list[int]:
    """Devices along the cluster path; inside a cluster fastest first (then by index)."""
    speed = [d.speed for d in cluster.devices]
    out: list[int] = []
    for c in path:
        out.extend(sorted(clusters[c], key=lambda i: (-speed[i], i)))
    return out


def start_candidates(cluster: Cluster, clusters: list[list[int]], cbw: np.ndarray, limit: int = 4) -> list[int]:
    """Clusters worth starting the pipeline from: the strongest by total speed, by
    total memory and by internal bandwidth (deduplicated, at most ``limit``)."""
    speed = np.array([sum(cluster.devices[i].speed for i in c) for c in clusters])
    memory = np.array([sum(cluster.devices[i].memory_bytes for i in c) for c in clusters])
    inside = np.array([cbw[c, c] if np.isfinite(cbw[c, c]) else 0.0 for c in range(len(clusters))])
    picks: list[int] = []
    for score in (speed, memory, inside * speed):
        for c in np.argsort(-score, kind="stable")[:2]:
            if int(c) not in picks:
                picks.append(int(c))
    return picks[:limit]

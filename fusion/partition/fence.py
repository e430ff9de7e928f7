"""OP-Fence: cluster the devices by bandwidth and cut the OP-DAG (FusionLLM §4).

The paper states the idea (Louvain finds high-bandwidth clusters; each
cluster gets a connected sub-graph) and the objective (Eq. 5: minimise the
pipelined iteration time within device memory). This module makes it an
algorithm:

1. **Clusters**: Louvain on the bandwidth graph (:func:`fusion.cluster.topology.device_clusters`).
2. **Order**: for a few promising start clusters, chain the clusters as a
   path keeping the strongest links between consecutive clusters, devices
   fastest first inside each (:mod:`fusion.cluster.topology`). Filling a *prefix* of
   that order means a cluster is used before the pipeline leaves it, so each
   cluster receives one contiguous (connected) range of the DAG, and heavy
   cuts stay on fast links.
3. **Partition**: the dynamic program of :mod:`fusion.partition.chain` splits the atom
   chain over the first m devices for every m at once, balancing compute by
   device speed, pricing each cut on its link, and respecting memory; it runs
   for a falling sequence of stage-time bounds B to trade
   ``sum_p (C_p + R_p)`` against ``(n_b - 1) max_p max(C_p, R_p)``. Not every
   device is used: with slow links, fewer parts on fast links win, and the
   DP stops adding devices once the sum alone exceeds the best time found.
4. **Refine**: hill-climbing on the exact estimator (direct sends of skip
   connections, 1F1B memory, tied-gradient sync): move a cut by 1-8 atoms,
   merge two neighbours, split a part onto an unused device, move a part to
   another device, swap two neighbours' devices. Every accepted move lowers
   the predicted iteration time and fits memory.
5. **Connectivity**: a range of a topological order can hold two
   disconnected pieces (parallel branches); such a piece moves to the
   neighbouring part it is attached to when the part graph stays acyclic.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np

from fusion.partition.chain import Chain, build_chain, candidate_positions, chain_dp
from fusion.cost.estimate import CostModel
from fusion.ir.errors import FusionError
from fusion.cluster.topology import cluster_bandwidth, cluster_path, device_clusters, device_order, start_candidates

log = logging.getLogger(__name__)


class NoFitError(FusionError):
    """No assignment fits the devices' memory."""


@dataclass
class Partition:
    """A partitioner's answer: part of every node (parts in pipeline order) and the device of every part."""

    node_part: np.ndarray
    part_device: list[int]
    iteration_s: float
    info: dict = field(default_factory=dict)


@dataclass
class _Layout:
    cuts: list[int]
    devices: list[int]

    def key(self) -> tuple:
        return tuple(self.cuts), tuple(self.devices)


def op_fence(cm: CostModel, clusters: list[list[int]] | None = None, seed: int = 0, max_units: int = 400,
             shrink: float = 0.9, max_passes: int = 40, max_sweeps: int = 60, max_exact: int = 200,
             progress: bool = False) -> Partition:
    """Run OP-Fence on a cost model; raises :class:`NoFitError` if nothing fits in memory."""
    from tqdm import tqdm

    t0 = time.perf_counter()
    clusters = clusters if clusters is not None else device_clusters(cm.cluster, seed)
    ch = build_chain(cm)
    pos = candidate_positions(ch, max_units)
    cbw = cluster_bandwidth(cm.cluster, clusters)
    starts = start_candidates(cm.cluster, clusters, cbw)
    n_b = cm.micro_batches
    found: dict[tuple, tuple[float, _Layout, int]] = {}
    best_dp = np.inf
    passes = 0
    bar = tqdm(total=len(starts) * max_passes, desc="op-fence", unit="pass", disable=True if not progress else None, leave=False)
    orders = []
    for s in starts:
        order = device_order(cm.cluster, clusters, cluster_path(cbw, s))
        orders.append(order)
        bound = np.inf
        for _ in range(max_passes):
            passes += 1
            bar.update(1)
            sols = chain_dp(ch, cm, order, pos, bound, prune_above=best_dp)
            if not sols:
                break
            scored = [(r.sum_s + (n_b - 1) * r.max_s, r) for r in sols]
            for t, r in scored:
                lay = _Layout(r.cuts, r.devices)
                if lay.key() not in found or found[lay.key()][0] > t:
                    found[lay.key()] = (t, lay, len(orders) - 1)
            t_best, r_best = min(scored, key=lambda x: x[0])
            best_dp = min(best_dp, t_best)
            if n_b == 1 or r_best.max_s <= 0:
                break
            bound = r_best.max_s * shrink
    bar.close()
    t_dp = time.perf_counter() - t0
    ranked = sorted(found.values(), key=lambda x: x[0])[:max_exact]
    best: tuple[float, _Layout, int] | None = None
    for _, lay, o in ranked:
        t, ok = cm.evaluate(ch.node_part(lay.cuts), lay.devices, detail=False)
        if ok and (best is None or t < best[0]):
            best = (t, lay, o)
    if best is None:
        raise NoFitError("no split of the model over the devices fits their memory")
    t_start = best[0]
    t, lay, moves = _refine(cm, ch, best[1], orders[best[2]], clusters, max_sweeps)
    node_part = ch.node_part(lay.cuts)
    node_part, fixed = _connect(cm, node_part, lay.devices)
    t_final, ok = cm.evaluate(node_part, lay.devices, detail=False)
    if not ok:  # a connectivity move never breaks memory, but be safe
        node_part, t_final = ch.node_part(lay.cuts), t
    info = {"clusters": len(clusters), "starts": len(starts), "dp_passes": passes, "dp_candidates": len(found),
            "dp_s": round(t_dp, 4), "dp_best_s": t_start, "refine_moves": moves, "connectivity_moves": fixed,
            "atoms": ch.n_atoms, "cut_positions": int(len(pos)), "seconds": round(time.perf_counter() - t0, 4)}
    log.info("op-fence: %d parts, predicted %.4g s (DP %.4g s, %d refine moves) in %.2f s",
             len(lay.devices), t_final, t_start, moves, info["seconds"])
    return Partition(node_part, list(lay.devices), float(t_final), info)


def _refine(cm: CostModel, ch: Chain, lay: _Layout, order: list[int], clusters: list[list[int]],
            max_sweeps: int) -> tuple[float, _Layout, int]:
    """Best-improvement hill climbing on the exact estimator."""
    cluster_of = {d: c for c, members in enumerate(clusters) for d in members}
    speed = cm.speed

    def score(l: _Layout) -> float:
        t, ok = cm.evaluate(ch.node_part(l.cuts), l.devices, detail=False)
        return t if ok else np.inf

    cur_t = score(lay)
    moves = 0
    A = ch.n_atoms
    for _ in range(max_sweeps):
        cands: list[_Layout] = []
        cuts, devs = lay.cuts, lay.devices
        bounds = [0] + cuts + [A]
        used = set(devs)
        for c in range(len(cuts)):  # shift a cut
            for step in (-8, -4, -2, -1, 1, 2, 4, 8):
                p = cuts[c] + step
                if bounds[c] < p < bounds[c + 2]:
                    cands.append(_Layout(cuts[:c] + [p] + cuts[c + 1:], devs))
        for c in range(len(cuts)):  # merge parts c and c+1 onto either device
            for keep in (devs[c], devs[c + 1]):
                cands.append(_Layout(cuts[:c] + cuts[c + 1:], devs[:c] + [keep] + devs[c + 2:]))
            cands.append(_Layout(cuts, devs[:c] + [devs[c + 1], devs[c]] + devs[c + 2:]))  # swap neighbours
        spare = [d for d in order if d not in used][:4]
        for p, d in enumerate(devs):  # move a part to another device / split it onto a spare one
            same = sorted((x for x in clusters[cluster_of[d]] if x not in used), key=lambda x: -speed[x])[:2]
            for alt in dict.fromkeys(spare + same):
                cands.append(_Layout(cuts, devs[:p] + [alt] + devs[p + 1:]))
            i, j = bounds[p], bounds[p + 1]
            if j - i >= 2 and (spare or same):
                mid = int(np.searchsorted(ch.flops, (ch.flops[i] + ch.flops[j]) / 2))
                mid = min(max(mid, i + 1), j - 1)
                new = (same or spare)[0]
                cands.append(_Layout(sorted(cuts + [mid]), devs[:p + 1] + [new] + devs[p + 1:]))
        best_t, best_l = cur_t, None
        for cand in cands:
            t = score(cand)
            if t < best_t * (1 - 1e-9):
                best_t, best_l = t, cand
        if best_l is None:
            break
        lay, cur_t = best_l, best_t
        moves += 1
    return cur_t, lay, moves


def _connect(cm: CostModel, node_part: np.ndarray, part_device: list[int]) -> tuple[np.ndarray, int]:
    """Move weakly disconnected pieces of a part to a neighbour part they touch (keeping the part DAG acyclic)."""
    node_part = node_part.copy()
    n_parts = len(part_device)
    src_nodes = cm.t_prod[cm.e_t]
    dst_nodes = cm.e_cons
    fixed = 0
    for p in range(n_parts):
        comps = _components(np.nonzero(node_part == p)[0], src_nodes, dst_nodes, node_part, p)
        if len(comps) <= 1:
            continue
        comps.sort(key=lambda c: -float(cm.flops[c].sum()))
        for comp in comps[1:]:
            cs = set(comp.tolist())
            touch = {int(node_part[b]) for a, b in zip(src_nodes, dst_nodes) if a in cs and node_part[b] != p} | \
                    {int(node_part[a]) for a, b in zip(src_nodes, dst_nodes) if b in cs and node_part[a] != p}
            best = None
            for q in sorted(touch):
                trial = node_part.copy()
                trial[comp] = q
                if not _acyclic(trial, src_nodes, dst_nodes, n_parts):
                    continue
                t, ok = cm.evaluate(trial, part_device, detail=False)
                if ok and (best is None or t < best[0]):
                    best = (t, q)
            if best is not None:
                node_part[comp] = best[1]
                fixed += 1
            else:
                log.warning("part %d keeps a disconnected piece (%d nodes): no neighbour can take it", p, len(comp))
    return node_part, fixed


def _components(members: np.ndarray, src: np.ndarray, dst: np.ndarray, node_part: np.ndarray, p: int) -> list[np.ndarray]:
    parent = {int(m): int(m) for m in members}

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    inside = (node_part[src] == p) & (node_part[dst] == p)
    for a, b in zip(src[inside].tolist(), dst[inside].tolist()):
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[ra] = rb
    groups: dict[int, list[int]] = {}
    for m in parent:
        groups.setdefault(find(m), []).append(m)
    return [np.array(sorted(v)) for v in groups.values()]


def _acyclic(node_part: np.ndarray, src: np.ndarray, dst: np.ndarray, n_parts: int) -> bool:
    a, b = node_part[src], node_part[dst]
    edges = set(zip(a[a != b].tolist(), b[a != b].tolist()))
    indeg = [0] * n_parts
    succ: dict[int, list[int]] = {}
    for x, y in edges:
        succ.setdefault(x, []).append(y)
        indeg[y] += 1
    ready = [p for p in range(n_parts) if indeg[p] == 0]
    seen = 0
    while ready:
        x = ready.pop()
        seen += 1
        for y in succ.get(x, []):
            indeg[y] -= 1
            if indeg[y] == 0:
                ready.append(y)
    return seen == n_parts


def layout_partition(cm: CostModel, ch: Chain, cuts: list[int], devices: list[int], info: dict | None = None) -> Partition:
    """A Partition from a chain layout, priced by the exact estimator."""
    node_part = ch.node_part(cuts)
    t, _ = cm.evaluate(node_part, devices, detail=False)
    return Partition(node_part, list(devices), float(t), dict(info or {}))


__all__ = ["op_fence", "Partition", "NoFitError", "layout_partition"]

"""DT-FM's scheduler (Yuan et al. 2022, "Decentralized Training of Foundation Models in
Heterogeneous Environments", §2-§3), reimplemented as a baseline for the DP x PP planner.

DT-FM assigns tasklets t_{i,j} (macro-batch i, stage j) to N devices with
``D_DP x D_PP = N``: every device is used, the layers are split evenly into
D_PP stages, and the scheduler only chooses which devices form each stage's
data-parallel group C_j and how the groups chain into pipelines. Its cost
model is communication only, on the symmetrised graph G (§2: each edge
carries the mean of both directions' latency and seconds per byte):

- Eq. (2), data parallel: ``DATAP-COST(C_j) = max_{d in C_j} sum_{d' in C_j - d} 2 (alpha_dd' + c_DP / D_DP * beta_dd')``,
  and ``DATAP-COST = max_j DATAP-COST(C_j)`` (groups reduce in parallel).
- Eq. (3), pipeline edge of the coarsened graph: ``min_M max_{(d,d') in M} 2 (alpha_dd' + c_PP * beta_dd')`` over
  perfect matchings M of C_j to C_j' (a bottleneck matching, :mod:`fusion.partition.matching`).
- Eq. (4): ``PIPELINEP-COST = OPENLOOPTSP(coarsened graph)`` (exact Held-Karp up to
  :data:`EXACT_TSP` groups, nearest neighbour + 2-opt above).
- Eq. (1): ``COMM-COST = DATAP-COST + PIPELINEP-COST``.

c_DP is the largest stage's parameter bytes, c_PP the activation bytes one
replica's macro-batch sends across the heaviest cut (forward bytes per
micro-batch x micro-batches per replica).

Search (§3.4): a hybrid genetic algorithm. The population starts as random
balanced partitions; each generation picks two parents, makes an offspring
by moving randomly chosen devices to the group the second parent gives them
(swapping to keep the groups balanced, after Bui and Moon's hybrid GA), then
runs DT-FM's local search: for every two groups C_j, C_j' take the fastest
link inside each (d1-d2, d1'-d2'), form the four swaps d1/d2 <-> d1'/d2' and
rank them by DT-FM's gain
``GAIN = mean_{d'' in C_j'} w_{d1,d''} - w_{d1,d2} + mean_{d'' in C_j} w_{d1',d''} - w_{d1',d2'}``
(w: the pipeline weight ``alpha + c_PP beta``); the best-ranked swap that
lowers COMM-COST is applied, until none does. The offspring replaces the
worst member when it is better. Everything is driven by one seeded
``numpy.random.Generator``: the same seed gives the same layout.

DT-FM's degrees: this module tries every split ``D_PP x D_DP = N`` whose even
cut fits memory, schedules each with the search above, and keeps the one the
shared estimator (:func:`fusion.cost.dp.dp_estimate`) predicts fastest, which
is the most favourable reading of DT-FM for the comparison (the paper tunes
the degrees by hand).
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field

import numpy as np

from fusion.cost.dp import dp_estimate, replica_cost_model, stage_grad_bytes
from fusion.cost.estimate import CostModel
from fusion.partition.chain import Chain, build_chain
from fusion.partition.matching import bottleneck_matching
from fusion.partition.dp import Candidate, DPPlacement, DPPlanError, batch_splits, connected, placement

log = logging.getLogger(__name__)

#: Open-loop TSP over at most this many groups is solved exactly (Held-Karp).
EXACT_TSP = 10


@dataclass
class SearchTrace:
    """How one DT-FM search went: COMM-COST of the best member after the random start and at the end."""

    initial_cost: float
    final_cost: float
    generations: int
    evaluations: int
    history: list[float] = field(default_factory=list)


class CommCost:
    """DT-FM's COMM-COST of a partition into D_PP groups (module docstring), with matchings cached."""

    def __init__(self, alpha: np.ndarray, beta: np.ndarray, c_dp: float, c_pp: float, d_dp: int):
        self.alpha = (alpha + alpha.T) / 2.0
        self.beta = (beta + beta.T) / 2.0
        self.c_dp, self.c_pp, self.d_dp = float(c_dp), float(c_pp), int(d_dp)
        self.w_pp = self.alpha + self.c_pp * self.beta  # pipeline weight of a link (the gain's w)
        self.w_dp = 2.0 * (self.alpha + self.c_dp / self.d_dp * self.beta)
        np.fill_diagonal(self.w_dp, 0.0)
        self._edge: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[float, np.ndarray]] = {}
        self.evaluations = 0

    def datap(self, group: list[int]) -> float:
        """Eq. (2) for one group."""
        g = np.asarray(group)
        return float(self.w_dp[np.ix_(g, g)].sum(axis=1).max()) if len(g) > 1 else 0.0

    def edge(self, g: list[int], h: list[int]) -> tuple[float, np.ndarray]:
        """Eq. (3): bottleneck perfect matching between two groups; (cost, perm: g[i] <-> h[perm[i]])."""
        return bottleneck_matching(2.0 * self.w_pp[np.ix_(list(g), list(h))])

    def edge_cost(self, g: list[int], h: list[int]) -> float:
        key = (tuple(sorted(g)), tuple(sorted(h)))
        got = self._edge.get(key)
        if got is None:
            got = bottleneck_matching(2.0 * self.w_pp[np.ix_(list(key[0]), list(key[1]))])
            self._edge[key] = got
        return got[0]

    def total(self, groups: list[list[int]]) -> tuple[float, list[int]]:
        """Eq. (1): COMM-COST and the open-loop TSP order of the groups."""
        self.evaluations += 1
        dp = max(self.datap(g) for g in groups)
        S = len(groups)
        W = np.zeros((S, S))
        for a in range(S):
            for b in range(a + 1, S):
                W[a, b] = W[b, a] = self.edge_cost(groups[a], groups[b])
        pp, order = open_loop_tsp(W)
        return dp + pp, order


def open_loop_tsp(W: np.ndarray) -> tuple[float, list[int]]:
    """Shortest Hamiltonian path (any ends) over a symmetric weight matrix: Held-Karp or NN + 2-opt."""
    S = len(W)
    if S == 1:
        return 0.0, [0]
    if S <= EXACT_TSP:
        full = 1 << S
        bit = 1 << np.arange(S)
        dp = np.full((full, S), np.inf)
        parent = np.full((full, S), -1, dtype=np.int64)
        dp[bit, np.arange(S)] = 0.0
        for mask in range(1, full):
            row = dp[mask]
            if not np.isfinite(row).any():
                continue
            cand = row[:, None] + W  # from v (in mask) to u
            v_best = np.argmin(cand, axis=0)
            c_best = cand[v_best, np.arange(S)]
            for u in np.nonzero((mask & bit) == 0)[0]:
                nm = mask | int(bit[u])
                if c_best[u] < dp[nm, u]:
                    dp[nm, u] = c_best[u]
                    parent[nm, u] = v_best[u]
        end = int(np.argmin(dp[full - 1]))
        cost = float(dp[full - 1, end])
        path, mask, v = [], full - 1, end
        while v >= 0:
            path.append(v)
            pv = int(parent[mask, v])
            mask ^= 1 << v
            v = pv
        return cost, path[::-1]
    starts = []
    for start in range(S):  # nearest neighbour from every start, 2-opt on the best few
        path, left = [start], np.ones(S, dtype=bool)
        left[start] = False
        cost = 0.0
        while left.any():
            row = np.where(left, W[path[-1]], np.inf)
            nxt = int(np.argmin(row))
            cost += float(row[nxt])
            path.append(nxt)
            left[nxt] = False
        starts.append((cost, path))
    starts.sort(key=lambda x: x[0])
    best = None
    for _, path in starts[:3]:
        path = _two_opt(W, path)
        c = float(sum(W[a, b] for a, b in zip(path, path[1:])))
        if best is None or c < best[0]:
            best = (c, path)
    return best


def _two_opt(W: np.ndarray, path: list[int]) -> list[int]:
    """Best-improvement 2-opt on an open path (segment reversals), vectorised over all (i, j)."""
    n = len(path)
    Wx = np.zeros((n + 1, n + 1))
    Wx[:n, :n] = W  # node n: a free end (weight 0 to everything)
    p = np.array(path)
    valid = np.triu(np.ones((n + 1, n + 1), dtype=bool), 2)[:n]
    for _ in range(10 * n):
        pe = np.concatenate([[n], p, [n]])
        X, Y = pe[:n + 1], pe[1:n + 2]
        delta = Wx[np.ix_(X, X)] + Wx[np.ix_(Y, Y)] - Wx[X, Y][:, None] - Wx[X, Y][None, :]
        delta = np.where(valid, delta[:n], np.inf)
        i, j = np.unravel_index(int(np.argmin(delta)), delta.shape)
        if not delta[i, j] < -1e-12:
            break
        p[i:j] = p[i:j][::-1].copy()
    return p.tolist()


def _labels_to_groups(labels: np.ndarray, S: int) -> list[list[int]]:
    return [sorted(np.nonzero(labels == j)[0].tolist()) for j in range(S)]


def _crossover(p1: np.ndarray, p2: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Move randomly chosen devices to their group in p2, swapping to keep groups balanced."""
    o = p1.copy()
    for d in np.nonzero(rng.random(len(o)) < 0.5)[0]:
        target = p2[d]
        if o[d] == target:
            continue
        inside = np.nonzero(o == target)[0]
        prefer = inside[p2[inside] != target]
        pool = prefer if len(prefer) else inside
        e = int(pool[rng.integers(len(pool))])
        o[d], o[e] = o[e], o[d]
    return o


def _local_search(labels: np.ndarray, S: int, cc: CommCost, cost: float, max_rounds: int = 30,
                  tries: int = 6) -> tuple[np.ndarray, float]:
    """DT-FM §3.4's local search: the fastest link of each group, four swaps per pair of groups, ranked by GAIN."""
    w = cc.w_pp
    for _ in range(max_rounds):
        groups = _labels_to_groups(labels, S)
        fast = []
        for g in groups:
            if len(g) < 2:
                fast.append((g[0], g[0]))
                continue
            sub = np.where(np.eye(len(g), dtype=bool), np.inf, w[np.ix_(g, g)])
            i, j = np.unravel_index(int(np.argmin(sub)), sub.shape)
            fast.append((g[i], g[j]))
        onehot = np.zeros((len(labels), S))
        onehot[np.arange(len(labels)), labels] = 1.0
        mean_to = (w @ onehot) / onehot.sum(axis=0)  # mean_to[d, j] = mean_{d'' in C_j} w_{d,d''}
        cands = []
        for a, b in itertools.combinations(range(S), 2):
            for x, y in itertools.product((0, 1), (0, 1)):
                d, dp_ = fast[a][x], fast[b][y]
                pd, pdp = fast[a][1 - x], fast[b][1 - y]
                gain = (mean_to[d, b] - (w[d, pd] if pd != d else 0.0)
                        + mean_to[dp_, a] - (w[dp_, pdp] if pdp != dp_ else 0.0))
                cands.append((-gain, d, dp_))
        cands.sort()
        moved = False
        for _, d, e in cands[:tries]:
            trial = labels.copy()
            trial[d], trial[e] = labels[e], labels[d]
            c, _ = cc.total(_labels_to_groups(trial, S))
            if c < cost - 1e-12:
                labels, cost, moved = trial, c, True
                break
        if not moved:
            break
    return labels, cost


def dtfm_search(cc: CommCost, N: int, S: int, seed: int = 0, population: int = 10, generations: int = 1000,
                patience: int = 100) -> tuple[list[list[int]], list[int], SearchTrace]:
    """The hybrid GA of DT-FM §3.4 over balanced partitions of N devices into S groups.

    Stops after ``generations`` offspring or after ``patience`` offspring in a row that did not enter the
    population (converged).

    Returns the best groups, their pipeline order (open-loop TSP) and a :class:`SearchTrace`.
    """
    rng = np.random.default_rng(seed)
    base = np.repeat(np.arange(S), N // S)
    pop = []
    for _ in range(population):
        lab = rng.permutation(base)
        pop.append((cc.total(_labels_to_groups(lab, S))[0], lab))
    initial = min(c for c, _ in pop)
    history = [initial]
    if S == 1 or S == N:  # one group, or singletons: every balanced partition is the same one
        generations = 0
    done, stale = 0, 0
    for _ in range(generations):
        done += 1
        i, j = rng.choice(len(pop), size=2, replace=False)
        child = _crossover(pop[i][1], pop[j][1], rng)
        c, _ = cc.total(_labels_to_groups(child, S))
        child, c = _local_search(child, S, cc, c)
        worst = int(np.argmax([p[0] for p in pop]))
        if c < pop[worst][0]:
            pop[worst] = (c, child)
            stale = 0
        else:
            stale += 1
        history.append(min(p[0] for p in pop))
        if stale >= patience:
            break
    best_c, best = min(pop, key=lambda p: p[0])
    groups = _labels_to_groups(best, S)
    _, order = cc.total(groups)
    return groups, order, SearchTrace(initial, best_c, done, cc.evaluations, history)


def even_cut(ch: Chain, S: int) -> list[int]:
    """DT-FM's even split of the layers: S ranges of (nearly) equal FLOPs over the atom chain."""
    A = ch.n_atoms
    total = ch.flops[-1]
    cuts, prev = [], 0
    for k in range(1, S):
        p = int(np.searchsorted(ch.flops, total * k / S, side="left")) if total > 0 else round(k * A / S)
        p = min(max(p, prev + 1), A - (S - k))
        cuts.append(p)
        prev = p
    return cuts


def _paths(cc: CommCost, groups: list[list[int]], order: list[int]) -> list[list[int]]:
    """devices[r][s] along the pipeline order, following the bottleneck matchings."""
    seq = [groups[j] for j in order]
    R = len(seq[0])
    cols = [list(seq[0])]
    for g, h in zip(seq, seq[1:]):
        _, perm = cc.edge(cols[-1], h)
        cols.append([h[perm[i]] for i in range(R)])
    return [[cols[s][r] for s in range(len(seq))] for r in range(R)]


def plan_dtfm_model(cm: CostModel, *, global_batch: int, micro_batches: int | None = None, seed: int = 0,
                    stages: list[int] | None = None, population: int = 10, generations: int = 1000, patience: int = 100,
                    overlap: bool = True, grad_wire_ratio: float = 1.0,
                    allreduce: str = "ring") -> tuple[DPPlacement, Candidate, dict]:
    """Run DT-FM's scheduler for every feasible D_PP (or those in ``stages``) and keep the fastest by the shared estimator.

    Returns the placement, the priced candidate and ``{D_PP: SearchTrace}``.
    """
    t0 = time.perf_counter()
    N = len(cm.cluster)
    ch = build_chain(cm)
    splits = {R: (n_b, scale) for R, n_b, scale in batch_splits(global_batch, cm.samples_per_micro_batch, N, micro_batches)}
    best: Candidate | None = None
    traces: dict[int, SearchTrace] = {}
    for S in range(1, min(N, ch.n_atoms) + 1):
        if N % S or (stages is not None and S not in stages) or (N // S) not in splits:
            continue
        R = N // S
        n_b, scale = splits[R]
        rcm = replica_cost_model(cm, n_b, scale)
        node_part = ch.node_part(even_cut(ch, S)) if S > 1 else np.zeros(len(cm.names), dtype=np.int64)
        # a quick memory check on the first S devices before searching (DT-FM assumes the split fits)
        est0 = rcm.evaluate(node_part, list(range(S)))
        if not est0.feasible and len({(d.memory_bytes, d.peak_flops) for d in cm.cluster.devices}) == 1:
            continue
        grad = stage_grad_bytes(rcm, node_part, S)
        fwd = max((le.fwd_bytes for le in est0.links), default=0.0)
        cc = CommCost(cm.cluster.alpha, cm.cluster.beta, float(grad.max()), fwd * n_b, R)
        groups, order, trace = dtfm_search(cc, N, S, seed=seed, population=population, generations=generations,
                                           patience=patience)
        traces[S] = trace
        for seq in (order, order[::-1]):
            devs = _paths(cc, groups, seq)
            est = dp_estimate(rcm, node_part, devs, overlap=overlap, grad_wire_ratio=grad_wire_ratio, algo=allreduce)
            cand = Candidate(node_part, devs, est, rcm, f"dtfm D_PP={S} D_DP={R}")
            if best is None or cand.per_sample < best.per_sample:
                best = cand
            if S == 1:
                break
    if best is None or not best.estimate.feasible:
        raise DPPlanError(f"{cm.cluster.source}: devices[].memory_bytes: no even D_PP x D_DP split fits the devices' memory")
    best = connected(best, overlap, grad_wire_ratio, allreduce)
    info = {"how": best.how, "seconds": round(time.perf_counter() - t0, 3), "degrees_tried": sorted(traces),
            "comm_cost": {S: [t.initial_cost, t.final_cost] for S, t in traces.items()}}
    log.info("dtfm scheduler: %s, predicted %.4g s/step in %.2f s", best.how, best.estimate.iteration_s, info["seconds"])
    return placement(best, "dtfm", info), best, traces





def plan_dtfm(graph, cluster, *, global_batch: int, micro_batches: int | None = None, schedule: str = "1f1b",
              optimizer_slots: int = 2, costs=None, seed: int = 0, **search) -> DPPlacement:
    """DT-FM's scheduler on a graph (same arguments as :func:`fusion.partition.dp.plan_dp`; ``search``:
    ``stages``, ``population``, ``generations``, ``patience``, ``overlap``, ``grad_wire_ratio``, ``allreduce``)."""
    from fusion.partition.dp import build_cost_model

    cm = build_cost_model(graph, cluster, costs=costs, schedule=schedule, optimizer_slots=optimizer_slots)
    return plan_dtfm_model(cm, global_batch=global_batch, micro_batches=micro_batches, seed=seed, **search)[0]
__all__ = ["CommCost", "SearchTrace", "dtfm_search", "open_loop_tsp", "even_cut", "plan_dtfm", "plan_dtfm_model", "EXACT_TSP"]

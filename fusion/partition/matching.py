"""Bipartite matchings between two device groups of equal size (DT-FM §3.3, Eq. 3).

``bottleneck_matching(w)``: the perfect matching whose largest weight is least
(binary search over the weights at or above the trivial lower bound, each
threshold tested by Kuhn's augmenting paths); polynomial, as DT-FM notes.
"""
from __future__ import annotations

import numpy as np


def bottleneck_matching(w: np.ndarray) -> tuple[float, np.ndarray]:
    """min over perfect matchings of the largest matched weight; returns (value, perm: row i <-> column perm[i]).

    Binary search over the thresholds at or above the trivial lower bound (every row and column needs
    one edge), each tested by Kuhn's augmenting paths.
    """
    n = len(w)
    if n == 1:
        return float(w[0, 0]), np.zeros(1, dtype=np.int64)
    lb = max(float(w.min(axis=1).max()), float(w.min(axis=0).max()))
    vals = np.unique(w[w >= lb])
    lo, hi = 0, len(vals) - 1
    best = None
    while lo <= hi:
        mid = lo if best is None and lo == 0 else (lo + hi) // 2
        perm = perfect_matching(w <= vals[mid])
        if perm is not None:
            best, hi = (float(vals[mid]), perm), mid - 1
        else:
            lo = mid + 1
    assert best is not None  # the largest threshold admits every edge
    return best


def perfect_matching(ok: np.ndarray) -> np.ndarray | None:
    """Kuhn's algorithm on a boolean bipartite adjacency matrix; perm or None when no perfect matching."""
    n = len(ok)
    adj = [np.nonzero(row)[0].tolist() for row in ok]
    match_col = [-1] * n

    def augment(u: int, seen: list[bool]) -> bool:
        for v in adj[u]:
            if not seen[v]:
                seen[v] = True
                if match_col[v] < 0 or augment(match_col[v], seen):
                    match_col[v] = u
                    return True
        return False

    for u in range(n):
        if not adj[u] or not augment(u, [False] * n):
            return None
    perm = np.empty(n, dtype=np.int64)
    for v, u in enumerate(match_col):
        perm[u] = v
    return perm


__all__ = ["bottleneck_matching", "perfect_matching"]

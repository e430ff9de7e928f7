"""The OP-DAG as a chain of atoms, and the dynamic program that cuts it.

**Atoms.** Every compute node (module, function, loss) is an atom, in the
graph's topological order. A placeholder joins the atom of its first user and
an output node the atom of its producer, so a placeholder is never cut off
from the operator that reads it. Contiguous ranges of atoms are what the
partitioner assigns: every edge points forward in the order, so any split
into ranges gives an acyclic part graph. Edges that skip ahead (residual
connections, a skip from the stem to the head) simply cross every cut between
their ends.

**Cut costs** (per cut position c, between atoms c-1 and c): the bytes and
number of tensors that cross it forward, and those that carry a gradient back.
The dynamic program prices a tensor crossing several cuts at each of them (as
if relayed); the exact estimator (:mod:`fusion.cost.estimate`) then prices direct
sends, and refinement works on that.

**Dynamic program.** For an ordered device list ``d_1 .. d_K`` and a bound B,
``f[k][j]`` is the least ``sum (C_p + R_p)`` that puts atoms ``[0, j)`` on the
first k devices, one non-empty range each, with every part's ``C_p <= B``,
``R_p <= B`` and memory within its device (activations counted for all n_b
micro-batches, GPipe's worst case). ``R_p`` charges part k the forward bytes
of its first cut on link ``d_{k-1} -> d_k`` and the gradient bytes of its last
cut on ``d_{k+1} -> d_k``, so ``f[m][N]`` for every m comes out of one pass.
OP-Fence runs it for a falling sequence of B to trade the sum against the
``(n_b - 1) * max`` term of Eq. (3). Each device step is one vectorised
``U x U`` min over candidate cut positions (U <= ``max_units``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fusion.cost.estimate import CostModel
from fusion.ir.node import NodeKind

_COMPUTE = (NodeKind.MODULE, NodeKind.FUNCTION, NodeKind.LOSS)


@dataclass
class Chain:
    """Atoms and prefix sums over them (index = cut position 0..A)."""

    n_atoms: int
    atom_of_node: np.ndarray
    flops: np.ndarray  # prefix sums, length A + 1
    mem: np.ndarray
    saved: np.ndarray
    state: np.ndarray
    cut_fwd_bytes: np.ndarray  # per cut position, length A + 1 (0 at both ends)
    cut_fwd_count: np.ndarray
    cut_bwd_bytes: np.ndarray
    cut_bwd_count: np.ndarray

    def node_part(self, cuts: list[int]) -> np.ndarray:
        """Part index of every node for interior cut positions ``cuts`` (sorted)."""
        atom_part = np.searchsorted(np.asarray(cuts, dtype=np.int64), np.arange(self.n_atoms), side="right")
        return atom_part[self.atom_of_node]


def build_chain(cm: CostModel) -> Chain:
    g = cm.graph
    nodes = list(g.nodes.values())
    compute = [i for i, n in enumerate(nodes) if n.kind in _COMPUTE]
    if not compute:
        compute = [0]
    atom = np.full(len(nodes), -1, dtype=np.int64)
    for a, i in enumerate(compute):
        atom[i] = a
    users: dict[int, list[int]] = {}
    for t, c in zip(cm.e_t.tolist(), cm.e_cons.tolist()):
        users.setdefault(int(cm.t_prod[t]), []).append(c)
    for i, n in enumerate(nodes):  # placeholders join their first compute user
        if atom[i] < 0 and n.kind in (NodeKind.INPUT, NodeKind.LABEL):
            us = [atom[u] for u in users.get(i, []) if atom[u] >= 0]
            atom[i] = min(us) if us else 0
    for i, n in enumerate(nodes):  # outputs (and anything left) join their producer
        if atom[i] < 0:
            prods = [cm.index[p] for p in n.producers()]
            atom[i] = max((atom[p] for p in prods), default=0)
    A = len(compute)
    pre = lambda v: np.concatenate([[0.0], np.cumsum(np.bincount(atom, weights=v, minlength=A))])  # noqa: E731
    # parameter state per atom, each parameter once per atom
    pa = np.unique(cm.pn_param * A + atom[cm.pn_node]) if len(cm.pn_param) else np.array([], dtype=np.int64)
    state = np.concatenate([[0.0], np.cumsum(np.bincount(pa % A, weights=cm.p_state[pa // A], minlength=A))])
    # cut crossings (a tensor produced in atom a, last used in atom L > a, crosses a+1 .. L)
    prod_atom = atom[cm.t_prod]
    last = np.full(len(cm.t_key), -1, dtype=np.int64)
    np.maximum.at(last, cm.e_t, atom[cm.e_cons])
    cross = last > prod_atom
    diff = np.zeros((4, A + 2))
    lo, hi = prod_atom[cross] + 1, last[cross] + 1
    for row, w in enumerate((cm.t_bytes[cross], np.ones(int(cross.sum())),
                             np.where(cm.t_rg[cross], cm.t_bytes[cross], 0.0), cm.t_rg[cross].astype(float))):
        np.add.at(diff[row], lo, w)
        np.add.at(diff[row], hi, -w)
    acc = np.cumsum(diff, axis=1)[:, : A + 1]
    return Chain(A, atom, pre(cm.flops), pre(cm.mem), pre(cm.saved), state, acc[0], acc[1], acc[2], acc[3])


@dataclass
class DPResult:
    """One solution of the dynamic program: interior cut positions and devices."""

    cuts: list[int]
    devices: list[int]
    sum_s: float  # sum_p (C_p + R_p) in the relay approximation
    max_s: float  # max_p max(C_p, R_p) in the relay approximation


def candidate_positions(ch: Chain, max_units: int) -> np.ndarray:
    """Cut positions the DP may use: all of them, or the ``max_units - 1`` cheapest interior ones."""
    A = ch.n_atoms
    if A <= max_units:
        return np.arange(A + 1)
    interior = np.arange(1, A)
    keep = interior[np.argsort(ch.cut_fwd_bytes[1:A] + ch.cut_bwd_bytes[1:A], kind="stable")[: max_units - 1]]
    return np.concatenate([[0], np.sort(keep), [A]])


def chain_dp(ch: Chain, cm: CostModel, order: list[int], pos: np.ndarray, bound: float,
             prune_above: float = np.inf) -> list[DPResult]:
    """Solutions using exactly m = 1, 2, ... devices of ``order`` (see module docstring)."""
    U = len(pos) - 1
    n_b = cm.micro_batches
    alpha, beta = cm.cluster.alpha, cm.cluster.beta
    F, M, S, P = ch.flops[pos], ch.mem[pos], ch.saved[pos], ch.state[pos]
    XF, NF, XB, NB = ch.cut_fwd_bytes[pos], ch.cut_fwd_count[pos], ch.cut_bwd_bytes[pos], ch.cut_bwd_count[pos]
    memw = P + n_b * S
    if cm.recompute_all:  # a recomputing range holds one micro-batch's activations and its inputs per micro-batch
        need = (P[None, :] - P[:, None]) + (S[None, :] - S[:, None]) + (n_b * XF)[:, None]
    else:
        need = memw[None, :] - memw[:, None]
    I, J = np.meshgrid(np.arange(U + 1), np.arange(U + 1), indexing="ij")
    upper = I < J
    f_prev = np.full(U + 1, np.inf)
    f_prev[0] = 0.0
    back: list[np.ndarray] = []
    out: list[DPResult] = []
    K = min(len(order), U)
    for k in range(K):
        d = order[k]
        W = F / cm.speed[d] + M / cm.mem_speed[d]
        fwd = np.zeros(U + 1) if k == 0 else NF * alpha[order[k - 1], d] + XF * beta[order[k - 1], d]
        if k + 1 < len(order):
            bwd = NB * alpha[order[k + 1], d] + XB * beta[order[k + 1], d]
            bwd[U] = 0.0
        else:
            bwd = np.full(U + 1, np.inf)
            bwd[U] = 0.0
        comp = W[None, :] - W[:, None]
        comm = fwd[:, None] + bwd[None, :]
        ok = upper & (comp <= bound) & (comm <= bound) & (need <= cm.mem_cap[d])
        val = np.where(ok, f_prev[:, None] + comp + comm, np.inf)
        arg = np.argmin(val, axis=0)
        f = val[arg, np.arange(U + 1)]
        back.append(arg)
        if np.isfinite(f[U]):
            out.append(_backtrack(back, order, pos, U, f[U]))
        f_prev = f.copy()
        f_prev[U] = np.inf  # a finished chain does not continue
        if not np.isfinite(f_prev).any() or f_prev.min() >= prune_above:
            break
    for r in out:
        r.max_s = _max_stage(ch, cm, r, pos)
    return out


def _backtrack(back: list[np.ndarray], order: list[int], pos: np.ndarray, U: int, total: float) -> DPResult:
    m = len(back)
    j = U
    cuts = []
    for k in range(m - 1, 0, -1):
        j = int(back[k][j])
        cuts.append(int(pos[j]))
    return DPResult(sorted(cuts), list(order[:m]), float(total), 0.0)


def _max_stage(ch: Chain, cm: CostModel, r: DPResult, pos: np.ndarray) -> float:
    """max_p max(C_p, R_p) of a DP solution, in the relay approximation."""
    bounds = [0] + r.cuts + [ch.n_atoms]
    alpha, beta = cm.cluster.alpha, cm.cluster.beta
    worst = 0.0
    for k, d in enumerate(r.devices):
        i, j = bounds[k], bounds[k + 1]
        c = (ch.flops[j] - ch.flops[i]) / cm.speed[d] + (ch.mem[j] - ch.mem[i]) / cm.mem_speed[d]
        rr = 0.0
        if k > 0:
            p = r.devices[k - 1]
            rr += ch.cut_fwd_count[i] * alpha[p, d] + ch.cut_fwd_bytes[i] * beta[p, d]
        if k + 1 < len(r.devices):
            q = r.devices[k + 1]
            rr += ch.cut_bwd_count[j] * alpha[q, d] + ch.cut_bwd_bytes[j] * beta[q, d]
        worst = max(worst, c, rr)
    return float(worst)

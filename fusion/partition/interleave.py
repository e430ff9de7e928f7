"""The cut of interleaved 1F1B: V*D chunks of the atom chain, round-robin over D devices.

Interleaved 1F1B (Narayanan et al. 2021; :func:`fusion.ir.schedule.interleaved_1f1b`) runs V
non-adjacent *virtual stages* (chunks) on each of D devices: chunk ``s`` of the chain
(:mod:`fusion.partition.chain`) runs on the ``s % D``-th device. Each device then does the work of
its V chunks per micro-batch, so a balanced pipeline gives device d the share
``S*_d / sum_e S*_e`` of the model's work (its speed over the devices' total), split evenly
over its chunks: chunk s ends where the prefix of the chain reaches
``sum_{t <= s} S*_{d(t)} / (V * sum_e S*_e)`` of the total.

``by="flops"`` measures work in forward + backward FLOPs, with memory-bound bytes and per-node overheads
converted to FLOPs at the devices' mean rates (:func:`work_prefix`; the ``equal-flops`` strategy with
interleaving, weighted by device speed); ``by="count"`` in operator nodes, with equal shares
(``equal-count``: blind to speed, as that baseline is). Work comes in lumps (a matmul is one atom), so the
chunk ends are chosen together: the cut minimises the squared relative misses of the chunks' work against
their targets (a dynamic program over cut positions), ties to fewer bytes across the cuts.
"""
from __future__ import annotations

import numpy as np

from fusion.cost.estimate import CostModel
from fusion.partition.chain import Chain, candidate_positions
from fusion.partition.fence import Partition, layout_partition

#: cut positions the dynamic program considers at most (its memory is quadratic in them)
MAX_UNITS = 512
#: what each strategy measures a chunk's work in (see the module doc)
INTERLEAVE_BY = {"equal-flops": "flops", "equal-count": "count"}


def interleaved_devices(cm: CostModel, ch: Chain, virtual_stages: int) -> list[int]:
    """The D devices of an interleaved cut: the first ``min(#devices, #atoms // V)`` of the cluster
    file, as the baselines use theirs (at least one)."""
    return list(range(max(1, min(len(cm.cluster), ch.n_atoms // virtual_stages))))


def chunk_shares(cm: CostModel, devices: list[int], virtual_stages: int, by: str) -> np.ndarray:
    """Each chunk's share of the work, chunk s on ``devices[s % D]`` (sums to 1)."""
    d = len(devices)
    w = cm.speed[np.asarray(devices)] if by == "flops" else np.ones(d)
    per_chunk = np.tile(w / w.sum(), virtual_stages) / virtual_stages
    return per_chunk


def work_prefix(cm: CostModel, ch: Chain, devices: list[int]) -> np.ndarray:
    """Prefix sums over the chain of each atom's work in FLOP-equivalents: its FLOPs, plus its memory-bound
    bytes and executed op nodes at the devices' mean FLOPs per byte (``S* / Bmem*``) and per node overhead
    (``S* o_node``), so that a chunk's time on device d is its work over ``S*_d`` (Eq. 1's compute)."""
    dev = np.asarray(devices)
    per_byte = float(np.mean(cm.speed[dev] / cm.mem_speed[dev]))
    per_node = float(np.mean(cm.speed[dev] * cm.node_overhead[dev]))
    nodes = np.concatenate([[0.0], np.cumsum(np.bincount(ch.atom_of_node, weights=cm.executes.astype(float),
                                                         minlength=ch.n_atoms))])
    return ch.flops + per_byte * ch.mem + per_node * nodes


def interleaved_cut(cm: CostModel, ch: Chain, devices: list[int], virtual_stages: int, by: str = "flops",
                    info: dict | None = None, max_units: int = MAX_UNITS) -> Partition:
    """V*D contiguous, non-empty chunks of the chain with part s on ``devices[s % D]`` (module doc). A chain of
    more than ``max_units`` atoms is cut only at its ``max_units - 1`` cheapest positions (as OP-Fence's DP).

    Raises ValueError when the chain has fewer atoms than chunks."""
    if by not in ("flops", "count"):
        raise ValueError(f"by must be 'flops' or 'count', got {by!r}")
    d, v = len(devices), virtual_stages
    n, A = d * v, ch.n_atoms
    if n > A:
        raise ValueError(f"{n} chunks ({v} virtual stages x {d} devices) need at least {n} operator nodes; "
                         f"the model has {A}")
    prefix = work_prefix(cm, ch, devices) if by == "flops" else np.arange(A + 1, dtype=float)
    if prefix[-1] <= 0:
        prefix = np.arange(A + 1, dtype=float)
    pos = candidate_positions(ch, max(max_units, n + 1))
    shares = chunk_shares(cm, devices, v, by)
    cuts = [int(pos[c]) for c in _closest_cuts(prefix[pos], shares * prefix[-1],
                                               (ch.cut_fwd_bytes + ch.cut_bwd_bytes)[pos])]
    meta = {"devices_used": d, "virtual_stages": v, "interleave_by": by, **(info or {})}
    return layout_partition(cm, ch, cuts, [devices[s % d] for s in range(n)], meta)


#: weight of the cut bytes against the squared miss (a tie-break among cuts that miss their targets alike)
_TIE = 1e-6


def _closest_cuts(prefix: np.ndarray, targets: np.ndarray, cut_bytes: np.ndarray) -> list[int]:
    """Interior cut positions of ``len(targets)`` non-empty ranges of the chain (``prefix``: work prefix
    sums, length A + 1) minimising ``sum_k ((work_k - targets_k) / targets_k)^2`` (each chunk's miss relative
    to its target: in time on its device, as targets go with device speed) by dynamic programming over cut
    positions (one vectorised ``(A+1) x (A+1)`` step per range); among equal misses, fewer bytes crossing
    the cuts."""
    A, n = len(prefix) - 1, len(targets)
    tie = _TIE * cut_bytes / max(float(np.max(cut_bytes)), 1.0)
    i, j = np.meshgrid(np.arange(A + 1), np.arange(A + 1), indexing="ij")
    work = prefix[None, :] - prefix[:, None]
    f = np.full(A + 1, np.inf)
    f[0] = 0.0
    back = []
    for k in range(n):
        cost = ((work - targets[k]) / max(targets[k], 1e-300)) ** 2 + (tie[None, :] if k + 1 < n else 0.0)
        val = np.where(i < j, f[:, None] + cost, np.inf)
        arg = np.argmin(val, axis=0)
        back.append(arg)
        f = val[arg, np.arange(A + 1)]
    cuts, pos = [], A
    for k in range(n - 1, 0, -1):
        pos = int(back[k][pos])
        cuts.append(pos)
    return sorted(cuts)

"""The data-parallel cost: R replica pipelines plus a gradient all-reduce per stage (DP x PP).

A DP x PP layout runs R replicas of one pipeline: every replica holds the
same cut into S stages (parts) on its own devices, ``devices[r][s]``, and
processes ``1/R`` of the global batch; the replicas of stage s form its
data-parallel group ``C_s = {devices[r][s] : r}`` (DT-FM §3.1), whose
parameter gradients are averaged every step.

Pricing, with the estimator of :mod:`fusion.cost.estimate` for everything
inside one replica:

- **Replica pipeline**: FusionLLM Eq. (3) with Eq. (1)-(2) (backward
  included) for replica r on its devices, ``n_b`` micro-batches of its share
  of the global batch, plus the estimator's tied-parameter sync:
  ``T_r = sum_p (C_p + R_p) + (n_b - 1) max_p max(C_p, R_p) + T_tied``.
  The step waits for the slowest: ``T_pipe = max_r T_r``.
- **All-reduce of stage s** (DT-FM §3.2, Eq. (2), in its ring form): the
  trainable parameters held by stage s, ``P_s`` bytes (each once per stage;
  ``grad_wire_ratio`` scales them for a gradient codec), reduced over its
  R members by a ring priced by the slowest link inside the group, as
  DT-FM prices a group by its slowest connection:
  ``T_ar(C_s) = 2 (R - 1) / R * P_s * beta_max(C_s) + 2 (R - 1) * alpha_max(C_s)``,
  ``beta_max`` and ``alpha_max`` over all ordered pairs of distinct devices of ``C_s``.
  The tree (binomial reduce to one rank + binomial broadcast, Thakur, Rabenseifner & Gropp 2005,
  the short-message algorithm of MPICH) sends the whole buffer ``L = ceil(log2 R)`` times each way:
  ``T_tree(C_s) = 2 ceil(log2 R) (alpha_max(C_s) + P_s beta_max(C_s))``. It pays fewer latencies
  (``2 L`` vs ``2 (R - 1)``) and more bandwidth (``2 L`` vs ``2 (R - 1) / R`` buffers): ``algo="auto"``
  takes the cheaper of the two per group (:func:`choose_allreduce`).
  Groups run in parallel (DT-FM: ``DATAP-COST = max_j DATAP-COST(C_j)``).
- **Overlap**: stage s's gradients are final once its last backward is done;
  the backward of the last micro-batch still has to pass stages ``s-1 .. 0``,
  so ``tail_s = sum_{p < s} (b C_p + R^bwd_p)`` of the pipeline is left (b = 2/3,
  the backward's share of a forward + backward, FLOPs of backward = 2 x forward),
  measured on the slowest replica. Exposed sync:
  ``T_dp = max_s max(0, T_ar(C_s) - tail_s)`` (``overlap=False``: ``max_s T_ar(C_s)``).
- **Iteration** ``T_iter = T_pipe + T_dp`` and throughput FusionLLM Eq. (4)
  over the global batch: ``phi = R * n_b * b_mb / T_iter`` samples/s.

With R = 1 there is no group to reduce and ``T_iter`` is the single-pipeline
estimate, to the bit.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fusion.cluster.model import Cluster
from fusion.cost.estimate import CostModel

#: The backward's share of a part's forward + backward compute (backward FLOPs = 2 x forward).
BACKWARD_SHARE = 2.0 / 3.0


@dataclass
class DPEstimate:
    """Predicted step of a DP x PP layout (seconds unless named otherwise).

    iteration_s:  T_iter = pipeline_s + dp_sync_s.
    pipeline_s:   max_r T_r, the slowest replica's Eq. (3) time plus its tied-parameter sync.
    dp_sync_s:    the all-reduce time not hidden behind the remaining backward (slowest group).
    replica_s:    T_r of every replica.
    allreduce_s:  T_ar(C_s) of every stage group (before overlap), by its algorithm.
    algos:        the all-reduce algorithm priced for every stage group (``"ring"`` or ``"tree"``).
    grad_bytes:   P_s, trainable parameter bytes of every stage (after ``grad_wire_ratio``).
    samples_per_s: Eq. (4) over the global batch.
    global_batch: R * n_b * samples per micro-batch.
    violations:   memory overflows, one line each (empty when every device fits).
    """

    iteration_s: float
    pipeline_s: float
    dp_sync_s: float
    replica_s: list[float]
    allreduce_s: list[float]
    grad_bytes: list[float]
    samples_per_s: float
    global_batch: int
    violations: list[str] = field(default_factory=list)
    algos: list[str] = field(default_factory=list)

    @property
    def feasible(self) -> bool:
        return not self.violations

    def predicted(self) -> dict[str, float]:
        """The flat numbers a plan records."""
        return {"iteration_s": self.iteration_s, "pipeline_s": self.pipeline_s, "dp_sync_s": self.dp_sync_s,
                "samples_per_s": self.samples_per_s, "allreduce_max_s": max(self.allreduce_s, default=0.0),
                "global_batch": float(self.global_batch)}


def group_links(cluster: Cluster, group: list[int]) -> tuple[float, float]:
    """(alpha_max, beta_max): the slowest latency and seconds-per-byte over ordered pairs of the group."""
    if len(group) < 2:
        return 0.0, 0.0
    ix = np.asarray(group, dtype=np.int64)
    off = ~np.eye(len(ix), dtype=bool)
    return float(cluster.alpha[np.ix_(ix, ix)][off].max()), float(cluster.beta[np.ix_(ix, ix)][off].max())


def ring_allreduce_time(cluster: Cluster, group: list[int], nbytes: float) -> float:
    """DT-FM §3.2, ring form: ``2 (n-1)/n * M * beta_max + 2 (n-1) * alpha_max`` over the group's slowest link."""
    n = len(group)
    if n < 2 or nbytes <= 0:
        return 0.0
    a, b = group_links(cluster, group)
    return 2.0 * (n - 1) / n * nbytes * b + 2.0 * (n - 1) * a


def tree_allreduce_time(cluster: Cluster, group: list[int], nbytes: float) -> float:
    """Binomial-tree reduce + broadcast: ``2 ceil(log2 n) (alpha_max + M * beta_max)`` over the group's slowest link."""
    n = len(group)
    if n < 2 or nbytes <= 0:
        return 0.0
    a, b = group_links(cluster, group)
    return 2.0 * (n - 1).bit_length() * (a + nbytes * b)


#: the all-reduce algorithms the estimator prices (and the runtime runs: ``Plan.dp_algo``)
ALLREDUCE_TIMES = {"ring": ring_allreduce_time, "tree": tree_allreduce_time}


def choose_allreduce(cluster: Cluster, group: list[int], nbytes: float, algo: str = "auto") -> tuple[str, float]:
    """(algorithm, predicted seconds) of one group's all-reduce: ``algo`` itself, or for ``"auto"`` the cheaper
    of ring and tree (the ring on a tie: it sends fewer bytes)."""
    if algo != "auto":
        if algo not in ALLREDUCE_TIMES:
            raise ValueError(f"all-reduce algorithm {algo!r}: expected ring, tree or auto")
        return algo, ALLREDUCE_TIMES[algo](cluster, group, nbytes)
    ring, tree = (ring_allreduce_time(cluster, group, nbytes), tree_allreduce_time(cluster, group, nbytes))
    return ("tree", tree) if tree < ring else ("ring", ring)


def stage_grad_bytes(cm: CostModel, node_part: np.ndarray, n_stages: int) -> np.ndarray:
    """P_s: bytes of the trainable parameters each stage holds (a tied parameter counts in every holder)."""
    node_part = np.asarray(node_part, dtype=np.int64)
    if not len(cm.pn_param):
        return np.zeros(n_stages)
    pp = np.unique(cm.pn_param * n_stages + node_part[cm.pn_node])
    par, part = pp // n_stages, pp % n_stages
    w = np.where(cm.p_trainable[par], cm.p_bytes[par], 0.0)
    return np.bincount(part, weights=w, minlength=n_stages)


def dp_estimate(cm: CostModel, node_part: np.ndarray, devices: list[list[int]], *, overlap: bool = True,
                grad_wire_ratio: float = 1.0, algo: str | list[str] = "ring") -> DPEstimate:
    """Price a DP x PP layout (module docstring).

    cm:        the cost model of ONE replica: ``cm.micro_batches`` is n_b per replica and
               ``cm.samples_per_micro_batch`` the micro-batch size (global batch = R * n_b * that).
    node_part: stage of every node (stages numbered in pipeline order), the same for every replica.
    devices:   ``devices[r][s]``, device index of replica r's stage s.
    algo:      the all-reduce of every stage group: ``"ring"``, ``"tree"``, ``"auto"`` (the cheaper per
               group, :func:`choose_allreduce`) or one of those per stage.
    """
    R = len(devices)
    S = len(devices[0]) if R else 0
    if R == 0 or any(len(row) != S for row in devices):
        raise ValueError("devices must be a non-empty R x S table")
    replica_s, tails, violations = [], [], []
    for r, row in enumerate(devices):
        est = cm.evaluate(node_part, row)
        replica_s.append(est.iteration_s)
        for v in est.violations:
            violations.append(f"replica {r}: {v}")
        tail = np.concatenate([[0.0], np.cumsum([BACKWARD_SHARE * p.compute_s + p.comm_bwd_s for p in est.parts])])
        tails.append(tail[:S])
    slow = int(np.argmax(replica_s))
    pipe = float(replica_s[slow])
    grad = stage_grad_bytes(cm, node_part, S) * float(grad_wire_ratio)
    per = [algo] * S if isinstance(algo, str) else list(algo)
    if len(per) != S:
        raise ValueError(f"algo names {len(per)} stage groups, the layout has {S}")
    chosen = [choose_allreduce(cm.cluster, [devices[r][s] for r in range(R)], float(grad[s]), per[s]) for s in range(S)]
    ar = [t for _, t in chosen]
    if overlap:
        exposed = [max(0.0, a - float(tails[slow][s])) for s, a in enumerate(ar)]
    else:
        exposed = list(ar)
    sync = max(exposed, default=0.0)
    total = pipe + sync
    batch = R * cm.micro_batches * cm.samples_per_micro_batch
    return DPEstimate(total, pipe, sync, [float(x) for x in replica_s], [float(x) for x in ar],
                      [float(x) for x in grad], batch / total if total > 0 else float("inf"), batch, violations,
                      [a for a, _ in chosen])


def replica_cost_model(cm: CostModel, micro_batches: int, scale: float = 1.0) -> CostModel:
    """The cost model of one replica: ``micro_batches`` per replica, each ``scale`` times the traced micro-batch.

    Compute, memory-bound bytes, saved activations and tensor bytes grow linearly with the micro-batch
    (batch-major activations); parameters do not. ``scale = 1`` keeps the traced micro-batch.
    """
    kw = {k: getattr(cm, k) for k in cm.__dataclass_fields__ if cm.__dataclass_fields__[k].init}
    kw["micro_batches"] = int(micro_batches)
    if scale != 1.0:
        for k in ("flops", "mem", "saved", "t_bytes"):
            kw[k] = getattr(cm, k) * scale
        kw["samples_per_micro_batch"] = int(round(cm.samples_per_micro_batch * scale))
    return CostModel(**kw)


__all__ = ["DPEstimate", "dp_estimate", "ring_allreduce_time", "tree_allreduce_time", "choose_allreduce",
           "ALLREDUCE_TIMES", "group_links", "stage_grad_bytes",
           "replica_cost_model", "BACKWARD_SHARE"]

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
from fusion.kernels.codecs import CODECS, Role

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



# -- DiLoCo: pseudo-gradients synced every H inner steps -------------------------------------------------------

#: codec cfgs the planner tries for pseudo-gradients, most faithful first (None: dense float32, exact average):
#: the codecs' own pseudo-gradient candidates (``Codec.auto[Role.PSEUDO_GRADIENT]``, ordered by the registry)
PSEUDO_CODECS: tuple[dict | None, ...] = (None, *CODECS.auto(Role.PSEUDO_GRADIENT))

#: inner steps per outer step the planner tries (DiLoCo: H = 500 matched synchronous training with 8 workers)
INNER_STEPS = (10, 20, 50, 100, 200, 500)


def codec_label(cfg: dict | None) -> str:
    """``dense`` for None, else ``quant:bits=4``, ``topk:ratio=100``, ``sparseloco:chunk=4096,k=64,beta=0.95`` ...:
    the CLI's spelling of a codec cfg (floats in their shortest ``g`` form), as the compile summary, the planner's
    prediction and ``fusion inspect`` print it."""
    if cfg is None:
        return "dense"
    rest = ",".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in cfg.items() if k != "algo")
    return f"{cfg['algo']}:{rest}" if rest else str(cfg["algo"])


def stage_param_specs(cm: CostModel, node_part: np.ndarray, n_stages: int) -> list[list[tuple[int, str]]]:
    """(numel, dtype) of every trainable parameter each stage holds (a tied parameter in every holder)."""
    node_part = np.asarray(node_part, dtype=np.int64)
    out: list[list[tuple[int, str]]] = [[] for _ in range(n_stages)]
    if not len(cm.pn_param):
        return out
    pp = np.unique(cm.pn_param * n_stages + node_part[cm.pn_node])
    for par, part in zip(pp // n_stages, pp % n_stages):
        if cm.p_trainable[par]:
            spec = cm.graph.params[cm.p_names[par]]
            out[int(part)].append((int(np.prod(spec.shape, dtype=np.int64)), str(spec.dtype)))
    return out


def pseudo_wire_bytes(specs: list[tuple[int, str]], codec: dict | None) -> float:
    """Bytes one replica puts on the wire for one stage's pseudo-gradient: the codec registry's
    ``wire_nbytes`` of every parameter tensor (scales, indices and headers included), or the dense bytes."""
    from fusion.kernels.codec import CODECS

    if codec is None:
        return float(sum(n * (2 if dt == "bfloat16" else np.dtype(dt).itemsize) for n, dt in specs))
    c = CODECS.get(codec["algo"])
    return float(sum(c.wire_nbytes(n, dt, codec) for n, dt in specs))


def allgather_time(cluster: Cluster, group: list[int], nbytes: float) -> float:
    """Ring all-gather of one ``nbytes`` payload per member: ``(n - 1) (alpha_max + M beta_max)``.

    How a lossy pseudo-gradient is averaged: every replica encodes its own once and every member decodes all
    of them and averages in replica order (so all apply the same bits); a ring relays each payload n - 1 hops.
    """
    n = len(group)
    if n < 2 or nbytes <= 0:
        return 0.0
    a, b = group_links(cluster, group)
    return (n - 1) * (a + nbytes * b)


def pseudo_sync_time(cluster: Cluster, group: list[int], nbytes: float, lossy: bool, algo: str = "ring") -> float:
    """Seconds to average one stage group's pseudo-gradient of ``nbytes`` per replica: the all-reduce of
    :func:`choose_allreduce` when dense (exact sums), the all-gather of :func:`allgather_time` when lossy."""
    if lossy:
        return allgather_time(cluster, group, nbytes)
    return choose_allreduce(cluster, group, nbytes, algo)[1]


def balance_shares(fit: list[tuple[float, float]], total: int) -> list[int]:
    """Micro-batches per replica so that the slowest replica's inner step is the shortest: replica r's step
    is about ``a_r + b_r n_r`` (Eq. (3) is affine in n_b), so ``total`` micro-batches are handed out one at a
    time to the replica whose step grows least (water filling; every replica keeps at least one).
    The share of replica r is then about proportional to its speed ``1 / b_r``."""
    import heapq

    R = len(fit)
    if total < R:
        raise ValueError(f"{total} micro-batches cannot feed {R} replicas")
    n = [1] * R
    heap = [(a + 2 * b, r) for r, (a, b) in enumerate(fit)]
    heapq.heapify(heap)
    for _ in range(total - R):
        _, r = heapq.heappop(heap)
        n[r] += 1
        heapq.heappush(heap, (fit[r][0] + (n[r] + 1) * fit[r][1], r))
    return n


@dataclass
class DiLoCoEstimate:
    """Predicted inner step of a DiLoCo layout (seconds unless named otherwise; see :func:`diloco_estimate`).

    iteration_s:   T_step = compute_s + exposed_s / H, one inner step with the outer sync amortised.
    compute_s:     T_c = max_r T_r(n_r), the slowest replica's inner step (Eq. (3) + its tied sync and step work).
    replica_s:     T_r(n_r) of every replica.
    micro_batches: n_r, micro-batches of every replica per inner step (its share of the global batch).
    inner_steps:   H.
    codec:         the pseudo-gradient codec cfg (None: dense float32).
    delay:         0: the outer sync blocks; 1: it overlaps the next H inner steps.
    fragments:     F, fragments per stage, synced on staggered inner steps.
    sync_bytes:    b_s, wire bytes one replica sends for stage s's whole pseudo-gradient per outer step.
    sync_s:        t_s, link seconds of stage group s per outer step (all F fragments).
    exposed_s:     E = max_s of the sync seconds per outer step that compute does not hide.
    dense_bytes:   P_s, the dense float32 bytes of stage s (what synchronous DP averages every step).
    samples_per_s: global_batch / iteration_s.
    violations:    memory overflows, one line each.
    recompute:     per replica and stage, whether that part recomputes its activations to fit.
    steps_ratio:   the convergence price the planner applied: steps to synchronous DP's held-out loss over
                   synchronous DP's steps (``fusion.cost.convergence``; None: not priced, H and delay not measured).
    """

    iteration_s: float
    compute_s: float
    replica_s: list[float]
    micro_batches: list[int]
    inner_steps: int
    codec: dict | None
    delay: int
    fragments: int
    sync_bytes: list[float]
    sync_s: list[float]
    exposed_s: float
    dense_bytes: list[float]
    samples_per_s: float
    global_batch: int
    violations: list[str] = field(default_factory=list)
    recompute: list[list[bool]] = field(default_factory=list)  # replica r's stage s recomputes its activations
    steps_ratio: float | None = None

    @property
    def feasible(self) -> bool:
        return not self.violations

    @property
    def samples_per_s_to_loss(self) -> float:
        """Samples/s worth of synchronous DP's progress toward its loss: ``samples_per_s / steps_ratio`` (the raw
        samples/s where the convergence is not priced)."""
        return self.samples_per_s / (self.steps_ratio or 1.0)

    @property
    def pipeline_s(self) -> float:
        return self.compute_s

    @property
    def dp_sync_s(self) -> float:
        """The exposed outer sync per inner step, ``E / H``."""
        return self.exposed_s / self.inner_steps

    def predicted(self) -> dict[str, float]:
        """The flat numbers a plan records (per inner step unless the name says per outer step)."""
        H = self.inner_steps
        per_outer = float(sum(self.sync_bytes))
        sync = max(self.sync_s, default=0.0)
        return {"iteration_s": self.iteration_s, "pipeline_s": self.compute_s, "dp_sync_s": self.dp_sync_s,
                "samples_per_s": self.samples_per_s, "global_batch": float(self.global_batch),
                "inner_steps": float(H), "sync_bytes_per_outer_step": per_outer,
                "sync_bytes_per_step": per_outer / H, "sync_peak_bytes": max(self.sync_bytes, default=0.0) / self.fragments,
                "dense_bytes_per_step": float(sum(self.dense_bytes)),
                "sync_s_per_outer_step": sync, "compute_s_per_outer_step": H * self.compute_s,
                "exposed_sync_s_per_outer_step": self.exposed_s,
                "sync_hidden": 1.0 - self.exposed_s / sync if sync > 0 else 1.0,
                **({} if self.steps_ratio is None else {"steps_to_sync_loss_ratio": float(self.steps_ratio)})}


def outer_step_exposed(sync_s: float, compute_s: float, inner_steps: int, delay: int) -> float:
    """Seconds of one outer step's sync that compute does not hide: all of it with ``delay`` 0; with ``delay``
    1 it overlaps the next H inner steps, so only ``max(0, t - H T_c)`` shows."""
    return sync_s if delay == 0 else max(0.0, sync_s - inner_steps * compute_s)


def diloco_step(compute_s: float, sync_s: list[float], inner_steps: int, delay: int) -> tuple[float, float]:
    """(T_step, E): ``E = max_s exposed(t_s)`` over the stage groups, which sync in parallel, and
    ``T_step = T_c + E / H``."""
    exposed = max((outer_step_exposed(t, compute_s, inner_steps, delay) for t in sync_s), default=0.0)
    return compute_s + exposed / inner_steps, exposed


def fragment_sync_time(cluster: Cluster, group: list[int], nbytes: float, codec: dict | None, fragments: int,
                       algo: str = "ring", delay: int = 0) -> float:
    """t_s: the link seconds of one stage group per outer step when its pseudo-gradient of ``nbytes`` goes
    as ``fragments`` fragments of ``nbytes / F`` each (one after another on the same links):
    ``F * X(nbytes / F)``, X the all-reduce or all-gather of :func:`pseudo_sync_time`: the all-gather for a
    lossy codec, and for every delayed round (``delay`` 1: the runtime all-gathers it, dense or not, so that
    it needs no engine-loop turn per hop while the next inner steps run; ``outer.OuterLoop.delayed_step``)."""
    F = int(fragments)
    return F * pseudo_sync_time(cluster, group, nbytes / F, codec is not None or delay == 1, algo)


def replica_fits(cm: CostModel, node_part: np.ndarray, devices: list[list[int]],
                 recompute: list[np.ndarray] | None = None, probe: tuple[int, int] = (1, 2)) -> list[tuple[float, float]]:
    """(a_r, b_r) with ``T_r(n) = a_r + b_r n`` for every replica, from two exact estimates at ``probe``
    (``recompute[r]``: replica r's parts that recompute their activations)."""
    n1, n2 = probe
    e1, e2 = (replica_cost_model(cm, n1), replica_cost_model(cm, n2))
    out = []
    for r, row in enumerate(devices):
        rc = None if recompute is None else recompute[r]
        t1 = e1.evaluate(node_part, row, detail=False, recompute=rc)[0]
        t2 = e2.evaluate(node_part, row, detail=False, recompute=rc)[0]
        b = max((t2 - t1) / (n2 - n1), 1e-12)
        out.append((t1 - b * n1, b))
    return out


def replica_recompute(cm: CostModel, node_part: np.ndarray, row: list[int]) -> np.ndarray:
    """The parts of one replica that recompute their activations, as the compiler's ``--recompute auto``
    chooses them: those over their device's memory without it."""
    est = cm.evaluate(node_part, row, recompute=np.zeros(len(row), dtype=bool))
    return np.array([pe.memory_bytes > pe.memory_limit for pe in est.parts], dtype=bool)


@dataclass
class DiLoCoLayout:
    """What one layout's pricing needs, computed once and shared by every (H, codec, delay, F) tried on it.

    compute_s, replica_s, micro_batches, violations: the inner step with the shares ``micro_batches``.
    specs: (numel, dtype) of the trainable parameters of every stage; groups: device indices of every stage group.
    """

    cm: CostModel
    node_part: np.ndarray
    devices: list[list[int]]
    compute_s: float
    replica_s: list[float]
    micro_batches: list[int]
    violations: list[str]
    specs: list[list[tuple[int, str]]]
    groups: list[list[int]]
    global_batch: int
    recompute: list[list[bool]] = field(default_factory=list)  # per replica and stage: activation recomputation

    @property
    def iteration_s(self) -> float:
        return self.compute_s

    @property
    def feasible(self) -> bool:
        return not self.violations


def diloco_layout(cm: CostModel, node_part: np.ndarray, devices: list[list[int]], total_micro_batches: int,
                  shares: bool = True, recompute: bool = False) -> DiLoCoLayout:
    """Price the inner step of a layout: ``shares`` True hands the ``total_micro_batches`` out by speed
    (:func:`balance_shares`), False splits them equally (then R must divide them); each replica is then
    priced exactly with its n_r. ``cm`` is the traced micro-batch's cost model (its micro_batches ignored).
    recompute: parts over their memory recompute their activations (:func:`replica_recompute`, chosen per
    replica with the equal share's micro-batches); False: none does."""
    R = len(devices)
    S = len(devices[0]) if R else 0
    if R == 0 or any(len(row) != S for row in devices):
        raise ValueError("devices must be a non-empty R x S table")
    node_part = np.asarray(node_part, dtype=np.int64)
    rc = [np.zeros(S, dtype=bool) for _ in devices]
    if recompute:
        probe = replica_cost_model(cm, max(1, total_micro_batches // R))
        rc = [replica_recompute(probe, node_part, row) for row in devices]
    if shares and R > 1:
        n = balance_shares(replica_fits(cm, node_part, devices, rc), total_micro_batches)
    else:
        if total_micro_batches % R:
            raise ValueError(f"{total_micro_batches} micro-batches do not split equally over {R} replicas")
        n = [total_micro_batches // R] * R
    replica_s, violations, models = [], [], {}
    for r, (row, nr) in enumerate(zip(devices, n)):
        m = models.setdefault(nr, replica_cost_model(cm, nr))
        est = m.evaluate(node_part, row, recompute=rc[r])
        replica_s.append(float(est.iteration_s))
        violations += [f"replica {r}: {v}" for v in est.violations]
    groups = [[devices[r][s] for r in range(R)] for s in range(S)]
    return DiLoCoLayout(cm, node_part, [list(r) for r in devices], max(replica_s), replica_s, n, violations,
                        stage_param_specs(cm, node_part, S), groups,
                        total_micro_batches * cm.samples_per_micro_batch, [[bool(x) for x in r] for r in rc])


def diloco_estimate(layout: DiLoCoLayout, inner_steps: int, codec: dict | None = None, delay: int = 0,
                    fragments: int = 1, algo: str = "ring") -> DiLoCoEstimate:
    """Price one DiLoCo config on a layout (:func:`diloco_layout`); the model, per stage group s:

    ``b_s = sum_p wire_nbytes(numel_p, dtype_p, codec)`` over s's trainable parameters (dense: 4 B each);
    ``t_s = F * X(C_s, b_s / F)`` with X the ring all-reduce (dense, delay 0) or all-gather (lossy, or
    delay 1) over the group's slowest link; exposed ``e_s = t_s`` (delay 0) or ``max(0, t_s - H T_c)`` (delay 1);
    ``T_step = T_c + max_s e_s / H`` and ``phi = G / T_step``.
    """
    H, F = int(inner_steps), int(fragments)
    if H < 1 or F < 1 or F > H:
        raise ValueError(f"inner steps {inner_steps} and fragments {fragments}: need 1 <= F <= H")
    if delay not in (0, 1):
        raise ValueError(f"delay {delay}: expected 0 or 1")
    cl = layout.cm.cluster
    dense = [pseudo_wire_bytes(sp, None) for sp in layout.specs]
    wire = dense if codec is None else [pseudo_wire_bytes(sp, codec) for sp in layout.specs]
    sync = [fragment_sync_time(cl, g, b, codec, F, algo, delay) for g, b in zip(layout.groups, wire)]
    step, exposed = diloco_step(layout.compute_s, sync, H, delay)
    return DiLoCoEstimate(step, layout.compute_s, list(layout.replica_s), list(layout.micro_batches), H,
                          None if codec is None else dict(codec), int(delay), F, wire, sync, exposed, dense,
                          layout.global_batch / step if step > 0 else float("inf"), layout.global_batch,
                          list(layout.violations), [list(r) for r in layout.recompute])


__all__ = ["DPEstimate", "dp_estimate", "ring_allreduce_time", "tree_allreduce_time", "choose_allreduce",
           "ALLREDUCE_TIMES", "group_links", "stage_grad_bytes",
           "replica_cost_model", "BACKWARD_SHARE", "PSEUDO_CODECS", "INNER_STEPS", "codec_label",
           "stage_param_specs", "pseudo_wire_bytes", "allgather_time", "pseudo_sync_time", "balance_shares",
           "DiLoCoEstimate", "DiLoCoLayout", "diloco_layout", "diloco_estimate", "diloco_step",
           "outer_step_exposed", "fragment_sync_time", "replica_fits", "replica_recompute"]

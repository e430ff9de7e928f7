"""Our DP x PP planner: replicas of an OP-Fence pipeline over stage groups drawn from Louvain clusters.

A DP x PP layout is R replica pipelines with one cut into S stages; stage
s of every replica forms a data-parallel group (its gradients are averaged
every step). The planner searches the number of replicas R, the groups, the
cut and the pipeline order, pricing everything with :func:`fusion.cost.dp.dp_estimate`
(FusionLLM Eq. (1)-(4) inside a replica, DT-FM §3.2's slowest-link all-reduce
between replicas):

1. **Replica counts**: every R that divides the global batch into whole
   micro-batches and leaves room for a stage group of R devices.
2. **Groups** (three shapes, all from the Louvain clusters and the pipeline
   device order of :mod:`fusion.cluster.topology`):
   - *groups inside clusters*: each cluster, fastest devices first, is cut into
     groups of R devices (leftovers are pooled last), so gradients are averaged
     over fast links and the pipeline crosses between clusters;
   - *replicas inside clusters*: the device order is cut into R runs of
     ``N // R`` devices, one per replica, and group s takes the s-th device of
     every run, so pipelines stay on fast links and the averaging crosses;
   - *replicas in runs*: every cluster is cut into runs of L devices (L a
     cluster size or half of one) and the R fastest runs host one replica each
     (two 8-GPU machines joined by a 1 Gbit/s link: one replica per machine).
3. **Virtual cluster**: each group becomes one virtual device (its slowest
   member's speed, smallest memory); the link from group g to group h is the
   worst link of the perfect matching of g's members to h's members whose worst
   link is best (DT-FM §3.3's bottleneck matching between consecutive groups).
4. **Cut**: OP-Fence (:func:`fusion.partition.fence.op_fence`) on the virtual
   cluster picks the groups that are used, their pipeline order and the cut
   (memory per replica with that replica's micro-batches in flight). Replica r
   follows the matchings from group to group along the pipeline.
5. **Price and choose**: each candidate is priced exactly by
   :func:`fusion.cost.dp.dp_estimate` on the real devices; the lowest predicted
   time per sample wins. A last pass tries the same groups with one stage more
   or less (chain DP solutions for every stage count), since OP-Fence alone
   ignores that more stages also shrink every group's all-reduce.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Mapping

import numpy as np

from fusion.cluster.model import Cluster, Device
from fusion.cluster.topology import cluster_bandwidth, cluster_path, device_clusters, device_order, start_candidates
from fusion.cost.dp import (INNER_STEPS, PSEUDO_CODECS, DPEstimate, codec_label, diloco_estimate, diloco_layout,
                             dp_estimate, replica_cost_model)
from fusion.cost.convergence import steps_ratio
from fusion.cost.estimate import CostModel, samples_per_micro_batch
from fusion.cost.flops import NodeCost, measure_costs
from fusion.ir.errors import FusionError
from fusion.kernels.codecs import CODECS
from fusion.ir.graph import OpGraph
from fusion.partition.chain import build_chain, candidate_positions, chain_dp
from fusion.partition.fence import NoFitError, op_fence
from fusion.partition.matching import bottleneck_matching

log = logging.getLogger(__name__)


class DPPlanError(FusionError):
    """No DP x PP layout fits (or the batch does not split); the message says why."""


@dataclass
class DPPlacement:
    """A DP x PP layout, the contract between the planners and ``fusion compile --strategy dp|dtfm``.

    cut:       node name -> stage index 0..S-1 (stages in pipeline order; the same cut for every
               replica; each stage a connected sub-DAG like OP-Fence's parts).
    devices:   ``devices[r][s]``: cluster device name of replica r's stage s; all distinct.
    predicted: at least ``iteration_s``, ``pipeline_s``, ``dp_sync_s``, ``samples_per_s``
               (:func:`fusion.cost.dp.dp_estimate`), plus ``replicas``, ``stages``,
               ``micro_batches`` (per replica) and ``micro_batch_size``.
    strategy:  ``dp`` (this planner) or ``dtfm`` (:mod:`fusion.partition.dtfm`).
    info:      how the planner got there (candidates tried, seconds, ...).
    """

    cut: dict[str, int]
    devices: list[list[str]]
    predicted: dict[str, float]
    strategy: str
    info: dict = field(default_factory=dict)

    @property
    def replicas(self) -> int:
        return len(self.devices)

    @property
    def stages(self) -> int:
        return len(self.devices[0]) if self.devices else 0


@dataclass
class Candidate:
    """One priced layout: stage of every node, device indices ``devices[r][s]``, its estimate."""

    node_part: np.ndarray
    devices: list[list[int]]
    estimate: DPEstimate
    cm: CostModel
    how: str

    @property
    def per_sample(self) -> float:
        return self.estimate.iteration_s / self.estimate.global_batch if self.estimate.feasible else np.inf

    @property
    def per_sample_to_loss(self) -> float:
        """:attr:`per_sample` times the estimate's convergence price (DiLoCo: ``steps_ratio``; else 1)."""
        return self.per_sample * (getattr(self.estimate, "steps_ratio", None) or 1.0)


def batch_splits(global_batch: int, traced: int, n_devices: int,
                 micro_batches: int | None) -> list[tuple[int, int, float]]:
    """(R, n_b per replica, micro-batch scale) for every replica count R the global batch allows.

    micro_batches None: micro-batches keep the traced size ``traced``; R must divide ``global_batch / traced``.
    micro_batches k: every replica runs k micro-batches of ``global_batch / (R k)`` samples.
    """
    if not isinstance(global_batch, int) or global_batch < 1:
        raise DPPlanError(f"global_batch must be an integer >= 1, got {global_batch!r}")
    out = []
    if micro_batches is None:
        if global_batch % traced:
            raise DPPlanError(f"global_batch {global_batch} is not a multiple of the traced micro-batch ({traced} samples)")
        total = global_batch // traced
        for R in range(1, min(n_devices, total) + 1):
            if total % R == 0:
                out.append((R, total // R, 1.0))
    else:
        if not isinstance(micro_batches, int) or micro_batches < 1:
            raise DPPlanError(f"micro_batches must be an integer >= 1, got {micro_batches!r}")
        for R in range(1, n_devices + 1):
            if global_batch % (R * micro_batches) == 0:
                out.append((R, micro_batches, global_batch / (R * micro_batches) / traced))
    if not out:
        raise DPPlanError(f"global_batch {global_batch} does not split into whole micro-batches over any replica count")
    return out


def groups_inside_clusters(cluster: Cluster, clusters: list[list[int]], order: list[int], R: int) -> list[list[int]]:
    """Stage groups of R devices cut from each Louvain cluster in ``order``; leftovers pooled at the end."""
    of = {d: c for c, members in enumerate(clusters) for d in members}
    seen: list[int] = []
    for d in order:
        if of[d] not in seen:
            seen.append(of[d])
    groups, left = [], []
    for c in seen:
        members = [d for d in order if of[d] == c]
        k = len(members) // R
        groups += [members[i * R:(i + 1) * R] for i in range(k)]
        left += members[k * R:]
    groups += [left[i * R:(i + 1) * R] for i in range(len(left) // R)]
    return groups


def replicas_inside_clusters(order: list[int], R: int) -> list[list[int]]:
    """Stage groups whose r-th member is the s-th device of replica r's run of ``len(order) // R`` devices."""
    L = len(order) // R
    return [[order[r * L + s] for r in range(R)] for s in range(L)]


def replicas_in_runs(cluster: Cluster, clusters: list[list[int]], order: list[int], R: int,
                     L: int) -> list[list[int]] | None:
    """Each cluster cut into runs of L devices (fastest first); the R fastest runs host one replica each
    (ties: earlier on the cluster path); group s takes the s-th device of every run. None if too few runs."""
    of = {d: c for c, members in enumerate(clusters) for d in members}
    seen: list[int] = []
    for d in order:
        if of[d] not in seen:
            seen.append(of[d])
    runs = []
    for c in seen:
        members = [d for d in order if of[d] == c]
        runs += [members[i * L:(i + 1) * L] for i in range(len(members) // L)]
    if len(runs) < R:
        return None
    speed = [min(cluster.devices[d].speed for d in run) * L for run in runs]
    pick = sorted(sorted(range(len(runs)), key=lambda i: -speed[i])[:R])
    return [[runs[i][s] for i in pick] for s in range(L)]


def matching(cluster: Cluster, g: list[int], h: list[int]) -> tuple[np.ndarray, float, float]:
    """Perfect matching of g's members to h's with the least worst link (seconds per byte, latency
    breaking ties): perm, worst alpha, worst beta."""
    gi, hi = np.asarray(g), np.asarray(h)
    beta = cluster.beta[np.ix_(gi, hi)]
    alpha = cluster.alpha[np.ix_(gi, hi)]
    _, perm = bottleneck_matching(beta + alpha * 1e-9)
    ar = np.arange(len(g))
    return perm, float(alpha[ar, perm].max()), float(beta[ar, perm].max())


def virtual_cluster(cluster: Cluster, groups: list[list[int]]) -> tuple[Cluster, dict[tuple[int, int], np.ndarray]]:
    """Each group as one device (slowest speed, least memory); links: the worst pair of the best matching."""
    G = len(groups)
    devs = []
    for k, g in enumerate(groups):
        ds = [cluster.devices[i] for i in g]
        devs.append(Device(f"group{k}", min(d.speed for d in ds), min(d.memory_bytes for d in ds), 1.0,
                           min(d.memory_speed for d in ds)))
    alpha, beta = np.zeros((G, G)), np.zeros((G, G))
    perms: dict[tuple[int, int], np.ndarray] = {}
    for a in range(G):
        for b in range(G):
            if a != b:
                perms[(a, b)], alpha[a, b], beta[a, b] = matching(cluster, groups[a], groups[b])
    return Cluster(f"{cluster.name}-groups", devs, alpha, beta, cluster.source), perms


def replica_paths(groups: list[list[int]], seq: list[int], perms: Mapping[tuple[int, int], np.ndarray]) -> list[list[int]]:
    """devices[r][s] following the matchings between consecutive groups of the pipeline ``seq``."""
    R = len(groups[seq[0]])
    pos = np.arange(R)  # member index of each replica in the current group
    out = [[groups[seq[0]][i] for i in pos]]
    for a, b in zip(seq, seq[1:]):
        pos = perms[(a, b)][pos]
        out.append([groups[b][i] for i in pos])
    return [[out[s][r] for s in range(len(seq))] for r in range(R)]


def search_micro_batches(cm: CostModel, n_groups: int, cap: int = 8) -> int:
    """Micro-batches the cut search sees. OP-Fence's chain DP charges every part activations for all n_b
    micro-batches (GPipe's worst case); under 1F1B a part holds at most depth + 1 <= stages of them, so the
    search runs with ``min(n_b, groups, cap)`` and every layout is then priced exactly with n_b."""
    if cm.schedule not in ("1f1b", "zb1"):
        return cm.micro_batches
    return max(1, min(cm.micro_batches, n_groups, cap))


def _layouts(cm: CostModel, groups: list[list[int]], seed: int, how: str, overlap: bool,
             grad_wire_ratio: float, allreduce: str = "ring", price=None) -> list[Candidate]:
    """OP-Fence on the virtual cluster of ``groups`` plus chain-DP solutions for every stage count.

    price: ``(node_part, devices) -> estimate`` (None: :func:`fusion.cost.dp.dp_estimate` with the options),
    any estimate with ``iteration_s``, ``global_batch``, ``feasible`` and ``replica_s``."""
    vc, perms = virtual_cluster(cm.cluster, groups)
    vcm = replica_cost_model(cm, search_micro_batches(cm, len(groups))).with_cluster(vc)
    out: list[Candidate] = []

    def add(node_part: np.ndarray, seq: list[int], tag: str) -> None:
        if len(set(seq)) != len(seq):
            return
        devs = replica_paths(groups, seq, perms)
        if price is None:
            est = dp_estimate(cm, node_part, devs, overlap=overlap, grad_wire_ratio=grad_wire_ratio, algo=allreduce)
        else:
            est = price(np.asarray(node_part), devs)
        out.append(Candidate(np.asarray(node_part), devs, est, cm, f"{how}/{tag}"))
        # DiLoCo: each replica pipeline on its own run (member r of every group), as the shapes cut the devices:
        # the matchings may mix runs, which puts a replica's pipeline and tied sync on the links between them
        runs = [[groups[g][r] for g in seq] for r in range(len(groups[seq[0]]))]
        if price is not None and runs != devs:
            out.append(Candidate(np.asarray(node_part), runs, price(np.asarray(node_part), runs), cm, f"{how}/{tag}/runs"))

    try:
        part = op_fence(vcm, seed=seed, max_sweeps=20)
        add(part.node_part, list(part.part_device), "opfence")
    except NoFitError:
        pass
    # every stage count along the virtual device order: more stages shrink each group's all-reduce
    vclusters = device_clusters(vc, seed)
    cbw = cluster_bandwidth(vc, vclusters)
    ch = build_chain(vcm)
    pos = candidate_positions(ch, 400)
    for s in start_candidates(vc, vclusters, cbw)[:2]:
        order = device_order(vc, vclusters, cluster_path(cbw, s))
        for r in chain_dp(ch, vcm, order, pos, np.inf):
            add(ch.node_part(r.cuts), r.devices, f"chain{len(r.devices)}")
    return out


def device_orders(cluster, clusters: list[list[int]] | None, seed: int) -> tuple[list[list[int]], list]:
    """The Louvain device clusters (``clusters`` when given) and the two device orders the DP planners try: paths
    through the clusters by bandwidth from the two best start clusters (step 2 of :func:`plan_dp_model`)."""
    clusters = clusters if clusters is not None else device_clusters(cluster, seed)
    cbw = cluster_bandwidth(cluster, clusters)
    orders = [device_order(cluster, clusters, cluster_path(cbw, s)) for s in start_candidates(cluster, clusters, cbw)[:2]]
    return clusters, orders


def plan_dp_model(cm: CostModel, *, global_batch: int, micro_batches: int | None = None, seed: int = 0,
                  replicas: list[int] | None = None, overlap: bool = True, grad_wire_ratio: float = 1.0,
                  clusters: list[list[int]] | None = None, allreduce: str = "ring") -> tuple[DPPlacement, Candidate]:
    """Plan on a cost model built for the whole cluster (its micro_batches is ignored; see :func:`plan_dp`)."""
    t0 = time.perf_counter()
    cluster = cm.cluster
    N = len(cluster)
    clusters, orders = device_orders(cluster, clusters, seed)
    splits = batch_splits(global_batch, cm.samples_per_micro_batch, N, micro_batches)
    if replicas is not None:
        allowed = [s[0] for s in splits]
        splits = [s for s in splits if s[0] in replicas]
        if not splits:
            raise DPPlanError(f"replicas {list(replicas)}: none splits global_batch {global_batch} into whole "
                              f"micro-batches on {N} devices (possible: {allowed})")
    need = float(cm.p_state.sum())
    best: Candidate | None = None
    tried = 0
    for R, n_b, scale in splits:
        rcm = replica_cost_model(cm, n_b, scale)
        for groups, how in group_shapes(cluster, clusters, orders, R, need):
            for cand in _layouts(rcm, groups, seed, how, overlap, grad_wire_ratio, allreduce):
                tried += 1
                if best is None or cand.per_sample < best.per_sample:
                    best = cand
    if best is None or not best.estimate.feasible:
        raise DPPlanError(f"{cluster.source}: devices[].memory_bytes: no DP x PP layout fits the devices' memory")
    best = connected(best, overlap, grad_wire_ratio, allreduce)
    info = {"candidates": tried, "how": best.how, "seconds": round(time.perf_counter() - t0, 3),
            "clusters": len(clusters)}
    log.info("dp planner: %d replicas x %d stages, predicted %.4g s/step (%s) in %.2f s", len(best.devices),
             len(best.devices[0]), best.estimate.iteration_s, best.how, info["seconds"])
    return placement(best, "dp", info), best


def group_shapes(cluster: Cluster, clusters: list[list[int]], orders: list[list[int]], R: int,
                 need: float = 0.0) -> list[tuple[list[list[int]], str]]:
    """The distinct stage-group tables of R replicas (module docstring, step 2) for every device order,
    each with how it was cut; those whose groups cannot hold ``need`` bytes of state (memory of each group's
    smallest member, summed) are left out."""
    N = len(cluster)
    shapes: dict[tuple, tuple[list[list[int]], str]] = {}
    for k, order in enumerate(orders):
        shaped = [(groups_inside_clusters(cluster, clusters, order, R), f"R{R}:groups-in-clusters{k}"),
                  (replicas_inside_clusters(order, R), f"R{R}:replicas-in-clusters{k}")]
        if R > 1:
            for L in sorted({len(c) for c in clusters} | {len(c) // 2 for c in clusters}):
                if 1 < L <= N // R:
                    shaped.append((replicas_in_runs(cluster, clusters, order, R, L), f"R{R}:replicas-in-runs{L}-{k}"))
        for groups, how in shaped:
            if groups:
                shapes.setdefault(tuple(tuple(g) for g in groups), (groups, how))
        if R == 1:
            break
    return [(g, how) for g, how in shapes.values()
            if sum(min(cluster.devices[i].memory_bytes for i in grp) for grp in g) >= need]


def connected(c: Candidate, overlap: bool = True, grad_wire_ratio: float = 1.0, allreduce: str = "ring",
              price=None) -> Candidate:
    """OP-Fence's connectivity repair (:func:`fusion.partition.fence._connect`) on the slowest replica's devices:
    a stage holding two disconnected pieces gives one to a neighbour it touches; kept when it still fits.
    price: as :func:`_layouts`'s."""
    from fusion.partition.fence import _connect

    slow = int(np.argmax(c.estimate.replica_s))
    node_part, fixed = _connect(c.cm, c.node_part, c.devices[slow])
    if not fixed:
        return c
    if price is None:
        est = dp_estimate(c.cm, node_part, c.devices, overlap=overlap, grad_wire_ratio=grad_wire_ratio, algo=allreduce)
    else:
        est = price(node_part, c.devices)
    return Candidate(node_part, c.devices, est, c.cm, c.how + "+connected") if est.feasible else c


def placement(c: Candidate, strategy: str, info: dict) -> DPPlacement:
    """A :class:`DPPlacement` from a priced candidate (device names, node names)."""
    names = [d.name for d in c.cm.cluster.devices]
    pred = c.estimate.predicted()
    pred.update({"replicas": float(len(c.devices)), "stages": float(len(c.devices[0])),
                 "micro_batches": float(c.cm.micro_batches), "micro_batch_size": float(c.cm.samples_per_micro_batch)})
    return DPPlacement({n: int(p) for n, p in zip(c.cm.names, c.node_part)},
                       [[names[d] for d in row] for row in c.devices], pred, strategy, dict(info))


def build_cost_model(graph: OpGraph, cluster: Cluster, *, costs: Mapping[str, NodeCost] | None = None,
                     schedule: str = "1f1b", optimizer_slots: int = 2) -> CostModel:
    """The whole-cluster cost model both planners start from (one traced micro-batch)."""
    costs = costs if costs is not None else measure_costs(graph)
    return CostModel.build(graph, costs, cluster, 1, schedule, optimizer_slots, samples_per_micro_batch(graph))


def plan_dp(graph: OpGraph, cluster: Cluster, *, global_batch: int, micro_batches: int | None = None,
            schedule: str = "1f1b", optimizer_slots: int = 2, costs: Mapping[str, NodeCost] | None = None,
            seed: int = 0, replicas: list[int] | None = None, overlap: bool = True,
            grad_wire_ratio: float = 1.0, allreduce: str = "ring") -> DPPlacement:
    """Choose R, the cut and the placement of a DP x PP plan (module docstring).

    global_batch:  samples per step over all replicas.
    micro_batches: per replica; None keeps the traced micro-batch size (n_b = global_batch / (R * traced)).
    schedule:      ``gpipe``, ``1f1b`` or ``zb1`` (activation memory in flight).
    optimizer_slots: state tensors per trainable parameter (SGD 0, momentum 1, AdamW 2).
    replicas:      restrict R to these counts (None: every count the batch allows).
    grad_wire_ratio: wire bytes of an averaged gradient per fp32 byte (1.0 plain, ~0.25 with 8-bit codes).
    allreduce:     how every candidate's stage groups are priced: ``"ring"``, ``"tree"`` or ``"auto"`` (the
                   cheaper per group; :func:`fusion.cost.dp.choose_allreduce`), as ``--dp-allreduce`` runs them.
    Raises DPPlanError when the batch does not split or nothing fits.
    """
    cm = build_cost_model(graph, cluster, costs=costs, schedule=schedule, optimizer_slots=optimizer_slots)
    return plan_dp_model(cm, global_batch=global_batch, micro_batches=micro_batches, seed=seed, replicas=replicas,
                         overlap=overlap, grad_wire_ratio=grad_wire_ratio, allreduce=allreduce)[0]



def single_pipeline(cm: CostModel, global_batch: int) -> tuple[float, int]:
    """The anchor a DP x PP plan is measured against: OP-Fence's best single pipeline (searched with 4, 8 and
    16 micro-batches, the best that fits) priced on the same global batch, all of it through that one
    pipeline. Returns (samples/s, parts); (0.0, 0) when no single pipeline fits."""
    full = replica_cost_model(cm, max(1, global_batch // cm.samples_per_micro_batch))
    best = (0.0, 0)
    for n_search in (4, 8, 16):
        try:
            part = op_fence(replica_cost_model(cm, n_search))
        except NoFitError:
            continue
        est = full.evaluate(part.node_part, part.part_device)
        if est.feasible and est.throughput > best[0]:
            best = (float(est.throughput), len(part.part_device))
    return best


def against_single_pipeline(graph: OpGraph, cluster: Cluster, *, global_batch: int, schedule: str,
                            optimizer_slots: int, samples_per_s: float) -> dict:
    """What a DP x PP plan's ``samples_per_s`` is worth against :func:`single_pipeline` on the same cluster and
    global batch: ``{"single_pipeline_samples_per_s", "single_pipeline_parts", "dp_vs_single_pipeline"}`` (the
    ratio is None when no single pipeline fits), written to ``plan.predicted`` and shown by ``fusion inspect``."""
    cm = build_cost_model(graph, cluster, schedule=schedule, optimizer_slots=optimizer_slots)
    single, parts = single_pipeline(cm, global_batch)
    return {"single_pipeline_samples_per_s": single, "single_pipeline_parts": parts,
            "dp_vs_single_pipeline": samples_per_s / single if single > 0 else None}


# -- DiLoCo: the sync mode, H, codec, shares and placement (--dp-sync auto|diloco) --------------------------------

#: ``--dp-sync auto`` keeps synchronous DP unless DiLoCo is predicted this much faster (it changes the training
#: dynamics: stale local steps, a lossy pseudo-gradient), as a ratio of samples/s
DILOCO_MARGIN = 1.10
#: inside one layout, configs within this fraction of the best samples/s count as ties, which go to the most
#: faithful one: the most faithful codec (the order of the codec list; DiLoCo matched synchronous training with
#: dense pseudo-gradients up to H = 500), then the fewest inner steps H, then no delay, then fewest fragments
TIE = 0.01


@dataclass
class SyncSearch:
    """The DiLoCo knobs the planner may choose among (one value each where the user fixed it).

    inner_steps: H values (each >= 1). codecs: pseudo-gradient codec cfgs, most faithful first (None: dense).
    delays: 0 (the outer sync blocks) and/or 1 (it overlaps the next H inner steps). fragments: F values.
    shares: hand the global batch out by replica speed (False: equal shares).
    recompute: let parts over their memory recompute their activations (``--recompute auto``; False: off).
    """

    inner_steps: tuple[int, ...] = INNER_STEPS
    codecs: tuple[dict | None, ...] = PSEUDO_CODECS
    delays: tuple[int, ...] = (0, 1)
    fragments: tuple[int, ...] = (1,)
    shares: bool = True
    recompute: bool = True

    def check(self) -> None:
        """DPPlanError (one line) for an empty list or a value out of range."""
        for name in ("inner_steps", "codecs", "delays", "fragments"):
            if not getattr(self, name):
                raise DPPlanError(f"dp sync search: {name} is empty")
        bad = [h for h in self.inner_steps if not isinstance(h, int) or isinstance(h, bool) or h < 1]
        if bad:
            raise DPPlanError(f"inner steps {bad[0]!r}: every H must be an integer >= 1")
        if any(d not in (0, 1) for d in self.delays):
            raise DPPlanError(f"outer delay {self.delays}: expected 0 or 1")
        if any(not isinstance(f, int) or f < 1 for f in self.fragments):
            raise DPPlanError(f"sync fragments {self.fragments}: every F must be an integer >= 1")


def best_sync(layout, search: SyncSearch, allreduce: str = "ring"):
    """The best :class:`fusion.cost.dp.DiLoCoEstimate` over the search's (codec, H, delay, F) on one layout, by
    predicted time to synchronous DP's loss: samples/s over the measured steps-to-loss ratio of (H, delay)
    (:mod:`fusion.cost.convergence`); configs without a measured ratio are left out when any has one, and ranked
    by samples/s alone when none has (ties within :data:`TIE` to the most faithful; F > H skipped)."""
    ests = []
    for h in sorted(search.inner_steps):
        for ci, codec in enumerate(search.codecs):
            for d in sorted(search.delays):
                for f in sorted(search.fragments):
                    if f <= h:
                        est = diloco_estimate(layout, h, codec, d, f, allreduce)
                        ests.append(((ci, h, d, f), replace(est, steps_ratio=steps_ratio(h, d))))
    if not ests:
        raise DPPlanError(f"sync fragments {search.fragments}: every F exceeds every H {search.inner_steps}")
    priced = [(k, e) for k, e in ests if e.steps_ratio is not None]
    ests = priced or ests
    top = max(e.samples_per_s_to_loss for _, e in ests)
    if top <= 0:
        return ests[0][1]
    return min((k, e) for k, e in ests if e.samples_per_s_to_loss >= top * (1 - TIE))[1]


def diloco_splits(global_batch: int, traced: int, n_devices: int, replicas: list[int] | None,
                  shares: bool) -> list[int]:
    """Replica counts DiLoCo may use: 2 .. devices with at least one micro-batch each (equal shares: those that
    divide the micro-batches)."""
    if not isinstance(global_batch, int) or global_batch < 1:
        raise DPPlanError(f"global_batch must be an integer >= 1, got {global_batch!r}")
    if global_batch % traced:
        raise DPPlanError(f"global_batch {global_batch} is not a multiple of the traced micro-batch ({traced} samples)")
    M = global_batch // traced
    out = [R for R in range(2, min(n_devices, M) + 1) if shares or M % R == 0]
    if replicas is not None:
        out = [R for R in out if R in replicas]
    if not out:
        raise DPPlanError(f"DiLoCo needs 2 or more replicas with a micro-batch each: {n_devices} device(s), global "
                          f"batch {global_batch}" + (f", replicas {list(replicas)}" if replicas is not None else ""))
    return out


def plan_diloco_model(cm: CostModel, *, global_batch: int, search: SyncSearch = SyncSearch(), seed: int = 0,
                      replicas: list[int] | None = None, clusters: list[list[int]] | None = None,
                      allreduce: str = "ring") -> tuple[DPPlacement, Candidate]:
    """Choose R, groups, cut and placement (as :func:`plan_dp_model`, step 2-4) and, per layout, shares, H,
    codec, delay and fragments (:func:`best_sync`), maximising the predicted samples/s of
    :func:`fusion.cost.dp.diloco_estimate`. The placement's ``predicted`` holds the DiLoCo figures and its
    ``info["dp_sync"]`` the chosen :class:`fusion.plan.DPSync` as a dict."""
    search.check()
    t0 = time.perf_counter()
    cluster = cm.cluster
    N = len(cluster)
    clusters, orders = device_orders(cluster, clusters, seed)
    traced = cm.samples_per_micro_batch
    M = global_batch // traced if isinstance(global_batch, int) and global_batch > 0 else 0
    counts = diloco_splits(global_batch, traced, N, replicas, search.shares)
    if replicas is None:  # one count per replica size N // R, the one that uses the most devices
        counts = sorted({N // R: R for R in counts}.values())
    base = replica_cost_model(cm, 1)

    def price(node_part: np.ndarray, devs: list[list[int]]):
        return best_sync(diloco_layout(base, node_part, devs, M, search.shares, search.recompute), search, allreduce)

    need = float(cm.p_state.sum())
    best: Candidate | None = None
    tried = 0
    for R in counts:
        rcm = replica_cost_model(cm, max(1, M // R))
        for groups, how in group_shapes(cluster, clusters, orders, R, need):
            found = _layouts(rcm, groups, seed, f"diloco/{how}", True, 1.0, allreduce, price)
            if search.recompute and not any(c.estimate.feasible for c in found):
                # cut again as if every stage recomputed: the cut search then sees the memory recomputation frees
                rcm.recompute_all = True
                found = _layouts(rcm, groups, seed, f"diloco/{how}+recompute", True, 1.0, allreduce, price)
                rcm.recompute_all = False
            for cand in found:
                tried += 1
                if best is None or cand.per_sample_to_loss < best.per_sample_to_loss:
                    best = cand
    if best is None or not best.estimate.feasible:
        raise DPPlanError(f"{cluster.source}: devices[].memory_bytes: no DiLoCo layout of {counts[0]} or more replicas "
                          "fits the devices' memory")
    best = connected(best, price=price)
    info = {"candidates": tried, "how": best.how, "seconds": round(time.perf_counter() - t0, 3),
            "clusters": len(clusters), "dp_sync": diloco_sync(best.estimate),
            "micro_batches": list(best.estimate.micro_batches), "codec": codec_label(best.estimate.codec),
            "recompute": [list(r) for r in best.estimate.recompute]}
    log.info("diloco planner: %d replicas x %d stages, H %d, %s, predicted %.4g samples/s (%s) in %.2f s",
             len(best.devices), len(best.devices[0]), best.estimate.inner_steps, codec_label(best.estimate.codec),
             best.estimate.samples_per_s, best.how, info["seconds"])
    pl = placement(best, "dp", info)
    # per replica n_r (info["micro_batches"]); the plan's one count is the equal split, or the mean
    pl.predicted["micro_batches"] = float(max(1, round(M / len(best.devices))))
    return pl, best


def diloco_sync(est) -> dict:
    """The :class:`fusion.plan.DPSync` (as a dict) of a priced DiLoCo estimate: DiLoCo's outer optimizer
    (Nesterov SGD, lr 0.7, momentum 0.9), error feedback with Top-K (SparseLoCo / DeMo), and the shares as
    rows per inner step when they are unequal."""
    from fusion.plan import DPSync

    rows = [n * (est.global_batch // sum(est.micro_batches)) for n in est.micro_batches]
    unit = None if est.codec is None else CODECS.unit(est.codec["algo"])
    outer = {} if unit is None or unit.outer_momentum is None else {"outer_momentum": unit.outer_momentum}
    sync = DPSync("diloco", est.inner_steps, codec=None if est.codec is None else dict(est.codec), **outer,
                  error_feedback=CODECS.error_feedback(est.codec), fragments=est.fragments,
                  delay=est.delay, shares={} if len(set(rows)) == 1 else {r: float(v) for r, v in enumerate(rows)})
    sync.check()
    return sync.to_dict()


def choose_dp_sync(cm: CostModel, *, global_batch: int, mode: str = "auto", search: SyncSearch = SyncSearch(),
                   seed: int = 0, replicas: list[int] | None = None, allreduce: str = "ring",
                   grad_wire_ratio: float = 1.0) -> tuple[DPPlacement, Candidate]:
    """``--dp-sync auto|diloco`` with ``--strategy dp``: the layout and sync the plan gets.

    mode ``diloco``: :func:`plan_diloco_model`. mode ``auto``: also plans synchronous DP (:func:`plan_dp_model`)
    and keeps it unless DiLoCo is predicted :data:`DILOCO_MARGIN` times faster. Either way the placement's
    ``predicted`` gains ``sync_dp_samples_per_s`` and ``diloco_over_sync_dp`` (when both were priced) and its
    ``info["dp_sync"]`` the chosen DPSync as a dict.
    Raises DPPlanError (one line) when no layout fits, the cluster has one device, or a knob is out of range.
    """
    if mode not in ("auto", "diloco"):
        raise DPPlanError(f"dp sync mode {mode!r}: the planner chooses for auto or diloco")
    if len(cm.cluster) < 2:
        raise DPPlanError(f"--dp-sync {mode}: {cm.cluster.source} has one device; data parallelism needs 2 or more")
    search.check()
    try:
        dl, dc = plan_diloco_model(cm, global_batch=global_batch, search=search, seed=seed, replicas=replicas,
                                   allreduce=allreduce)
    except DPPlanError:
        if mode == "diloco":
            raise
        dl = dc = None
    if mode == "diloco":
        return dl, dc
    sp, sc = plan_dp_model(cm, global_batch=global_batch, seed=seed, replicas=replicas, allreduce=allreduce,
                           grad_wire_ratio=grad_wire_ratio)
    sync_rate = sp.predicted["samples_per_s"]
    to_loss = None if dl is None else dc.estimate.samples_per_s_to_loss
    if dl is None or to_loss < DILOCO_MARGIN * sync_rate:
        sp.info["dp_sync"] = {"mode": "every"}
        if dl is not None:
            sp.predicted["diloco_samples_per_s"] = dl.predicted["samples_per_s"]
            sp.predicted["diloco_to_loss_over_sync_dp"] = to_loss / sync_rate
        return sp, sc
    dl.predicted["sync_dp_samples_per_s"] = sync_rate
    dl.predicted["diloco_over_sync_dp"] = dl.predicted["samples_per_s"] / sync_rate
    dl.predicted["diloco_to_loss_over_sync_dp"] = to_loss / sync_rate
    return dl, dc


__all__ = ["DPPlacement", "DPPlanError", "Candidate", "plan_dp", "plan_dp_model", "placement", "build_cost_model",
           "batch_splits", "groups_inside_clusters", "replicas_inside_clusters", "virtual_cluster", "replica_paths",
           "group_shapes", "SyncSearch", "best_sync", "diloco_splits", "plan_diloco_model", "diloco_sync",
           "choose_dp_sync", "DILOCO_MARGIN"]

"""The estimator: predicted time and memory of a partitioned OP-DAG (FusionLLM §3.5-3.6).

Notation (per micro-batch; part p runs on device d(p)):

- Eq. (1) ``T(f,p) = R(Pa(f)) + C(f,p) + W(f,p)`` with ``W = 0`` (local IO
  ignored, as in the paper) and ``R(Pa(f)) = sum over parents on other parts
  of T_comm^{d(Pa) d(p)}(M)``.
- Compute: ``C(f,p) = [(F_fwd + F_bwd)(f) / S*_p + (B_fwd + B_bwd)(f) / Bmem*_p] / lambda_p``
  with F the measured FLOPs and B the bytes of memory-bound operators
  (:mod:`fusion.cost.flops`), plus the fixed costs FLOPs do not capture, fitted by
  ``fusion profile`` per device (:mod:`fusion.cost.profile`; 0 when a cluster file
  has none): ``C_p = sum_{f in p} C(f,p) + n_p * o_node + m_p * o_msg`` with n_p the
  op nodes the part executes (placeholders and outputs run nothing), ``o_node`` the
  device's ``node_overhead_s``, m_p the messages the part sends or receives per
  micro-batch (one per cut tensor and consuming part and direction, as the runtime
  sends them) and ``o_msg`` its ``message_overhead_s``. A recomputing part adds its
  forward again: FLOPs, bytes and ``FORWARD_SHARE * n_p * o_node``.
- Measured node times (``fusion compile --node-times FILE``, :mod:`fusion.cost.node_times`,
  :meth:`CostModel.use_node_times`): a node timed on a host of fitted speed S_h costs
  ``C(f,p) = (t_fwd + t_bwd)(f) * S_h / S_p`` (S_p = lambda_p S*_p; the same speed: the measured time)
  instead of its FLOP, byte and ``o_node`` terms (a measured time holds its fixed cost); a recomputing
  part adds ``t_fwd * S_h / S_p``. Internally a timed node's FLOPs become ``t * S_h``, so every
  partitioner prices (and ``equal-flops`` balances) measured time; ``PartEstimate.flops`` stays FLOPs.
- Eq. (2), backward included: a tensor t (producer output, M_t bytes) made on
  part a and used on part b != a crosses once per (t, b), whatever the number
  of its users on b. Forward it costs ``alpha_ab + beta_ab M_t`` and counts in
  ``R_b`` (b retrieves it); if t requires grad its gradient costs
  ``alpha_ba + beta_ba M_t`` and counts in ``R_a``. So
  ``R_p = sum_{t into p} T_comm^{src->p}(M_t) + sum_{t out of p, grad} T_comm^{dst->p}(M_t)``.
  A compressed edge uses its wire bytes instead of M_t (:mod:`fusion.compress.adatopk`).
  With :class:`CodecPrices` set (``--compress CODEC``), every candidate cut is
  priced with the codec it would get: a direction costs
  ``min(alpha + beta M_t, alpha + beta W_t + M_t / rate)`` (W_t the codec's
  wire bytes, rate its encode + decode throughput), the rule by which
  :func:`fusion.compress.policy.choose` compresses an edge afterwards, so
  OP-Fence minimises the compressed iteration time (FusionLLM Eq. 5 with
  compression) instead of cutting for dense traffic.
- Eq. (3), backward included:
  ``T_pipe = sum_p (C_p + R_p) + (n_b - 1) * max_p max(C_p, R_p)``.
- Tied parameters held by several parts have their gradients summed after the
  pipeline drains: owners send to the first owner and get the sum back,
  ``T_sync = sum_params [max_o T_comm^{o->first}(P_o) + max_o T_comm^{first->o}(P_first)]``, P_o the bytes
  of owner o's gradient: dense, or for an embedding's the rows a step's ids touch, as values and indices
  (:mod:`fusion.cost.grad_rows`; the runtime sends it so, ``executors/runtime/exact_zeros.py``).
  With a tied codec (``Plan.tied_codec``, :func:`tied_prices`) P is the codec's
  wire bytes ``Codec.wire_nbytes`` of the parameter and each parameter adds its
  encode + decode seconds.
- Eq. (3) prices the pipeline only, and the paper's Eq. (4) divides by it alone
  (``phi = N_s / T(G)_{n_b,pipe}``, FusionLLM §3.6); an iteration also runs work before and
  after the pipeline that the paper's model leaves out, priced here from per-device costs fitted by ``fusion profile``
  (:mod:`fusion.cost.profile`; each 0 when a cluster file has none, so older files predict what
  they did):
  ``T_step = max_p o_step + sum_p n_b (k_p o_feed + I_p o_byte) + max_p P_p o_opt``, with
  ``o_step`` the device's ``step_overhead_s`` (the coordinator's ``step`` control out and ``done``
  back: one round trip per iteration, the parts' overlap), k_p and I_p the input and label
  placeholders on part p and the bytes they feed per micro-batch (the coordinator sends every
  micro-batch's share in the ``step`` message before the part can start), ``o_feed`` /
  ``o_byte`` the device's ``feed_overhead_s`` / ``feed_byte_s``, P_p the bytes of p's trainable
  parameters and ``o_opt`` the device's ``optimizer_byte_s`` for the plan's optimizer (the
  optimizer step and gradient zeroing each part runs after its last backward; the slowest one
  is priced, exact when the part that drains last has the largest step, as the first part of
  a GPipe or 1F1B pipeline does when the parameters are spread evenly).
- Iteration ``T_iter = T_pipe + T_sync + T_step`` (what the partitioners minimise; the compiler
  reports the plan's schedule simulated with these numbers instead, :func:`fusion.cost.schedules.simulate_estimate`,
  and keeps this as ``eq3_iteration_s``); Eq. (4) throughput
  ``phi = N_s / T_iter`` with ``N_s = n_b * (samples per micro-batch)``.
- Memory of part p: its parameters (each counted once per part) times
  ``1 + [trainable] (1 gradient + optimizer slots)`` (SGD with momentum 1,
  AdamW 2), plus saved activations times the micro-batches in flight (GPipe:
  n_b; 1F1B: ``min(n_b, depth_p + 1)``; interleaved: counted from the part's
  action list, :func:`interleaved_in_flight`, and a device holds the sum over
  its chunks, :func:`device_memory`), plus, for every cut edge into or out
  of p whose activations go as ``delta`` (AQ-SGD), that edge's buffer: one
  decoded activation per training sample, ``N_samples * M_t / n_mb`` bytes
  (n_mb samples per micro-batch), kept by the sender and by the receiver.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from fusion.cluster.model import Cluster
from fusion.cost.flops import NodeCost
from fusion.cost.grad_rows import node_grad_nbytes
from fusion.ir.boundary import edge_requires_grad
from fusion.ir.graph import OpGraph
from fusion.ir.node import IDLE_KINDS, PLACEHOLDER_KINDS, NodeKind, TensorMeta


#: the share of a node's fixed cost (``node_overhead_s``, forward + backward) that is its forward: 0.39
#: measured by timing the profiler's op chains with and without backward on the 2-core CPU host
FORWARD_SHARE = 0.4


@dataclass
class CodecPrices:
    """What the candidate codecs cost on each tensor of a :class:`CostModel` (column t as ``t_key``).

    Each direction has K candidates (rows; ``--compress CODEC`` gives one, ``--compress auto`` the
    table of :mod:`fusion.compress.policy`); each direction of each cut edge takes the candidate with
    the shortest priced transfer, or none where dense is faster.

    fwd_wire, bwd_wire: (K, n) bytes on the wire of the activation / its gradient under each candidate
                        (``inf`` where a candidate does not apply: not a float tensor, no sample rows for
                        ``delta``, or no codec asked for that direction). 1-D arrays are one candidate.
    fwd_s, bwd_s:       (K, n) seconds of encode + decode of one message (dense bytes / codec rate).
    fwd_mem:            (K, n) bytes that each END of a cut edge keeps for a candidate (``delta``'s
                        AQ-SGD buffers: data-set samples x per-sample activation bytes); None: none keeps any.
    fwd_cfgs, bwd_cfgs: the K codec cfgs of each direction (what the plan records for a chosen row).
    fallback:           where a part would not fit its device with the buffers of its edges' chosen
                        candidates, those edges take their best candidate that keeps none (``auto``);
                        False: the part does not fit (an explicit ``--compress delta``).
    """

    fwd_wire: np.ndarray
    fwd_s: np.ndarray
    bwd_wire: np.ndarray
    bwd_s: np.ndarray
    fwd_mem: np.ndarray | None = None
    fwd_cfgs: list = field(default_factory=list)
    bwd_cfgs: list = field(default_factory=list)
    fallback: bool = False

    def __post_init__(self) -> None:
        for k in ("fwd_wire", "fwd_s", "bwd_wire", "bwd_s"):
            setattr(self, k, np.atleast_2d(np.asarray(getattr(self, k), dtype=float)))
        self.fwd_mem = (np.zeros_like(self.fwd_wire) if self.fwd_mem is None
                        else np.atleast_2d(np.asarray(self.fwd_mem, dtype=float)))


@dataclass
class PartEstimate:
    """Predictions for one part, seconds per micro-batch (fwd + bwd)."""

    device: str
    compute_s: float
    comm_s: float
    comm_fwd_s: float
    comm_bwd_s: float
    flops: float
    memory_bytes: float
    param_state_bytes: float
    activation_bytes: float
    in_flight: int
    memory_limit: float
    delta_buffer_bytes: float = 0.0  # AQ-SGD buffers of the part's delta edges (both roles), in memory_bytes
    optimizer_s: float = 0.0  # P_p * o_opt, its optimizer step per iteration (in Estimate.step_s when the slowest)


@dataclass
class LinkEstimate:
    """Traffic from part ``src`` to part ``dst`` per micro-batch (activations;
    the gradients go back on the reverse device link)."""

    src: int
    dst: int
    tensors: int
    fwd_bytes: float
    bwd_bytes: float
    fwd_s: float
    bwd_s: float


@dataclass
class Estimate:
    parts: list[PartEstimate]
    links: list[LinkEstimate]
    pipeline_s: float
    sync_s: float
    iteration_s: float
    throughput: float
    violations: list[str] = field(default_factory=list)
    #: (tensor, src part, dst part) -> (fwd, bwd) row of :class:`CodecPrices` each direction of a cut edge
    #: takes (-1: dense); only when priced with codecs
    codecs: dict[tuple[int, int, int], tuple[int, int]] = field(default_factory=dict)
    #: T_step: the iteration's work outside the pipeline (control round trip, feeds, optimizer step), in iteration_s
    step_s: float = 0.0

    @property
    def feasible(self) -> bool:
        return not self.violations


@dataclass
class CostModel:
    """A graph, its node costs and a cluster as flat arrays; built once per compile."""

    graph: OpGraph
    cluster: Cluster
    names: list[str]
    index: dict[str, int]
    flops: np.ndarray  # F_fwd + F_bwd per node
    mem: np.ndarray  # memory-bound bytes, fwd + bwd
    saved: np.ndarray  # saved activation bytes per micro-batch
    t_key: list[tuple[str, int | None]]  # tensors that some node consumes
    t_prod: np.ndarray
    t_bytes: np.ndarray
    t_rg: np.ndarray
    e_t: np.ndarray  # one row per (tensor, consumer node)
    e_cons: np.ndarray
    pn_param: np.ndarray  # parameter-node incidence
    pn_node: np.ndarray
    p_names: list[str]
    p_state: np.ndarray  # bytes per parameter incl. gradient and optimizer slots
    p_bytes: np.ndarray
    p_trainable: np.ndarray
    micro_batches: int
    schedule: str
    samples_per_micro_batch: int
    fwd_flops: np.ndarray | None = None  # F_fwd per node (the forward a recomputing part runs twice)
    fwd_mem: np.ndarray | None = None  # memory-bound bytes of the forward per node
    input_bytes: np.ndarray | None = None  # bytes a placeholder node feeds per micro-batch (0 for other nodes)
    recompute_all: bool = False  # price every part as recomputing its activations (see :meth:`evaluate`)
    optimizer_slots: int = 0  # state tensors per trainable parameter: picks the device's optimizer_byte_s entry
    #: nodes priced by measured seconds (:meth:`use_node_times`; None: none): their ``flops``/``fwd_flops`` hold
    #: seconds x the profiling host's speed, their ``mem``/``fwd_mem`` 0, and they pay no ``node_overhead``
    timed: np.ndarray | None = None
    op_flops: np.ndarray | None = None  # the counted FLOPs per node when ``flops`` holds measured time (reports)
    #: nodes whose float32 outputs bfloat16 autocast makes bfloat16 (``--precision bf16``,
    #: :func:`fusion.cost.autocast.with_precision`): their tensors are priced at 2 bytes an element
    bf16: frozenset = frozenset()
    speed: np.ndarray = field(init=False)
    mem_speed: np.ndarray = field(init=False)
    mem_cap: np.ndarray = field(init=False)
    #: whether node i pays the per-node fixed cost ``node_overhead``: it runs an op (not a placeholder or an
    #: output) and has no measured time (a measured time holds that cost already)
    executes: np.ndarray = field(init=False)
    node_overhead: np.ndarray = field(init=False)  # o_node per device, seconds per node per micro-batch
    message_overhead: np.ndarray = field(init=False)  # o_msg per device, seconds per message
    step_overhead: np.ndarray = field(init=False)  # o_step per device, seconds per iteration
    feed_overhead: np.ndarray = field(init=False)  # o_feed per device, seconds per fed array
    feed_byte: np.ndarray = field(init=False)  # o_byte per device, seconds per fed byte
    optimizer_byte: np.ndarray = field(init=False)  # o_opt per device, seconds per trainable parameter byte
    fed: np.ndarray = field(init=False)  # whether node i is an input or label placeholder (fed by the coordinator)
    #: set by the compiler for ``--compress CODEC``: :meth:`evaluate` then prices cut edges with the codec
    codec_prices: CodecPrices | None = field(default=None, init=False)
    #: set by the compiler for ``--tied-codec``: bytes on the wire of each parameter's gradient under the
    #: codec (None: ``p_bytes``, dense) and seconds of its encode + decode per step (:func:`tied_prices`)
    tied_wire: np.ndarray | None = field(default=None, init=False)
    tied_codec_s: np.ndarray | None = field(default=None, init=False)
    #: (parameter-node row, micro-batches) -> that node's share of the tied gradient's wire bytes (a cache)
    _grad_nbytes: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self.speed = np.array([d.peak_flops for d in self.cluster.devices]) * np.array([d.lam for d in self.cluster.devices])
        self.mem_speed = np.array([d.memory_speed for d in self.cluster.devices])
        self.mem_cap = np.array([d.memory_bytes for d in self.cluster.devices])
        self.node_overhead = np.array([d.node_overhead_s for d in self.cluster.devices], dtype=float)
        self.message_overhead = np.array([d.message_overhead_s for d in self.cluster.devices], dtype=float)
        devs = self.cluster.devices
        self.step_overhead = np.array([d.step_overhead_s for d in devs], dtype=float)
        self.feed_overhead = np.array([d.feed_overhead_s for d in devs], dtype=float)
        self.feed_byte = np.array([d.feed_byte_s for d in devs], dtype=float)
        kind = min(max(int(self.optimizer_slots), 0), 2)
        self.optimizer_byte = np.array([d.optimizer_byte_s[kind] for d in devs], dtype=float)
        self.executes = self._runs_op() if self.timed is None else self._runs_op() & ~self.timed
        self.fed = np.array([self.graph[n].kind in PLACEHOLDER_KINDS for n in self.names], dtype=bool)

    # -- construction ------------------------------------------------------------
    @classmethod
    def build(cls, graph: OpGraph, costs: Mapping[str, NodeCost], cluster: Cluster, micro_batches: int = 1,
              schedule: str = "gpipe", optimizer_slots: int = 0, samples_per_micro_batch: int = 1) -> "CostModel":
        """optimizer_slots: state tensors per trainable parameter (SGD 0, SGD+momentum 1, AdamW 2)."""
        names = list(graph.nodes)
        index = {n: i for i, n in enumerate(names)}
        get = [costs.get(n, NodeCost()) for n in names]
        flops = np.array([c.flops_fwd + c.flops_bwd for c in get], dtype=float)
        mem = np.array([c.mem_fwd + c.mem_bwd for c in get], dtype=float)
        saved = np.array([c.saved_bytes for c in get], dtype=float)
        t_index: dict[tuple[str, int | None], int] = {}
        t_key, t_prod, t_bytes, t_rg, e_t, e_cons = [], [], [], [], [], []
        for node in graph.nodes.values():
            for ref in dict.fromkeys(node.refs()):
                key = (ref.node, ref.index)
                if key not in t_index:
                    t_index[key] = len(t_key)
                    t_key.append(key)
                    t_prod.append(index[ref.node])
                    t_bytes.append(tensor_bytes(graph, ref.node, ref.index))
                    t_rg.append(edge_requires_grad(graph, ref.node, ref.index))
                e_t.append(t_index[key])
                e_cons.append(index[node.name])
        p_names = list(graph.params)
        p_idx = {p: i for i, p in enumerate(p_names)}
        pn_param, pn_node = [], []
        for node in graph.nodes.values():
            for p in node.param_names():
                pn_param.append(p_idx[p])
                pn_node.append(index[node.name])
        specs = [graph.params[p] for p in p_names]
        p_bytes = np.array([s.nbytes for s in specs], dtype=float)
        p_train = np.array([s.trainable for s in specs], dtype=bool)
        p_state = p_bytes * (1.0 + p_train * (1.0 + optimizer_slots))
        ia = lambda v: np.array(v, dtype=np.int64)  # noqa: E731
        fwd_flops = np.array([c.flops_fwd for c in get], dtype=float)
        fwd_mem = np.array([c.mem_fwd for c in get], dtype=float)
        input_bytes = np.array([tensor_bytes(graph, n, None) if graph[n].kind in PLACEHOLDER_KINDS else 0.0
                                for n in names], dtype=float)
        return cls(graph, cluster, names, index, flops, mem, saved, t_key, ia(t_prod), np.array(t_bytes, dtype=float),
                   np.array(t_rg, dtype=bool), ia(e_t), ia(e_cons), ia(pn_param), ia(pn_node), p_names, p_state,
                   p_bytes, p_train, micro_batches, schedule, samples_per_micro_batch, fwd_flops, fwd_mem, input_bytes,
                   optimizer_slots=optimizer_slots)

    def variant(self, **changes: Any) -> "CostModel":
        """This model with ``changes`` (any field, ``init=False`` ones too: ``codec_prices``, ``tied_wire``,
        ``tied_codec_s``; ``schedule``, ``recompute_all``): how the compiler prices with other inputs instead of
        setting and restoring fields of a shared model. A shallow copy: the arrays are shared (never written in
        place; :meth:`use_node_times` replaces them)."""
        bad = [k for k in changes if k not in self.__dataclass_fields__]
        if bad:
            raise TypeError(f"CostModel has no field {bad[0]!r}")
        out = copy.copy(self)
        for k, v in changes.items():
            setattr(out, k, v)
        return out

    def with_cluster(self, cluster: Cluster) -> "CostModel":
        kw = {k: getattr(self, k) for k in self.__dataclass_fields__ if self.__dataclass_fields__[k].init}
        kw["cluster"] = cluster
        return CostModel(**kw)

    def _runs_op(self) -> np.ndarray:
        """Whether node i runs an op (is not a placeholder or the output marker)."""
        return np.array([self.graph[n].kind not in IDLE_KINDS for n in self.names], dtype=bool)

    def use_node_times(self, fwd_s, bwd_s, timed, host_speed: float) -> None:
        """Price the nodes where ``timed`` holds by measured seconds (forward ``fwd_s``, backward ``bwd_s``, per
        node index, one micro-batch) taken on a host of speed ``host_speed`` (FLOP/s): on device d such a node
        costs ``(fwd_s + bwd_s) * host_speed / speed[d]``, its forward share ``fwd_s * host_speed / speed[d]``
        (recomputation, the schedule simulation), with no FLOP, byte or per-node overhead term. Placeholders
        and outputs stay untimed."""
        if not host_speed > 0:
            raise ValueError(f"host_speed must be > 0, got {host_speed!r}")
        runs = self._runs_op()
        timed = np.asarray(timed, dtype=bool) & runs
        fwd, bwd = np.asarray(fwd_s, dtype=float), np.asarray(bwd_s, dtype=float)
        if self.op_flops is None:
            self.op_flops = self.flops.copy()
        self.flops = np.where(timed, (fwd + bwd) * host_speed, self.flops)
        self.fwd_flops = np.where(timed, fwd * host_speed, self.fwd_flops)
        self.mem = np.where(timed, 0.0, self.mem)
        self.fwd_mem = np.where(timed, 0.0, self.fwd_mem)
        self.timed = timed if self.timed is None else (self.timed | timed)
        self.executes = runs & ~self.timed

    # -- Eq. (1) ------------------------------------------------------------------
    def compute_time(self, node: int, device: int) -> float:
        """C(f, p) for node index ``node`` on device index ``device`` (fwd + bwd), its fixed cost included."""
        return float(self.flops[node] / self.speed[device] + self.mem[node] / self.mem_speed[device]
                     + self.executes[node] * self.node_overhead[device])

    def op_time(self, node: int, node_part: np.ndarray, part_device: np.ndarray) -> float:
        """Eq. (1): T(f,p) = R(Pa(f)) + C(f,p) + W(f,p), W = 0; forward retrieval of remote parents."""
        p = int(node_part[node])
        d = int(part_device[p])
        r = 0.0
        for t in np.unique(self.e_t[self.e_cons == node]):
            q = int(node_part[self.t_prod[t]])
            if q != p:
                r += self.cluster.comm_time(int(part_device[q]), d, float(self.t_bytes[t]))
        return r + self.compute_time(node, d)

    # -- Eq. (2)-(4) and memory -------------------------------------------------------
    def evaluate(self, node_part: np.ndarray, part_device: np.ndarray,
                 wire: Mapping[tuple[int, int, int], tuple[float, float]] | None = None, detail: bool = True,
                 recompute: np.ndarray | None = None, priced: bool = True, prices: CodecPrices | None = None):
        """Estimate an assignment. ``node_part[i]``: part of node i; ``part_device[p]``: device index of part p.

        wire: optional (tensor, src part, dst part) -> (fwd bytes, bwd bytes) on the wire (compression).
        recompute: optional bool per part: the part keeps only its inputs per micro-batch in flight and
            runs its forward again in backward (activation recomputation). Its Eq. (1) compute time gains
            the forward's time, and its activation memory becomes inputs x in-flight + one micro-batch's
            saved activations (those of the forward being recomputed). None: ``recompute_all`` for all.
        priced: use :attr:`codec_prices` when set and no ``wire`` is given (False: the dense estimate).
        prices: price with these candidate codecs instead of :attr:`codec_prices` (what
            :func:`fusion.compress.policy.choose` reads the chosen codecs from, :attr:`Estimate.codecs`).
        Memory: a cut edge whose activation takes a candidate that keeps buffers (``delta``, AQ-SGD) adds
            ``CodecPrices.fwd_mem`` to both its sender's and its receiver's memory.
        Returns an :class:`Estimate` (``detail=False``: just ``(iteration_s, feasible)``).
        """
        node_part = np.asarray(node_part, dtype=np.int64)
        dev = np.asarray(part_device, dtype=np.int64)
        n_parts = len(dev)
        rc = np.full(n_parts, self.recompute_all) if recompute is None else np.asarray(recompute, dtype=bool)
        comp = np.bincount(node_part, weights=self.flops, minlength=n_parts) / self.speed[dev] \
            + np.bincount(node_part, weights=self.mem, minlength=n_parts) / self.mem_speed[dev]
        n_exec = np.bincount(node_part, weights=self.executes, minlength=n_parts)
        comp = comp + n_exec * self.node_overhead[dev]
        flops_p = np.bincount(node_part, weights=self.flops if self.op_flops is None else self.op_flops,
                              minlength=n_parts)
        if rc.any():
            fwd = (np.bincount(node_part, weights=self.fwd_flops, minlength=n_parts) / self.speed[dev]
                   + np.bincount(node_part, weights=self.fwd_mem, minlength=n_parts) / self.mem_speed[dev]
                   + FORWARD_SHARE * n_exec * self.node_overhead[dev])
            comp = comp + np.where(rc, fwd, 0.0)
        src = node_part[self.t_prod[self.e_t]]
        dst = node_part[self.e_cons]
        cut = src != dst
        pair = np.unique(self.e_t[cut] * n_parts + dst[cut])
        pt, pdst = pair // n_parts, pair % n_parts
        psrc = node_part[self.t_prod[pt]]
        if self.message_overhead.any():  # each cut (tensor, consumer part): one message forward, one gradient back
            per_pair = 1.0 + self.t_rg[pt]
            n_msg = np.bincount(psrc, weights=per_pair, minlength=n_parts) + np.bincount(pdst, weights=per_pair,
                                                                                        minlength=n_parts)
            comp = comp + n_msg * self.message_overhead[dev]
        fb = self.t_bytes[pt].copy()
        bb = np.where(self.t_rg[pt], fb, 0.0)
        if wire:
            for k, (t, a, b) in enumerate(zip(pt.tolist(), psrc.tolist(), pdst.tolist())):
                w = wire.get((t, a, b))
                if w is not None:
                    fb[k] = w[0]
                    if self.t_rg[t]:
                        bb[k] = w[1]
        ds, dd = dev[psrc], dev[pdst]
        alpha, beta = self.cluster.alpha, self.cluster.beta
        f_s = alpha[ds, dd] + beta[ds, dd] * fb
        b_s = np.where(self.t_rg[pt], alpha[dd, ds] + beta[dd, ds] * bb, 0.0)
        # memory without codec buffers
        pp = np.unique(self.pn_param * n_parts + node_part[self.pn_node])
        par, ppart = pp // n_parts, pp % n_parts
        state = np.bincount(ppart, weights=self.p_state[par], minlength=n_parts)
        acts = np.bincount(node_part, weights=self.saved, minlength=n_parts)
        inflight = self.in_flight(n_parts, psrc, pdst, dev)
        memory = state + acts * inflight
        if rc.any():  # a recomputing part holds its inputs (received dense, or fed) per micro-batch in flight
            held = np.bincount(pdst, weights=self.t_bytes[pt], minlength=n_parts) \
                + np.bincount(node_part, weights=self.input_bytes, minlength=n_parts)
            memory = np.where(rc, state + held * inflight + acts, memory)
        cap = self.mem_cap[dev]
        cp = prices if prices is not None else (self.codec_prices if priced and not wire else None)
        buf, em = np.zeros(n_parts), np.zeros(len(pt))  # buffer bytes per part, per cut edge and end
        f_pick = b_pick = None
        if cp is not None:  # each direction of each cut edge: its fastest candidate codec where that beats dense
            f_pick, f_s, fb, em = _pick(cp.fwd_wire[:, pt], cp.fwd_s[:, pt], cp.fwd_mem[:, pt], alpha[ds, dd],
                                        beta[ds, dd], f_s, fb, np.ones(len(pt), dtype=bool))
            buf = np.bincount(psrc, weights=em, minlength=n_parts) + np.bincount(pdst, weights=em, minlength=n_parts)
            over = memory + buf > cap
            if cp.fallback and (over & (buf > 0)).any():  # auto: such parts' edges keep no buffers
                hit = (em > 0) & (over[psrc] | over[pdst])
                no_buf = np.where(cp.fwd_mem[:, pt] > 0, np.inf, cp.fwd_wire[:, pt])
                g_pick, g_s, g_b, _ = _pick(no_buf, cp.fwd_s[:, pt], cp.fwd_mem[:, pt], alpha[ds, dd], beta[ds, dd],
                                            alpha[ds, dd] + beta[ds, dd] * self.t_bytes[pt], self.t_bytes[pt].copy(),
                                            np.ones(len(pt), dtype=bool))
                f_pick, f_s, fb = np.where(hit, g_pick, f_pick), np.where(hit, g_s, f_s), np.where(hit, g_b, fb)
                em = np.where(hit, 0.0, em)
                buf = np.bincount(psrc, weights=em, minlength=n_parts) + np.bincount(pdst, weights=em, minlength=n_parts)
            b_pick, b_s, bb, _ = _pick(cp.bwd_wire[:, pt], cp.bwd_s[:, pt], np.zeros_like(cp.bwd_wire[:, pt]),
                                       alpha[dd, ds], beta[dd, ds], b_s, bb, self.t_rg[pt])
        memory = memory + buf
        r_fwd = np.bincount(pdst, weights=f_s, minlength=n_parts)
        r_bwd = np.bincount(psrc, weights=b_s, minlength=n_parts)
        comm = r_fwd + r_bwd
        n_b = self.micro_batches
        pipe = float(np.sum(comp + comm) + (n_b - 1) * np.max(np.maximum(comp, comm)))
        if self.schedule == "interleaved":
            pipe = interleaved_pipeline(comp, comm, dev, n_b)
        # tied-parameter gradient sync
        sync = 0.0
        if len(par):
            owners = np.bincount(par, minlength=len(self.p_names))
            for q in np.nonzero((owners > 1) & self.p_trainable)[0]:
                holders = sorted(set(ppart[par == q].tolist()))
                first, others = dev[holders[0]], dev[holders[1:]]
                if self.tied_wire is None:  # dense: each owner's own gradient (an embedding's: its rows)
                    nb = np.array([self.tied_grad_nbytes(q, node_part, h) for h in holders])
                    nb_first, nb_others = nb[0], nb[1:]
                else:
                    nb_first = nb_others = self.tied_wire[q]
                sync += float(np.max(alpha[others, first] + beta[others, first] * nb_others))
                sync += float(np.max(alpha[first, others] + beta[first, others] * nb_first))
                if self.tied_codec_s is not None:
                    sync += float(self.tied_codec_s[q])
        opt, step = self.step_time(node_part, dev, par, ppart)
        total = pipe + sync + step
        over = memory > cap
        if self.schedule == "interleaved":  # a device holds all its chunks: their sum against its memory
            over = device_memory(memory, dev)[dev] > cap
        if not detail:
            return total, not bool(over.any())
        names = [d.name for d in self.cluster.devices]
        parts = [PartEstimate(names[dev[p]], float(comp[p]), float(comm[p]), float(r_fwd[p]), float(r_bwd[p]),
                              float(flops_p[p]), float(memory[p]), float(state[p]), float(acts[p]),
                              int(inflight[p]), float(cap[p]), float(buf[p]), float(opt[p])) for p in range(n_parts)]
        links: dict[tuple[int, int], LinkEstimate] = {}
        for k in range(len(pt)):
            key = (int(psrc[k]), int(pdst[k]))
            le = links.setdefault(key, LinkEstimate(key[0], key[1], 0, 0.0, 0.0, 0.0, 0.0))
            le.tensors += 1
            le.fwd_bytes += float(fb[k])
            le.bwd_bytes += float(bb[k])
            le.fwd_s += float(f_s[k])
            le.bwd_s += float(b_s[k])
        violations = [f"part {p} on {names[dev[p]]} needs {memory[p] / 1e9:.3f} GB > {cap[p] / 1e9:.3f} GB"
                      + (self._buffer_note(p, pt, psrc, pdst, em) if buf[p] > 0 else "")
                      for p in np.nonzero(over)[0]]
        if self.schedule == "interleaved":
            dm = device_memory(memory, dev)
            violations = [f"parts {', '.join(str(q) for q in np.nonzero(dev == d)[0])} (virtual stages) on {names[d]} "
                          f"need {dm[d] / 1e9:.3f} GB together > {self.mem_cap[d] / 1e9:.3f} GB"
                          for d in sorted(set(dev[over].tolist()))]
        n_s = n_b * self.samples_per_micro_batch
        codecs = {} if f_pick is None else {
            (int(t), int(a), int(b)): (int(f), int(g))
            for t, a, b, f, g in zip(pt, psrc, pdst, f_pick, b_pick) if f >= 0 or g >= 0}
        return Estimate(parts, sorted(links.values(), key=lambda e: (e.src, e.dst)), pipe, sync, total,
                        n_s / total if total > 0 else float("inf"), violations, codecs, step)

    def tied_grad_nbytes(self, q: int, node_part: np.ndarray, part: int) -> float:
        """Wire bytes of part ``part``'s gradient of parameter ``q`` without a tied codec: the sum over its nodes
        that use ``q`` (an embedding's nonzero rows, :func:`fusion.cost.grad_rows.node_grad_nbytes`), at most dense."""
        total = 0.0
        for i in np.nonzero((self.pn_param == q) & (node_part[self.pn_node] == part))[0]:
            key = (int(i), self.micro_batches)
            if key not in self._grad_nbytes:
                node = self.graph.nodes[self.names[int(self.pn_node[i])]]
                self._grad_nbytes[key] = node_grad_nbytes(self.graph, node, self.p_names[q], self.micro_batches)
            total += self._grad_nbytes[key]
        return min(total, float(self.p_bytes[q]))

    def step_time(self, node_part: np.ndarray, dev: np.ndarray, par: np.ndarray,
                  ppart: np.ndarray) -> tuple[np.ndarray, float]:
        """(optimizer step per part, T_step): the iteration's work outside the pipeline (module docstring).

        par, ppart: one row per (parameter, part holding it), as :meth:`evaluate` builds them."""
        n_parts = len(dev)
        opt = np.zeros(n_parts)
        if len(par) and self.optimizer_byte.any():
            trainable = np.bincount(ppart, weights=self.p_bytes[par] * self.p_trainable[par], minlength=n_parts)
            opt = trainable * self.optimizer_byte[dev]
        step = float(np.max(self.step_overhead[dev]) + np.max(opt))
        if self.feed_overhead.any() or self.feed_byte.any():
            n_b = self.micro_batches
            arrays = np.bincount(node_part, weights=self.fed, minlength=n_parts) * n_b
            fed_bytes = self.input_bytes if self.input_bytes is not None else np.zeros(len(self.names))
            nbytes = np.bincount(node_part, weights=fed_bytes, minlength=n_parts) * n_b
            step += float(np.sum(arrays * self.feed_overhead[dev] + nbytes * self.feed_byte[dev]))
        return opt, step

    def _buffer_note(self, p: int, pt, psrc, pdst, em) -> str:
        """`` (of which 1.6 GB delta (AQ-SGD) buffers: add_2 -> part 2, ...)`` for a part over its memory."""
        mine = [(float(em[k]), self.t_key[int(pt[k])][0], "->" if psrc[k] == p else "<-",
                 int(pdst[k] if psrc[k] == p else psrc[k])) for k in range(len(pt))
                if em[k] > 0 and p in (psrc[k], pdst[k])]
        total = sum(m[0] for m in mine)
        listed = ", ".join(f"{name} {arrow} part {q} {b / 1e9:.3f} GB" for b, name, arrow, q in sorted(mine, reverse=True)[:3])
        return (f" (of which {total / 1e9:.3f} GB are delta (AQ-SGD) buffers, one activation per training sample: "
                f"{listed}{', ...' if len(mine) > 3 else ''})")

    def in_flight(self, n_parts: int, psrc: np.ndarray, pdst: np.ndarray, dev: np.ndarray | None = None) -> np.ndarray:
        """Micro-batches whose activations a part holds at once (GPipe: all; 1F1B: depth + 1; zb1: depth + 1
        plus up to depth deferred weight gradients, counted in full; interleaved: counted from each part's
        projection of its device's action list, :func:`interleaved_in_flight`, which needs ``dev``)."""
        n_b = self.micro_batches
        if self.schedule == "interleaved":
            return interleaved_in_flight(n_parts, dev, n_b)
        if self.schedule not in ("1f1b", "zb1") or n_parts == 1:
            return np.full(n_parts, n_b)
        succ: dict[int, set[int]] = {p: set() for p in range(n_parts)}
        indeg = np.zeros(n_parts, dtype=int)
        for a, b in set(zip(psrc.tolist(), pdst.tolist())):
            if b not in succ[a]:
                succ[a].add(b)
                indeg[b] += 1
        order, ready = [], [p for p in range(n_parts) if indeg[p] == 0]
        while ready:
            p = ready.pop()
            order.append(p)
            for s in succ[p]:
                indeg[s] -= 1
                if indeg[s] == 0:
                    ready.append(s)
        depth = np.zeros(n_parts, dtype=int)
        for p in reversed(order):
            depth[p] = 1 + max((depth[s] for s in succ[p]), default=-1)
        return np.minimum(n_b, depth + 1 + (depth if self.schedule == "zb1" else 0))


def interleaved_in_flight(n_parts: int, part_device: np.ndarray, n_micro: int) -> np.ndarray:
    """Per part (parts indexed in pipeline order, part s on device ``part_device[s]``, round-robin): the
    most forwards it has run whose backward has not, in its projection of its device's interleaved 1F1B
    action list (:func:`fusion.ir.schedule.make_schedule`). A chunk early in the chain warms up with more
    forwards than one late in it (Megatron-LM's order), so the counts differ per chunk."""
    from fusion.ir.schedule import ActionKind, make_schedule

    order = list(range(n_parts))
    acts = make_schedule("interleaved", order, {(p, p + 1): None for p in order[:-1]}, n_micro,
                         {p: int(part_device[p]) for p in order})
    out = np.zeros(n_parts, dtype=int)
    for p in order:
        live = 0
        for a in acts[p]:
            live += 1 if a.kind == ActionKind.F else -1 if a.kind == ActionKind.B else 0
            out[p] = max(out[p], live)
    return out


def device_memory(memory: np.ndarray, part_device: np.ndarray) -> np.ndarray:
    """Bytes per device index: the sum of its parts' memory (the chunks of an interleaved device)."""
    dev = np.asarray(part_device, dtype=np.int64)
    return np.bincount(dev, weights=memory, minlength=int(dev.max()) + 1 if len(dev) else 0)


def interleaved_pipeline(comp: np.ndarray, comm: np.ndarray, part_device: np.ndarray, n_micro: int) -> float:
    """Eq. (3) for interleaved 1F1B with V chunks per device: the fill and drain go through one chunk per
    device, ``T_pipe = sum_p (C_p + R_p) / V + (n_b - 1 / V) * max_d sum_{p on d} max(C_p, R_p)``.
    With V = 1 this is Eq. (3); with equal chunks (c per chunk, t = V c per device) it is Megatron-LM's
    ``(n_b + (D - 1) / V) t`` (Narayanan et al. 2021, Sec. 2.2)."""
    dev = np.asarray(part_device, dtype=np.int64)
    v = len(dev) / max(len(set(dev.tolist())), 1)
    per_device = np.bincount(dev, weights=np.maximum(comp, comm))
    return float(np.sum(comp + comm) / v + (n_micro - 1 / v) * per_device.max())


def _pick(wire: np.ndarray, secs: np.ndarray, mem: np.ndarray, alpha: np.ndarray, beta: np.ndarray,
          dense_s: np.ndarray, dense_b: np.ndarray, mask: np.ndarray):
    """For each cut edge (column) the candidate row with the shortest priced transfer
    ``alpha + beta * W + s`` (Eq. 2 with the codec's wire bytes W and encode + decode seconds s), taken
    where ``mask`` holds and it beats the dense time. Returns (row or -1, seconds, wire bytes, buffer
    bytes per end)."""
    with np.errstate(invalid="ignore"):
        c = alpha + beta * wire + secs
    c = np.where(np.isnan(c), np.inf, c)
    k = np.argmin(c, axis=0)
    cols = np.arange(c.shape[1])
    best = c[k, cols]
    use = mask & (best < dense_s)
    return (np.where(use, k, -1), np.where(use, best, dense_s), np.where(use, wire[k, cols], dense_b),
            np.where(use, mem[k, cols], 0.0))


def tied_prices(cm: CostModel, cfg: dict | None, rate_bytes_s: float) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(:attr:`CostModel.tied_wire`, :attr:`CostModel.tied_codec_s`) under the tied codec ``cfg`` (None: dense).

    Each parameter's gradient costs ``Codec.wire_nbytes(numel, dtype, cfg)`` bytes on the wire (float
    parameters; others stay dense) and ``P / rate_bytes_s`` seconds to encode and decode (``rate_bytes_s``:
    dense bytes per second through the codec, its ``rate``: ``fusion.kernels.codecs.CODECS.rate``)."""
    if cfg is None:
        return None, None
    from fusion.kernels.codec import CODECS

    codec = CODECS.get(cfg["algo"])
    wire = cm.p_bytes.copy()
    secs = np.zeros_like(cm.p_bytes)
    for q, name in enumerate(cm.p_names):
        spec = cm.graph.params[name]
        if str(spec.dtype).startswith(("float", "bfloat")) and cm.p_bytes[q] > 0:
            wire[q] = float(codec.wire_nbytes(int(np.prod(spec.shape, dtype=np.int64)), str(spec.dtype), cfg))
            secs[q] = cm.p_bytes[q] / rate_bytes_s
    return wire, secs


def tensor_bytes(graph: OpGraph, producer: str, index: int | None) -> float:
    """M_t: bytes of output ``index`` of ``producer`` (all outputs when None); 0 for non-tensors."""
    node = graph[producer]
    outs = node.meta.outputs
    if index is None:
        return float(sum(o.nbytes for o in outs if isinstance(o, TensorMeta)))
    o = outs[index] if index < len(outs) else None
    return float(o.nbytes) if isinstance(o, TensorMeta) else 0.0


def optimizer_slots(name: str, momentum: float = 0.0) -> int:
    """Optimizer state tensors per trainable parameter (muon: 2, an upper bound: its matrices keep 1, the momentum
    buffer, its AdamW group 2)."""
    if name in ("adamw", "muon"):
        return 2
    return 1 if momentum else 0


def samples_per_micro_batch(graph: OpGraph) -> int:
    """Batch size of one micro-batch: dim 0 of the first input placeholder (1 if unknown)."""
    for n in graph.placeholders(NodeKind.INPUT) or graph.placeholders():
        outs = n.meta.outputs
        if outs and isinstance(outs[0], TensorMeta) and outs[0].shape:
            return int(outs[0].shape[0])
    return 1

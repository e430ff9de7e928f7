"""Plan: the one contract between compile time and run time (the plan format both import).

A plan is a directory::

    plan.json         graph, cluster, assignment, compression, schedule, optimizer,
                      seed, predictions (format "fusion.plan", versioned)
    weights.safetensors   initial parameter values (optional: absent for meta plans)

No pickle anywhere. An executor needs the plan, its part name and nothing else.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fusion.ir.errors import FusionError, GraphError
from fusion.ir.files import atomic_write, remove_stale_tmp
from fusion.ir.registry import check_targets
from fusion.ir.graph import OpGraph
from fusion.ir.serialize import graph_from_dict, graph_to_dict

PLAN_FORMAT = "fusion.plan"
PLAN_VERSION = 1


#: the micro-batch schedules an executor knows (``fusion.executors.runtime.schedule.SCHEDULES``; a test keeps them equal)
SCHEDULE_NAMES = ("gpipe", "1f1b", "zb1", "interleaved")


#: the optimizers a plan may name (``OptimizerConfig.name``, ``fusion compile --optimizer``): the one list of names;
#: each engine maps the names it has to its update (the torch engine's ``TORCH_OPTIMIZERS``: all of them; the NumPy
#: engine's ``NumpyOptimizer.NAMES``: sgd and adamw), and ``check_optimizer`` refuses a part whose engine lacks one
OPTIMIZER_NAMES = ("sgd", "adamw", "muon")


@dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer of every part (``fusion compile --optimizer/--lr/...``), with its training knobs.

    name:          ``"sgd"``, ``"adamw"`` (torch's update formulas on every engine) or ``"muon"`` (torch engine only:
                   ``torch.optim.Muon`` on the 2-D weights that no embedding op reads, AdamW on the rest, both at
                   ``lr`` and ``weight_decay``; docs/training.md, "Muon").
    lr:            the base learning rate.
    momentum, weight_decay, betas, eps: the usual hyper-parameters.
    lr_schedule:   ``"constant"``, ``"linear"`` or ``"cosine"`` (``--lr-schedule``): optimizer step ``k`` (0-based,
                   completed steps before it) runs with ``lr * fusion.ir.lr_schedule.lr_factor(...)``, torch's
                   ``LambdaLR`` over the Hugging Face warmup/decay lambdas.
    warmup_steps:  steps of linear warmup from 0 to ``lr`` (``--warmup-steps``).
    total_steps:   steps the linear/cosine decay spans, reaching 0 at ``total_steps`` (HF's
                   ``num_training_steps``; ``--lr-decay-steps``, by default ``fusion run``'s ``--steps``); 0 for
                   ``constant``.
    clip_grad_norm: max global L2 norm of the gradients (``--clip-grad-norm``), over every part of a pipeline
                   (tied parameters once), after the data-parallel average: every gradient is scaled by
                   ``min(1, clip / (norm + 1e-6))`` before the step, as ``torch.nn.utils.clip_grad_norm_`` in one
                   process; None: no clipping.
    muon_momentum: Muon's momentum mu (Nesterov), ``muon`` only (its AdamW group uses ``betas``).
    The four knobs and ``muon_momentum`` are left off ``to_dict`` at their defaults, so a plan without them reads as before.
    """

    name: str = "sgd"
    lr: float = 0.01
    momentum: float = 0.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    total_steps: int = 0
    clip_grad_norm: float | None = None
    muon_momentum: float = 0.95

    def __post_init__(self):
        from fusion.ir.lr_schedule import check_schedule

        if self.name not in OPTIMIZER_NAMES:
            raise ValueError(f"optimizer.name must be one of {', '.join(OPTIMIZER_NAMES)}, got {self.name!r}")
        if not 0 <= self.muon_momentum < 1:
            raise ValueError(f"optimizer.muon_momentum must be in [0, 1), got {self.muon_momentum}")
        if not self.lr > 0:
            raise ValueError(f"optimizer.lr must be > 0, got {self.lr}")
        bad = check_schedule(self.lr_schedule, self.warmup_steps, self.total_steps)
        if bad:
            raise ValueError(f"optimizer.{bad}")
        c = self.clip_grad_norm
        if c is not None and not (isinstance(c, (int, float)) and not isinstance(c, bool) and 0 < c < math.inf):
            raise ValueError(f"optimizer.clip_grad_norm must be a positive number (or null: no clipping), got {c!r}")

    def lr_at(self, step: int, base: float | None = None) -> float:
        """The learning rate of optimizer step ``step`` (0-based): ``lr * lr_factor(step)``, as ``LambdaLR``;
        ``base`` in place of ``lr`` where given (a DiLoCo replica's inner lr, :meth:`DPSync.base_lr`)."""
        from fusion.ir.lr_schedule import lr_factor

        return (self.lr if base is None else base) * lr_factor(self.lr_schedule, step, self.warmup_steps,
                                                               self.total_steps)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["betas"] = list(self.betas)
        for k, default in (("lr_schedule", "constant"), ("warmup_steps", 0), ("total_steps", 0),
                           ("clip_grad_norm", None), ("muon_momentum", 0.95)):
            if d[k] == default:
                del d[k]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "OptimizerConfig":
        d = dict(d)
        if "betas" in d:
            d["betas"] = tuple(d["betas"])
        return cls(**d)


@dataclass(frozen=True)
class DPSync:
    """How the data-parallel replicas of a plan synchronise (``Plan.dp_sync``; ``fusion compile --dp-sync``).

    mode:           ``"every"``: today's synchronous data parallelism, gradients averaged every step (the
                    default, and what a plan without the field means); ``"diloco"``: DiLoCo (Douillard et al.
                    2023, Algorithm 1): each replica takes ``inner_steps`` steps with the plan's optimizer
                    (the *inner* optimizer, its state per replica), then the replicas average their
                    pseudo-gradient ``Delta = theta_global - theta_local`` and the *outer* optimizer (SGD with
                    Nesterov momentum) updates the global weights, which every replica then continues from.
    inner_steps:    H, inner steps per outer step (>= 1).
    outer_lr:       the outer optimizer's learning rate (DiLoCo's 0.7; 1 with ``outer_momentum`` 0 and an SGD
                    inner optimizer makes H = 1 equal to synchronous DP).
    outer_momentum: the outer optimizer's momentum (0.6, MuLoCo's; DiLoCo's paper 0.9, which never reached
                    synchronous DP's loss in the convergence study's tuning, docs/data-parallel.md); 0: plain
                    SGD. A plan.json without the field loads as 0.9, what it ran.
    nesterov:       Nesterov momentum (DiLoCo's choice) or heavy-ball.
    codec:          None (pseudo-gradients averaged exactly) or a codec cfg of the registry that may serve the
                    pseudo-gradient role (``{"algo": "quant", "bits": 4}``, ``{"algo": "topk", "ratio": 100}``).
    error_feedback: keep each replica's unsent residual of its pseudo-gradient and add it to the next one
                    (SparseLoCo / DeMo style); only with a lossy ``codec``.
    fragments:      Streaming DiLoCo: each stage's parameters split into this many fragments, fragment ``f``
                    synced at inner steps ``t`` with ``t % H == (f * H) // fragments`` (staggered); 1: all at once.
    delay:          outer steps by which an outer update is applied late (0: at once; 1: the all-reduce overlaps
                    the next H inner steps and is applied at the following boundary, as ``overlap`` says).
    overlap:        with ``delay`` 1, how the round in flight is used (Kale, Douillard and Donchev 2025, arXiv
                    2502.12996): ``"eager"`` (what ``fusion compile --outer-delay 1`` writes unless told
                    otherwise, with outer momentum 0: it beat the naive step on every tuning seed,
                    docs/data-parallel.md "Eager by default"): each replica applies its own fresh
                    pseudo-gradient at once as a proxy and the others' one round late; ``"delayed"``: the whole
                    average one round late (each replica's own window kept). Written to plan.json only when eager
                    (plans without it hash as before, and load as ``"delayed"``, what they ran).
    shares:         replica -> relative share of the global batch rows per inner step (unequal islands); empty:
                    equal shares. The outer average weights each replica's pseudo-gradient by the samples it saw.
    sync_warmup:    N: the first N steps are synchronous DP (gradients all-reduced every step, each replica's
                    inner optimizer stepping on the average), then DiLoCo starts from the weights after step N
                    (its global weights, zero outer momentum and residual) with each replica's optimizer state
                    kept; outer boundaries count from N (docs/data-parallel.md: the warm start that gave the
                    convergence study its best worst seed). 0: none. Equal shares only. Written to plan.json only
                    when > 0 (other plans keep their bytes).
    inner_lr:       the replicas' own (inner) learning rate once DiLoCo runs (optimizer steps after the warm-up's N;
                    the warm-up's synchronous steps take the plan's ``optimizer.lr``); the plan's lr schedule
                    scales it as it scales that lr. None: the plan's lr throughout. A replica trains on 1/R of the
                    global batch, for which a smaller lr can be right (docs/data-parallel.md: halving AdamW's lr
                    for a quarter batch, the square-root rule, helped every setting without a warm-up); the
                    DP planner chooses it (:mod:`fusion.partition.diloco_defaults`). Written to plan.json only when
                    set (other plans keep their bytes).
    inner_steps_per_replica: replica -> H_r, the inner steps replica r takes per outer round (``--inner-steps
                    auto``: H in proportion to each replica's speed, after Async Local-SGD, Liu et al. 2024,
                    arXiv 2401.09135). A round is ``inner_steps`` (= max H_r) global steps; replica r steps in
                    its last H_r of them and is idle before (``executors/runtime/dp/inner_steps.py``); the outer
                    average weighs its pseudo-gradient by the samples it saw, H_r x its rows per step. Empty: every
                    replica takes ``inner_steps``. Written to plan.json only when set (other plans hash as before).
    """

    mode: str = "every"
    inner_steps: int = 1
    outer_lr: float = 0.7
    outer_momentum: float = 0.6
    nesterov: bool = True
    codec: dict | None = None
    error_feedback: bool = False
    fragments: int = 1
    delay: int = 0
    shares: dict[int, float] = field(default_factory=dict)
    overlap: str = "delayed"
    sync_warmup: int = 0
    inner_lr: float | None = None
    inner_steps_per_replica: dict[int, int] = field(default_factory=dict)

    MODES = ("every", "diloco")
    OVERLAPS = ("eager", "delayed")

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in ("mode", "inner_steps", "outer_lr", "outer_momentum", "nesterov", "codec",
                                           "error_feedback", "fragments", "delay")}
        d["shares"] = {str(r): float(v) for r, v in self.shares.items()}
        if self.delay and self.overlap != "delayed":  # only when not the default: other plans keep their bytes
            d["overlap"] = self.overlap
        if self.sync_warmup:
            d["sync_warmup"] = self.sync_warmup
        if self.inner_lr is not None:
            d["inner_lr"] = self.inner_lr
        if self.inner_steps_per_replica:  # only when set: other plans keep their bytes
            d["inner_steps_per_replica"] = {str(r): int(h) for r, h in sorted(self.inner_steps_per_replica.items())}
        return d

    def base_lr(self, step: int, lr: float) -> float:
        """The base learning rate of a replica's optimizer step ``step`` (0-based; the lr schedule's factor then
        applies): ``inner_lr`` once DiLoCo runs (``step >= sync_warmup``), else ``lr``, the plan's."""
        if self.mode == "diloco" and self.inner_lr is not None and step >= self.sync_warmup:
            return self.inner_lr
        return lr

    @classmethod
    def from_dict(cls, d: Any, source: str = "plan.dp_sync") -> "DPSync":
        """The config of a plan's ``dp_sync`` field; PlanError naming the field for anything malformed."""
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise PlanError(f"{source}: expected a map, got {type(d).__name__}")
        unknown = set(d) - {"mode", "inner_steps", "outer_lr", "outer_momentum", "nesterov", "codec",
                            "error_feedback", "fragments", "delay", "shares", "overlap", "sync_warmup", "inner_lr",
                            "inner_steps_per_replica"}
        if unknown:
            raise PlanError(f"{source}: unknown field(s) {sorted(unknown)}")
        try:
            shares = {int(r): float(v) for r, v in dict(d.get("shares") or {}).items()}
        except (TypeError, ValueError):
            raise PlanError(f"{source}.shares: expected replica -> share, got {d.get('shares')!r}"[:200]) from None
        try:
            per = {int(r): h for r, h in dict(d.get("inner_steps_per_replica") or {}).items()}
        except (TypeError, ValueError):
            raise PlanError(f"{source}.inner_steps_per_replica: expected replica -> H, got "
                            f"{d.get('inner_steps_per_replica')!r}"[:200]) from None
        out = cls(str(d.get("mode", "every")), d.get("inner_steps", 1), d.get("outer_lr", 0.7),
                  d.get("outer_momentum", 0.9),  # absent: 0.9, the default it was written under
                  d.get("nesterov", True), d.get("codec"),
                  d.get("error_feedback", False), d.get("fragments", 1), d.get("delay", 0), shares,
                  d.get("overlap", "delayed"), d.get("sync_warmup", 0), d.get("inner_lr"), per)
        out.check(source)
        return out

    def check(self, source: str = "plan.dp_sync") -> None:
        """PlanError (one line naming the field) for a value out of range."""
        def nat(name: str, lo: int) -> None:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise PlanError(f"{source}.{name} must be an integer >= {lo}, got {v!r}")

        if self.mode not in self.MODES:
            raise PlanError(f"{source}.mode must be one of {list(self.MODES)}, got {self.mode!r}")
        nat("inner_steps", 1)
        nat("fragments", 1)
        nat("delay", 0)
        nat("sync_warmup", 0)
        if self.sync_warmup and self.shares:
            raise PlanError(f"{source}.sync_warmup: the synchronous warm-up averages equal shares; drop the shares "
                            "or the warm-up")
        if self.delay > 1:
            raise PlanError(f"{source}.delay must be 0 or 1 (an outer step applied at once or one outer step late), "
                            f"got {self.delay}")
        if self.overlap not in self.OVERLAPS:
            raise PlanError(f"{source}.overlap must be one of {list(self.OVERLAPS)}, got {self.overlap!r}"[:200])
        for name in ("outer_lr", "outer_momentum"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v >= 0 or v != v or v == float("inf"):
                raise PlanError(f"{source}.{name} must be a finite number >= 0, got {v!r}")
        if self.outer_momentum >= 1:
            raise PlanError(f"{source}.outer_momentum must be < 1, got {self.outer_momentum!r}")
        v = self.inner_lr
        if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v < float("inf")):
            raise PlanError(f"{source}.inner_lr must be a finite number > 0 (or null: the plan's lr), got {v!r}")
        if not isinstance(self.nesterov, bool) or not isinstance(self.error_feedback, bool):
            raise PlanError(f"{source}: nesterov and error_feedback must be true or false")
        if self.codec is not None and not (isinstance(self.codec, dict) and isinstance(self.codec.get("algo"), str)):
            raise PlanError(f"{source}.codec must be a codec cfg with an 'algo' name or null, got {self.codec!r}"[:200])
        if self.error_feedback and self.codec is None:
            raise PlanError(f"{source}.error_feedback needs a codec (exact averaging leaves no residual)")
        if self.fragments > self.inner_steps:
            raise PlanError(f"{source}.fragments ({self.fragments}) must be <= inner_steps ({self.inner_steps})")
        if any(r < 0 or not v > 0 or v == float("inf") for r, v in self.shares.items()):
            raise PlanError(f"{source}.shares: every share must be a positive number of a replica >= 0")
        self._check_per_replica(source)
        if self.mode == "every" and (self.inner_steps != 1 or self.fragments != 1 or self.delay or self.codec
                                     or self.error_feedback or self.sync_warmup or self.inner_lr is not None):
            raise PlanError(f"{source}: inner_steps, fragments, delay, codec, error_feedback, sync_warmup and inner_lr "
                            "are DiLoCo's (mode 'diloco'); synchronous DP takes its codec from dp_codec")


    def _check_per_replica(self, source: str) -> None:
        """``inner_steps_per_replica``: each H_r an integer in 1 .. inner_steps, the fastest's = inner_steps (the
        round's length), and none of what it is not built with (one line naming the field)."""
        per = self.inner_steps_per_replica
        if not per:
            return
        name = f"{source}.inner_steps_per_replica"
        if self.mode != "diloco":
            raise PlanError(f"{name}: per-replica inner steps are DiLoCo's (mode 'diloco')")
        for r, h in sorted(per.items()):
            if r < 0 or not isinstance(h, int) or isinstance(h, bool) or not 1 <= h <= self.inner_steps:
                raise PlanError(f"{name}: replica {r}'s H must be an integer in 1 .. inner_steps "
                                f"({self.inner_steps}), got {h!r}"[:200])
        if max(per.values()) != self.inner_steps:
            raise PlanError(f"{name}: the fastest replica's H ({max(per.values())}) must be inner_steps "
                            f"({self.inner_steps}), the round's length")
        for what, bad in (("streaming fragments (fragments > 1)", self.fragments > 1),
                          ("the overlapped outer step (delay 1)", self.delay),
                          ("the synchronous warm-up (sync_warmup > 0)", self.sync_warmup)):
            if bad:
                raise PlanError(f"{name}: per-replica inner steps with {what} are not built")


class PlanError(FusionError):
    """A malformed or inconsistent plan; the message names the file and field."""


@dataclass(frozen=True)
class EdgeCompression:
    """Compression of one cut tensor (producer output) on one part-to-part link.

    ratio: Top-K ratio r_i of FusionLLM Eq. (7) (1 = dense); k = ceil(numel / ratio).
    directions: which directions are compressed: ``"fwd"`` activations, ``"bwd"`` gradients.
    error_feedback: keep the unsent residual and add it to the next message (Top-K only).
    fwd_codec / bwd_codec: a codec cfg from the registry (``{"algo": "quant", "bits": 4, ...}``,
        see :mod:`fusion.kernels.codec`) for that direction; it replaces Top-K(ratio) there.
        Plans written before these fields existed load as Top-K in ``directions``.
    """

    producer: str
    index: int | None
    src: str
    dst: str
    ratio: float = 1.0
    directions: tuple[str, ...] = ("fwd", "bwd")
    error_feedback: bool = False
    fwd_codec: dict | None = None
    bwd_codec: dict | None = None

    def codec(self, direction: str) -> dict | None:
        """The codec cfg of ``direction`` (``"fwd"`` or ``"bwd"``), or None when it is sent dense."""
        explicit = self.fwd_codec if direction == "fwd" else self.bwd_codec
        if explicit is not None:
            return dict(explicit)
        if direction in self.directions and self.ratio > 1:  # AdaTopK's ratio: Top-K
            from fusion.kernels.codecs.topk import TopKCodec

            return {"algo": TopKCodec.name, "ratio": float(self.ratio)}
        return None


@dataclass(frozen=True)
class BottleneckSpec:
    """What the bottleneck pass (:mod:`fusion.compress.bottleneck`, ``fusion compile --bottleneck``) inserted at
    one cut edge (``plan.json`` ``bottlenecks[i]``): an encoder ``z = x @ P + x @ W_enc`` on ``src`` and, on each
    part of ``dsts``, a decoder ``y = z @ P^T + z @ W_dec`` whose output replaces x there (ResBM's residual
    bottleneck with a low-rank identity path).

    producer, index: the cut tensor x (as :class:`CutEdge`); src: the part that encodes; dsts: the parts that
    decode, each with its own decoder. width: D, x's last dim; rank: R, the code's last dim; dtype: x's dtype.
    projection: name of the fixed buffer P (D x R, orthonormal columns); encoder: name of W_enc (D x R);
    decoders: names of W_dec (R x D), one per part of ``dsts``, same order.
    code: the node whose output z (R wide) crosses the cut; outputs: per ``dsts`` the node whose output y
    replaces x there. nodes: every inserted node -> the part it runs on. seed: the seed P was drawn from.
    """

    producer: str
    index: int | None
    src: str
    dsts: tuple[str, ...]
    width: int
    rank: int
    dtype: str
    projection: str
    encoder: str
    decoders: tuple[str, ...]
    code: str
    outputs: tuple[str, ...]
    nodes: dict[str, str] = field(default_factory=dict)
    seed: int = 0

    @property
    def edge(self) -> str:
        return self.producer if self.index is None else f"{self.producer}[{self.index}]"

    @property
    def trainable_params(self) -> int:
        """Trainable parameters added: W_enc (D R) and one W_dec (R D) per destination part."""
        return self.width * self.rank * (1 + len(self.dsts))

    @property
    def param_names(self) -> list[str]:
        return [self.projection, self.encoder, *self.decoders]

    def to_dict(self) -> dict[str, Any]:
        return {"producer": self.producer, "index": self.index, "src": self.src, "dsts": list(self.dsts),
                "width": self.width, "rank": self.rank, "dtype": self.dtype, "projection": self.projection,
                "encoder": self.encoder, "decoders": list(self.decoders), "code": self.code,
                "outputs": list(self.outputs), "nodes": dict(self.nodes), "seed": self.seed}

    @classmethod
    def from_dict(cls, d: Any) -> "BottleneckSpec":
        if not isinstance(d, dict):
            raise TypeError(f"a bottleneck entry must be a map, got {type(d).__name__}")
        return cls(str(d["producer"]), d.get("index"), str(d["src"]), tuple(d["dsts"]), int(d["width"]),
                   int(d["rank"]), str(d["dtype"]), str(d["projection"]), str(d["encoder"]), tuple(d["decoders"]),
                   str(d["code"]), tuple(d["outputs"]), dict(d.get("nodes", {})), int(d.get("seed", 0)))


@dataclass
class Part:
    """One CompNode: name (part id), the cluster device it runs on, its
    address (``tcp://host:port``), its engine (``torch`` or ``numpy``), and
    the estimator's predictions in seconds per micro-batch.

    replica: which data-parallel replica pipeline the part belongs to (0 .. R-1).
    stage:   the stage whose sub-DAG it runs, named by replica 0's part of that stage (the part name
             :attr:`Plan.assignment` uses); ``""`` for a replica-0 part (its own name is its stage).
             Replica ``r > 0`` names its part of stage ``S`` ``r<r>.<S>`` (e.g. ``r1.part0``), see
             :func:`replica_part_name`. Plans written before these fields load as replica 0.
    recompute: the compiler chose activation recomputation for this part (it keeps only its inputs
             per micro-batch in flight and runs its forward again in backward) because it would not
             fit its device otherwise.
    """

    name: str
    device: str
    address: str = ""
    engine: str = "torch"
    predicted_compute_s: float = 0.0
    predicted_comm_s: float = 0.0
    memory_bytes: float = 0.0
    replica: int = 0
    stage: str = ""
    recompute: bool = False


def replica_part_name(stage: str, replica: int) -> str:
    """The part of replica ``replica`` that runs ``stage``: the stage's own name for replica 0, else ``r<replica>.<stage>``."""
    return stage if replica == 0 else f"r{replica}.{stage}"


@dataclass
class Plan:
    """Everything an executor needs.

    graph:         the OP-DAG with shapes and costs.
    cluster:       the cluster description as plain data (``Cluster.to_dict``).
    parts:         part name -> Part.
    assignment:    node name -> part name.
    compression:   compressed cut edges (absent edges are dense).
    schedule:      ``"gpipe"``, ``"1f1b"`` or ``"zb1"``; micro_batches: n_b of Eq. (3).
    optimizer:     ``OptimizerConfig.to_dict()``.
    seed:          seed for anything random at run time.
    predicted:     estimator outputs, e.g. ``{"iteration_s": ..., "links": {...}}``.
    example:       placeholder name -> {"shape": [...], "dtype": ...} of one micro-batch.
    strategy:      the partitioner that produced the assignment.
    boundaries:    part -> its boundary tables (FusionLLM Table 3) as written by
                   :func:`boundary_tables`; optional (derivable from graph and
                   assignment), checked against them on load when present.
    global_batch:  rows of one step's global batch over all replicas (0: not fixed; then
                   ``replicas x micro_batches`` micro-batches of the example's size). Each step's
                   batch is split into ``replicas`` equal contiguous shares (replica r takes share r),
                   each share into ``micro_batches`` micro-batches.

    Data parallelism (DP x PP): ``assignment`` maps every node to a part of replica 0 (the *stages*);
    replica ``r`` runs the same sub-DAGs on its own parts (``Part.replica == r``, ``Part.stage`` the
    stage), on devices no other replica uses. The parts of one stage form its data-parallel group,
    whose parameter gradients are averaged every step before the optimizer steps. A plan without
    replica fields is one pipeline (R = 1).
    dp_codec:      None (gradients averaged exactly) or the cfg of a codec that serves data-parallel gradients
                   (the registry says which: ``Role.DP_GRADIENT``; ``{"algo": "quant", "bits": 8}``) for the
                   all-reduce chunks between replicas (lossy; ``executors/runtime/dp/allreduce.py``).
    tied_codec:    None (gradients of parameters held by several parts, e.g. a tied embedding, are summed
                   exactly) or the cfg of a codec that serves tied-parameter gradients (``{"algo": "quant",
                   "bits": 8}``; quant, hadamard-quant, topk or a user codec) for the gradients their owners
                   exchange each step: every owner sums the
                   decoded gradients of all owners in part order, so all apply the same bits
                   (``executors/runtime/dp/tied.py``, ``TiedCodec``). Plans without the field load with None.
    dp_algo:       stage -> ``"ring"`` or ``"tree"``: the all-reduce algorithm of that stage's data-parallel
                   group (``executors/runtime/dp/allreduce.py``; ``fusion compile --dp-allreduce``); a stage
                   without an entry (every stage of an older plan) runs the ring.
    dp_sync:       how the replicas synchronise (:class:`DPSync`): every step (synchronous DP, the default and
                   what a plan without the field means) or DiLoCo's outer steps.
    precision:     ``"fp32"`` (the default; left out of plan.json, so older plans hash the same) or ``"bf16"``:
                   mixed precision. Every part (torch only) runs its forward, and so its backward, under
                   ``torch.autocast(dtype=torch.bfloat16)``; parameters and optimizer state stay in the graph's
                   dtype (fp32 master weights). A cut-edge activation travels in the dtype autocast gave it
                   (bfloat16 bits where its producer was an autocast bf16 op, e.g. a matmul: half the bytes;
                   float32 where it was fp32, e.g. a residual sum or a LayerNorm), so the run equals one process
                   under autocast (``docs/training.md``, "Mixed precision").
    bottlenecks:   what ``fusion compile --bottleneck`` inserted into ``graph`` at the cut (:class:`BottleneckSpec`,
                   one per bottlenecked edge; ``docs/compression.md``, "Bottlenecks at the cut"); their nodes and
                   parameters are ordinary graph nodes and parameters, this list says where they sit. Left out of
                   plan.json when empty, so older plans read and hash as before.
    subspace:      what ``fusion compile --subspace`` changed (``fusion.compress.subspace.SubspaceSpec.to_dict``:
                   the writers confined to span(U), the cut edges rebuilt from coordinates and ids); plain data
                   here, the nodes and parameters are ordinary ones, checked on load against the graph and
                   assignment (:func:`check_subspace`). Left out of plan.json when None.
    """

    graph: OpGraph
    cluster: dict[str, Any]
    parts: dict[str, Part]
    assignment: dict[str, str]
    compression: list[EdgeCompression] = field(default_factory=list)
    schedule: str = "gpipe"
    micro_batches: int = 1
    optimizer: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    predicted: dict[str, Any] = field(default_factory=dict)
    example: dict[str, dict[str, Any]] = field(default_factory=dict)
    strategy: str = ""
    boundaries: dict[str, dict[str, list]] = field(default_factory=dict)
    global_batch: int = 0
    dp_codec: dict | None = None
    tied_codec: dict | None = None
    dp_algo: dict[str, str] = field(default_factory=dict)
    dp_sync: DPSync = field(default_factory=DPSync)
    precision: str = "fp32"
    bottlenecks: list[BottleneckSpec] = field(default_factory=list)
    subspace: dict[str, Any] | None = None

    PRECISIONS = ("fp32", "bf16")

    # -- replicas (DP x PP) ---------------------------------------------------------------
    def stage_of(self, part: str) -> str:
        """The stage (replica 0's part name) whose sub-DAG ``part`` runs."""
        p = self.parts[part]
        return p.stage or p.name

    @property
    def replicas(self) -> int:
        """R: the number of replica pipelines (1 for a plain pipeline plan)."""
        return 1 + max((p.replica for p in self.parts.values()), default=0)

    def replica_parts(self, replica: int) -> dict[str, str]:
        """Stage -> the part of ``replica`` that runs it."""
        return {self.stage_of(n): n for n, p in self.parts.items() if p.replica == replica}

    def replica_assignment(self, replica: int) -> dict[str, str]:
        """Node -> part of ``replica`` (replica 0: :attr:`assignment` itself)."""
        if replica == 0:
            return self.assignment
        m = self.replica_parts(replica)
        return {n: m[s] for n, s in self.assignment.items()}

    def replica_compression(self, replica: int) -> list[EdgeCompression]:
        """The compressed edges as replica ``replica`` sees them (src/dst renamed to its parts)."""
        if replica == 0:
            return list(self.compression)
        from dataclasses import replace

        m = self.replica_parts(replica)
        return [replace(c, src=m[c.src], dst=m[c.dst]) for c in self.compression]

    def dp_group(self, part: str) -> list[str]:
        """The data-parallel group of ``part``: every replica's part of its stage, by replica."""
        stage = self.stage_of(part)
        return sorted((n for n in self.parts if self.stage_of(n) == stage), key=lambda n: self.parts[n].replica)

    def _validate_interleaved(self, source: str) -> None:
        """Interleaved 1F1B: the parts go round-robin over the devices in part order, the micro-batches are a
        multiple of the devices, one replica (data-parallel replicas of an interleaved pipeline are not built)."""
        if any(p.replica for p in self.parts.values()):
            raise PlanError(f"{source}: schedule 'interleaved' runs one pipeline; data-parallel replicas of it are "
                            "not supported (use 1f1b or zb1 with replicas)")
        try:
            ranks = self.lanes()
        except ValueError as e:
            raise PlanError(f"{source}: parts: {e}") from None
        if self.micro_batches % len(ranks):
            raise PlanError(f"{source}: micro_batches {self.micro_batches} must be a multiple of the {len(ranks)} devices "
                            "of an interleaved schedule")

    def lanes(self) -> dict[str, list[str]]:
        """The executor processes of the plan: lane -> the parts it runs, in part order. One part per process,
        except under ``interleaved``, where one process per device runs the device's chunks (virtual stages)."""
        if self.schedule != "interleaved":
            return {p: [p] for p in self.parts}
        from fusion.ir.boundary import part_order
        from fusion.ir.schedule import virtual_stages

        order = part_order(self.graph, self.assignment)
        ranks, v = virtual_stages(order, {p: self.parts[p].device for p in order})
        return {dev: [order[c * len(ranks) + r] for c in range(v)] for r, dev in enumerate(ranks)}

    def lane_of(self, part: str) -> list[str]:
        """The parts that share ``part``'s executor process (``[part]`` unless the schedule interleaves)."""
        return next(ps for ps in self.lanes().values() if part in ps)

    def dp_algo_of(self, part: str) -> str:
        """The all-reduce algorithm of ``part``'s data-parallel group (``"ring"`` unless ``dp_algo`` says otherwise)."""
        return self.dp_algo.get(self.stage_of(part), "ring")

    def to_dict(self) -> dict:
        return {
            "format": PLAN_FORMAT, "version": PLAN_VERSION,
            "graph": graph_to_dict(self.graph), "cluster": self.cluster,
            "parts": {n: vars(p) for n, p in self.parts.items()},
            "assignment": self.assignment,
            "compression": [{**vars(c), "directions": list(c.directions)} for c in self.compression],
            "schedule": self.schedule, "micro_batches": self.micro_batches,
            "optimizer": self.optimizer, "seed": self.seed, "predicted": self.predicted,
            "example": self.example, "strategy": self.strategy, "boundaries": self.boundaries,
            "global_batch": self.global_batch, "dp_codec": self.dp_codec, "tied_codec": self.tied_codec,
            "dp_algo": self.dp_algo, "dp_sync": self.dp_sync.to_dict(),
            **({"precision": self.precision} if self.precision != "fp32" else {}),
            **({"bottlenecks": [b.to_dict() for b in self.bottlenecks]} if self.bottlenecks else {}),
            **({"subspace": self.subspace} if self.subspace is not None else {}),
        }

    @classmethod
    def from_dict(cls, d: Any, source: str = "plan") -> "Plan":
        if not isinstance(d, dict) or d.get("format") != PLAN_FORMAT:
            raise PlanError(f"{source}: not a fusion plan (field 'format' must be {PLAN_FORMAT!r})")
        if d.get("version") != PLAN_VERSION:
            raise PlanError(f"{source}: unsupported plan version {d.get('version')!r} (this fusion reads {PLAN_VERSION})")
        for key in ("graph", "cluster", "parts", "assignment"):
            if key not in d:
                raise PlanError(f"{source}: missing field {key!r}")
        try:
            graph = graph_from_dict(d["graph"], f"{source}: graph").validate(check_targets=False)
            try:
                check_targets(graph)  # a plan is data: no op outside the allow-list, checked before anything runs
            except GraphError as e:
                raise PlanError(f"{source}: graph: {e}") from None
            parts = {n: Part(**p) for n, p in d["parts"].items()}
            bnecks = [BottleneckSpec.from_dict(b) for b in d.get("bottlenecks", [])]
            comp = [EdgeCompression(**{**c, "directions": tuple(c.get("directions", ("fwd", "bwd")))}) for c in d.get("compression", [])]
        except (TypeError, ValueError, KeyError) as e:
            raise PlanError(f"{source}: malformed field ({e})") from None
        plan = cls(graph, d["cluster"], parts, dict(d["assignment"]), comp, d.get("schedule", "gpipe"),
                   _int_field(d, "micro_batches", 1, source), dict(d.get("optimizer", {})), _int_field(d, "seed", 0, source),
                   dict(d.get("predicted", {})), dict(d.get("example", {})), str(d.get("strategy", "")),
                   dict(d.get("boundaries", {})), _int_field(d, "global_batch", 0, source), d.get("dp_codec"),
                   d.get("tied_codec"), d.get("dp_algo", {}), DPSync.from_dict(d.get("dp_sync"), f"{source}: dp_sync"),
                   d.get("precision", "fp32"), bnecks, d.get("subspace"))
        plan.check(source)
        return plan

    def check(self, source: str = "plan") -> None:
        """Cross-field consistency; raises PlanError naming the field."""
        for node, part in self.assignment.items():
            if node not in self.graph.nodes:
                raise PlanError(f"{source}: assignment names unknown node {node!r}")
            if part not in self.parts:
                raise PlanError(f"{source}: assignment puts node {node!r} on unknown part {part!r}")
        missing = [n for n in self.graph.nodes if n not in self.assignment]
        if missing:
            raise PlanError(f"{source}: assignment misses node {missing[0]!r}")
        self._check_precision(source)
        if self.schedule not in SCHEDULE_NAMES:
            raise PlanError(f"{source}: schedule must be one of {list(SCHEDULE_NAMES)}, got {self.schedule!r}")
        if self.micro_batches < 1:
            raise PlanError(f"{source}: micro_batches must be >= 1, got {self.micro_batches}")
        if self.schedule == "interleaved":
            self._validate_interleaved(source)
        for c in self.compression:
            if c.src not in self.parts or c.dst not in self.parts:
                raise PlanError(f"{source}: compression edge {c.producer} names unknown part {c.src!r}->{c.dst!r}")
            if c.producer not in self.graph.nodes:
                raise PlanError(f"{source}: compression names unknown node {c.producer!r}")
            if not c.ratio >= 1:
                raise PlanError(f"{source}: compression ratio of {c.producer} must be >= 1, got {c.ratio}")
            for field_name in ("fwd_codec", "bwd_codec"):
                cfg = getattr(c, field_name)
                if cfg is not None and not (isinstance(cfg, dict) and isinstance(cfg.get("algo"), str)):
                    raise PlanError(f"{source}: compression of {c.producer}: {field_name} must be a codec cfg "
                                    f"with an 'algo' name, got {cfg!r}")
        tc = self.tied_codec
        if tc is not None and not (isinstance(tc, dict) and isinstance(tc.get("algo"), str) and _serves(tc, "TIED_GRADIENT")):
            raise PlanError(f"{source}: tied_codec must be null or a codec cfg with an 'algo' name of a codec that "
                            f"serves tied-parameter gradients (e.g. {{'algo': 'quant', 'bits': 8}}), got {tc!r}")
        for p in self.parts.values():
            if not isinstance(p.recompute, bool):
                raise PlanError(f"{source}: parts.{p.name}.recompute must be true or false, got {p.recompute!r}")
            if p.recompute and p.engine != "torch":
                raise PlanError(f"{source}: parts.{p.name} needs activation recomputation, which the {p.engine} "
                                "engine does not do (only torch)")
        devices = self.cluster.get("devices") if isinstance(self.cluster, dict) else None
        if isinstance(devices, list) and devices:
            names = {e.get("name") for e in devices if isinstance(e, dict)}
            for p in self.parts.values():
                if p.device not in names:
                    raise PlanError(f"{source}: parts.{p.name}.device names unknown device {p.device!r} (not in cluster.devices)")
        self._check_replicas(source)
        self._check_bottlenecks(source)
        if self.subspace is not None:
            check_subspace(self.subspace, self.graph, self.assignment, set(self.parts), f"{source}: subspace")
        from fusion.ir.boundary import part_order
        from fusion.ir.errors import GraphError

        try:
            part_order(self.graph, self.assignment)
        except GraphError as e:
            raise PlanError(f"{source}: assignment: {e}") from None
        if self.boundaries:
            want = boundary_tables(self.graph, self.assignment)
            for part in sorted(set(want) | set(self.boundaries)):
                if self.boundaries.get(part) != want.get(part):
                    raise PlanError(f"{source}: boundaries.{part} does not match the graph and assignment")


    def _check_bottlenecks(self, source: str) -> None:
        """Each bottleneck's parameters and nodes are in the graph where it says: P fixed, W_enc (D x R) and
        W_dec (R x D) trainable, R < D, every node on the part it names."""
        for i, b in enumerate(self.bottlenecks):
            where = f"{source}: bottlenecks[{i}] ({b.edge})"
            if not 1 <= b.rank < b.width:
                raise PlanError(f"{where}: rank {b.rank} must be >= 1 and smaller than the width {b.width}")
            if len(b.decoders) != len(b.dsts) or len(b.outputs) != len(b.dsts):
                raise PlanError(f"{where}: one decoder and one output per destination part (dsts {list(b.dsts)})")
            want = {b.projection: ((b.width, b.rank), False), b.encoder: ((b.width, b.rank), True),
                    **{d: ((b.rank, b.width), True) for d in b.decoders}}
            for name, (shape, trainable) in want.items():
                p = self.graph.params.get(name)
                if p is None or tuple(p.shape) != shape or p.trainable != trainable:
                    raise PlanError(f"{where}: graph parameter {name!r} must exist with shape {list(shape)}"
                                    f"{'' if trainable else ', not trainable'}")
            if b.nodes.get(b.code) != b.src:
                raise PlanError(f"{where}: the code node {b.code!r} must be one of its nodes, on part {b.src!r}")
            for node, part in b.nodes.items():
                if self.assignment.get(node) != part:
                    raise PlanError(f"{where}: node {node!r} must be on part {part!r} (assignment: "
                                    f"{self.assignment.get(node)!r})")

    def _check_precision(self, source: str) -> None:
        """``precision`` is fp32 or bf16; bf16 (autocast) runs on torch parts only. Compressed cut edges are
        encoded in the dtype autocast gave the tensor (``CompressionTable.autocast``)."""
        if self.precision not in self.PRECISIONS:
            raise PlanError(f"{source}: precision {self.precision!r}: one of {', '.join(self.PRECISIONS)}")
        if self.precision == "fp32":
            return
        other = sorted(n for n, p in self.parts.items() if p.engine != "torch")
        if other:
            raise PlanError(f"{source}: precision bf16 runs torch autocast; part {other[0]!r} is on the "
                            f"{self.parts[other[0]].engine} engine (use fp32, or put it on torch)")

    def _check_dp_codec(self, source: str) -> None:
        """``dp_codec`` names a codec the registry lets carry data-parallel gradients (``Role.DP_GRADIENT``) with
        a cfg it accepts; a codec this process does not know may come from the plan's plugins (each executor
        checks it after importing them)."""
        from fusion.kernels.codecs import CODECS, Role

        c = self.dp_codec
        if not (isinstance(c, dict) and isinstance(c.get("algo"), str)):
            raise PlanError(f"{source}: dp_codec must be a codec cfg ({{'algo': 'quant', 'bits': 8}}) or null, "
                            f"got {c!r}"[:200])
        if c["algo"] not in CODECS and self.graph.plugins:
            return
        try:
            CODECS.check_role(c, Role.DP_GRADIENT, f"{source}: dp_codec")
        except FusionError as e:
            raise PlanError(str(e)) from None

    def _check_warmup_codec(self, source: str) -> None:
        """A ``dp_codec`` under DiLoCo quantises only its synchronous warm-up: the plan needs a warm-up, and a
        pseudo-gradient codec (exact pseudo-gradients are averaged over the same ring, which would quantise them)."""
        ds = self.dp_sync
        if ds.mode == "diloco" and not (ds.sync_warmup and ds.codec is not None):
            raise PlanError(f"{source}: dp_codec: DiLoCo runs the per-step gradient all-reduce only in its synchronous "
                            "warm-up, and averages exact pseudo-gradients over the same ring: it needs "
                            "dp_sync.sync_warmup > 0 and a dp_sync.codec")

    def _check_replicas(self, source: str) -> None:
        """Replicas run the same cut on disjoint devices; the global batch divides over them."""
        stages = set(self.assignment.values())
        seen: dict[tuple[int, str], str] = {}
        for n, p in self.parts.items():
            if not isinstance(p.replica, int) or isinstance(p.replica, bool) or p.replica < 0:
                raise PlanError(f"{source}: parts.{n}.replica must be an integer >= 0, got {p.replica!r}")
            stage = p.stage or n
            if p.replica == 0 and stage != n:
                raise PlanError(f"{source}: parts.{n}: a replica-0 part is its own stage, but stage is {p.stage!r}")
            if stage not in stages:
                raise PlanError(f"{source}: parts.{n}.stage {stage!r} is not a stage of the assignment "
                                f"(replicas must run the same cut; stages: {sorted(stages)})")
            if p.replica > 0 and n != replica_part_name(stage, p.replica):
                raise PlanError(f"{source}: parts.{n}: replica {p.replica}'s part of stage {stage!r} must be named "
                                f"{replica_part_name(stage, p.replica)!r}")
            if (p.replica, stage) in seen:
                raise PlanError(f"{source}: parts.{n}: replica {p.replica} already runs stage {stage!r} on part "
                                f"{seen[p.replica, stage]!r} (replicas must have the same cut)")
            seen[p.replica, stage] = n
        r_count = 1 + max((p.replica for p in self.parts.values()), default=0)
        for r in range(r_count):
            for stage in sorted(stages):
                if (r, stage) not in seen:
                    other = next((n for (rr, _), n in seen.items() if rr == r), None)
                    where = f"parts.{other}" if other else f"replica {r}"
                    raise PlanError(f"{source}: {where}: replica {r} has no part for stage {stage!r} "
                                    "(replicas must have the same cut)")
        if r_count > 1:
            owner: dict[str, str] = {}
            for n, p in self.parts.items():
                prev = owner.setdefault(p.device, n)
                if prev != n and self.parts[prev].replica != p.replica:
                    raise PlanError(f"{source}: parts.{n}.device {p.device!r} is also used by part {prev!r} of another "
                                    "replica (replicas run on disjoint devices)")
        if self.dp_codec is not None:
            self._check_dp_codec(source)
        if not isinstance(self.dp_algo, dict):
            raise PlanError(f"{source}: dp_algo must map stages to 'ring' or 'tree', got {self.dp_algo!r}"[:200])
        for stage, algo in self.dp_algo.items():
            if stage not in stages:
                raise PlanError(f"{source}: dp_algo.{stage}: not a stage of the assignment (stages: {sorted(stages)})")
            if algo not in ("ring", "tree"):
                raise PlanError(f"{source}: dp_algo.{stage} must be 'ring' or 'tree', got {algo!r}"[:200])
        if not isinstance(self.optimizer, dict):
            raise PlanError(f"{source}: optimizer must be a map, got {type(self.optimizer).__name__}")
        try:  # the executors build their optimizer (schedule, clipping) from this: a bad field is named here
            OptimizerConfig.from_dict(self.optimizer)
        except (TypeError, ValueError) as e:
            raise PlanError(f"{source}: {e}"[:300]) from None
        if not isinstance(self.dp_sync, DPSync):
            raise PlanError(f"{source}: dp_sync must be a DPSync, got {type(self.dp_sync).__name__}")
        self.dp_sync.check(f"{source}: dp_sync")
        if self.dp_codec is not None:
            self._check_warmup_codec(source)
        if any(r >= r_count for r in self.dp_sync.shares):
            raise PlanError(f"{source}: dp_sync.shares names replica {max(self.dp_sync.shares)}, the plan has {r_count}")
        per = self.dp_sync.inner_steps_per_replica
        if per and sorted(per) != list(range(r_count)):
            raise PlanError(f"{source}: dp_sync.inner_steps_per_replica names replicas {sorted(per)}; the plan has "
                            f"{r_count} (0..{r_count - 1}), each needs its H")
        if self.global_batch < 0:
            raise PlanError(f"{source}: global_batch must be >= 0, got {self.global_batch}")
        if self.global_batch and self.global_batch % (r_count * self.micro_batches):
            raise PlanError(f"{source}: global_batch {self.global_batch} does not divide into {r_count} replica(s) x "
                            f"{self.micro_batches} micro-batch(es)")


def _serves(cfg: dict, role: str) -> bool:
    """Whether the codec ``cfg`` names may serve ``role`` (a ``Role`` member's name); a codec this process does
    not know passes here (a plan plugin may register it; executors check it after importing plugins)."""
    from fusion.kernels.codecs import CODECS, Role

    return cfg["algo"] not in CODECS or Role[role] in CODECS.unit(cfg["algo"]).roles


def _int_field(d: dict, name: str, default: int, source: str) -> int:
    v = d.get(name, default)
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not isinstance(v, int) or isinstance(v, bool):
        raise PlanError(f"{source}: field {name!r} must be an integer, got {v!r}")
    return v


#: the fields of ``plan.json``'s ``subspace`` (``fusion.compress.subspace.SubspaceSpec.to_dict``), what each must be
SUBSPACE_FIELDS = {"width": "the residual stream's width d", "rank": "k, the coordinates per token",
                   "dtype": "the stream's dtype", "seed": "the seed U and T are drawn from",
                   "ids": "the token ids input ('' without a token embedding)", "table_std": "T's standard deviation",
                   "stream": "the stream's nodes", "writers": "the writers confined", "cuts": "the cut edges rebuilt"}
#: the fixed parameters of a subspace plan: the basis U (d x k) and the token table's rest T (V x d)
SUBSPACE_BASIS, SUBSPACE_TABLE = "subspace.U", "subspace.T"


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_subspace(d: Any, graph: OpGraph, assignment: dict[str, str], parts: set[str], where: str) -> None:
    """``plan.json``'s ``subspace`` (docs/compression.md, "Subspace-confined residual stream") agrees with itself and
    with the graph and assignment: 1 <= k < d, an integer seed, U (d x k) and T (V x d) fixed graph parameters, the
    ids a graph input, the stream and writers graph nodes, and each cut edge on the stream, from its part, sending
    a k-wide coordinates node and rebuilt on each destination part. PlanError naming the field otherwise."""
    if not isinstance(d, dict):
        raise PlanError(f"{where}: must be a map (the subspace passes' record), got {type(d).__name__}")
    for key, what in SUBSPACE_FIELDS.items():
        if key not in d and key != "cuts":
            raise PlanError(f"{where}.{key} is missing ({what})")
    width, rank, seed = d["width"], d["rank"], d["seed"]
    if not _int(width) or width < 2:
        raise PlanError(f"{where}.width must be an integer >= 2 (the stream's width), got {width!r}")
    if not _int(rank) or not 1 <= rank < width:
        raise PlanError(f"{where}.rank must be an integer k with 1 <= k < the width {width}, got {rank!r}")
    if not _int(seed) or seed < 0:
        raise PlanError(f"{where}.seed must be an integer >= 0 (the seed U and T are drawn from), got {seed!r}")
    if d["dtype"] not in ("float32", "float64"):
        raise PlanError(f"{where}.dtype must be float32 or float64 (the rebuild is exact in those), got {d['dtype']!r}")
    std = d["table_std"]
    if isinstance(std, bool) or not isinstance(std, (int, float)) or not (math.isfinite(std) and std > 0):
        raise PlanError(f"{where}.table_std must be a finite number > 0, got {std!r}")
    ids = d["ids"]
    if not isinstance(ids, str) or (ids and (ids not in graph.nodes or graph[ids].kind.value != "input")):
        raise PlanError(f"{where}.ids must be '' or an input node of the graph, got {ids!r}")
    fixed = {SUBSPACE_BASIS: (width, rank)}
    if ids:
        table = graph.params.get(SUBSPACE_TABLE)
        fixed[SUBSPACE_TABLE] = (table.shape[0] if table is not None and table.shape else -1, width)
    for name, shape in fixed.items():
        p = graph.params.get(name)
        if p is None or tuple(p.shape) != shape or p.trainable:
            raise PlanError(f"{where}: graph parameter {name!r} must exist with shape {list(shape)}, not trainable "
                            f"(width {width}, rank {rank})")
    stream = d["stream"]
    if not isinstance(stream, list) or not stream or not all(isinstance(n, str) and n in graph.nodes for n in stream):
        bad = next((n for n in stream if not (isinstance(n, str) and n in graph.nodes)), None) \
            if isinstance(stream, list) else stream
        raise PlanError(f"{where}.stream must list the stream's nodes of the graph; {bad!r} is not one")
    if not isinstance(d["writers"], list):
        raise PlanError(f"{where}.writers must be a list of the writers confined")
    for i, w in enumerate(d["writers"]):
        if not isinstance(w, dict) or w.get("node") not in graph.nodes:
            raise PlanError(f"{where}.writers[{i}].node must name a node of the graph, got "
                            f"{w.get('node') if isinstance(w, dict) else w!r}")
        for name in w.get("added", []):
            if name not in graph.params or not graph.params[name].trainable:
                raise PlanError(f"{where}.writers[{i}] ({w['node']}): added parameter {name!r} must be a trainable "
                                "graph parameter")
    cuts = d.get("cuts", [])
    if not isinstance(cuts, list):
        raise PlanError(f"{where}.cuts must be a list of the cut edges rebuilt")
    for i, c in enumerate(cuts):
        _check_subspace_cut(c, graph, assignment, parts, set(stream), rank, f"{where}.cuts[{i}]")


def _check_subspace_cut(c: Any, graph: OpGraph, assignment: dict[str, str], parts: set[str], stream: set[str],
                        rank: int, where: str) -> None:
    """One ``subspace.cuts[i]``: an edge on the stream from ``src`` whose coordinates node (k wide, on ``src``) each
    part of ``dsts`` rebuilds in its ``outputs`` entry (on that part)."""
    if not isinstance(c, dict):
        raise PlanError(f"{where} must be a map, got {type(c).__name__}")
    for key in ("producer", "src", "dsts", "coords", "outputs"):
        if key not in c:
            raise PlanError(f"{where}.{key} is missing")
    producer, src, dsts, coords, outputs = c["producer"], c["src"], c["dsts"], c["coords"], c["outputs"]
    if producer not in stream:
        raise PlanError(f"{where}.producer {producer!r} is not on the residual stream (subspace.stream): only a "
                        "stream edge is rebuilt exactly from its coordinates")
    if src not in parts or assignment.get(producer) != src:
        raise PlanError(f"{where}.src {src!r} must be the part of the producer {producer!r} "
                        f"(assignment: {assignment.get(producer)!r})")
    if not isinstance(dsts, list) or not dsts or any(p not in parts or p == src for p in dsts):
        raise PlanError(f"{where}.dsts must list the parts other than {src!r} that rebuild it, got {dsts!r}")
    meta = graph.output_meta(coords, None) if isinstance(coords, str) and coords in graph.nodes else None
    if meta is None or assignment.get(coords) != src or not getattr(meta, "shape", ()) or meta.shape[-1] != rank:
        raise PlanError(f"{where}.coords {coords!r} must be a node on part {src!r} whose output is {rank} wide "
                        "(the coordinates sent)")
    if not isinstance(outputs, list) or len(outputs) != len(dsts):
        raise PlanError(f"{where}.outputs must name one rebuilt node per part of dsts {dsts!r}")
    for out, dst in zip(outputs, dsts):
        if out not in graph.nodes or assignment.get(out) != dst:
            raise PlanError(f"{where}.outputs: {out!r} must be a node on part {dst!r} (assignment: "
                            f"{assignment.get(out) if isinstance(out, str) else None!r})")


def boundary_tables(graph: OpGraph, assignment: dict[str, str]) -> dict[str, dict[str, list]]:
    """Each part's boundary (FusionLLM Table 3) as plain data:
    ``{column: [[producer, index, actual_user, requires_grad], ...]}``."""
    from fusion.ir.boundary import partition

    out = {}
    for part, sg in partition(graph, assignment).items():
        b = sg.boundary
        out[part] = {col: [[e.producer, e.index, e.actual_user, e.requires_grad] for e in getattr(b, col)]
                     for col in ("required_acts", "sent_acts", "required_grads", "sent_grads")}
    return out


def save_plan(plan: Plan, path: str | Path, params: dict[str, Any] | None = None) -> Path:
    """Write ``path/plan.json`` (and ``path/weights.safetensors`` when params are given)."""
    import shutil

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    data = plan.to_dict()
    # user op files travel inside the plan: an executor needs nothing else
    plugins = []
    for entry in plan.graph.plugins:
        src = Path(entry)
        if entry.endswith(".py") and src.is_absolute():
            atomic_write(path / "plugins" / src.name, lambda t, src=src: shutil.copyfile(src, t))
            entry = f"plugins/{src.name}"
        plugins.append(entry)
    data["graph"]["plugins"] = plugins
    remove_stale_tmp(path)
    if params:  # weights first: a plan.json never points at weights that are not there yet
        save_weights(params, path / "weights.safetensors")
    atomic_write(path / "plan.json", lambda t: t.write_text(json.dumps(data, indent=1)))
    return path


def load_plan(path: str | Path) -> Plan:
    path = Path(path)
    f = path / "plan.json" if path.is_dir() else path
    try:
        data = json.loads(f.read_text())
    except FileNotFoundError:
        raise PlanError(f"{f}: no such plan file") from None
    except (OSError, json.JSONDecodeError) as e:
        raise PlanError(f"{f}: cannot read plan ({e})") from None
    return Plan.from_dict(data, str(f))


def save_weights(params: dict[str, Any], path: str | Path) -> None:
    import torch
    from safetensors.torch import save_file

    tensors = {k: torch.as_tensor(v).contiguous() for k, v in params.items()}
    atomic_write(path, lambda t: save_file(tensors, str(t)))


def save_arrays(arrays: dict[str, np.ndarray], path: str | Path, dtypes: dict[str, str] | None = None) -> None:
    """Write NumPy arrays as safetensors without torch; an array whose ``dtypes`` entry is
    ``"bfloat16"`` holds bfloat16 bits (uint16) and is written as BF16, so torch reads it back as bfloat16."""
    from safetensors import TensorSpec, serialize_file

    keep = {k: np.ascontiguousarray(v) for k, v in arrays.items()}  # alive while serialize_file reads them
    specs = {}
    for k, a in keep.items():
        bf16 = (dtypes or {}).get(k) == "bfloat16" and a.dtype in (np.uint16, np.int16)
        try:
            specs[k] = TensorSpec(dtype="bfloat16" if bf16 else a.dtype.name, shape=a.shape, data_ptr=a.ctypes.data,
                                  data_len=a.nbytes)
        except Exception as e:  # an unsupported dtype
            raise PlanError(f"{path}: cannot store {k!r} of dtype {a.dtype} ({e})") from None
    atomic_write(path, lambda t: serialize_file(specs, str(t)))


def load_weights(path: str | Path, names: list[str] | None = None) -> dict[str, Any]:
    """Parameter values by name (all, or only ``names``) as NumPy arrays; safetensors never runs code.

    bfloat16 tensors (NumPy has none) come back as their raw bits in uint16 arrays,
    which the engines view by the graph's dtype; no torch is needed to read them.
    """
    from safetensors import safe_open

    out, bits = {}, []
    try:
        with safe_open(str(path), framework="numpy") as f:
            stored = set(f.keys())
            keys = stored if names is None else names
            for k in keys:
                if k in stored and f.get_slice(k).get_dtype() == "BF16":
                    bits.append(k)
                else:
                    out[k] = f.get_tensor(k)
        if bits:
            out.update(_bfloat16_bits(path, set(bits)))
    except FileNotFoundError:
        raise PlanError(f"{path}: no weights file") from None
    except Exception as e:  # safetensors raises its own error types
        raise PlanError(f"{path}: cannot read weights ({e})") from None
    return out


def _bfloat16_bits(path: str | Path, names: set[str]) -> dict[str, np.ndarray]:
    """The named BF16 tensors of a safetensors file as uint16 arrays (safetensors' framework-free reader)."""
    from safetensors import deserialize

    return {n: np.frombuffer(d["data"], dtype="<u2").reshape(d["shape"]).copy()
            for n, d in deserialize(Path(path).read_bytes()) if n in names}

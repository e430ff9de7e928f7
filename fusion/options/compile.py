"""The compile options (``fusion compile``, and ``fusion run`` on a MODEL): partitioner, schedule, data-parallel
sync, compression, optimizer, engines. One :class:`CompileOptions` section; its fields' ``group`` splits ``--help``."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from fusion.ir.lr_schedule import SCHEDULES
from fusion.options.field import Section, flag_of, option
from fusion.options.types import non_negative_int, positive_finite, positive_int, seed_int
from fusion.plan import OPTIMIZER_NAMES

#: one default for both `fusion compile` and `fusion run MODEL`
MICRO_BATCHES = 4

#: ``--outer-momentum`` when left out (a codec may prescribe its own then: SparseLoCo 0)
DEFAULT_OUTER_MOMENTUM = 0.6
#: ``--outer-momentum`` when left out under the eager overlapped outer step (``--outer-delay 1``, its default
#: variant): none; the convergence study's tuning seeds (docs/data-parallel.md, "Eager by default")
EAGER_OUTER_MOMENTUM = 0.0
#: partitioners that plan data-parallel replicas (fusion.partition.dp, fusion.partition.dtfm)
DP_STRATEGIES = ("dp", "dtfm")

PARTITION, DP, COMPRESSION, OPTIMIZER = "partition and schedule", "data-parallel replicas", "compression", "optimizer"


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


@dataclass
class CompileOptions(Section):
    """What a compile makes of a model: every field changes the plan (and is in the compile cache's key) except
    ``no_cache``."""

    TITLE = "compiling"

    strategy: str = option("--strategy", essential=True, default="opfence", choices=("opfence", "equal-count", "equal-flops", *DP_STRATEGIES), group=PARTITION, help="partitioner (OP-Fence may put a small model on one device; equal-count/equal-flops use every device of the cluster file, blind to links; dp plans data-parallel replicas of a pipeline and dtfm is DT-FM's scheduler for them, both with --global-batch)")
    micro_batches: int = option("--micro-batches", default=MICRO_BATCHES, type=positive_int, group=PARTITION, help="n_b: micro-batches per iteration")
    schedule: str = option("--schedule", default="gpipe", choices=("gpipe", "1f1b", "zb1", "interleaved", "auto"), group=PARTITION, help="pipeline schedule (default: gpipe); interleaved: interleaved 1F1B, the model cut into V x D chunks, chunk s on the (s %% D)-th device (--virtual-stages V; equal-flops or equal-count); auto: the compiler prices gpipe, 1f1b and zb1 on the chosen cut and devices (and, with --virtual-stages V > 1, interleaved on its own cut) by simulating their action lists and keeps the shortest predicted iteration among those that fit memory (ties: the smaller peak memory)")
    virtual_stages: int | None = option("--virtual-stages", type=positive_int, metavar="V", group=PARTITION, help="chunks (virtual stages) per device of --schedule interleaved (default 2), or with --schedule auto, V > 1 prices interleaved too; micro-batches must be a multiple of the devices")
    recompute: str = option("--recompute", default="auto", choices=("auto", "off", "all"), group=PARTITION, help="activation recomputation per part: auto turns it on only where a part would not fit its device otherwise")
    node_times: str | None = option("--node-times", metavar="FILE", group=PARTITION, help="per-node forward/backward seconds measured by `fusion profile --model MODEL -o FILE`: the estimator prices those nodes by them (scaled by profiling host speed / device speed) instead of FLOPs / lambda; one pipeline only (not with --replicas, --global-batch or --strategy dp|dtfm)")
    seed: int = option("--seed", default=0, type=seed_int, group=PARTITION, help="seed of the data and of anything random in compiling")
    precision: str = option("--precision", default="fp32", choices=("fp32", "bf16"), group=PARTITION, help="bf16: mixed precision: torch parts run forward and backward under torch.autocast (bfloat16), parameters and optimizer state stay fp32; activations autocast made bfloat16 cross cut edges as bfloat16 (half the bytes; a --compress codec encodes them as bfloat16). Torch parts only")
    engine: list = option("--engine", default=[], metavar="[PART=]ENGINE", group=PARTITION, help="execution engine of a part (e.g. part1=numpy), or of every part (e.g. numpy); repeatable, later ones win; parts are named part0, part1, ... in pipeline order, replica r's r<r>.part0, ... (default: torch)")
    loss: str | None = option("--loss", metavar="NAME", group=PARTITION, help="an output of the model to minimise (a floating-point scalar), for a model whose forward returns no single scalar loss (default: the model's loss; a model without one is refused)")

    replicas: int = option("--replicas", essential=True, default=1, type=positive_int, metavar="R", group=DP, help="data-parallel replicas of the compiled pipeline: replica 0 is the compiled one, each further replica puts the same stages on the fastest free devices that hold them (gradients averaged every step; --micro-batches then counts per replica; default 1)")
    global_batch: int | None = option("--global-batch", type=positive_int, metavar="ROWS", group=DP, help="rows of one step's batch over all replicas: split into R equal shares, each into micro-batches of the model's example size (sets --micro-batches)")
    dp_codec: str | None = option("--dp-codec", metavar="quant:bits=8[,block=N]", group=DP, help="quantise the gradient all-reduce between replicas (lossy; default: exact); with --dp-sync diloco, that of its --sync-warmup steps (needs a --pseudo-codec)")
    dp_allreduce: str = option("--dp-allreduce", default="ring", metavar="ring|tree|auto", group=DP, help="all-reduce of each stage's replicas: ring (bandwidth-optimal), tree (binomial reduce + broadcast: 2 ceil(log2 R) latencies instead of 2 (R-1)), or auto: per group the one the estimator prices cheaper on its links (default: ring)")
    dp_sync: str = option("--dp-sync", default="every", choices=("every", "diloco", "auto"), group=DP, help="how the replicas synchronise: every (gradients averaged every step, exact synchronous DP; the default), diloco (DiLoCo: --inner-steps H local steps with the plan's optimizer, then the replicas average their pseudo-gradients and an outer Nesterov SGD step updates the global weights; H times fewer exchanges; with --strategy dp the planner chooses what is not given) or auto (--strategy dp: the planner prices both and keeps DiLoCo where it is predicted >= 1.1x faster, choosing replicas, H, codec and shares)")
    inner_steps: str | None = option("--inner-steps", metavar="H[,H...]|auto[:H]", group=DP, help="diloco: inner steps per outer step (default 20), or with --strategy dp a comma list the planner chooses from (default 10,20,50,100,200,500); auto[:H]: each replica's inner steps in proportion to its predicted speed, H (default 20) for the fastest (docs/data-parallel.md, 'Inner steps by speed')")
    outer_lr: float = option("--outer-lr", default=0.7, type=float, metavar="X", group=DP, help="diloco: outer learning rate (0.7)")
    outer_momentum: float | None = option("--outer-momentum", type=float, metavar="M", group=DP, help="diloco: outer (Nesterov) momentum (default 0.6; 0 under the eager outer step and SparseLoCo; a value given, 0.6 included, is kept; 0: plain SGD)")
    no_nesterov: bool = option("--no-nesterov", kind="flag", group=DP, help="diloco: heavy-ball outer momentum, not Nesterov")
    pseudo_codec: str | None = option("--pseudo-codec", metavar="quant:bits=8|4 | topk:ratio=R | sparseloco[:chunk=C,k=K,beta=B]", group=DP, help="diloco: codec of the pseudo-gradients (each replica encodes its own once; lossy; default: exact averaging); sparseloco (SparseLoCo: chunk Top-k + 2-bit) turns error feedback on and the outer momentum off unless --outer-momentum is given")
    pseudo_error_feedback: bool = option("--pseudo-error-feedback", kind="flag", group=DP, help="diloco: keep what the codec did not send of each replica's pseudo-gradient and add it to the next one (needs --pseudo-codec)")
    replica_shares: str | None = option("--replica-shares", metavar="R=S[,R=S...]", group=DP, help="diloco: unequal islands: replica R takes share S of each global batch's micro-batches (1 where not given), and its pseudo-gradient weighs the samples it saw")
    sync_fragments: int = option("--sync-fragments", default=1, type=int, metavar="F", group=DP, help="diloco: Streaming DiLoCo: each stage's parameters in F fragments, fragment f synced after steps t with t %% H == f H / F (staggered: the exchange spread over H steps; 1)")
    sync_warmup: int | None = option("--sync-warmup", type=int, metavar="N", group=DP, help="diloco: the first N steps are synchronous DP (gradients averaged every step), then DiLoCo starts from those weights, each replica keeping its optimizer state (0: none; default: 0, or with --strategy dp the planner's choice: 150, at most a sixth of the run's --steps)")
    inner_lr: float | None = option("--inner-lr", type=float, metavar="X", group=DP, help="diloco: the replicas' own learning rate once DiLoCo runs (after the warm-up, which runs at --lr); the lr schedule scales it as it scales --lr (default: --lr, or with --strategy dp the planner's choice for adamw: --lr x 2/3 after a warm-up, --lr x sqrt(1/R) without one)")
    outer_delay: int | None = option("--outer-delay", type=int, metavar="D", group=DP, help="diloco: outer steps an update is applied late: 0 (the outer exchange blocks) or 1 (it overlaps the next H inner steps); default 0, or the planner's choice with --strategy dp")
    outer_overlap: str | None = option("--outer-overlap", metavar="eager|delayed", group=DP, help="diloco with --outer-delay 1: eager (the default; Kale et al. 2025: each replica applies its own pseudo-gradient at once, the others' one round late; outer momentum 0 unless --outer-momentum is given) or delayed (the naive step: the whole average one round late; converged worse here: docs/data-parallel.md)")

    compress_ratio: float | None = option("--compress-ratio", type=float, metavar="R", group=COMPRESSION, help="AdaTopK ratio r (Eq. 7) for the cut edges (default: no compression)")
    compress: str | None = option("--compress", essential=True, metavar="none|auto|CODEC[:K=V,...]", group=COMPRESSION, help="codec for activations (and gradients) on the cut edges where the cost model says it pays, e.g. quant:bits=8, hadamard-quant:bits=4,block=64, topk:ratio=100; auto: per edge and direction the fastest the cost model prices among the codecs the convergence study shows to converge (default: none)")
    compress_bwd: str | None = option("--compress-bwd", metavar="none|auto|CODEC[:K=V,...]", group=COMPRESSION, help="codec for the gradients sent back (default: as --compress)")
    bottleneck: str | None = option("--bottleneck", metavar="RANK|auto", group=COMPRESSION, help='learned bottlenecks at the cut (changes the model): each cut edge of the residual stream (or --bottleneck-edges) gets an encoder D->RANK on the producing part and a decoder RANK->D on the consuming part (ResBM: a fixed orthonormal low-rank identity path plus trained W_enc, W_dec, zero at start), so the edge sends RANK of D numbers per row; auto: the estimator picks D/64 .. D/8 (docs/compression.md, "Bottlenecks at the cut")')
    bottleneck_edges: str | None = option("--bottleneck-edges", metavar="NODE[,NODE...]", group=COMPRESSION, help="the cut edges to bottleneck, by producer node (NODE[INDEX] for one output of a multi-output node), or all (every float cut edge, e.g. an MLP's hidden layer where the cut falls inside a block); default: every cut edge of the residual width")
    subspace: str | None = option("--subspace", metavar="K|FRACTION", group=COMPRESSION, help='confine the residual stream to a seeded rank-K subspace (changes the model; needs --allow-architecture-change): every writer writes through a fixed d x K basis, the token embedding\'s rest is a fixed table rebuilt from the ids, so a cut on the stream sends K coordinates + ids and loses nothing (docs/compression.md, "Subspace")')
    allow_architecture_change: bool = option("--allow-architecture-change", kind="flag", group=COMPRESSION, help="consent to a changed model: needed by --subspace; with --compress auto (and no --subspace/--bottleneck) the compiler prices the model as it is, a subspace-confined stream at K = d/16 and d/6 and a bottleneck at its auto rank, and keeps the shortest predicted iteration (fusion inspect lists them); without it auto only picks codecs")
    samples: int | None = option("--samples", type=positive_int, metavar="N", group=COMPRESSION, help="training samples in the data set (distinct sample ids the data gives, visited again every epoch): sizes delta (AQ-SGD) buffers in the memory model and lets --compress auto choose delta (needed for delta unless fusion run trains on the built-in text corpus)")
    tied_codec: str | None = option("--tied-codec", metavar="none|auto|CODEC[:K=V,...]", group=COMPRESSION, help="codec for the gradients that the owners of a tied parameter (e.g. a tied embedding and LM head on two parts) exchange each step, e.g. quant:bits=8; auto: 8-bit quant where the cost model says the iteration gets shorter (default: auto with --compress auto, else none: exact)")

    optimizer: str = option("--optimizer", default="sgd", choices=OPTIMIZER_NAMES, group=OPTIMIZER, help="optimizer of every part; muon: torch.optim.Muon on the 2-D weights, AdamW on embeddings, norms and biases, one --lr (torch engine only; docs/training.md)")
    lr: float = option("--lr", essential=True, default=0.01, type=float, group=OPTIMIZER, help="learning rate")
    momentum: float = option("--momentum", default=0.0, type=float, group=OPTIMIZER, help="SGD momentum")
    weight_decay: float = option("--weight-decay", default=0.0, type=float, group=OPTIMIZER, help="weight decay")
    lr_schedule: str = option("--lr-schedule", default="constant", choices=SCHEDULES, group=OPTIMIZER, help="learning rate per step: constant, or linear / cosine decay to 0 at --lr-decay-steps (Hugging Face's schedules, torch's LambdaLR; docs/training.md)")
    warmup_steps: int = option("--warmup-steps", default=0, type=non_negative_int, metavar="N", group=OPTIMIZER, help="linear warmup of the learning rate from 0 over the first N steps (default 0)")
    lr_decay_steps: int | None = option("--lr-decay-steps", type=positive_int, metavar="N", group=OPTIMIZER, help="steps the linear/cosine schedule decays over (default: fusion run's --steps; fusion compile needs it with --lr-schedule linear|cosine)")
    clip_grad_norm: float | None = option("--clip-grad-norm", type=positive_finite, metavar="X", group=OPTIMIZER, help="clip the gradients to global L2 norm X over every part (torch's clip_grad_norm_; default: no clipping)")

    no_cache: bool = option("--no-cache", kind="flag", help='compile afresh: neither use nor store the compile cache ($FUSION_CACHE, default ~/.cache/fusion; docs/compiler.md "Compile cache")')

    def check(self) -> None:
        """Values that cannot be right (issue 26), before torch is imported or a model traced. (The DiLoCo
        options are checked as early by ``DPSync``'s own rules, through compile's option parsing.)"""
        from fusion.ir.errors import FusionError

        rules = [
            ("lr", lambda v: _finite(v) and v > 0, "must be a positive number"),
            ("momentum", lambda v: _finite(v) and 0 <= v < 1, "must be in [0, 1)"),
            ("weight_decay", lambda v: _finite(v) and v >= 0, "must be 0 or more"),
            ("inner_lr", lambda v: v is None or (_finite(v) and v > 0), "must be a positive number"),
            ("compress_ratio", lambda v: v is None or (_finite(v) and v >= 1),
             "must be at least 1 (AdaTopK keeps 1/R of the values, Eq. 7)"),
        ]
        for dest, ok, rule in rules:
            if not ok(getattr(self, dest)):
                raise FusionError(f"--{dest.replace('_', '-')} {getattr(self, dest)}: {rule}")
        self._check_engines()
        self._check_combinations()

    def _check_combinations(self) -> None:
        """Options that exclude each other: virtual stages without an interleaved schedule, interleaved 1F1B with
        replicas, and what the data-parallel planners do not plan yet (bottlenecks, a tied codec)."""
        from fusion.ir.errors import FusionError

        if self.dp_allreduce not in ("ring", "tree", "auto"):
            raise FusionError(f"--dp-allreduce {self.dp_allreduce!r}: expected ring, tree or auto")
        if self.virtual_stages is not None and self.schedule not in ("interleaved", "auto"):
            raise FusionError(f"--virtual-stages {self.virtual_stages}: virtual stages are chunks of interleaved "
                              f"1F1B; give --schedule interleaved (or auto), not {self.schedule}")
        interleaves = self.schedule == "interleaved" or (self.schedule == "auto" and (self.virtual_stages or 1) > 1)
        if interleaves and self.strategy in DP_STRATEGIES:
            raise FusionError(f"--schedule {self.schedule} --virtual-stages: the {self.strategy} planner plans "
                              "data-parallel replicas, which interleaved 1F1B does not run; use --strategy "
                              "equal-flops or equal-count")
        if interleaves and self.replicas > 1:
            raise FusionError(f"--replicas {self.replicas}: interleaved 1F1B runs one pipeline (no data-parallel "
                              "replicas); leave out --replicas or use --schedule 1f1b/zb1")
        if self.strategy in DP_STRATEGIES and (self.bottleneck is not None or self.subspace is not None):
            what = "--bottleneck" if self.bottleneck is not None else "--subspace"
            raise FusionError(f"{what} with --strategy {self.strategy}: the data-parallel planners do not "
                              "rewrite the model yet; use opfence, equal-flops or equal-count (with --replicas)")
        if self.strategy in DP_STRATEGIES and self.tied_codec is not None:
            raise FusionError(f"--tied-codec with --strategy {self.strategy}: the data-parallel planners do not "
                              "price a tied codec yet; leave it out")

    def _check_engines(self) -> None:
        """Each ``--engine`` names a known engine; ``--precision bf16`` only with torch ones: each codec encodes a
        cut tensor in the dtype autocast gave it and the receiver decodes to that dtype (docs/training.md)."""
        if not self.engine:
            return
        from fusion.executors.engines.select import engine_names
        from fusion.ir.errors import FusionError

        for spec in self.engine:
            engine = spec.rpartition("=")[2]
            if engine not in engine_names():
                raise FusionError(f"--engine {spec}: unknown engine {engine!r} (known: {', '.join(engine_names())})")
            if engine != "torch" and self.precision == "bf16":
                raise FusionError(f"--precision bf16 with --engine {spec}: mixed precision is torch autocast; "
                                  f"the {engine} engine runs fp32 only")

    def values(self) -> dict:
        """Option name -> value of every field that changes the plan (all but ``no_cache``)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "no_cache"}

    def changed(self) -> list[str]:
        """The flags whose value is not the default (what a PLAN target refuses: it has them fixed)."""
        fresh = CompileOptions()
        return [flag_of(f).flags[-1] for f in dataclasses.fields(self)
                if f.name != "no_cache" and getattr(self, f.name) != getattr(fresh, f.name)]


@dataclass
class CompileJob:
    """One compile: the model, the cluster file, the compile options, and the two ``fusion run`` options the compile
    reads (None under ``fusion compile``): ``steps`` (the lr schedule's length without ``--lr-decay-steps``; the
    cap on the DP planner's DiLoCo warm-up without ``--sync-warmup``) and
    ``data`` (the corpus size for ``--compress``'s delta buffers)."""

    #: file.py:function or model.onnx[:loss]
    target: str
    #: the cluster file (YAML or scenario JSON) or a shipped scenario's name
    cluster: str
    options: CompileOptions
    steps: int | None = None
    data: str | None = None

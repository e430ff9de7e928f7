"""``fusion compile MODEL --cluster FILE -o PLAN``: partition a model over a cluster into a plan."""
from __future__ import annotations

import argparse
from pathlib import Path

from fusion.commands.coordinator import positive_int, seed_int


def add_parser(sub) -> None:
    p = sub.add_parser("compile", help="partition a model over a cluster (OP-Fence + AdaTopK) into a plan",
                       description="Load MODEL (file.py:function returning a fusion Model, an OpGraph, or "
                                   "(module, example inputs)) and a cluster file (YAML or scenario JSON), "
                                   "partition the OP-DAG and write the plan directory.")
    p.add_argument("model", help="file.py:function")
    p.add_argument("--cluster", required=True, help="cluster file (.yaml or scenario .json)")
    defaults = add_compile_options(p)
    p.add_argument("-o", "--output", "--out", required=True, metavar="PLAN",
                   help="plan folder to write (a new or empty folder, or with --force a plan to replace)")
    p.add_argument("--force", action="store_true", help="replace the plan already in -o PLAN")
    p.set_defaults(run=run, compile_defaults=defaults)


#: one default for both `fusion compile` and `fusion run MODEL`
MICRO_BATCHES = 4


#: partitioners that plan data-parallel replicas (fusion.partition.dp, fusion.partition.dtfm)
DP_STRATEGIES = ("dp", "dtfm")


def add_compile_options(p, note: str = "") -> dict[str, object]:
    """The partitioner, schedule, compression, optimizer and engine options (``compile``, and ``run`` on a MODEL).

    Returns option dest -> default.
    """
    from fusion.plan import OPTIMIZER_NAMES

    g = p.add_argument_group(f"compiling{note}")
    actions = [
        g.add_argument("--strategy", default="opfence", choices=["opfence", "equal-count", "equal-flops", *DP_STRATEGIES],
                       help="partitioner (OP-Fence may put a small model on one device; equal-count/equal-flops "
                            "use every device of the cluster file, blind to links; dp plans data-parallel replicas "
                            "of a pipeline and dtfm is DT-FM's scheduler for them, both with --global-batch)"),
        g.add_argument("--micro-batches", type=positive_int, default=MICRO_BATCHES,
                       help="n_b: micro-batches per iteration"),
        g.add_argument("--replicas", type=positive_int, default=1, metavar="R",
                       help="data-parallel replicas of the compiled pipeline: replica 0 is the compiled one, each "
                            "further replica puts the same stages on the fastest free devices that hold them "
                            "(gradients averaged every step; --micro-batches then counts per replica; default 1)"),
        g.add_argument("--dp-codec", default=None, metavar="quant:bits=8[,block=N]",
                       help="quantise the gradient all-reduce between replicas (lossy; default: exact)"),
        g.add_argument("--dp-allreduce", default="ring", metavar="ring|tree|auto",
                       help="all-reduce of each stage's replicas: ring (bandwidth-optimal), tree (binomial reduce + "
                            "broadcast: 2 ceil(log2 R) latencies instead of 2 (R-1)), or auto: per group the one "
                            "the estimator prices cheaper on its links (default: ring)"),
        g.add_argument("--dp-sync", default="every", choices=["every", "diloco", "auto"],
                       help="how the replicas synchronise: every (gradients averaged every step, exact synchronous "
                            "DP; the default), diloco (DiLoCo: --inner-steps H local steps with the plan's "
                            "optimizer, then the replicas average their pseudo-gradients and an outer Nesterov SGD "
                            "step updates the global weights; H times fewer exchanges; with --strategy dp the planner "
                            "chooses what is not given) or auto (--strategy dp: the planner prices both and keeps "
                            "DiLoCo where it is predicted >= 1.1x faster, choosing replicas, H, codec and shares)"),
        g.add_argument("--inner-steps", default=None, metavar="H[,H...]",
                       help="diloco: inner steps per outer step (default 20), or with --strategy dp a comma list "
                            "the planner chooses from (default 10,20,50,100,200,500)"),
        g.add_argument("--outer-lr", type=float, default=0.7, metavar="X", help="diloco: outer learning rate (0.7)"),
        g.add_argument("--outer-momentum", type=float, default=DEFAULT_OUTER_MOMENTUM, metavar="M",
                       help="diloco: outer (Nesterov) momentum (0.6; 0: plain SGD)"),
        g.add_argument("--no-nesterov", action="store_true", help="diloco: heavy-ball outer momentum, not Nesterov"),
        g.add_argument("--pseudo-codec", default=None,
                       metavar="quant:bits=8|4 | topk:ratio=R | sparseloco[:chunk=C,k=K,beta=B]",
                       help="diloco: codec of the pseudo-gradients (each replica encodes its own once; lossy; "
                            "default: exact averaging); sparseloco (SparseLoCo: chunk Top-k + 2-bit) turns error "
                            "feedback on and the outer momentum off unless --outer-momentum is given"),
        g.add_argument("--pseudo-error-feedback", action="store_true",
                       help="diloco: keep what the codec did not send of each replica's pseudo-gradient and add it "
                            "to the next one (needs --pseudo-codec)"),
        g.add_argument("--replica-shares", default=None, metavar="R=S[,R=S...]",
                       help="diloco: unequal islands: replica R takes share S of each global batch's micro-batches "
                            "(1 where not given), and its pseudo-gradient weighs the samples it saw"),
        g.add_argument("--sync-fragments", type=int, default=1, metavar="F",
                       help="diloco: Streaming DiLoCo: each stage's parameters in F fragments, fragment f synced "
                            "after steps t with t %% H == f H / F (staggered: the exchange spread over H steps; 1)"),
        g.add_argument("--outer-delay", type=int, default=None, metavar="D",
                       help="diloco: outer steps an update is applied late: 0 (the outer exchange blocks) or 1 (it "
                            "overlaps the next H inner steps); default 0, or the planner's choice with --strategy dp"),
        g.add_argument("--sync-warmup", type=int, default=0, metavar="N",
                       help="diloco: the first N steps are synchronous DP (gradients averaged every step), then "
                            "DiLoCo starts from those weights, each replica keeping its optimizer state (0: none)"),
        g.add_argument("--outer-overlap", default=None, metavar="eager|delayed",
                       help="diloco with --outer-delay 1: delayed (the default: the whole average one round late) or "
                            "eager (Kale et al. 2025: each replica applies its own pseudo-gradient at once, the "
                            "others' one round late; it converged worse than delayed with the default outer "
                            "momentum here: docs/data-parallel.md)"),
        g.add_argument("--global-batch", type=positive_int, default=None, metavar="ROWS",
                       help="rows of one step's batch over all replicas: split into R equal shares, each into "
                            "micro-batches of the model's example size (sets --micro-batches)"),
        g.add_argument("--compress-ratio", type=float, default=None, metavar="R",
                       help="AdaTopK ratio r (Eq. 7) for the cut edges (default: no compression)"),
        g.add_argument("--compress", default=None, metavar="none|auto|CODEC[:K=V,...]",
                       help="codec for activations (and gradients) on the cut edges where the cost model says it "
                            "pays, e.g. quant:bits=8, hadamard-quant:bits=4,block=64, topk:ratio=100; "
                            "auto: per edge and direction the fastest the cost model prices among the codecs the "
                            "convergence study shows to converge (default: none)"),
        g.add_argument("--compress-bwd", default=None, metavar="none|auto|CODEC[:K=V,...]",
                       help="codec for the gradients sent back (default: as --compress)"),
        g.add_argument("--bottleneck", default=None, metavar="RANK|auto",
                       help="learned bottlenecks at the cut (changes the model): each cut edge of the residual stream "
                            "(or --bottleneck-edges) gets an encoder D->RANK on the producing part and a decoder "
                            "RANK->D on the consuming part (ResBM: a fixed orthonormal low-rank identity path plus "
                            "trained W_enc, W_dec, zero at start), so the edge sends RANK of D numbers per row; auto: "
                            "the estimator picks D/64 .. D/8 (docs/compression.md, \"Bottlenecks at the cut\")"),
        g.add_argument("--bottleneck-edges", default=None, metavar="NODE[,NODE...]",
                       help="the cut edges to bottleneck, by producer node (NODE[INDEX] for one output of a "
                            "multi-output node), or all (every float cut edge, e.g. an MLP's hidden layer where the "
                            "cut falls inside a block); default: every cut edge of the residual width"),
        g.add_argument("--allow-architecture-change", action="store_true",
                       help="let --compress auto add bottlenecks at the cut (new parameters) where the estimator "
                            "says the iteration gets shorter; without it auto only picks codecs"),
        g.add_argument("--samples", type=positive_int, default=None, metavar="N",
                       help="training samples in the data set (distinct sample ids the data gives, visited again "
                            "every epoch): sizes delta (AQ-SGD) buffers in the memory model and lets --compress auto "
                            "choose delta (needed for delta unless fusion run trains on the built-in text corpus)"),
        g.add_argument("--tied-codec", default=None, metavar="none|auto|CODEC[:K=V,...]",
                       help="codec for the gradients that the owners of a tied parameter (e.g. a tied embedding "
                            "and LM head on two parts) exchange each step, e.g. quant:bits=8; auto: 8-bit quant "
                            "where the cost model says the iteration gets shorter (default: auto with "
                            "--compress auto, else none: exact)"),
        g.add_argument("--schedule", default="gpipe", choices=["gpipe", "1f1b", "zb1", "interleaved", "auto"],
                       help="pipeline schedule (default: gpipe); interleaved: interleaved 1F1B, the model cut into "
                            "V x D chunks, chunk s on the (s %% D)-th device (--virtual-stages V; equal-flops or "
                            "equal-count); auto: the compiler prices gpipe, 1f1b and zb1 on the chosen cut and devices "
                            "(and, with --virtual-stages V > 1, interleaved on its own cut) by simulating their "
                            "action lists and keeps the shortest predicted iteration among those that fit memory "
                            "(ties: the smaller peak memory)"),
        g.add_argument("--virtual-stages", type=positive_int, default=None, metavar="V",
                       help="chunks (virtual stages) per device of --schedule interleaved (default 2), or with "
                            "--schedule auto, V > 1 prices interleaved too; micro-batches must be a multiple of "
                            "the devices"),
        g.add_argument("--recompute", default="auto", choices=["auto", "off", "all"],
                       help="activation recomputation per part: auto turns it on only where a part would not fit "
                            "its device otherwise"),
        g.add_argument("--node-times", default=None, metavar="FILE",
                       help="per-node forward/backward seconds measured by `fusion profile --model MODEL -o FILE`: "
                            "the estimator prices those nodes by them (scaled by profiling host speed / device "
                            "speed) instead of FLOPs / lambda; one pipeline only (not with --replicas, "
                            "--global-batch or --strategy dp|dtfm)"),
        g.add_argument("--optimizer", default="sgd", choices=list(OPTIMIZER_NAMES),
                       help="optimizer of every part; muon: torch.optim.Muon on the 2-D weights, AdamW on "
                            "embeddings, norms and biases, one --lr (torch engine only; docs/training.md)"),
        g.add_argument("--lr", type=float, default=0.01, help="learning rate"),
        g.add_argument("--momentum", type=float, default=0.0, help="SGD momentum"),
        g.add_argument("--weight-decay", type=float, default=0.0, help="weight decay"),
        *add_training_knobs(g),
        g.add_argument("--seed", type=seed_int, default=0, help="seed of the data and of anything random in compiling"),
        g.add_argument("--precision", default="fp32", choices=["fp32", "bf16"],
                       help="bf16: mixed precision: torch parts run forward and backward under torch.autocast "
                            "(bfloat16), parameters and optimizer state stay fp32; activations autocast made "
                            "bfloat16 cross cut edges as bfloat16 (half the bytes; a --compress codec encodes them as "
                            "bfloat16). Torch parts only"),
        add_engine_arg(g),
    ]
    # the loss to minimise (issue 26; fusion.loss): a model without one is refused unless --loss names one
    actions.append(g.add_argument("--loss", default=None, metavar="NAME",
                                  help="an output of the model to minimise (a floating-point scalar), for a model "
                                       "whose forward returns no single scalar loss (default: the model's loss; a "
                                       "model without one is refused)"))
    from fusion.commands.compile_cache import add_cache_arg

    add_cache_arg(g)  # not among the returned options: it changes no plan
    return {a.dest: a.default for a in actions}


def add_training_knobs(g) -> list:
    """``--lr-schedule``, ``--warmup-steps``, ``--lr-decay-steps``, ``--clip-grad-norm`` (the plan's optimizer section:
    ``OptimizerConfig.lr_schedule`` .. ``clip_grad_norm``); each value is checked by argparse, before any trace."""
    from fusion.commands.coordinator import non_negative_int, positive_finite
    from fusion.ir.lr_schedule import SCHEDULES

    return [
        g.add_argument("--lr-schedule", default="constant", choices=SCHEDULES,
                       help="learning rate per step: constant, or linear / cosine decay to 0 at --lr-decay-steps "
                            "(Hugging Face's schedules, torch's LambdaLR; docs/training.md)"),
        g.add_argument("--warmup-steps", type=non_negative_int, default=0, metavar="N",
                       help="linear warmup of the learning rate from 0 over the first N steps (default 0)"),
        g.add_argument("--lr-decay-steps", type=positive_int, default=None, metavar="N",
                       help="steps the linear/cosine schedule decays over (default: fusion run's --steps; "
                            "fusion compile needs it with --lr-schedule linear|cosine)"),
        g.add_argument("--clip-grad-norm", type=positive_finite, default=None, metavar="X",
                       help="clip the gradients to global L2 norm X over every part (torch's clip_grad_norm_; "
                            "default: no clipping)"),
    ]


def optimizer_from_args(args: argparse.Namespace):
    """The plan's ``OptimizerConfig`` from the options; FusionError naming the option. Called before the model
    is traced, so a bad value costs no trace."""
    from fusion.ir.errors import FusionError
    from fusion.plan import OptimizerConfig

    total = 0  # (--lr, --momentum and --weight-decay: fusion.commands.checks, which runs first)
    if args.lr_schedule != "constant":
        total = args.lr_decay_steps or getattr(args, "steps", None) or 0
        if not total:
            raise FusionError(f"--lr-schedule {args.lr_schedule} needs --lr-decay-steps N (the steps it decays over)")
        if args.warmup_steps > total:
            raise FusionError(f"--warmup-steps {args.warmup_steps} exceeds the {total} steps the {args.lr_schedule} "
                              "schedule spans (--lr-decay-steps, or --steps)")
    elif args.lr_decay_steps is not None:
        raise FusionError("--lr-decay-steps applies to --lr-schedule linear or cosine, not constant")
    try:
        return OptimizerConfig(args.optimizer, args.lr, args.momentum, args.weight_decay, lr_schedule=args.lr_schedule,
                               warmup_steps=args.warmup_steps, total_steps=total, clip_grad_norm=args.clip_grad_norm)
    except ValueError as e:
        raise FusionError(f"--optimizer/--lr: {e}") from None


def compile_from_args(args: argparse.Namespace, model, cluster):
    """The plan for ``model`` on ``cluster`` with the options of :func:`add_compile_options`, engines assigned."""
    from fusion.compile import compile_model
    from fusion.plan import OptimizerConfig
    from fusion.ir.errors import FusionError

    opt = optimizer_from_args(args)
    from fusion.compress.policy import request

    compress = request(args.compress, args.compress_bwd, *_data_samples(args, model))
    if compress is not None and args.compress_ratio is not None:
        raise FusionError("--compress-ratio (AdaTopK) and --compress/--compress-bwd (codecs) exclude each other")
    dp_codec = _dp_codec(args)
    dp_sync = dp_sync_from_args(args)
    tied = _tied_codec(args)
    if args.dp_allreduce not in ("ring", "tree", "auto"):
        raise FusionError(f"--dp-allreduce {args.dp_allreduce!r}: expected ring, tree or auto")
    if args.virtual_stages is not None and args.schedule not in ("interleaved", "auto"):
        raise FusionError(f"--virtual-stages {args.virtual_stages}: virtual stages are chunks of interleaved 1F1B; "
                          f"give --schedule interleaved (or auto), not {args.schedule}")
    interleaves = args.schedule == "interleaved" or (args.schedule == "auto" and (args.virtual_stages or 1) > 1)
    if interleaves and args.strategy in DP_STRATEGIES:
        raise FusionError(f"--schedule {args.schedule} --virtual-stages: the {args.strategy} planner plans data-parallel "
                          "replicas, which interleaved 1F1B does not run; use --strategy equal-flops or equal-count")
    if interleaves and args.replicas > 1:
        raise FusionError(f"--replicas {args.replicas}: interleaved 1F1B runs one pipeline (no data-parallel replicas); "
                          "leave out --replicas or use --schedule 1f1b/zb1")
    node_times = _node_times(args)
    if args.strategy in DP_STRATEGIES:
        if getattr(args, "bottleneck", None) is not None:
            raise FusionError(f"--bottleneck with --strategy {args.strategy}: the data-parallel planners do not "
                              "insert bottlenecks yet; use opfence, equal-flops or equal-count (with --replicas)")
        if args.tied_codec is not None:
            raise FusionError(f"--tied-codec with --strategy {args.strategy}: the data-parallel planners do not price "
                              "a tied codec yet; leave it out")
        plan = _compile_dp(args, model, cluster, opt, compress, dp_codec)
        set_dp_allreduce(plan, cluster, args.dp_allreduce)
        if args.dp_sync == "every":
            _set_dp_sync(plan, dp_sync)
        else:  # the planner chose H, codec, shares (apply_dp_sync); the outer optimizer is the user's
            _keep_outer_options(plan, dp_sync)
        set_precision(plan, args.precision)
        return plan
    micro = args.micro_batches
    if args.global_batch is not None:
        from fusion.replicas import split_global_batch

        rows = {int(v.shape[0]) for v in (model.example or {}).values() if getattr(v, "ndim", 0)}
        # the default --micro-batches gives way to what the global batch makes; another value must agree with it
        micro = split_global_batch(args.global_batch, args.replicas, 0 if micro == MICRO_BATCHES else micro,
                                   rows.pop() if len(rows) == 1 else None)
    bneck = bottleneck_from_args(args)
    plan = compile_model(model, cluster, strategy=args.strategy, micro_batches=micro,
                         compress_ratio=args.compress_ratio, schedule=args.schedule, optimizer=opt, seed=args.seed,
                         compress=compress, recompute=args.recompute, tied_codec=tied,
                         virtual_stages=args.virtual_stages, node_times=node_times, bottleneck=bneck)
    if plan.bottlenecks:  # the model is now the one with bottlenecks: its graph and initial weights
        from fusion.compress.bottleneck import initial_values

        model.graph = plan.graph
        if model.params:
            model.params = {**model.params, **initial_values(plan.bottlenecks)}
    if dp_codec is not None and args.replicas < 2:
        raise FusionError("--dp-codec needs --replicas 2 or more")
    if args.replicas > 1 or args.global_batch is not None:
        from fusion.replicas import next_free_devices, replicate

        plan = replicate(plan, cluster, next_free_devices(plan, cluster, args.replicas), args.global_batch or 0,
                         dp_codec=dp_codec)
    set_dp_allreduce(plan, cluster, args.dp_allreduce)
    _set_dp_sync(plan, dp_sync)
    assign_engines(plan, args.engine)
    set_precision(plan, args.precision)
    record_codec_plugins(plan)
    return plan


def bottleneck_from_args(args: argparse.Namespace):
    """The :class:`~fusion.compress.bottleneck.BottleneckRequest` of ``--bottleneck``, ``--bottleneck-edges`` and
    ``--compress auto --allow-architecture-change`` (None: the model stays as it is); FusionError, one line, for
    a bad rank or an edge list without a bottleneck."""
    from fusion.compress.bottleneck import BottleneckRequest, parse_rank
    from fusion.ir.errors import FusionError

    rank, names = getattr(args, "bottleneck", None), getattr(args, "bottleneck_edges", None)
    edges = tuple(n.strip() for n in names.split(",") if n.strip()) if names is not None else None
    consent = getattr(args, "allow_architecture_change", False)
    if rank is not None:
        if getattr(args, "precision", "fp32") != "fp32":
            raise FusionError("--bottleneck with --precision bf16 is not built (the bottleneck is fp32 matmuls)")
        return BottleneckRequest(parse_rank(rank), edges)
    if (getattr(args, "compress", None) or "").strip() == "auto" and consent:
        return BottleneckRequest("auto", edges, optional=True)
    if edges is not None:
        raise FusionError("--bottleneck-edges names the edges of --bottleneck RANK|auto (or of --compress auto "
                          "--allow-architecture-change); give one of them")
    return None


def set_precision(plan, precision: str) -> None:
    """``Plan.precision`` from ``--precision``; bf16 on a non-torch part is refused."""
    from fusion.ir.errors import FusionError
    from fusion.plan import PlanError

    plan.precision = precision
    try:
        plan._check_precision(f"--precision {precision}")
    except PlanError as e:
        raise FusionError(str(e)) from None


def _set_dp_sync(plan, sync) -> None:
    """``Plan.dp_sync``; a DP planner that chose one replica leaves nothing to synchronise (synchronous DP)."""
    from fusion.ir.errors import FusionError
    from fusion.plan import DPSync

    from fusion.executors.runtime.outer import replica_micro_batches

    plan.dp_sync = sync if plan.replicas > 1 else DPSync()
    plan.check()
    try:
        replica_micro_batches(plan)  # every replica must get a micro-batch of each step
    except FusionError as e:
        raise FusionError(str(e).replace("plan.dp_sync.shares", "--replica-shares")) from None


def _keep_outer_options(plan, asked) -> None:
    """After the DiLoCo planner wrote ``plan.dp_sync``: the outer optimizer (lr, momentum, Nesterov) and error
    feedback are the user's options (``asked``), which the planner does not price."""
    import dataclasses

    if plan.dp_sync.mode != "diloco":
        return
    plan.dp_sync = dataclasses.replace(plan.dp_sync, outer_lr=asked.outer_lr, outer_momentum=asked.outer_momentum,
                                       nesterov=asked.nesterov,
                                       error_feedback=asked.error_feedback and plan.dp_sync.codec is not None,
                                       # the variant of a delay the planner chose: the user's
                                       overlap=asked.overlap if plan.dp_sync.delay else "delayed")
    plan.dp_sync = codec_outer(dataclasses.replace(plan.dp_sync, sync_warmup=asked.sync_warmup),
                               asked.outer_momentum != DEFAULT_OUTER_MOMENTUM)
    _set_dp_sync(plan, plan.dp_sync)


def _node_times(args: argparse.Namespace):
    """The table of ``--node-times`` (None without it); FusionError (exit 2, one line) for a bad file or an
    option the measured prices are not wired into."""
    from fusion.cost.node_times import NodeTimes
    from fusion.ir.errors import FusionError

    path = getattr(args, "node_times", None)
    if path is None:
        return None
    if args.strategy in DP_STRATEGIES:
        raise FusionError(f"--node-times with --strategy {args.strategy}: the data-parallel planners price by FLOPs "
                          "only; use --strategy opfence, equal-flops or equal-count")
    if args.replicas > 1 or args.global_batch is not None:
        raise FusionError("--node-times prices one pipeline; replicas (--replicas, --global-batch) are priced by "
                          "FLOPs only: leave one of them out")
    return NodeTimes.load(path)


def set_dp_allreduce(plan, cluster, mode: str) -> None:
    """``--dp-allreduce``: each stage group's all-reduce (``Plan.dp_algo``), priced by :mod:`fusion.cost.dp` on its
    slowest link for its gradient bytes; ``auto`` takes the cheaper per group. ``ring`` leaves the plan as before."""
    import numpy as np

    from fusion.cost.dp import ALLREDUCE_TIMES, choose_allreduce
    from fusion.ir.boundary import part_order

    if plan.replicas < 2 or mode == "ring":
        return
    ratio = plan.dp_codec.get("bits", 8) / 32 if plan.dp_codec else 1.0
    algos, priced = {}, {}
    for stage in part_order(plan.graph, plan.assignment):
        names = {p for n, part in plan.assignment.items() if part == stage for p in plan.graph[n].param_names()}
        nbytes = ratio * sum(int(np.prod(plan.graph.params[p].shape, dtype=np.int64))
                             * (2 if plan.graph.params[p].dtype == "bfloat16" else np.dtype(plan.graph.params[p].dtype).itemsize)
                             for p in names if plan.graph.params[p].trainable)
        group = [cluster.index(plan.parts[p].device) for p in plan.dp_group(stage)]
        algos[stage], t = choose_allreduce(cluster, group, float(nbytes), mode)
        priced[stage] = {"algo": algos[stage], "grad_bytes": float(nbytes),
                         **{f"{a}_s": f(cluster, group, float(nbytes)) for a, f in ALLREDUCE_TIMES.items()}}
    plan.dp_algo = algos
    plan.predicted["dp_allreduce"] = priced


def _data_samples(args: argparse.Namespace, model) -> tuple[int | None, bool | None]:
    """(data set size for delta buffers, whether ``auto`` may choose delta): ``--samples``, or for
    ``fusion run`` on the built-in text corpus its window count, which ``auto`` does not use (windows are
    drawn at random, so a sample rarely comes back within a run)."""
    from fusion.data.batches import corpus_samples
    from fusion.ir.errors import FusionError

    if args.compress is None and args.compress_bwd is None:
        return args.samples, None
    corpus = corpus_samples(model.graph, args.data) if getattr(args, "data", None) else None
    if corpus is None:
        return args.samples, None
    if args.samples is not None and args.samples != corpus:
        raise FusionError(f"--samples {args.samples}: the built-in text corpus gives this model {corpus} windows, "
                          "drawn at random; --samples is the size of a --data function's data set")
    return corpus, False


def _tied_codec(args: argparse.Namespace):
    """The codec cfg of ``--tied-codec`` (None: exact; ``"auto"``: the compiler decides, also the default with
    ``--compress auto``); FusionError (exit 2) with one line for a bad value."""
    from fusion.compress.policy import parse_spec
    from fusion.executors.runtime.compression import TiedCodec

    spec = getattr(args, "tied_codec", None)
    if spec is None:  # --compress auto compresses the tied exchange too, where it pays (8-bit quant)
        return "auto" if (getattr(args, "compress", None) or "").strip() == "auto" else None
    cfg = parse_spec(spec, "--tied-codec")
    if cfg is None or cfg == "auto":
        return cfg
    TiedCodec.from_cfg(cfg, f"--tied-codec {spec}")
    return cfg


def record_codec_plugins(plan) -> list[str]:
    """List, as plan plugins, the files that register the user codecs the plan names (its edges' codecs,
    ``tied_codec`` and ``dp_codec``), so that executors started with ``--trust-plugins`` import them and know the
    codecs. Returns the files added."""
    import sys

    from fusion.ir.errors import FusionError
    from fusion.kernels.codec import CODECS

    algos = {cfg["algo"] for e in plan.compression for cfg in (e.codec("fwd"), e.codec("bwd")) if cfg is not None}
    for extra in (plan.tied_codec, plan.dp_codec):
        if extra is not None:
            algos.add(extra["algo"])
    added = []
    for algo in sorted(algos):
        module = CODECS.user_module(algo)
        if module is None:
            continue
        path = getattr(sys.modules.get(module), "__file__", None)
        if not path or not path.endswith(".py"):
            raise FusionError(f"codec {algo!r} is defined in {module!r}, which is not a Python file a plan can carry; "
                              "register it from the model file (or a file the model file imports by path)")
        path = str(Path(path).resolve())
        if path not in plan.graph.plugins and module not in plan.graph.plugins:
            plan.graph.plugins = [*plan.graph.plugins, path]
            added.append(path)
    return added


def _dp_codec(args: argparse.Namespace):
    """The all-reduce codec of ``--dp-codec`` (None: exact averaging)."""
    from fusion.compress.policy import parse_spec
    from fusion.ir.errors import FusionError

    if args.dp_codec is None:
        return None
    cfg = parse_spec(args.dp_codec, "--dp-codec")
    from fusion.kernels.codecs import CODECS, Role

    if cfg is not None and (not isinstance(cfg, dict) or Role.DP_GRADIENT not in CODECS.unit(cfg["algo"]).roles):
        raise FusionError(f"--dp-codec {args.dp_codec}: the all-reduce takes "
                          f"{', '.join(CODECS.serving(Role.DP_GRADIENT))} (the codecs that serve data-parallel "
                          "gradients; e.g. quant:bits=B[,block=N]) or none")
    return cfg


#: ``--inner-steps`` of ``--dp-sync diloco`` when left out
DILOCO_INNER_STEPS = 20


def inner_steps_of(args: argparse.Namespace) -> tuple[int, ...] | None:
    """``--inner-steps H[,H...]`` as integers (None when not given); FusionError for a bad one or an H < 1."""
    from fusion.ir.errors import FusionError

    if args.inner_steps is None:
        return None
    try:
        hs = tuple(int(h) for h in str(args.inner_steps).split(","))
    except ValueError:
        raise FusionError(f"--inner-steps {args.inner_steps}: expected an integer H or a comma list of them") from None
    bad = [h for h in hs if h < 1]
    if bad:
        raise FusionError(f"--inner-steps {bad[0]}: DiLoCo takes at least one inner step per outer step")
    return hs


#: ``--outer-momentum`` when left out
DEFAULT_OUTER_MOMENTUM = 0.6


def codec_outer(sync, momentum_given: bool):
    """``sync`` with the outer step its pseudo-gradient codec's algorithm prescribes (the codec registry's answer):
    error feedback on where the codec always feeds back (SparseLoCo, arXiv 2508.15706 Algorithm 1), and the
    codec's outer momentum (SparseLoCo: 0, its error feedback replaces it) unless ``--outer-momentum`` was given."""
    import dataclasses

    from fusion.kernels.codecs import CODECS

    if sync.codec is None:
        return sync
    unit = CODECS.unit(sync.codec["algo"])
    changes: dict = {"error_feedback": True} if unit.pseudo_feedback else {}
    if unit.outer_momentum is not None and not momentum_given:
        changes["outer_momentum"] = unit.outer_momentum
    return dataclasses.replace(sync, **changes)


def dp_sync_from_args(args: argparse.Namespace):
    """The :class:`~fusion.plan.DPSync` of ``--dp-sync`` and its options, checked before the model is traced:
    FusionError (one line naming the flag) for H < 1, a codec that is unknown or not allowed for
    pseudo-gradients, DiLoCo with one replica, or a DiLoCo option without ``--dp-sync diloco``.
    (``--dp-sync auto``, the planner's choice, is to come from ``fusion.partition.dp``; it would be resolved
    here, after :func:`_compile_dp`'s planner ran.)"""
    from fusion.compress.policy import parse_spec
    from fusion.executors.runtime.outer import check_pseudo_codec
    from fusion.ir.errors import FusionError
    from fusion.plan import DPSync, PlanError

    if args.dp_sync == "every":
        given = [f for f, v, d in (("--inner-steps", args.inner_steps, None), ("--outer-lr", args.outer_lr, 0.7),
                                   ("--outer-momentum", args.outer_momentum, 0.6), ("--no-nesterov", args.no_nesterov, False),
                                   ("--pseudo-codec", args.pseudo_codec, None),
                                   ("--pseudo-error-feedback", args.pseudo_error_feedback, False),
                                   ("--replica-shares", args.replica_shares, None),
                                   ("--sync-fragments", args.sync_fragments, 1), ("--outer-delay", args.outer_delay, None),
                                   ("--outer-overlap", getattr(args, "outer_overlap", None), None),
                                   ("--sync-warmup", getattr(args, "sync_warmup", 0), 0))
                 if v != d]
        if given:
            raise FusionError(f"{given[0]} is an option of --dp-sync diloco (the replicas now average gradients every "
                              "step)")
        return DPSync()
    if args.dp_sync == "auto" and args.strategy != "dp":
        raise FusionError(f"--dp-sync auto is the --strategy dp planner's choice (not {args.strategy}); give "
                          "--strategy dp, or --dp-sync diloco with its options")
    hs = inner_steps_of(args)
    if hs is not None and len(hs) > 1 and args.strategy != "dp":
        raise FusionError(f"--inner-steps {args.inner_steps}: a list of H is for the --strategy dp planner to choose "
                          "from; give one H")
    h = DILOCO_INNER_STEPS if hs is None else hs[0]
    if args.strategy not in DP_STRATEGIES and args.replicas < 2:
        raise FusionError("--dp-sync diloco needs --replicas 2 or more (one replica has nobody to average with)")
    if args.dp_codec is not None and args.dp_sync == "diloco":
        raise FusionError("--dp-codec compresses the per-step gradient all-reduce, which --dp-sync diloco does not run; "
                          "use --pseudo-codec")
    if args.outer_delay not in (None, 0, 1):
        raise FusionError(f"--outer-delay {args.outer_delay}: an outer step is applied at once (0) or one outer step "
                          "late, its exchange overlapping the next H inner steps (1)")
    overlap = getattr(args, "outer_overlap", None)
    if overlap is not None and overlap not in DPSync.OVERLAPS:
        raise FusionError(f"--outer-overlap {overlap}: expected eager (each replica's own pseudo-gradient at once, "
                          "the others' one round late) or delayed (the whole average one round late)")
    if overlap is not None and args.outer_delay == 0:
        raise FusionError(f"--outer-overlap {overlap} is an option of --outer-delay 1 (with 0 the outer step blocks)")
    if args.sync_fragments < 1 or args.sync_fragments > h:
        raise FusionError(f"--sync-fragments {args.sync_fragments}: streaming fragments must number 1 .. --inner-steps "
                          f"({h}), one outer step of a fragment per inner step at most")
    codec = None
    if args.pseudo_codec is not None:
        codec = parse_spec(args.pseudo_codec, "--pseudo-codec")
        if codec == "auto":
            raise FusionError("--pseudo-codec auto: name the codec (quant:bits=8, quant:bits=4, topk:ratio=R) or none")
        check_pseudo_codec(codec, f"--pseudo-codec {args.pseudo_codec}")
    if args.pseudo_error_feedback and codec is None:
        raise FusionError("--pseudo-error-feedback needs a lossy --pseudo-codec (exact averaging leaves no residual)")
    shares = {}
    for item in filter(None, (args.replica_shares or "").split(",")):
        r, eq, v = item.partition("=")
        try:
            shares[int(r)] = float(v)
        except ValueError:
            raise FusionError(f"--replica-shares {args.replica_shares}: expected REPLICA=SHARE items, got {item!r}") from None
        if not eq:
            raise FusionError(f"--replica-shares {args.replica_shares}: expected REPLICA=SHARE items, got {item!r}")
    if args.strategy not in DP_STRATEGIES and any(r >= args.replicas for r in shares):
        raise FusionError(f"--replica-shares names replica {max(shares)}; there are {args.replicas} (0..{args.replicas - 1})")
    sync = DPSync("diloco", h, args.outer_lr, args.outer_momentum, not args.no_nesterov, codec,
                  args.pseudo_error_feedback, fragments=args.sync_fragments, delay=args.outer_delay or 0, shares=shares,
                  overlap=overlap or "delayed", sync_warmup=getattr(args, "sync_warmup", 0))
    sync = codec_outer(sync, args.outer_momentum != DEFAULT_OUTER_MOMENTUM)
    try:
        sync.check("--dp-sync diloco")
    except PlanError as e:
        msg = str(e)
        msg = msg.replace("--dp-sync diloco.shares", "--replica-shares").replace("--dp-sync diloco.sync_warmup",
                                                                                  "--sync-warmup")
        for name in ("outer_lr", "outer_momentum"):
            msg = msg.replace(f"--dp-sync diloco.{name}", "--" + name.replace("_", "-"))
        raise FusionError(msg) from None
    return sync


def _compile_dp(args: argparse.Namespace, model, cluster, opt, compress, dp_codec):
    """``--strategy dp|dtfm``: the planner chooses replicas, cut and placement (issue 14), then the plan is built."""
    from fusion.compile import _ensure_shapes
    from fusion.cost.estimate import optimizer_slots
    from fusion.ir.errors import FusionError
    from fusion.partition.dp import plan_dp
    from fusion.partition.dtfm import plan_dtfm
    from fusion.replicas import compile_replicated

    s = args.strategy
    if args.global_batch is None:
        raise FusionError(f"--strategy {s} plans data-parallel replicas for a step's batch: give --global-batch ROWS")
    if args.replicas != 1:
        raise FusionError(f"--strategy {s} chooses the number of replicas; leave out --replicas {args.replicas}")
    if compress is not None or args.compress_ratio is not None:
        raise FusionError(f"--strategy {s}: compressing cut edges is not planned with replicas yet (--dp-codec "
                          "compresses the gradient all-reduce)")
    if args.schedule == "auto":
        raise FusionError(f"--schedule auto: the {s} planner does not price schedules yet; give gpipe, 1f1b or zb1")
    _ensure_shapes(model)
    bits = dp_codec.get("bits", 8) if dp_codec else 32
    planner = plan_dp if s == "dp" else plan_dtfm
    pl = plan_dp_sync(args, model, cluster, opt, bits / 32)  # --dp-sync auto|diloco: the planner's choice
    if pl is None:
        pl = planner(model.graph, cluster, global_batch=args.global_batch, micro_batches=None, schedule=args.schedule,
                     optimizer_slots=optimizer_slots(opt.name, opt.momentum), seed=args.seed,
                     grad_wire_ratio=bits / 32, allreduce=args.dp_allreduce)
    micro = int(pl.predicted["micro_batches"])
    if args.micro_batches != MICRO_BATCHES and args.micro_batches != micro:
        raise FusionError(f"--micro-batches {args.micro_batches}: the {s} plan runs {micro} micro-batches per replica "
                          f"({pl.replicas} replicas of {args.global_batch} rows); leave it out")
    if dp_codec is not None and pl.replicas < 2:
        dp_codec = None  # one replica: nothing to average
    diloco = pl.info.get("dp_sync", {}).get("mode") == "diloco"
    # unequal DiLoCo shares: rows per replica are dp_sync.shares, and the plan's micro-batch count their mean
    batch = args.global_batch if args.global_batch % (pl.replicas * micro) == 0 or not diloco else 0
    plan = compile_replicated(model, cluster, pl.cut, pl.devices, micro_batches=micro, global_batch=batch,
                              schedule=args.schedule, optimizer=opt, seed=args.seed, strategy=pl.strategy,
                              dp_codec=None if diloco else dp_codec)
    plan.predicted["dp_planner"] = dict(pl.predicted)
    apply_dp_sync(plan, pl)
    # the planner priced the gradient all-reduce too (fusion.cost.dp): its iteration time is the plan's
    plan.predicted.update(iteration_s=pl.predicted["iteration_s"], dp_sync_s=pl.predicted["dp_sync_s"],
                          throughput_samples_s=pl.predicted["samples_per_s"])
    assign_engines(plan, args.engine)
    return plan


def plan_dp_sync(args: argparse.Namespace, model, cluster, opt, grad_wire_ratio: float = 1.0):
    """``--strategy dp --dp-sync auto`` (or ``diloco`` with knobs left open): the placement of
    :func:`fusion.partition.dp.choose_dp_sync`, which chooses the replicas, H, codec, shares and placement; None
    for every other ``--dp-sync`` (the planners as before). Knobs the user gave (``--inner-steps`` one value or
    a comma list, ``--pseudo-codec``, ``--sync-fragments``, ``--outer-delay``) narrow the search."""
    from fusion.cost.estimate import optimizer_slots
    from fusion.ir.errors import FusionError
    from fusion.partition.dp import SyncSearch, build_cost_model, choose_dp_sync

    mode = getattr(args, "dp_sync", None) or "every"
    if mode not in ("auto", "diloco"):
        return None
    if args.strategy != "dp":
        raise FusionError(f"--dp-sync {mode} with --strategy {args.strategy}: the DiLoCo planner is --strategy dp's")
    search = SyncSearch()
    hs = inner_steps_of(args)
    if hs is not None:
        search.inner_steps = hs
    codec = getattr(args, "pseudo_codec", None)
    if codec is not None:
        from fusion.compress.policy import parse_spec
        from fusion.cost.dp import PSEUDO_CODECS

        cfg = parse_spec(codec, "--pseudo-codec") if isinstance(codec, str) else codec
        if cfg != "auto":  # auto: the planner's list
            planned = list(dict.fromkeys(c["algo"] for c in PSEUDO_CODECS if c))  # the codecs the planner prices
            if cfg is not None and cfg.get("algo") not in planned:
                raise FusionError(f"--pseudo-codec {codec}: pseudo-gradients take {' or '.join(planned)} (or none)")
            search.codecs = (cfg,)
    # --sync-fragments' default (1 fragment) narrows the search too; --outer-delay left out: 0 and 1 are priced
    # (the runtime runs both) and the planner chooses
    for name, field in (("sync_fragments", "fragments"), ("outer_delay", "delays")):
        v = getattr(args, name, None)
        if v is not None:
            setattr(search, field, (int(v),))
    cm = build_cost_model(model.graph, cluster, schedule=args.schedule,
                          optimizer_slots=optimizer_slots(opt.name, opt.momentum))
    pl, _ = choose_dp_sync(cm, global_batch=args.global_batch, mode=mode, search=search, seed=args.seed,
                           allreduce=args.dp_allreduce, grad_wire_ratio=grad_wire_ratio)
    return pl


def apply_dp_sync(plan, pl) -> None:
    """Write the planner's sync choice into the plan: ``Plan.dp_sync`` and, for DiLoCo, its priced figures
    as ``predicted["dp_sync"]`` and the iteration (per inner step, the outer sync amortised)."""
    from fusion.plan import DPSync

    sync = pl.info.get("dp_sync")
    if not sync:
        return
    plan.dp_sync = DPSync.from_dict(sync, "planner: dp_sync")
    if plan.dp_sync.mode != "diloco":
        return
    plan.predicted["dp_sync"] = {**pl.predicted, "micro_batches_per_replica": list(pl.info["micro_batches"]),
                                 "codec": pl.info["codec"]}
    from fusion.ir.boundary import part_order

    stages = part_order(plan.graph, plan.assignment)
    for r, flags in enumerate(pl.info.get("recompute", [])):  # the parts priced with recomputation to fit
        for stage, on in zip(stages, flags):
            plan.parts[plan.replica_parts(r)[stage]].recompute = bool(on)
    plan.predicted.update(iteration_s=pl.predicted["iteration_s"], dp_sync_s=pl.predicted["dp_sync_s"],
                          throughput_samples_s=pl.predicted["samples_per_s"])


def add_engine_arg(p):
    return p.add_argument("--engine", action="append", default=[], metavar="[PART=]ENGINE",
                          help="execution engine of a part (e.g. part1=numpy), or of every part (e.g. numpy); "
                               "repeatable, later ones win; parts are named part0, part1, ... in pipeline order, "
                               "replica r's r<r>.part0, ... (default: torch)")


def assign_engines(plan, specs: list[str]) -> dict[str, str]:
    """Set ``Part.engine`` from ``--engine`` specs and check every node's op against its part's engine.

    Raises FusionError naming the unknown engine or part, or (``check_engines``) every node and op its
    part's engine lacks.
    """
    from fusion.executors.engines.select import check_engines, check_optimizer, engine_names
    from fusion.ir.errors import FusionError

    engines = {p: part.engine for p, part in plan.parts.items()}
    for spec in specs:
        part, sep, engine = spec.rpartition("=")
        if engine not in engine_names():
            raise FusionError(f"--engine {spec}: unknown engine {engine!r} (known: {', '.join(engine_names())})")
        if not sep:
            engines = dict.fromkeys(engines, engine)
        elif part not in engines:
            raise FusionError(f"--engine {spec}: the plan has no part {part!r} (parts: {', '.join(engines)})")
        else:
            engines[part] = engine
    for p, engine in engines.items():
        if plan.parts[p].recompute and engine != "torch":
            raise FusionError(f"--engine {p}={engine}: {p} fits its device only with activation recomputation, "
                              f"which the {engine} engine does not do (only torch)")
    check_optimizer((plan.optimizer or {}).get("name", "sgd"), engines)
    for r in range(plan.replicas):
        check_engines(plan.graph, plan.replica_assignment(r), engines)
    for p, engine in engines.items():
        plan.parts[p].engine = engine
    return engines


def check_output(out: Path, force: bool = False) -> None:
    """``-o`` must be new, empty, or with ``force`` a plan folder (which is replaced); anything else is refused."""
    from fusion.ir.errors import FusionError

    if out.exists() and not out.is_dir():
        raise FusionError(f"-o {out}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not (out / "plan.json").exists():
        entries = sorted(p.name for p in out.iterdir())
        raise FusionError(f"-o {out}: a folder that is not a plan and not empty ({', '.join(entries[:4])}"
                          f"{', ...' if len(entries) > 4 else ''}); choose a new folder")
    if (out / "plan.json").exists() and not force:
        raise FusionError(f"-o {out}: holds a plan already; give --force to replace it, or choose a new folder")


def describe_plan(plan, cluster) -> str:
    """``4 parts on 4 of 4 devices (equal-flops), 3 compressed edges; engines ...; predicted ...``."""
    engines = {p: part.engine for p, part in plan.parts.items()}
    pr = plan.predicted
    stages = len(plan.parts) // plan.replicas
    reps = f" ({plan.replicas} replicas x {stages} stage{'s' if stages > 1 else ''})" if plan.replicas > 1 else ""
    ds = plan.dp_sync
    if plan.replicas > 1 and ds.mode == "diloco":
        codec = ",".join(f"{k}={v}" for k, v in ds.codec.items() if k != "algo") if ds.codec else ""
        reps += (f", DiLoCo H={ds.inner_steps} outer lr {ds.outer_lr:g} momentum {ds.outer_momentum:g}"
                 + (f" pseudo-gradients {ds.codec['algo']}:{codec}" if ds.codec else "")
                 + (f", outer step one round late ({ds.overlap})" if ds.delay else ""))
    chunks = (f", {len(plan.parts) // len(plan.lanes())} virtual stages per device (interleaved 1F1B)"
              if plan.schedule == "interleaved" else "")
    return (f"{len(plan.parts)} parts{reps} on {len({p.device for p in plan.parts.values()})} of {len(cluster)} devices "
            f"({plan.strategy}){chunks}, {len(plan.compression)} compressed edges"
            + (f", {len(plan.bottlenecks)} bottleneck{'s' if len(plan.bottlenecks) > 1 else ''} "
               f"({', '.join(f'{b.edge} {b.width}->{b.rank}' for b in plan.bottlenecks)})" if plan.bottlenecks else "")
            + "; engines "
            f"{', '.join(f'{p}={e}' for p, e in engines.items())}; predicted {pr['iteration_s']:.4g} s/iteration "
            f"({pr['throughput_samples_s']:.4g} samples/s)"
            + ("; mixed precision bf16 (torch autocast, fp32 weights)" if plan.precision == "bf16" else ""))


def run(args: argparse.Namespace) -> int:
    from fusion.commands.checks import check_compile_options

    check_compile_options(args)  # bad --lr, --compress-ratio or --engine: one line before anything is imported or traced
    from fusion.commands.compile_cache import compile_cached

    check_output(Path(args.output), args.force)

    def check() -> None:  # on a cache miss, before the model is traced:
        dp_sync_from_args(args)  # a bad --dp-sync option is one line at once
        optimizer_from_args(args)  # and a bad --lr, --lr-schedule, --warmup-steps, --clip-grad-norm
        bottleneck_from_args(args)  # and a bad --bottleneck rank

    compiled = compile_cached(args, args.model, compile_from_args, describe_plan, check)  # the cache's plan, or traced and compiled here
    out = compiled.save(args.output)
    print(f"wrote {out}: {compiled.describe()}")
    return 0

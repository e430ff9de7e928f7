"""``fusion compile MODEL --cluster FILE -o PLAN``: partition a model over a cluster into a plan."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from fusion.options.compile import DEFAULT_OUTER_MOMENTUM, DP_STRATEGIES, EAGER_OUTER_MOMENTUM, MICRO_BATCHES, CompileJob, CompileOptions

if TYPE_CHECKING:
    from fusion.options.commands import Compile

log = logging.getLogger(__name__)


def optimizer_from_args(args: CompileOptions, steps: int | None = None):
    """The plan's ``OptimizerConfig`` from the options; FusionError naming the option. Called before the model
    is traced, so a bad value costs no trace."""
    from fusion.ir.errors import FusionError
    from fusion.plan import OptimizerConfig

    total = 0  # (--lr, --momentum and --weight-decay: CompileOptions.check, which runs first)
    if args.lr_schedule != "constant":
        total = args.lr_decay_steps or steps or 0
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


def compile_from_args(job: CompileJob, model, cluster):
    """The plan for ``model`` on ``cluster`` with ``job``'s compile options, engines assigned. (The checks that
    need the options alone ran already: :meth:`fusion.options.compile.CompileOptions.check`.)"""
    from fusion.ir.errors import FusionError

    args = job.options
    # fusion run's --steps and --data, read only where they matter (compile_key.compile_options hashes them there)
    opt = optimizer_from_args(args, job.steps if args.lr_schedule != "constant" and args.lr_decay_steps is None
                              else None)
    from fusion.compress.policy import request

    compress = request(args.compress, args.compress_bwd, *_data_samples(args, model, job))
    if compress is not None and args.compress_ratio is not None:
        raise FusionError("--compress-ratio (AdaTopK) and --compress/--compress-bwd (codecs) exclude each other")
    dp_codec = _dp_codec(args)
    dp_sync = dp_sync_from_args(args)
    tied = _tied_codec(args)
    node_times = _node_times(args)
    if args.strategy in DP_STRATEGIES:
        plan = _compile_dp(args, model, cluster, opt, compress, dp_codec)
        set_dp_allreduce(plan, cluster, args.dp_allreduce)
        if args.dp_sync == "every":
            _set_dp_sync(plan, dp_sync)
        else:  # the planner chose H, codec, shares (apply_dp_sync); the outer optimizer is the user's
            _keep_outer_options(plan, dp_sync, args)
            choose_warmup_and_inner_lr(plan, args, job.steps)
        set_precision(plan, args.precision)
        return plan
    return _compile_pipeline(args, model, cluster, opt, compress, dp_codec, dp_sync, tied, node_times)


def _compile_pipeline(args: CompileOptions, model, cluster, opt, compress, dp_codec, dp_sync, tied, node_times):
    """The plan of every strategy but the data-parallel planners: one pipeline compiled (compile_model), then
    replicated over the fastest free devices for ``--replicas`` / ``--global-batch``."""
    from fusion.ir.errors import FusionError

    micro = args.micro_batches
    if args.global_batch is not None:
        from fusion.replicas import split_global_batch

        rows = {int(v.shape[0]) for v in (model.example or {}).values() if getattr(v, "ndim", 0)}
        # the default --micro-batches gives way to what the global batch makes; another value must agree with it
        micro = split_global_batch(args.global_batch, args.replicas, 0 if micro == MICRO_BATCHES else micro,
                                   rows.pop() if len(rows) == 1 else None)
    plan = _replica_zero_pipeline(args, model, cluster, micro, opt, compress, tied, node_times)
    _adopt_plan_graph(model, plan)
    if dp_codec is not None and args.replicas < 2:
        raise FusionError("--dp-codec needs --replicas 2 or more")
    if args.replicas > 1 or args.global_batch is not None:
        from fusion.replicas import next_free_devices, replicate

        plan = replicate(plan, cluster, next_free_devices(plan, cluster, args.replicas), args.global_batch or 0,
                         dp_codec=dp_codec)
    set_dp_allreduce(plan, cluster, args.dp_allreduce)
    _set_dp_sync(plan, dp_sync)
    auto_h = auto_inner_steps(args)
    if auto_h is not None:  # --inner-steps auto: each replica's H by its predicted speed (fusion/inner_steps.py)
        from fusion.executors.runtime.dp.outer import replica_micro_batches
        from fusion.inner_steps import apply_auto_inner_steps

        apply_auto_inner_steps(plan, auto_h, replica_micro_batches(plan), cluster)
    assign_engines(plan, args.engine)
    set_precision(plan, args.precision)
    record_codec_plugins(plan)
    return plan


def _replica_zero_pipeline(args: CompileOptions, model, cluster, micro: int, opt, compress, tied, node_times):
    """The single pipeline (compile_model on the whole cluster); with ``--replicas R``, cut again on replica 0's
    1/R share of the devices when it took those the other replicas need (:func:`fusion.replicas.replica_zero_share`;
    the plan keeps the whole cluster)."""
    from fusion.compile import compile_model
    from fusion.replicas import on_whole_cluster, replica_zero_share

    bneck, subspace, architecture = bottleneck_from_args(args), subspace_from_args(args), architecture_from_args(args)

    def pipeline(on):
        return compile_model(model, on, strategy=args.strategy, micro_batches=micro,
                             compress_ratio=args.compress_ratio, schedule=args.schedule, optimizer=opt, seed=args.seed,
                             compress=compress, recompute=args.recompute, tied_codec=tied,
                             virtual_stages=args.virtual_stages, node_times=node_times, bottleneck=bneck,
                             precision=getattr(args, "precision", "fp32"), subspace=subspace,
                             architecture=architecture)

    plan = pipeline(cluster)
    share = replica_zero_share(len(plan.parts), cluster, args.replicas) if args.replicas > 1 else None
    if share is None:
        return plan
    log.info("replica 0's pipeline used %d of %d devices, too many for %d replicas: cut again on its share, %s",
             len(plan.parts), len(cluster), args.replicas, ", ".join(share))
    return on_whole_cluster(pipeline(cluster.subset(share)), cluster, args.seed)


def _adopt_plan_graph(model, plan) -> None:
    """The model becomes the plan's when a pass changed it: the confined one of a subspace cut, the one with
    bottlenecks (their graph and initial weights)."""
    if plan.subspace is not None:
        from fusion.compress.subspace import SubspaceSpec, initial_params

        model.graph, model.params = plan.graph, initial_params(SubspaceSpec.from_dict(plan.subspace), model.params)
    if plan.bottlenecks:
        from fusion.compress.bottleneck import initial_values

        model.graph = plan.graph
        if model.params:
            model.params = {**model.params, **initial_values(plan.bottlenecks)}

def bottleneck_from_args(args: CompileOptions):
    """The :class:`~fusion.compress.bottleneck.BottleneckRequest` of ``--bottleneck`` and ``--bottleneck-edges``
    (None: no bottleneck asked for; under ``--compress auto --allow-architecture-change`` the edges go to
    :func:`architecture_from_args`); FusionError, one line, for a bad rank or an edge list without a bottleneck."""
    from fusion.compress.bottleneck import BottleneckRequest, parse_rank
    from fusion.ir.errors import FusionError

    rank, names = getattr(args, "bottleneck", None), getattr(args, "bottleneck_edges", None)
    edges = tuple(n.strip() for n in names.split(",") if n.strip()) if names is not None else None
    if rank is not None:
        if getattr(args, "precision", "fp32") != "fp32":
            raise FusionError("--bottleneck with --precision bf16 is not built (the bottleneck is fp32 matmuls)")
        return BottleneckRequest(parse_rank(rank), edges)
    if _architecture_auto(args) and getattr(args, "subspace", None) is None:
        return None  # the bottleneck is one of the candidates architecture_from_args lets the compiler price
    if edges is not None:
        raise FusionError("--bottleneck-edges names the edges of --bottleneck RANK|auto (or of --compress auto "
                          "--allow-architecture-change); give one of them")
    return None


def _architecture_auto(args: CompileOptions) -> bool:
    """``--compress auto --allow-architecture-change``: the user consents to a changed model chosen by price."""
    return (getattr(args, "compress", None) or "").strip() == "auto" and getattr(args, "allow_architecture_change", False)


def architecture_from_args(args: CompileOptions):
    """The :class:`~fusion.passes.architecture.ArchitectureRequest` of ``--compress auto
    --allow-architecture-change`` without ``--subspace`` and ``--bottleneck`` (the compiler prices dense, subspace
    and bottleneck and keeps the fastest); None otherwise (the model as it is, or as the user's own flag changes it)."""
    from fusion.passes.architecture import ArchitectureRequest

    if not _architecture_auto(args) or getattr(args, "subspace", None) is not None \
            or getattr(args, "bottleneck", None) is not None:
        return None
    names = getattr(args, "bottleneck_edges", None)
    edges = tuple(n.strip() for n in names.split(",") if n.strip()) if names is not None else None
    return ArchitectureRequest(bottleneck_edges=edges)


def subspace_from_args(args: CompileOptions):
    """The :class:`~fusion.compress.subspace.SubspaceRequest` of ``--subspace`` (None without it); FusionError,
    one line, for a bad K, a missing ``--allow-architecture-change`` or a precision it is not built for."""
    from fusion.compress.subspace import parse_subspace
    from fusion.ir.errors import FusionError

    value = getattr(args, "subspace", None)
    if value is None:
        return None
    req = parse_subspace(value)
    if not getattr(args, "allow_architecture_change", False):
        raise FusionError(f"--subspace {value} changes the model (its stream's writers); add "
                          "--allow-architecture-change to consent")
    if getattr(args, "precision", "fp32") != "fp32":
        raise FusionError("--subspace with --precision bf16 is not built (the rebuilt stream is exact in fp32 only)")
    return req


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

    from fusion.executors.runtime.dp.outer import replica_micro_batches

    plan.dp_sync = sync if plan.replicas > 1 else DPSync()
    plan.check()
    try:
        replica_micro_batches(plan)  # every replica must get a micro-batch of each step
    except FusionError as e:
        raise FusionError(str(e).replace("plan.dp_sync.shares", "--replica-shares")) from None


def _keep_outer_options(plan, asked, args: CompileOptions) -> None:
    """After the DiLoCo planner wrote ``plan.dp_sync``: the outer optimizer (lr, momentum, Nesterov) and error
    feedback are the user's options (``asked``), which the planner does not price; the variant of a delay the
    planner chose is the user's ``--outer-overlap`` (eager where not given, :func:`overlap_outer`)."""
    import dataclasses

    if plan.dp_sync.mode != "diloco":
        return
    momentum, momentum_given = _outer_momentum(args)
    plan.dp_sync = dataclasses.replace(plan.dp_sync, outer_lr=asked.outer_lr, outer_momentum=momentum,
                                       nesterov=asked.nesterov,
                                       error_feedback=asked.error_feedback and plan.dp_sync.codec is not None)
    plan.dp_sync = codec_outer(overlap_outer(plan.dp_sync, args.outer_overlap, momentum_given), momentum_given)
    _set_dp_sync(plan, plan.dp_sync)


def choose_warmup_and_inner_lr(plan, args: CompileOptions, steps: int | None) -> None:
    """After the DiLoCo planner: its synchronous warm-up and inner lr (:mod:`fusion.partition.diloco_defaults`;
    ``--sync-warmup`` and ``--inner-lr`` where given win) into ``plan.dp_sync``, the reasons into
    ``predicted["diloco_choice"]`` (``fusion inspect`` prints them). ``steps``: ``fusion run``'s ``--steps`` (None
    under ``fusion compile``, where ``--lr-decay-steps`` is the run's length if given)."""
    import dataclasses

    from fusion.partition.diloco_defaults import DiLoCoSetting, choose

    ds = plan.dp_sync
    if ds.mode != "diloco":
        return
    opt = plan.optimizer or {}
    length, source = (steps, "--steps") if steps is not None else (args.lr_decay_steps, "--lr-decay-steps")
    chosen = choose(DiLoCoSetting(plan.replicas, ds.inner_steps, str(opt.get("name", "sgd")),
                                  float(opt.get("lr", args.lr)), equal_shares=not ds.shares, steps=length,
                                  steps_from=source, given_warmup=args.sync_warmup, given_inner_lr=args.inner_lr))
    plan.predicted["diloco_choice"] = chosen.to_dict()
    _set_dp_sync(plan, dataclasses.replace(ds, sync_warmup=chosen.sync_warmup, inner_lr=chosen.inner_lr))


def _node_times(args: CompileOptions):
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


def _data_samples(args: CompileOptions, model, job: CompileJob | None = None) -> tuple[int | None, bool | None]:
    """(data set size for delta buffers, whether ``auto`` may choose delta): ``--samples``, or for
    ``fusion run`` on the built-in text corpus its window count, which ``auto`` does not use (windows are
    drawn at random, so a sample rarely comes back within a run)."""
    from fusion.data.batches import corpus_samples
    from fusion.ir.errors import FusionError

    if args.compress is None and args.compress_bwd is None:
        return args.samples, None
    data = job.data if job is not None else None
    corpus = corpus_samples(model.graph, data) if data else None
    if corpus is None:
        return args.samples, None
    if args.samples is not None and args.samples != corpus:
        raise FusionError(f"--samples {args.samples}: the built-in text corpus gives this model {corpus} windows, "
                          "drawn at random; --samples is the size of a --data function's data set")
    return corpus, False


def _tied_codec(args: CompileOptions):
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


def _dp_codec(args: CompileOptions):
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


def auto_inner_steps(args: CompileOptions) -> int | None:
    """``--inner-steps auto[:H]`` under ``--dp-sync diloco``: the fastest replica's H (None without ``auto``);
    FusionError, one line, for a combination per-replica inner steps are not built with (docs/data-parallel.md,
    "Inner steps by speed")."""
    from fusion.inner_steps import parse_auto
    from fusion.ir.errors import FusionError

    h = parse_auto(args.inner_steps, DILOCO_INNER_STEPS)
    if h is None:
        return None
    if args.strategy in DP_STRATEGIES:
        raise FusionError(f"--inner-steps {args.inner_steps} with --strategy {args.strategy} is not built (the planner "
                          "chooses one H); give --replicas R with another strategy")
    if args.dp_sync != "diloco":
        raise FusionError(f"--inner-steps {args.inner_steps} is an option of --dp-sync diloco")
    for flag, value, default in (("--sync-fragments", args.sync_fragments, 1), ("--outer-delay", args.outer_delay or 0, 0),
                                 ("--sync-warmup", args.sync_warmup or 0, 0)):
        if value != default:
            raise FusionError(f"--inner-steps {args.inner_steps} with {flag} {value} is not built (per-replica inner "
                              "steps run the blocking outer step of one fragment, from the first step)")
    return h


def inner_steps_of(args: CompileOptions) -> tuple[int, ...] | None:
    """``--inner-steps H[,H...]`` as integers (None when not given); FusionError for a bad one or an H < 1.
    ``auto[:H]`` is :func:`auto_inner_steps`'s: its fastest H here."""
    from fusion.ir.errors import FusionError

    if args.inner_steps is None:
        return None
    auto = auto_inner_steps(args)
    if auto is not None:
        return (auto,)
    try:
        hs = tuple(int(h) for h in str(args.inner_steps).split(","))
    except ValueError:
        raise FusionError(f"--inner-steps {args.inner_steps}: expected an integer H or a comma list of them") from None
    bad = [h for h in hs if h < 1]
    if bad:
        raise FusionError(f"--inner-steps {bad[0]}: DiLoCo takes at least one inner step per outer step")
    return hs


def _refuse_diloco_options(args: CompileOptions) -> None:
    """Under ``--dp-sync every``, a DiLoCo option given (not at its default) is one line naming it."""
    from fusion.ir.errors import FusionError

    given = [f for f, v, d in (("--inner-steps", args.inner_steps, None), ("--outer-lr", args.outer_lr, 0.7),
                               ("--outer-momentum", args.outer_momentum, None), ("--no-nesterov", args.no_nesterov, False),
                               ("--pseudo-codec", args.pseudo_codec, None),
                               ("--pseudo-error-feedback", args.pseudo_error_feedback, False),
                               ("--replica-shares", args.replica_shares, None),
                               ("--sync-fragments", args.sync_fragments, 1), ("--outer-delay", args.outer_delay, None),
                               ("--outer-overlap", args.outer_overlap, None), ("--sync-warmup", args.sync_warmup, None),
                               ("--inner-lr", args.inner_lr, None))
             if v != d]
    if given:
        raise FusionError(f"{given[0]} is an option of --dp-sync diloco (the replicas now average gradients every "
                          "step)")


def _pseudo_codec(args: CompileOptions):
    """The codec cfg of ``--pseudo-codec`` (None: exact averaging), one a pseudo-gradient may travel under."""
    from fusion.compress.policy import parse_spec
    from fusion.ir.errors import FusionError
    from fusion.kernels.codecs import CODECS, Role

    codec = None
    if args.pseudo_codec is not None:
        codec = parse_spec(args.pseudo_codec, "--pseudo-codec")
        if codec == "auto":
            raise FusionError("--pseudo-codec auto: name the codec (quant:bits=8, quant:bits=4, topk:ratio=R) or none")
        CODECS.check_role(codec, Role.PSEUDO_GRADIENT, f"--pseudo-codec {args.pseudo_codec}")
    if args.pseudo_error_feedback and codec is None:
        raise FusionError("--pseudo-error-feedback needs a lossy --pseudo-codec (exact averaging leaves no residual)")
    return codec


def _replica_shares(args: CompileOptions) -> dict[int, float]:
    """``--replica-shares R=S,...`` as replica -> share."""
    from fusion.ir.errors import FusionError

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
    return shares


def dp_sync_from_args(args: CompileOptions):
    """The :class:`~fusion.plan.DPSync` of ``--dp-sync`` and its options, checked before the model is traced:
    FusionError (one line naming the flag) for H < 1, a codec that is unknown or not allowed for
    pseudo-gradients, DiLoCo with one replica, or a DiLoCo option without ``--dp-sync diloco``.
    (``--dp-sync auto``, the planner's choice, is to come from ``fusion.partition.dp``; it would be resolved
    here, after :func:`_compile_dp`'s planner ran.)"""
    from fusion.ir.errors import FusionError
    from fusion.plan import DPSync

    if args.dp_sync == "every":
        _refuse_diloco_options(args)
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
    warmup_coded = args.sync_warmup and args.pseudo_codec not in (None, "none")
    if args.dp_codec is not None and args.dp_sync == "diloco" and not warmup_coded:
        raise FusionError("--dp-codec compresses the per-step gradient all-reduce, which --dp-sync diloco runs only in "
                          "its synchronous warm-up: give --sync-warmup N and a --pseudo-codec (the exact "
                          "pseudo-gradients would travel by the same ring), or drop --dp-codec")
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
    codec = _pseudo_codec(args)
    shares = _replica_shares(args)
    momentum, momentum_given = _outer_momentum(args)
    sync = DPSync("diloco", h, args.outer_lr, momentum, not args.no_nesterov, codec,
                  args.pseudo_error_feedback, fragments=args.sync_fragments, delay=args.outer_delay or 0, shares=shares,
                  sync_warmup=args.sync_warmup or 0, inner_lr=args.inner_lr)
    return _checked_sync(codec_outer(overlap_outer(sync, overlap, momentum_given), momentum_given))


def _outer_momentum(args: CompileOptions) -> tuple[float, bool]:
    """(``--outer-momentum`` or :data:`DEFAULT_OUTER_MOMENTUM`, whether it was given). A value given is the user's even
    when it equals the default; one left out yields to the eager step's and the codec's own
    (:func:`overlap_outer`, :func:`codec_outer`)."""
    given = args.outer_momentum is not None
    return (args.outer_momentum if given else DEFAULT_OUTER_MOMENTUM), given


def _checked_sync(sync):
    """``sync`` once ``DPSync.check`` passes; its refusal as one line naming the flag (FusionError)."""
    from fusion.ir.errors import FusionError
    from fusion.plan import PlanError

    try:
        sync.check("--dp-sync diloco")
    except PlanError as e:
        msg = str(e).replace("--dp-sync diloco.shares", "--replica-shares")
        for name in ("outer_lr", "outer_momentum", "sync_warmup", "inner_lr"):
            msg = msg.replace(f"--dp-sync diloco.{name}", "--" + name.replace("_", "-"))
        raise FusionError(msg) from None
    return sync


def overlap_outer(sync, overlap: str | None, momentum_given: bool):
    """``sync`` with the variant of its overlapped outer step (``dp_sync.delay`` 1): ``overlap`` as given, else
    **eager** (Kale, Douillard and Donchev 2025, arXiv 2502.12996: each replica's own pseudo-gradient at once, the
    others' one round late), whose outer momentum is :data:`EAGER_OUTER_MOMENTUM` unless ``--outer-momentum`` was
    given: with Nesterov momentum and a one-round lag the eager step lost to the naive delayed one, without it it
    beat it on every tuning seed (docs/data-parallel.md, "Eager by default"). Delay 0 keeps ``"delayed"`` (unused)."""
    import dataclasses

    if not sync.delay:
        return dataclasses.replace(sync, overlap="delayed")
    chosen = overlap or "eager"
    changes: dict = {"overlap": chosen}
    if chosen == "eager" and not momentum_given:
        changes["outer_momentum"] = EAGER_OUTER_MOMENTUM
    return dataclasses.replace(sync, **changes)


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


def _compile_dp(args: CompileOptions, model, cluster, opt, compress, dp_codec):
    """``--strategy dp|dtfm``: the planner chooses replicas, cut and placement (issue 14), then the plan is built."""
    from fusion.compile import _ensure_shapes
    from fusion.cost.estimate import optimizer_slots
    from fusion.ir.errors import FusionError
    from fusion.partition.dp import against_single_pipeline, plan_dp
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
                              dp_codec=None if diloco else dp_codec, recompute=pl.info.get("recompute"))
    plan.predicted["dp_planner"] = dict(pl.predicted)
    apply_dp_sync(plan, pl)
    # the planner priced the gradient all-reduce too (fusion.cost.dp): its iteration time is the plan's
    plan.predicted.update(iteration_s=pl.predicted["iteration_s"], dp_sync_s=pl.predicted["dp_sync_s"],
                          throughput_samples_s=pl.predicted["samples_per_s"])
    plan.predicted.update(against_single_pipeline(model.graph, cluster, global_batch=args.global_batch,
                                                  schedule=args.schedule,
                                                  optimizer_slots=optimizer_slots(opt.name, opt.momentum),
                                                  samples_per_s=pl.predicted["samples_per_s"]))
    assign_engines(plan, args.engine)
    return plan


def plan_dp_sync(args: CompileOptions, model, cluster, opt, grad_wire_ratio: float = 1.0):
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
    plan.predicted.update(iteration_s=pl.predicted["iteration_s"], dp_sync_s=pl.predicted["dp_sync_s"],
                          throughput_samples_s=pl.predicted["samples_per_s"])


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
        from fusion.cost.dp import codec_label

        per = ds.inner_steps_per_replica
        reps += (f", DiLoCo H={ds.inner_steps}"
                 + (f" (by speed: {', '.join(f'r{r} {h}' for r, h in sorted(per.items()))})" if per else "")
                 + f" outer lr {ds.outer_lr:g} momentum {ds.outer_momentum:g}"
                 + (f" pseudo-gradients {codec_label(ds.codec)}" if ds.codec else "")
                 + (f", outer step one round late ({ds.overlap})" if ds.delay else "")
                 + (f", {ds.sync_warmup} synchronous warm-up steps" if ds.sync_warmup else "")
                 + (f" (all-reduce {codec_label(plan.dp_codec)})" if ds.sync_warmup and plan.dp_codec else "")
                 + (f", inner lr {ds.inner_lr:g}" if ds.inner_lr is not None else ""))
    chunks = (f", {len(plan.parts) // len(plan.lanes())} virtual stages per device (interleaved 1F1B)"
              if plan.schedule == "interleaved" else "")
    return (f"{len(plan.parts)} parts{reps} on {len({p.device for p in plan.parts.values()})} of {len(cluster)} devices "
            f"({plan.strategy}){chunks}, {len(plan.compression)} compressed edges"
            + (f", {len(plan.bottlenecks)} bottleneck{'s' if len(plan.bottlenecks) > 1 else ''} "
               f"({', '.join(f'{b.edge} {b.width}->{b.rank}' for b in plan.bottlenecks)})" if plan.bottlenecks else "")
            + (f", subspace-confined stream (width {plan.subspace['width']} -> k = {plan.subspace['rank']})"
               if plan.subspace is not None else "")
            + (f", architecture chosen by price: {arch['chosen']}" if (arch := pr.get("architecture")) else "")
            + "; engines "
            f"{', '.join(f'{p}={e}' for p, e in engines.items())}; predicted {pr['iteration_s']:.4g} s/iteration "
            f"({pr['throughput_samples_s']:.4g} samples/s)"
            + ("; mixed precision bf16 (torch autocast, fp32 weights)" if plan.precision == "bf16" else ""))


def run(opts: "Compile") -> int:
    """``fusion compile`` with its options (:class:`fusion.options.commands.Compile`, checked already)."""
    from fusion.commands.compile_cache import compile_cached

    check_output(Path(opts.output), opts.force)
    args = opts.compile

    def check() -> None:  # on a cache miss, before the model is traced:
        dp_sync_from_args(args)  # a bad --dp-sync option is one line at once
        optimizer_from_args(args)  # and a bad --lr, --lr-schedule, --warmup-steps, --clip-grad-norm
        bottleneck_from_args(args)  # and a bad --bottleneck rank
        subspace_from_args(args)  # and a bad --subspace

    compiled = compile_cached(opts.job(), compile_from_args, describe_plan, check)  # the cache's plan, or traced and compiled here
    out = compiled.save(opts.output)
    print(f"wrote {out}: {compiled.describe()}")
    return 0

"""``fusion compile MODEL --cluster FILE -o PLAN``: partition a model over a cluster into a plan."""
from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    p = sub.add_parser("compile", help="partition a model over a cluster (OP-Fence + AdaTopK) into a plan",
                       description="Load MODEL (file.py:function returning a fusion Model, an OpGraph, or "
                                   "(module, example inputs)) and a cluster file (YAML or scenario JSON), "
                                   "partition the OP-DAG and write the plan directory.")
    p.add_argument("model", help="file.py:function")
    p.add_argument("--cluster", required=True, help="cluster file (.yaml or scenario .json)")
    add_compile_options(p, micro_batches=1)
    p.add_argument("-o", "--output", required=True, help="plan directory to write")
    p.set_defaults(run=run)


def add_compile_options(p, micro_batches: int, note: str = "") -> dict[str, object]:
    """The partitioner, schedule, compression, optimizer and engine options (``compile``, and ``run`` on a MODEL).

    Returns option dest -> default.
    """
    g = p.add_argument_group(f"compiling{note}")
    actions = [
        g.add_argument("--strategy", default="opfence", choices=["opfence", "equal-count", "equal-flops"],
                       help="partitioner (OP-Fence may put a small model on one device; equal-count/equal-flops "
                            "use every device of the cluster file, blind to links)"),
        g.add_argument("--micro-batches", type=int, default=micro_batches,
                       help=f"n_b: micro-batches per iteration (default {micro_batches})"),
        g.add_argument("--compress-ratio", type=float, default=None,
                       help="AdaTopK ratio r (Eq. 7); default: no compression"),
        g.add_argument("--schedule", default="gpipe", choices=["gpipe", "1f1b"]),
        g.add_argument("--optimizer", default="sgd", choices=["sgd", "adamw"]),
        g.add_argument("--lr", type=float, default=0.01),
        g.add_argument("--momentum", type=float, default=0.0),
        g.add_argument("--weight-decay", type=float, default=0.0),
        g.add_argument("--seed", type=int, default=0),
        add_engine_arg(g),
    ]
    return {a.dest: a.default for a in actions}


def compile_from_args(args: argparse.Namespace, model, cluster):
    """The plan for ``model`` on ``cluster`` with the options of :func:`add_compile_options`, engines assigned."""
    from ..compile import compile_model
    from ..executors.optim import OptimizerConfig
    from ..ir.errors import FusionError

    try:
        opt = OptimizerConfig(args.optimizer, args.lr, args.momentum, args.weight_decay)
    except ValueError as e:
        raise FusionError(f"--optimizer/--lr: {e}") from None
    plan = compile_model(model, cluster, strategy=args.strategy, micro_batches=args.micro_batches,
                         compress_ratio=args.compress_ratio, schedule=args.schedule, optimizer=opt, seed=args.seed)
    assign_engines(plan, args.engine)
    return plan


def add_engine_arg(p):
    return p.add_argument("--engine", action="append", default=[], metavar="[PART=]ENGINE",
                          help="execution engine of a part (e.g. part1=numpy), or of every part (e.g. numpy); "
                               "repeatable, later ones win; parts are named part0, part1, ... in pipeline order "
                               "(default: torch)")


def assign_engines(plan, specs: list[str]) -> dict[str, str]:
    """Set ``Part.engine`` from ``--engine`` specs and check every node's op against its part's engine.

    Raises FusionError naming the unknown engine or part, or (``check_engines``) every node and op its
    part's engine lacks.
    """
    from ..executors.engines import check_engines, engine_names
    from ..ir.errors import FusionError

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
    check_engines(plan.graph, plan.assignment, engines)
    for p, engine in engines.items():
        plan.parts[p].engine = engine
    return engines


def run(args: argparse.Namespace) -> int:
    from ..cluster import load_cluster
    from ..loader import load_model
    from ..plan import save_plan

    cluster = load_cluster(args.cluster)
    model = load_model(args.model)
    plan = compile_from_args(args, model, cluster)
    engines = {p: part.engine for p, part in plan.parts.items()}
    out = save_plan(plan, args.output, model.params or None)
    pr = plan.predicted
    print(f"wrote {out}: {len(plan.parts)} parts on {len({p.device for p in plan.parts.values()})} of "
          f"{len(cluster)} devices ({args.strategy}), {len(plan.compression)} compressed edges; engines "
          f"{', '.join(f'{p}={e}' for p, e in engines.items())}; predicted "
          f"{pr['iteration_s']:.4g} s/iteration ({pr['throughput_samples_s']:.4g} samples/s)")
    return 0

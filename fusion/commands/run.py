"""``fusion run MODEL|PLAN``: train a plan on this host, one executor process per CompNode.

Given a model (``file.py:function``) it compiles a plan first (``fusion.compile``)
for ``--cluster``; given a plan directory it runs that. Output directory::

    plan/                 the plan that ran (when compiled here)
    metrics.jsonl         one line per step: loss, iteration time, samples/s, per-part times and bytes
    trace/<part>.json     Chrome-trace timeline of each CompNode (open in Perfetto or chrome://tracing)
    logs/<part>.log       executor logs
    checkpoints/          with --checkpoint-every; --resume continues from the newest complete one
    final.safetensors     parameters after the last step
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .coordinator import add_common, train


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="train a model or plan locally, one process per CompNode",
                       description="Compile MODEL (file.py:function) for --cluster, or load PLAN (a plan directory), "
                                   "then train it with one executor process per CompNode on loopback.")
    p.add_argument("target", metavar="MODEL|PLAN", help="file.py:function or a plan directory")
    p.add_argument("--cluster", help="cluster file (needed to compile a MODEL)")
    p.add_argument("--out", default=None, help="run directory (default: runs/<model or plan name>)")
    from .compile import add_compile_options

    defaults = add_compile_options(p, micro_batches=4, note=" a MODEL (a PLAN has these fixed already)")
    p.add_argument("--threads", type=int, default=None, help="threads per executor (default: cores / CompNodes)")
    add_common(p)
    p.set_defaults(run=run, compile_defaults={**defaults, "cluster": None})


def _compile(args: argparse.Namespace, out: Path) -> Path:
    from ..ir.errors import FusionError
    from ..loader import load_model
    from ..plan import save_plan

    if not args.cluster:
        raise FusionError("compiling a model needs --cluster FILE")
    from ..cluster import load_cluster
    from .compile import compile_from_args

    model = load_model(args.target)
    plan = compile_from_args(args, model, load_cluster(args.cluster))
    return save_plan(plan, out / "plan", params=model.params)


def _reject_compile_options(args: argparse.Namespace) -> None:
    """A PLAN fixes partition, schedule, optimizer and engines: an option that would be ignored is an error."""
    from ..ir.errors import FusionError

    given = [k for k, v in args.compile_defaults.items() if getattr(args, k) != v]
    if given:
        flags = ", ".join("--" + k.replace("_", "-") for k in given)
        raise FusionError(f"{flags} only apply when compiling a MODEL; {args.target} is a plan "
                          "(recompile it with `fusion compile`, or run the model file)")


def run(args: argparse.Namespace) -> int:
    from ..data import make_batches
    from ..executors.coordinator import CoordinatorConfig
    from ..executors.launcher import LocalCluster

    target = Path(args.target)
    is_plan = target.is_dir() or target.name == "plan.json"
    name = (target.parent.name if target.name == "plan.json" else target.name) if is_plan else \
        Path(args.target.rpartition(":")[0]).stem + "-" + args.target.rpartition(":")[2]
    out = Path(args.out or Path("runs") / name)
    if is_plan:
        _reject_compile_options(args)
        plan_dir = target.parent if target.name == "plan.json" else target
    elif args.resume and (out / "plan" / "plan.json").exists():
        plan_dir = out / "plan"  # resume runs the plan compiled the first time
    else:
        plan_dir = _compile(args, out)
    cfg = CoordinatorConfig(emulate_links=args.emulate_links, checkpoint_dir=str(out / "checkpoints"),
                            checkpoint_every=args.checkpoint_every, peer_timeout_s=args.peer_timeout)
    cluster = LocalCluster(plan_dir, out, cfg, threads=args.threads)
    batch_fn = make_batches(cluster.plan, args.data, cluster.plan.seed)  # fail before starting processes
    graceful = False
    try:
        first = cluster.start(resume=args.resume)
        if first:
            print(f"resuming at step {first} from {out / 'checkpoints'}", file=sys.stderr)
        train(cluster.coordinator, batch_fn, first, args.steps, out, not args.no_progress)
        graceful = True
    finally:
        cluster.close(graceful=graceful)
    print(f"done: {args.steps} steps; metrics {out / 'metrics.jsonl'}, traces {out / 'trace'}, weights {out / 'final.safetensors'}",
          file=sys.stderr)
    return 0

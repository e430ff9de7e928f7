"""``fusion run MODEL|PLAN``: train a plan on this host, one executor process per CompNode.

Given a model (``file.py:function``) it compiles a plan first (``fusion.compile``)
for ``--cluster``; given a plan directory it runs that. Each run writes into a
folder of its own (``--out``, default ``runs/<name>-<YYYYmmdd-HHMMSS>``; a
non-empty folder needs ``--resume`` or ``--overwrite``). With ``--ray ADDRESS`` the
executors run as Ray actors on the nodes of an existing Ray cluster instead of on
this host (``fusion.executors.runtime.ray_cluster``; the coordinator and the run
folder stay here)::

    run.json              the command line and start time of each run into this folder
    plan/                 the plan that ran (when compiled here)
    metrics.jsonl         one line per step: loss, iteration time, samples/s, per-part times and bytes
    loss.png              loss and samples/s per step (also written on Ctrl-C)
    trace.json            one Chrome/Perfetto trace of the run: every CompNode plus the coordinator's steps
    trace/<part>.json     Chrome-trace timeline of each CompNode (open in Perfetto or chrome://tracing)
    logs/<part>.log       executor logs
    checkpoints/          with --checkpoint-every; --resume continues from the newest complete one
    final.safetensors     parameters after the last step (also written on Ctrl-C)
"""
from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from pathlib import Path

from fusion.commands.coordinator import _number, add_common, eval_from_args, non_negative_int, positive_int, run_name
from fusion.commands.steploop import train

#: an argparse type: a number of seconds >= 0
non_negative_float = _number(float, "a number", lambda v: 0 <= v < float("inf"), "must be 0 or more seconds")


def check_warmup_steps(sync, steps: int) -> None:
    """FusionError (one line) when the synchronous warm-up (``dp_sync.sync_warmup``) leaves DiLoCo no step."""
    from fusion.ir.errors import FusionError

    if sync.mode == "diloco" and sync.sync_warmup and sync.sync_warmup >= steps:
        raise FusionError(f"--sync-warmup {sync.sync_warmup}: the synchronous warm-up must be shorter than the run "
                          f"(--steps {steps}), or DiLoCo never starts")


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="train a model or plan locally, one process per CompNode",
                       description="Compile MODEL (file.py:function) for --cluster, or load PLAN (a plan directory), "
                                   "then train it with one executor process per CompNode on loopback.")
    p.add_argument("target", metavar="MODEL|PLAN", help="file.py:function or a plan directory")
    p.add_argument("--cluster", help="cluster file (needed to compile a MODEL)")
    p.add_argument("--out", default=None, metavar="RUN", help="run folder (default: runs/<model or plan>-<time>)")
    from fusion.commands.compile import add_compile_options

    defaults = add_compile_options(p, note=" a MODEL (a PLAN has these fixed already)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="threads per executor (default: cores / CompNodes; with --ray, torch's default on each node)")
    p.add_argument("--trace", choices=("on", "off"), default="on",
                   help="write a Chrome trace per CompNode under OUT/trace (default on; spilled to disk as it grows)")
    p.add_argument("--insecure", action="store_true",
                   help="no CURVE: links between the local processes are neither authenticated nor encrypted, and any "
                        "process on this host can send them messages (default: fresh keys for this run in OUT/keys)")
    p.add_argument("--trust-plugins", action="store_true",
                   help="let executors import the plugin files (Python code) the plan lists; without it such a plan is refused")
    p.add_argument("--device", default="cpu", metavar="DEV",
                   help="torch device of every CompNode's engine (cpu, cuda, cuda:0, ...); CompNodes may share one GPU")
    parts = p.add_mutually_exclusive_group()
    parts.add_argument("--compile-parts", action="store_true",
                       help="torch engine: torch.compile each part's generated module (slow first step)")
    parts.add_argument("--interpreted-parts", action="store_true",
                       help="torch engine: walk each part node by node instead of one generated function")
    p.add_argument("--heap", default="steady", choices=["steady", "default"],
                   help="every CompNode's C allocator (fusion executor --heap): steady (default) keeps freed tensor "
                        "memory for the next step instead of unmapping and page-faulting it in again; default: as is")
    p.add_argument("--ray", default=None, metavar="ADDRESS",
                   help="run each CompNode as a Ray actor on the node of an existing Ray cluster (HOST:PORT of its "
                        "head, or auto) that has the resource fusion-dev:<device> of its device; needs "
                        "pip install 'fusion[ray]' (see docs/runtime.md)")
    # --- recovery without a human (issue 28): restarts
    p.add_argument("--max-restarts", type=non_negative_int, default=0, metavar="N",
                   help="when a CompNode dies or stops answering, kill every executor, start them again from the "
                        "latest complete checkpoint and train on, at most N times (needs --checkpoint-every; each "
                        "restart is an event line in metrics.jsonl; default 0: the run ends at the first failure)")
    add_common(p)
    # output options (issue 26): the step log when stderr is not a terminal
    p.add_argument("--config", metavar="FILE.yaml",
                   help="options from a YAML file (option: value, MODEL|PLAN as target:); the command line overrides "
                        "them (fusion.commands.runconfig; see docs/training.md)")
    p.add_argument("--log-every", type=non_negative_float, default=30.0, metavar="SECONDS",
                   help="when stderr is not a terminal (a log file, CI), a one-line step log at most this often, "
                        "even with --no-progress (0: every step)")
    p.set_defaults(run=run, compile_defaults={**defaults, "cluster": None})


def _reject_compile_options(args: argparse.Namespace) -> None:
    """A PLAN fixes partition, schedule, optimizer and engines: an option that would be ignored is an error."""
    from fusion.ir.errors import FusionError

    given = [k for k, v in args.compile_defaults.items() if getattr(args, k) != v]
    if given:
        flags = ", ".join("--" + k.replace("_", "-") for k in given)
        raise FusionError(f"{flags} only apply when compiling a MODEL; {args.target} is a plan "
                          "(recompile it with `fusion compile`, or run the model file)")


def executor_flags(args: argparse.Namespace, trust: bool) -> list[str]:
    """The ``fusion executor`` flags this run passes on to every CompNode."""
    flags = ["--trust-plugins"] if trust else []
    if args.device != "cpu":
        flags += ["--device", args.device]
    if args.compile_parts:
        flags.append("--compile-parts")
    if args.interpreted_parts:
        flags.append("--interpreted-parts")
    if args.heap != "steady":
        flags += ["--heap", args.heap]
    return flags


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _sigterm_as_interrupt():
    """SIGTERM (kill, a scheduler, systemd) stops a run like Ctrl-C: the executors are stopped, not orphaned."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    return signal.signal(signal.SIGTERM, interrupt)


def _refuse_untrusted(plan, plan_dir, trust: bool) -> None:
    """Refuse, with the reason, a plan with plugins the user has not trusted, before any executor starts."""
    if plan.graph.plugins and not trust:
        from fusion.ir.errors import FusionError
        from fusion.ir.registry import TRUST_HINT

        raise FusionError(f"{plan_dir}: the plan lists plugins {plan.graph.plugins}: {TRUST_HINT}")


def _check_restarts(args: argparse.Namespace) -> None:
    """--max-restarts resumes from checkpoints: one line when there are none."""
    from fusion.ir.errors import FusionError

    if args.max_restarts and not args.checkpoint_every:
        raise FusionError(f"--max-restarts {args.max_restarts} needs --checkpoint-every N: a restarted run resumes "
                          "from its latest complete checkpoint")


def run(args: argparse.Namespace) -> int:
    from fusion.commands.checks import check_compile_options, check_data_options

    check_data_options(args)  # a missing data file is said now, not after the compile
    if not (Path(args.target).is_dir() or Path(args.target).name == "plan.json"):  # a MODEL (file.py:fn, .onnx):
        check_compile_options(args)  # its option values, before torch is imported or the model traced
    from fusion.commands.report import finish_run
    from fusion.commands.rundir import (check_resumable, check_resume_plan, check_resume_recipe, check_run_dir,
                                        default_run_dir, prepare_run_dir, recipe, record_plan_digest, resume_hint)
    from fusion.data.batches import make_batches
    from fusion.executors.runtime.coordinator import CoordinatorConfig
    from fusion.executors.runtime.launcher import LocalCluster
    from fusion.executors.runtime.plandigest import plan_digest
    from fusion.ir.errors import FusionError

    t_start = time.monotonic()
    _check_restarts(args)
    if not args.ray:  # a Ray node checks its own devices
        from fusion.executors.engines.torch.device import check_device

        check_device(args.device)
    if args.ray and args.join_at:
        raise FusionError("--join-at with --ray is not built: a late replica's executors start on this host only")
    if args.ray:
        from fusion.executors.runtime.ray_cluster import check_reachable, import_ray

        import_ray()  # before a long compile: without Ray, one line saying how to install it
        check_reachable(args.ray)  # and a head that is not there is one line too
    target = Path(args.target)
    is_plan = target.is_dir() or target.name == "plan.json"
    if args.resume and not args.out:
        raise FusionError("--resume continues the run in --out RUN: name it")
    if is_plan:
        _reject_compile_options(args)
        plan_dir = target.parent if target.name == "plan.json" else target
        name = run_name(plan_dir)
    else:
        plan_dir = None
        name = Path(args.target.rpartition(":")[0]).stem + "-" + args.target.rpartition(":")[2]
    out = Path(args.out) if args.out else default_run_dir(name)
    check_run_dir(out, resume=args.resume, overwrite=args.overwrite, plan_dir=plan_dir)  # before a long compile
    this_recipe = recipe(args)  # what a later --resume must match, and what this one is compared with
    if args.resume:  # nothing to resume, or another model / options / data than the run's: refused, run untouched
        check_resumable(out)
        check_resume_recipe(out, this_recipe, is_plan)
    plan = compiled = None
    trust = args.trust_plugins or not is_plan  # a MODEL file is the user's own code, already run to compile it
    if is_plan:  # a bad plan, or plugins not trusted: one line, before the run folder is made
        from fusion.plan import load_plan

        loaded = load_plan(plan_dir)
        _refuse_untrusted(loaded, plan_dir, trust)
        check_warmup_steps(loaded.dp_sync, args.steps)
        if not loaded.graph.loss_nodes():
            raise FusionError(f"{plan_dir}: the plan's model has no loss, so training would minimise nothing; "
                              "recompile it with --loss NAME (a scalar output of the model)")
    if not is_plan and not (args.resume and (out / "plan" / "plan.json").exists()):
        # compile in memory first: a model or cluster error leaves no run folder behind
        if not args.cluster:
            if ":" not in args.target:  # neither a plan folder nor file.py:function: most likely a mistyped plan
                raise FusionError(f"{args.target}: not a plan folder (no {Path(args.target) / 'plan.json'}) and not a "
                                  "MODEL (file.py:function)")
            raise FusionError("compiling a model needs --cluster FILE")
        from fusion.commands.compile import compile_from_args, describe_plan, dp_sync_from_args, optimizer_from_args
        from fusion.commands.compile_cache import compile_cached

        check_warmup_steps(dp_sync_from_args(args), args.steps)  # before the model is traced: one line at once
        if args.join_at:  # what the options say already (the rest is checked on the compiled plan)
            from fusion.executors.runtime.join import check_join_options

            check_join_options(args.replicas, args.dp_sync, [r for _, r in args.join_at])
        optimizer_from_args(args)  # a bad --lr, --lr-schedule, --warmup-steps or --clip-grad-norm

        if sys.stderr.isatty():  # a terminal sees progress at once; a log keeps a user error to its one line
            _say(f"compiling {args.target} for {args.cluster} ({args.strategy}) ...")
        # a run that trains nothing is refused (choose_loss); a cache hit skips the trace and compile
        compiled = compile_cached(args, args.target, compile_from_args, describe_plan)
        plan = compiled.plan
        _say(f"compiled: {compiled.describe()} ({time.monotonic() - t_start:.1f} s)")
    if args.join_at:  # a join schedule the plan cannot run is one line before the run folder is made
        from fusion.commands.coordinator import joins_from_args
        from fusion.plan import load_plan

        joins = joins_from_args(args, plan if plan is not None else load_plan(plan_dir or out / "plan"))
    else:
        joins = {}
    digest = None
    if args.resume and plan_dir is not None:  # a plan folder given: it must be the plan that wrote the run
        digest = plan_digest(plan_dir)
        check_resume_plan(out, digest, plan_dir)
    prepare_run_dir(out, resume=args.resume, overwrite=args.overwrite, plan_dir=plan_dir, run_recipe=this_recipe)
    if compiled is not None:
        plan_dir = compiled.save(out / "plan")
    elif plan_dir is None:
        plan_dir = out / "plan"  # resume runs the plan compiled the first time
    record_plan_digest(out, digest or plan_digest(plan_dir))
    cfg = CoordinatorConfig(emulate_links=args.emulate_links, checkpoint_dir=str(out / "checkpoints"),
                            checkpoint_every=args.checkpoint_every, peer_timeout_s=args.peer_timeout,
                            drop_failed_replicas=args.drop_failed_replicas, joins=joins)
    executor_args = executor_flags(args, trust)
    if args.ray:
        from fusion.executors.runtime.ray_cluster import RayCluster

        cluster = RayCluster(args.ray, plan_dir, out, cfg, threads=args.threads, report=_say,
                             trace=args.trace == "on", executor_args=executor_args,
                             verbose=1 + args.verbose + args.verbose_after, curve=not args.insecure)
    else:
        cluster = LocalCluster(plan_dir, out, cfg, threads=args.threads, report=_say, trace=args.trace == "on",
                               executor_args=executor_args, curve=not args.insecure)
    if args.insecure:
        _say("warning: --insecure: the CompNodes' links are neither authenticated nor encrypted")
    batch_fn = make_batches(cluster.plan, args.data, cluster.plan.seed, args.val_split / 100)  # fail before starting processes
    evaluation = eval_from_args(args, cluster.plan, batch_fn)  # --eval-every's held-out batches, also before any process
    _say(f"run folder {out}")
    n = len(cluster.plan.parts)
    if args.ray:
        cluster.connect()  # a missing node or device resource is one line before anything starts
        _say(f"starting {n} CompNode{'s' if n > 1 else ''} as Ray actors on {args.ray} "
             f"(logs in {out / 'logs'}) ...")
    else:
        _say(f"starting {n} CompNode process{'es' if n > 1 else ''} ({cluster.threads} thread{'s' if cluster.threads > 1 else ''} "
             f"each; logs in {out / 'logs'}) ...")
    graceful = interrupted = False
    summary = None
    previous = _sigterm_as_interrupt()
    t_launch = time.monotonic()
    try:
        if not args.max_restarts:  # (with --max-restarts, a failure at start-up is restarted too: started there)
            first = cluster.start(resume=args.resume)
            _say(f"all {n} CompNodes ready, {time.monotonic() - t_launch:.1f} s after launch "
                 f"({time.monotonic() - t_start:.1f} s since the command started)"
                 + (f"; resuming at step {first} from {out / 'checkpoints'}" if first else ""))
        try:
            if args.max_restarts:
                from fusion.commands.restarts import train_with_restarts

                summary = train_with_restarts(cluster, batch_fn, 0, args.steps, out, not args.no_progress,
                                              args.max_restarts, _say, log_every_s=args.log_every,
                                              evaluation=evaluation, resume=args.resume)
            else:
                summary = train(cluster.coordinator, batch_fn, first, args.steps, out, not args.no_progress,
                                log_every_s=args.log_every, evaluation=evaluation)
        except KeyboardInterrupt as e:
            interrupted = True
            summary = e.args[0] if e.args and isinstance(e.args[0], dict) else None
        graceful = True  # stop the executors so they write their traces
    finally:
        cluster.close(graceful=graceful)  # after SIGTERM/Ctrl-C: terminate the executors now, kill what lingers
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        written = finish_run(out, f"{name}: {n} CompNodes")
    what = ", ".join(f"{k} {v}" for k, v in (("metrics", out / "metrics.jsonl"), *written.items(),
                                             ("weights", out / "final.safetensors")))
    loss = summary.get("loss") if summary else None
    result = f"final loss {loss:.6g}" if loss is not None else "no step done"
    if interrupted:
        steps = summary["steps"] if summary else "?"
        _say(f"interrupted after {steps} steps; {what}")
        _say(resume_hint(out, args.checkpoint_every))
        print(f"interrupted: {steps} steps, {result}, run folder {out}", flush=True)  # the result: on stdout
        return 130
    restarts = (summary or {}).get("restarts")
    _say(f"done: {args.steps} steps in {time.monotonic() - t_start:.1f} s"
         + (f" after {restarts} restart{'s' if restarts > 1 else ''}" if restarts else "") + f"; {what}")
    print(f"done: {summary['steps'] if summary else args.steps} steps, {result}, run folder {out}", flush=True)
    return 0

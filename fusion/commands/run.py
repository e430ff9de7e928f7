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

The options are :class:`fusion.options.commands.Run`, checked before :func:`run` starts; the lifecycle (run
folder, inputs, start, step loop, report) is :mod:`fusion.commands.lifecycle`'s, shared with ``fusion coordinator``.
"""
from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fusion.commands.lifecycle import Outcome, drive, inputs_of, joins_of, open_run_folder, run_name, say

if TYPE_CHECKING:
    from fusion.options.commands import Run


@dataclass
class Target:
    """What ``fusion run`` was given, resolved: the run's name, the plan folder (None for a MODEL), the run folder."""

    name: str
    plan_dir: Path | None
    out: Path


def resolve_target(opts: "Run") -> Target:
    """The run's name and folders; a PLAN target with compile options (it has them fixed) is refused."""
    from fusion.commands.rundir import default_run_dir
    from fusion.ir.errors import FusionError

    if opts.is_plan:
        given = opts.compile.changed()
        if given:
            raise FusionError(f"{', '.join(given)} only apply when compiling a MODEL; {opts.target} is a plan "
                              "(recompile it with `fusion compile`, or run the model file)")
        target = Path(opts.target)
        plan_dir = target.parent if target.name == "plan.json" else target
        name = run_name(plan_dir)
    else:
        plan_dir = None
        name = Path(opts.target.rpartition(":")[0]).stem + "-" + opts.target.rpartition(":")[2]
    return Target(name, plan_dir, Path(opts.out) if opts.out else default_run_dir(name))


def check_plan_folder(plan_dir: Path, trust: bool, steps: int) -> None:
    """A bad plan, plugins the user has not trusted, a plan without a loss, or a DiLoCo warm-up as long as the run:
    one line, before the run folder."""
    from fusion.ir.errors import FusionError
    from fusion.options.commands import check_warmup_steps
    from fusion.plan import load_plan

    plan = load_plan(plan_dir)
    check_warmup_steps(plan.dp_sync.mode, plan.dp_sync.sync_warmup, steps, f"{plan_dir}: dp_sync.sync_warmup")
    if plan.graph.plugins and not trust:
        from fusion.ir.registry import TRUST_HINT

        raise FusionError(f"{plan_dir}: the plan lists plugins {plan.graph.plugins}: {TRUST_HINT}")
    if not plan.graph.loss_nodes():
        raise FusionError(f"{plan_dir}: the plan's model has no loss, so training would minimise nothing; "
                          "recompile it with --loss NAME (a scalar output of the model)")


def compile_target(opts: "Run", t_start: float):
    """The MODEL compiled in memory (a model or cluster error leaves no run folder behind), or from the cache."""
    import sys

    from fusion.commands.compile import compile_from_args, describe_plan, dp_sync_from_args, optimizer_from_args
    from fusion.commands.compile_cache import compile_cached
    from fusion.ir.errors import FusionError

    if not opts.cluster:
        if ":" not in opts.target:  # neither a plan folder nor file.py:function: most likely a mistyped plan
            raise FusionError(f"{opts.target}: not a plan folder (no {Path(opts.target) / 'plan.json'}) and not a "
                              "MODEL (file.py:function)")
        raise FusionError("compiling a model needs --cluster FILE")
    dp_sync_from_args(opts.compile)  # before the model is traced: a bad --dp-sync option is one line at once
    optimizer_from_args(opts.compile, opts.train.steps)  # a bad --lr-schedule, --warmup-steps or --clip-grad-norm
    if sys.stderr.isatty():  # a terminal sees progress at once; a log keeps a user error to its one line
        say(f"compiling {opts.target} for {opts.cluster} ({opts.compile.strategy}) ...")
    # a run that trains nothing is refused (choose_loss); a cache hit skips the trace and compile
    compiled = compile_cached(opts.job(), compile_from_args, describe_plan)
    say(f"compiled: {compiled.describe()} ({time.monotonic() - t_start:.1f} s)")
    return compiled


def write_run_folder(opts: "Run", target: Target, compiled, recipe: dict) -> Path:
    """Make the run folder (the plan checked to be the run's on --resume of a PLAN) and its plan; the plan folder."""
    from fusion.commands.rundir import check_resume_plan, prepare_run_dir, record_plan_digest
    from fusion.executors.runtime.plandigest import plan_digest

    out, plan_dir, digest = target.out, target.plan_dir, None
    if opts.train.resume and plan_dir is not None:  # a plan folder given: it must be the plan that wrote the run
        digest = plan_digest(plan_dir)
        check_resume_plan(out, digest, plan_dir)
    prepare_run_dir(out, resume=opts.train.resume, overwrite=opts.train.overwrite, plan_dir=plan_dir,
                    run_recipe=recipe)
    if compiled is not None:
        plan_dir = compiled.save(out / "plan")
    elif plan_dir is None:
        plan_dir = out / "plan"  # resume runs the plan compiled the first time
    record_plan_digest(out, digest or plan_digest(plan_dir))
    return plan_dir


def make_cluster(opts: "Run", plan_dir: Path, out: Path, joins: dict, trust: bool):
    """The CompNodes to start: processes on this host, or Ray actors with ``--ray``."""
    from fusion.executors.runtime.coordinator import CoordinatorConfig

    t, launch = opts.train, opts.launch
    cfg = CoordinatorConfig(emulate_links=t.emulate_links, checkpoint_dir=str(out / "checkpoints"),
                            checkpoint_every=t.checkpoint_every, peer_timeout_s=t.peer_timeout, link_timeout_s=t.link_timeout,
                            drop_failed_replicas=t.drop_failed_replicas, steps_ahead=t.steps_ahead, joins=joins)
    common = dict(threads=launch.threads, report=say, trace=launch.trace == "on",
                  executor_args=launch.executor_flags(trust), curve=not launch.insecure)
    if launch.ray:
        from fusion.executors.runtime.ray_cluster import RayCluster

        return RayCluster(launch.ray, plan_dir, out, cfg, verbose=1 + _verbosity(), **common)
    from fusion.executors.runtime.launcher import LocalCluster

    return LocalCluster(plan_dir, out, cfg, **common, ipc=launch.links == "ipc" and not launch.insecure)


def _verbosity() -> int:
    """The -v count of this command (0, 1 or 2), as the logging level it set: Ray's executors log as verbosely."""
    import logging

    level = logging.getLogger().getEffectiveLevel()
    return 2 if level <= logging.DEBUG else 1 if level <= logging.INFO else 0


def announce(opts: "Run", cluster, out: Path) -> None:
    """Say where the run goes and what starts (a Ray cluster is connected here: a missing node is one line)."""
    if opts.launch.insecure:
        say("warning: --insecure: the CompNodes' links are neither authenticated nor encrypted")
    say(f"run folder {out}")
    n = len(cluster.plan.parts)
    if opts.launch.ray:
        cluster.connect()  # a missing node or device resource is one line before anything starts
        say(f"starting {n} CompNode{'s' if n > 1 else ''} as Ray actors on {opts.launch.ray} "
            f"(logs in {out / 'logs'}) ...")
    else:
        say(f"starting {n} CompNode process{'es' if n > 1 else ''} ({cluster.threads} "
            f"thread{'s' if cluster.threads > 1 else ''} each; logs in {out / 'logs'}) ...")


def _sigterm_as_interrupt():
    """SIGTERM (kill, a scheduler, systemd) stops a run like Ctrl-C: the executors are stopped, not orphaned. The
    handler is marked ``graceful``: the step loop takes it over as it does Ctrl-C (the step in flight ends first, a
    second one stops at once; steploop._StopAtStepEnd); outside the loop it raises KeyboardInterrupt."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    interrupt.graceful = True
    return signal.signal(signal.SIGTERM, interrupt)


def train_cluster(opts: "Run", cluster, inputs, out: Path, label: str, t_start: float) -> Outcome:
    """Start the CompNodes and train; SIGTERM stops like Ctrl-C; the executors are always stopped."""
    n, previous = len(cluster.plan.parts), _sigterm_as_interrupt()
    t_launch = time.monotonic()

    def start() -> int:
        first = cluster.start(resume=opts.train.resume)
        say(f"all {n} CompNodes ready, {time.monotonic() - t_launch:.1f} s after launch "
            f"({time.monotonic() - t_start:.1f} s since the command started)"
            + (f"; resuming at step {first} from {out / 'checkpoints'}" if first else ""))
        return first

    def stop(graceful: bool) -> None:
        cluster.close(graceful=graceful)  # after SIGTERM/Ctrl-C: terminate the executors now, kill what lingers
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)

    return drive(cluster, inputs, opts.train, opts.launch.max_restarts, out, label, start, stop)


def report(opts: "Run", outcome: Outcome, out: Path, t_start: float) -> int:
    """The result: progress lines on stderr, the one result line on stdout; 130 after an interrupt."""
    from fusion.commands.rundir import resume_hint

    what = ", ".join(f"{k} {v}" for k, v in (("metrics", out / "metrics.jsonl"), *outcome.written.items(),
                                             ("weights", out / "final.safetensors")))
    summary, steps = outcome.summary, opts.train.steps
    loss = summary.get("loss") if summary else None
    result = f"final loss {loss:.6g}" if loss is not None else "no step done"
    if outcome.interrupted:
        done = summary["steps"] if summary else "?"
        say(f"interrupted after {done} steps; {what}")
        say(resume_hint(out, opts.train.checkpoint_every))
        print(f"interrupted: {done} steps, {result}, run folder {out}", flush=True)  # the result: on stdout
        return 130
    restarts = (summary or {}).get("restarts")
    say(f"done: {(summary or {}).get('steps', steps)} steps in {time.monotonic() - t_start:.1f} s"
        + (f" after {restarts} restart{'s' if restarts > 1 else ''}" if restarts else "") + f"; {what}")
    print(f"done: {summary['steps'] if summary else steps} steps, {result}, run folder {out}", flush=True)
    return 0


def run(opts: "Run") -> int:
    """``fusion run``: resolve the target, check the run folder, compile or load the plan, make the run folder,
    start the CompNodes, train, report."""
    from fusion.commands.rundir import recipe
    from fusion.plan import load_plan

    t_start = time.monotonic()
    target = resolve_target(opts)
    out = target.out
    this_recipe = recipe(opts.target, {**opts.compile.values(), "cluster": opts.cluster}, opts.data.data,
                         opts.data.val_split)  # what a later --resume must match, and what this one is compared with
    open_run_folder(out, opts.train, target.plan_dir, this_recipe, opts.is_plan)  # before a long compile
    trust = opts.launch.trust_plugins or not opts.is_plan  # a MODEL file is the user's own code, already run
    compiled = None
    if opts.is_plan:
        check_plan_folder(target.plan_dir, trust, opts.train.steps)
    elif not (opts.train.resume and (out / "plan" / "plan.json").exists()):
        compiled = compile_target(opts, t_start)
    joins = {}
    if opts.train.join_at:  # a join schedule the plan cannot run is one line before the run folder is made
        joins = joins_of(opts.train, compiled.plan if compiled else load_plan(target.plan_dir or out / "plan"))
    plan_dir = write_run_folder(opts, target, compiled, this_recipe)
    cluster = make_cluster(opts, plan_dir, out, joins, trust)
    inputs = inputs_of(cluster.plan, opts.data, joins)  # before any process: a bad data function fails at once
    announce(opts, cluster, out)
    label = f"{target.name}: {len(cluster.plan.parts)} CompNodes"
    outcome = train_cluster(opts, cluster, inputs, out, label, t_start)
    return report(opts, outcome, out, t_start)

"""``fusion coordinator PLAN --bind ADDR --steps N``: drive executors started by hand on other hosts.

The options are :class:`fusion.options.commands.Coordinator`, checked before :func:`run` starts; the lifecycle
(run folder, inputs, start, step loop, report) is :mod:`fusion.commands.lifecycle`'s, shared with ``fusion run``.
"""
from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from fusion.commands.lifecycle import Outcome, drive, inputs_of, joins_of, open_run_folder, run_name, say

if TYPE_CHECKING:
    from fusion.options.commands import Coordinator

log = logging.getLogger(__name__)


def security_of(opts: "Coordinator", plan):
    """The coordinator's CURVE keys (None: --insecure); FusionError when keys are needed and missing or bad."""
    from fusion.commands.keys import COORDINATOR, security_from_args

    return security_from_args(opts.security, opts.plan, [COORDINATOR, *plan.parts], COORDINATOR, opts.listen.bind)


def listen(opts: "Coordinator", plan, out: Path, joins: dict, security):
    """The bound coordinator, inside the restarts' wait for parts (:class:`~fusion.commands.restarts.WaitForParts`:
    ``fusion run``'s cluster interface for executors started by hand)."""
    from fusion.commands.restarts import WaitForParts
    from fusion.executors.runtime.coordinator import Coordinator, CoordinatorConfig
    from fusion.executors.runtime.plandigest import plan_digest

    t, lis = opts.train, opts.listen
    cfg = CoordinatorConfig(bind=lis.bind, emulate_links=t.emulate_links, checkpoint_dir=str(out / "checkpoints"),
                            checkpoint_every=t.checkpoint_every, peer_timeout_s=t.peer_timeout, link_timeout_s=t.link_timeout,
                            startup_timeout_s=lis.startup_timeout, security=security,
                            plan_digest=plan_digest(opts.plan), drop_failed_replicas=t.drop_failed_replicas, steps_ahead=t.steps_ahead,
                            joins=joins)
    coord = Coordinator(plan, cfg, report=say)
    return WaitForParts(coord, lambda c: Coordinator(plan, c, report=say), lis.restart_wait, say)


def announce(opts: "Coordinator", parts, out: Path, joins: dict, secure: bool) -> None:
    """Where it listens and which executors it waits for (and which join later)."""
    plan = parts.plan
    late = [p for p in plan.parts if plan.parts[p].replica in joins]
    now = [p for p in plan.parts if p not in late]
    print(f"run folder {out}", file=sys.stderr)
    if not secure:
        from fusion.commands.keys import COORDINATOR
        from fusion.executors.runtime.keys import insecure_warning

        log.warning("%s", insecure_warning(COORDINATOR, parts.coordinator.bind()))
    print(f"coordinator listening on {parts.coordinator.bind()}; waiting up to {opts.listen.startup_timeout:.0f} s for "
          f"{len(now)} executors: {', '.join(now)} (start each with "
          f"`fusion executor {opts.plan} --node PART --coordinator tcp://THIS_HOST:PORT`)"
          + (f"; {', '.join(late)} join(s) later (--join-at): start them by hand too" if late else ""),
          file=sys.stderr, flush=True)


def report(opts: "Coordinator", outcome: Outcome, out: Path) -> int:
    """The result on stderr (and how to resume after an interrupt); 130 after an interrupt."""
    print(f"{'interrupted' if outcome.interrupted else 'done'}; run folder {out} (metrics.jsonl, loss.png, "
          "final.safetensors)", file=sys.stderr)
    if not outcome.interrupted:
        return 0
    from fusion.commands.rundir import resume_hint

    print(resume_hint(out, opts.train.checkpoint_every), file=sys.stderr)
    return 130


def run(opts: "Coordinator") -> int:
    """``fusion coordinator``: load the plan, check the run folder, listen, wait for the executors, train, report."""
    from fusion.commands.rundir import default_run_dir, prepare_run_dir, recipe
    from fusion.plan import load_plan

    plan = load_plan(opts.plan)
    out = Path(opts.out) if opts.out else default_run_dir(run_name(Path(opts.plan)))
    joins = joins_of(opts.train, plan)
    inputs = inputs_of(plan, opts.data, joins)  # fail before anything waits
    this_recipe = recipe("", {}, opts.data.data, opts.data.val_split)  # what a later --resume must match
    security = security_of(opts, plan)  # no run folder yet: a key error leaves none behind
    open_run_folder(out, opts.train, Path(opts.plan), this_recipe, is_plan=True)
    prepare_run_dir(out, resume=opts.train.resume, overwrite=opts.train.overwrite, plan_dir=Path(opts.plan),
                    run_recipe=this_recipe)
    parts = listen(opts, plan, out, joins, security)
    announce(opts, parts, out, joins, security is not None)

    def stop(graceful: bool) -> None:
        if graceful:
            parts.coordinator.stop()
            time.sleep(0.5)  # let stop messages leave before the sockets close
        parts.coordinator.close()  # (the coordinator of the latest restart)

    outcome = drive(parts, inputs, opts.train, opts.listen.max_restarts, out,
                    f"{run_name(Path(opts.plan))}: {len(plan.parts)} CompNodes", None, stop)
    return report(opts, outcome, out)

"""``fusion coordinator PLAN --bind ADDR --steps N``: drive executors started by hand on other hosts.

Also home of the options and argparse types ``fusion run`` shares with it; both train with the step loop of
:mod:`fusion.commands.steploop`.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import Callable

from fusion.commands.steploop import Evaluation, train

log = logging.getLogger(__name__)


def _number(parse: Callable[[str], float], kind: str, ok: Callable[[float], bool], rule: str):
    """An argparse type that parses with ``parse`` and accepts a value only when ``ok(value)``.

    ``kind`` names what was expected ("a whole number"), ``rule`` what ``ok`` checks ("must be at least 1")."""
    def check(text: str):
        try:
            v = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind}, got {text!r}") from None
        if not ok(v):
            raise argparse.ArgumentTypeError(f"{rule}, got {text}")
        return v
    return check


#: argparse types: an integer >= 1, an integer >= 0, a finite number of seconds > 0
positive_int = _number(int, "a whole number", lambda v: v >= 1, "must be at least 1")
non_negative_int = _number(int, "a whole number", lambda v: v >= 0, "must be 0 or more")
positive_float = _number(float, "a number", lambda v: 0 < v < float("inf"), "must be a positive number of seconds")
#: a finite number > 0 (not a time)
positive_finite = _number(float, "a number", lambda v: 0 < v < float("inf"), "must be a positive number")
#: a seed NumPy and torch both take: a whole number from 0 to 2**32 - 1
seed_int = _number(int, "a whole number", lambda v: 0 <= v < 2 ** 32, "must be 0 to 4294967295")
#: a finite number of seconds >= 0
non_negative_seconds = _number(float, "a number", lambda v: 0 <= v < float("inf"), "must be 0 or more seconds")


def zmq_address(text: str) -> str:
    """An argparse type: ``tcp://HOST:PORT`` (or ``ipc://PATH``); says what is expected otherwise."""
    proto, sep, rest = text.partition("://")
    if not sep or proto not in ("tcp", "ipc", "inproc") or not rest:
        raise argparse.ArgumentTypeError(f"{text!r} is not an address: expected tcp://HOST:PORT "
                                         f"(e.g. tcp://*:5600 to listen, tcp://10.0.0.1:5600 to connect)")
    if proto == "tcp":
        host, colon, port = rest.rpartition(":")
        if not colon or not host or not (port == "*" or port.isdigit() and 0 < int(port) < 65536):
            raise argparse.ArgumentTypeError(f"{text!r}: expected tcp://HOST:PORT with a port 1-65535 (or *)")
    return text


def add_common(p: argparse.ArgumentParser) -> None:
    """Options shared by ``run`` and ``coordinator``."""
    p.add_argument("--steps", type=positive_int, default=10, help="train until this many steps are done")
    p.add_argument("--emulate-links", action="store_true",
                   help="delay and rate-limit every link by the plan's alpha/beta (rehearse a plan on one host)")
    p.add_argument("--checkpoint-every", type=non_negative_int, default=0, metavar="N",
                   help="checkpoint every N steps (0: never)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last complete checkpoint")
    p.add_argument("--overwrite", action="store_true", help="replace the previous run in --out")
    p.add_argument("--data", default="auto", metavar="auto|text|synthetic|text:PATH|FILE.py:FUNCTION",
                   help="training data: auto (generated text corpus for language models, synthetic otherwise), "
                        "text:PATH[?tokenizer=NAME] (your text file or folder of .txt/.md/.py files; byte-level "
                        "tokens, or an installed tokenizer available offline; see docs/training.md), "
                        "or your FUNCTION(step) returning {placeholder: array of all micro-batches}")
    # data options (issue 26): the held-out part of --data text:PATH
    p.add_argument("--val-split", type=_number(float, "a percentage", lambda v: 0 <= v < 100, "must be in [0, 100)"),
                   default=0.0, metavar="PCT",
                   help="with --data text:PATH: hold out the last PCT %% of the text for validation, never trained on")
    p.add_argument("--peer-timeout", type=positive_float, default=10.0, help="a CompNode silent this long has failed (s)")
    p.add_argument("--drop-failed-replicas", action="store_true",
                   help="with data-parallel replicas: when a CompNode dies or falls silent, drop its replica and go on "
                        "with the others (the step is redone on them with the global batch re-split; metrics.jsonl "
                        "records the replica and step)")
    from fusion.executors.runtime.dp.join import join_at

    p.add_argument("--join-at", type=join_at, action="append", default=[], metavar="STEP:REPLICA",
                   help="DiLoCo: replica REPLICA of the plan starts late and joins the running job before step STEP (an "
                        "outer boundary, a multiple of --inner-steps): it takes the global weights and outer momentum "
                        "of a live replica and the global batch is re-split (`fusion run` starts its executors then; "
                        "under `fusion coordinator` start them by hand, with a --startup-timeout that covers the wait). "
                        "Repeatable")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_eval_options(p)


def add_eval_options(p: argparse.ArgumentParser) -> None:
    """``--eval-every``, ``--eval-batches``: a held-out loss, forward only, every N steps (docs/training.md)."""
    p.add_argument("--eval-every", type=non_negative_int, default=0, metavar="N",
                   help="every N steps, the loss of --eval-batches held-out batches, forward only through the "
                        "pipeline (no gradient, no optimizer step), in metrics.jsonl and loss.png (0: never)")
    p.add_argument("--eval-batches", type=positive_int, default=4, metavar="K",
                   help="held-out batches per evaluation (default 4): the corpus's held-out text, other synthetic "
                        "batches, or your FUNCTION(k, split='val')")


def eval_from_args(args: argparse.Namespace, plan, batch_fn=None) -> "Evaluation | None":
    """The run's :class:`Evaluation` (None without ``--eval-every``); its batches are made here, before any process
    starts, so a data function without ``split`` fails at once. Training data that holds its own validation split
    (``--data text:PATH`` with ``--val-split``: ``batch_fn.validation(k)``) gives the held-out batches itself."""
    if not getattr(args, "eval_every", 0):
        return None
    from fusion.data.batches import make_eval_batches
    from fusion.ir.errors import FusionError

    if any(len(ps) > 1 for ps in plan.lanes().values()):
        raise FusionError("--eval-every does not run under the interleaved schedule yet (several parts per process)")

    held_out = getattr(batch_fn, "validation", None)
    if held_out is not None:
        return Evaluation(args.eval_every, [held_out(k) for k in range(args.eval_batches)])
    return Evaluation(args.eval_every, make_eval_batches(plan, args.data, plan.seed, args.eval_batches))


def joins_from_args(args: argparse.Namespace, plan) -> dict[int, int]:
    """``--join-at`` as replica -> step, checked against ``plan`` (one line, exit 2, for a schedule that cannot run)."""
    from fusion.executors.runtime.dp.join import check_joins
    from fusion.ir.errors import FusionError

    joins: dict[int, int] = {}
    for step, r in args.join_at:
        if r in joins:
            raise FusionError(f"--join-at: replica {r} is given twice")
        joins[r] = step
    if any(s >= args.steps for s in joins.values()):
        r, s = next((r, s) for r, s in joins.items() if s >= args.steps)
        raise FusionError(f"--join-at {s}:{r}: the run stops after --steps {args.steps}, before step {s}")
    check_joins(plan, joins)
    return joins


def add_parser(sub) -> None:
    p = sub.add_parser("coordinator", help="coordinate executors started with `fusion executor` (multi-host runs)",
                       description="Listen at --bind ADDR, wait for one `fusion executor` per part of PLAN "
                                   "(parts are named part0, part1, ...; see `fusion inspect PLAN`), and train.")
    p.add_argument("plan", help="plan directory")
    p.add_argument("--bind", required=True, type=zmq_address, metavar="ADDR",
                   help="address to listen on, tcp://HOST:PORT, e.g. tcp://*:5600")
    p.add_argument("--out", default=None, metavar="RUN",
                   help="run folder for metrics, checkpoints, final weights (default: runs/<plan>-<time>)")
    p.add_argument("--startup-timeout", type=positive_float, default=120.0,
                   help="give up when the executors have not all said hello after this long (s)")
    add_common(p)
    # recovery without a human (issue 28): wait for a part to come back
    p.add_argument("--max-restarts", type=non_negative_int, default=0, metavar="N",
                   help="when a CompNode dies or stops answering, tell every executor to stop, wait for a new "
                        "executor of every part (started by you or a supervisor such as systemd with "
                        "Restart=on-failure) and train on from the latest complete checkpoint, at most N times "
                        "(needs --checkpoint-every; each restart is an event line in metrics.jsonl; default 0: the "
                        "run ends at the first failure)")
    p.add_argument("--restart-wait", type=positive_float, default=300.0, metavar="SECONDS",
                   help="with --max-restarts: how long a restart waits for a new executor of every part (default 300)")
    p.add_argument("--log-every", type=non_negative_seconds, default=30.0, metavar="SECONDS",
                   help="when stderr is not a terminal (a log file, CI), a one-line step log at most this often, "
                        "even with --no-progress (0: every step)")
    from fusion.commands.keys import add_security_options

    add_security_options(p)
    p.set_defaults(run=run, default_verbosity=1)


def run_name(plan_dir: Path) -> str:
    """A run's default folder name from its plan folder (``runs/tiny.plan`` -> ``tiny``; ``RUN/plan`` -> ``RUN``)."""
    p = plan_dir.resolve()
    name = p.parent.name if p.name == "plan" else p.name
    return name.removesuffix(".plan") or "run"


def run(args: argparse.Namespace) -> int:
    from fusion.commands.report import finish_run
    from fusion.commands.rundir import (check_resumable, check_resume_recipe, default_run_dir, prepare_run_dir,
                                        recipe)
    from fusion.data.batches import make_batches
    from fusion.executors.runtime.coordinator import Coordinator, CoordinatorConfig
    from fusion.ir.errors import FusionError
    from fusion.plan import load_plan

    if args.max_restarts and not args.checkpoint_every:  # before the plan is read
        raise FusionError(f"--max-restarts {args.max_restarts} needs --checkpoint-every N: a restarted run resumes "
                          "from its latest complete checkpoint")
    from fusion.commands.checks import check_data_options

    check_data_options(args)
    plan = load_plan(args.plan)
    if args.resume and not args.out:
        raise FusionError("--resume continues the run in --out RUN: name it")
    out = Path(args.out) if args.out else default_run_dir(run_name(Path(args.plan)))
    batch_fn = make_batches(plan, args.data, plan.seed, args.val_split / 100)  # fail before anything waits
    joins = joins_from_args(args, plan)
    evaluation = eval_from_args(args, plan, batch_fn)
    from fusion.commands.keys import COORDINATOR, security_from_args
    from fusion.executors.runtime.plandigest import plan_digest

    security = security_from_args(args, args.plan, [COORDINATOR, *plan.parts], COORDINATOR, args.bind)  # no folder yet
    this_recipe = recipe(args)  # what a later --resume must match, and what this one is compared with
    if args.resume:  # nothing to resume, or other data than the run's: refused, the run untouched
        check_resumable(out)
        check_resume_recipe(out, this_recipe, is_plan=True)
    prepare_run_dir(out, resume=args.resume, overwrite=args.overwrite, plan_dir=Path(args.plan), run_recipe=this_recipe)
    cfg = CoordinatorConfig(bind=args.bind, emulate_links=args.emulate_links, checkpoint_dir=str(out / "checkpoints"),
                            checkpoint_every=args.checkpoint_every, peer_timeout_s=args.peer_timeout,
                            startup_timeout_s=args.startup_timeout, security=security, plan_digest=plan_digest(args.plan),
                            drop_failed_replicas=args.drop_failed_replicas, joins=joins)
    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    coord = Coordinator(plan, cfg, report=say)
    from fusion.commands.restarts import WaitForParts

    parts = WaitForParts(coord, lambda c: Coordinator(plan, c, report=say), args.restart_wait, say)
    interrupted = False
    try:
        print(f"run folder {out}", file=sys.stderr)
        if security is None:
            from fusion.executors.runtime.keys import insecure_warning

            log.warning("%s", insecure_warning(COORDINATOR, coord.bind()))
        late = [p for p in plan.parts if plan.parts[p].replica in joins]
        now = [p for p in plan.parts if p not in late]
        print(f"coordinator listening on {coord.bind()}; waiting up to {args.startup_timeout:.0f} s for "
              f"{len(now)} executors: {', '.join(now)} (start each with "
              f"`fusion executor {args.plan} --node PART --coordinator tcp://THIS_HOST:PORT`)"
              + (f"; {', '.join(late)} join(s) later (--join-at): start them by hand too" if late else ""),
              file=sys.stderr, flush=True)
        try:
            if args.max_restarts:  # (a failure in the first start-up is restarted too: train_with_restarts starts it)
                from fusion.commands.restarts import train_with_restarts

                train_with_restarts(parts, batch_fn, 0, args.steps, out, not args.no_progress, args.max_restarts,
                                    say, log_every_s=args.log_every, evaluation=evaluation, resume=args.resume)
            else:
                first = coord.start(resume=args.resume)
                train(coord, batch_fn, first, args.steps, out, not args.no_progress, log_every_s=args.log_every,
                      evaluation=evaluation)
        except KeyboardInterrupt:
            interrupted = True
        parts.coordinator.stop()
        time.sleep(0.5)  # let stop messages leave before the sockets close
    finally:
        parts.coordinator.close()  # (the coordinator of the latest restart)
        finish_run(out, f"{run_name(Path(args.plan))}: {len(plan.parts)} CompNodes")
    print(f"{'interrupted' if interrupted else 'done'}; run folder {out} (metrics.jsonl, loss.png, final.safetensors)",
          file=sys.stderr)
    if interrupted:
        from fusion.commands.rundir import resume_hint

        print(resume_hint(out, args.checkpoint_every), file=sys.stderr)
    return 130 if interrupted else 0

"""The lifecycle ``fusion run`` and ``fusion coordinator`` share, as named steps: the run folder (its name, the
resume checks, making it), the inputs of a plan (batches, held-out batches, late replicas), and driving the
CompNodes (start, the step loop or its restarts, stop, the run's report). A command brings its own *cluster*:
an object with ``.plan``, ``.coordinator``, ``.start(resume) -> first step`` and ``.restart()`` (``fusion run``'s
LocalCluster or RayCluster, ``fusion coordinator``'s :class:`~fusion.commands.restarts.WaitForParts`)."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from fusion.commands.steploop import Evaluation, train
from fusion.options.train import DataOptions, TrainOptions


def say(line: str) -> None:
    """A progress line on stderr (stdout holds a command's result only)."""
    print(line, file=sys.stderr, flush=True)


def run_name(plan_dir: Path) -> str:
    """A run's default folder name from its plan folder (``runs/tiny.plan`` -> ``tiny``; ``RUN/plan`` -> ``RUN``)."""
    p = plan_dir.resolve()
    name = p.parent.name if p.name == "plan" else p.name
    return name.removesuffix(".plan") or "run"


def open_run_folder(out: Path, train_opts: TrainOptions, plan_dir: Path | None, recipe: dict, is_plan: bool) -> None:
    """Refuse, before any long work, a run folder that is in use (without ``--resume``/``--overwrite``), or a
    ``--resume`` with nothing to resume or another model / options / data than the run's (the run untouched)."""
    from fusion.commands.rundir import check_resumable, check_resume_recipe, check_run_dir

    check_run_dir(out, resume=train_opts.resume, overwrite=train_opts.overwrite, plan_dir=plan_dir)
    if train_opts.resume:
        check_resumable(out)
        check_resume_recipe(out, recipe, is_plan)


def evaluation_of(data: DataOptions, plan, batch_fn=None) -> Evaluation | None:
    """The run's :class:`Evaluation` (None without ``--eval-every``); its batches are made here, before any process
    starts, so a data function without ``split`` fails at once. Training data that holds its own validation split
    (``--data text:PATH`` with ``--val-split``: ``batch_fn.validation(k)``) gives the held-out batches itself."""
    if not data.eval_every:
        return None
    from fusion.data.batches import make_eval_batches
    from fusion.ir.errors import FusionError

    if any(len(ps) > 1 for ps in plan.lanes().values()):
        raise FusionError("--eval-every does not run under the interleaved schedule yet (several parts per process)")
    held_out = getattr(batch_fn, "validation", None)
    if held_out is not None:
        return Evaluation(data.eval_every, [held_out(k) for k in range(data.eval_batches)], data.stop_at_val_loss)
    return Evaluation(data.eval_every, make_eval_batches(plan, data.data, plan.seed, data.eval_batches),
                      data.stop_at_val_loss)


@dataclass
class Inputs:
    """What a plan trains on: ``batch_fn(step)``, the held-out batches, and the late replicas (replica -> step)."""

    batch_fn: Callable[[int], dict]
    evaluation: Evaluation | None
    joins: dict[int, int]


def joins_of(train_opts: TrainOptions, plan) -> dict[int, int]:
    """``--join-at`` as replica -> step, checked against ``plan`` (one line, exit 2, for a schedule it cannot run)."""
    from fusion.options.joins import check_joins

    joins = train_opts.joins()
    check_joins(plan, joins)
    return joins


def inputs_of(plan, data: DataOptions, joins: dict[int, int]) -> Inputs:
    """The batches and held-out batches of ``plan`` (before any process starts: a bad data function fails at once),
    with its ``joins`` (:func:`joins_of`)."""
    from fusion.data.batches import make_batches

    batch_fn = make_batches(plan, data.data, plan.seed, data.val_split / 100)
    return Inputs(batch_fn, evaluation_of(data, plan, batch_fn), joins)


@dataclass
class Outcome:
    """How a run ended: the step loop's summary (None: no step), whether Ctrl-C/SIGTERM stopped it, and the files
    :func:`~fusion.commands.report.finish_run` wrote (name -> path)."""

    summary: dict | None
    interrupted: bool
    written: dict[str, Any]


def _loop(cluster, inputs: Inputs, train_opts: TrainOptions, max_restarts: int, out: Path, first: int | None):
    """The step loop on ``cluster``, or with ``max_restarts`` the loop that restarts it (and starts it: a failure
    at start-up is restarted too). ``first``: the step it starts at when started already."""
    progress, t = not train_opts.no_progress, train_opts
    if max_restarts:
        from fusion.commands.restarts import train_with_restarts

        return train_with_restarts(cluster, inputs.batch_fn, 0, t.steps, out, progress, max_restarts, say,
                                   log_every_s=t.log_every, evaluation=inputs.evaluation, resume=t.resume)
    if first is None:
        first = cluster.start(resume=t.resume)
    return train(cluster.coordinator, inputs.batch_fn, first, t.steps, out, progress, log_every_s=t.log_every,
                 evaluation=inputs.evaluation)


def drive(cluster, inputs: Inputs, train_opts: TrainOptions, max_restarts: int, out: Path, label: str,
          start: Callable[[], int] | None, stop: Callable[[bool], None]) -> Outcome:
    """Start ``cluster``, train, and always ``stop(graceful)`` it and write the run's report (``label`` heads it).
    ``start``: how the command starts it outside the loop (Ctrl-C there is not a graceful stop), or None: the loop
    starts it. Ctrl-C (SIGTERM too, where the command maps it) in the loop stops at the end of the step."""
    from fusion.commands.report import finish_run

    graceful = interrupted = False
    summary = None
    try:
        first = start() if start is not None and not max_restarts else None
        try:
            summary = _loop(cluster, inputs, train_opts, max_restarts, out, first)
        except KeyboardInterrupt as e:
            interrupted = True
            summary = e.args[0] if e.args and isinstance(e.args[0], dict) else None
        graceful = True  # stop the executors so they write their traces
    finally:
        stop(graceful)
        written = finish_run(out, label)
    return Outcome(summary, interrupted, written)

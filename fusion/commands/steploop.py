"""The step loop shared by ``fusion run`` and ``fusion coordinator``: :func:`train` runs the steps on a started
coordinator, with a progress bar (step, loss, samples/s) or a step log, the metrics JSONL, the held-out loss of
``--eval-every`` (:class:`Evaluation`) and the final weights. ``fusion run --max-restarts`` and ``fusion coordinator
--max-restarts`` call it again after each restart (:mod:`fusion.commands.restarts`).
"""
from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)


@dataclass
class Evaluation:
    """What ``--eval-every`` evaluates: every ``every`` steps, the mean loss of ``batches`` (held out)."""

    every: int
    batches: list
    #: stop after the first evaluation whose loss is <= this (``--stop-at-val-loss``); None: run every step
    stop_below: float | None = None


def train(coord, batch_fn: Callable[[int], dict], first: int, steps: int, out: Path, progress: bool = True,
          resumed: bool = False, log_every_s: float | None = None, evaluation: "Evaluation | None" = None) -> dict:
    """Run steps ``first..steps-1``; write their metrics to ``out/metrics.jsonl``; save ``out/final.safetensors``.

    ``log_every_s``: when stderr is not a terminal (a log file, a CI job), a one-line step log there at most
    this often (and after the last step), whatever ``progress`` says; None: never.
    evaluation: after every ``evaluation.every``-th step, the held-out loss (:meth:`Coordinator.evaluate`, mean over
    its batches) is printed and written as ``{"step", "val_loss", "time"}``; with ``evaluation.stop_below`` the loop
    ends after the first evaluation at or below it (``steps`` is then the cap).

    Metrics of steps from ``first`` on are replaced, never appended twice (a resumed run rewrites what it
    replays; ``resumed``: also when ``first`` is 0, as after a restart before the first checkpoint), and the
    line of step ``first - 1`` is restored from its checkpoint when a crash lost it. On Ctrl-C the latest
    weights are still saved, then KeyboardInterrupt propagates.
    Returns ``{"steps": steps done, "loss": last loss, "interrupted": bool}``.
    """
    from fusion.commands.rundir import restore_committed_line, trim_metrics
    from fusion.plan import save_arrays

    out.mkdir(parents=True, exist_ok=True)
    metrics = out / "metrics.jsonl"
    resumed = resumed or bool(first)
    if resumed:
        trim_metrics(metrics, first)
        if restore_committed_line(metrics, coord.cfg.checkpoint_dir, first):
            log.warning("restored the metrics line of step %d from its checkpoint (a crash had lost it)", first - 1)
    bar = None
    if progress and first < steps:
        from tqdm import tqdm

        bar = tqdm(total=steps, initial=first, desc="train", unit="step", file=sys.stderr, dynamic_ncols=True)
    last = None
    done = first
    interrupted = False
    step_log = log_every_s is not None and not sys.stderr.isatty()
    t0 = t_logged = time.monotonic()
    from fusion.commands.metrics_log import LiveBoard

    board = LiveBoard(metrics, out / "tensorboard")  # TensorBoard as the run goes (with the tensorboard extra)
    ctrl_c = _StopAtStepEnd(bar)
    try:
        with open(metrics, "a" if resumed else "w") as mf:
            for step in range(first, steps):
                if ctrl_c.asked:
                    raise KeyboardInterrupt
                r = coord.step(batch_fn(step))
                last, done = r, step + 1
                line = r.metrics_line()
                mf.write(json.dumps(line) + "\n")
                mf.flush()
                board.add(line)
                if bar is not None:
                    bar.set_postfix(loss=f"{r.loss:.4f}", samples_s=f"{r.samples_per_s:.1f}")
                    bar.update(1)
                if step_log and (time.monotonic() - t_logged >= log_every_s or step + 1 == steps):
                    t_logged = time.monotonic()
                    _say(bar, f"step {step + 1}/{steps} loss {r.loss:.4f} {r.samples_per_s:.1f} samples/s "
                              f"({t_logged - t0:.0f} s)")
                if evaluation is not None and (step + 1) % evaluation.every == 0:
                    val = float(sum(coord.evaluate(b) for b in evaluation.batches) / len(evaluation.batches))
                    val_line = {"step": r.step, "val_loss": val, "time": time.time()}
                    mf.write(json.dumps(val_line) + "\n")
                    mf.flush()
                    board.add(val_line)
                    _say(bar, f"step {step + 1}/{steps}: val_loss {val:.4f} ({len(evaluation.batches)} held-out "
                              f"batches; metrics.jsonl step {r.step})")
                    if evaluation.stop_below is not None and val <= evaluation.stop_below:
                        _say(bar, f"step {step + 1}: val_loss {val:.4f} <= --stop-at-val-loss "
                                  f"{evaluation.stop_below:g}: stopping")
                        break
            if ctrl_c.asked:
                raise KeyboardInterrupt
    except KeyboardInterrupt:
        interrupted = True
    finally:
        ctrl_c.restore()
        board.close()
        if bar is not None:
            bar.close()
    if interrupted:
        print(f"interrupted after {done} steps; saving the latest weights (Ctrl-C again to skip)", file=sys.stderr)
    state = coord.fetch_state()
    tmp = out / "final.safetensors.tmp"
    save_arrays(state, tmp, {k: spec.dtype for k, spec in coord.plan.graph.params.items()})
    tmp.replace(out / "final.safetensors")
    summary = {"steps": done, "loss": None if last is None else last.loss, "interrupted": interrupted}
    if interrupted:
        raise KeyboardInterrupt(summary)
    return summary


def _say(bar, text: str) -> None:
    """A line on stderr, above the progress bar when there is one (``tqdm.write``: a bar drawn into a log file
    ends without a newline, and a plain print would be glued to it)."""
    if bar is not None:
        bar.write(text, file=sys.stderr)
    else:
        print(text, file=sys.stderr, flush=True)


class _StopAtStepEnd:
    """Ctrl-C during the step loop: the first one lets the step in flight finish (its line written) and then stops
    the loop; a second one stops at once (KeyboardInterrupt where the main thread is). A KeyboardInterrupt raised in
    the middle of a step (inside the coordinator's waits and receives) had left it unable to fetch the weights now
    and then (the Ctrl-C test hung after 'saving the latest weights'). Outside the main thread nothing changes."""

    def __init__(self, bar=None):
        import signal
        import threading

        self.asked, self.bar, self._previous = False, bar, None
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is \
                signal.default_int_handler:
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)

    def _on_sigint(self, signum, frame) -> None:
        if self.asked:
            raise KeyboardInterrupt
        self.asked = True
        _say(self.bar, "Ctrl-C: stopping after this step (Ctrl-C again to stop now)")

    def restore(self) -> None:
        if self._previous is not None:
            import signal

            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

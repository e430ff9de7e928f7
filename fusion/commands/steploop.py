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
    metrics = out / "metrics.jsonl"
    resumed = resumed or bool(first)
    _open_metrics(coord, out, first, resumed)
    bar = _progress_bar(first, steps) if progress and first < steps else None
    last, done, interrupted = None, first, False
    step_log = log_every_s is not None and not sys.stderr.isatty()
    t0 = t_logged = time.monotonic()
    from fusion.commands.metrics_log import LiveBoard

    board = LiveBoard(metrics, out / "tensorboard")  # TensorBoard as the run goes (with the tensorboard extra)
    ctrl_c = _StopAtStepEnd(bar)
    try:
        with open(metrics, "a" if resumed else "w") as mf:
            batches = _Batches(batch_fn)
            for step in range(first, steps):
                if ctrl_c.asked:
                    raise KeyboardInterrupt
                evaluates = evaluation is not None and (step + 1) % evaluation.every == 0
                last_one = step + 1 == steps or evaluates or ctrl_c.asked
                r = coord.step(batches.pop(step), ahead=None if last_one else batches.ahead(coord, step + 1))
                last, done = r, step + 1
                _record(mf, board, bar, r)
                if step_log and (time.monotonic() - t_logged >= log_every_s or step + 1 == steps):
                    t_logged = time.monotonic()
                    _say(bar, f"step {step + 1}/{steps} loss {r.loss:.4f} {r.samples_per_s:.1f} samples/s "
                              f"({t_logged - t0:.0f} s)")
                if evaluates and _evaluate(
                        coord, evaluation, r.step, mf, board, lambda t, s=step: _say(bar, f"step {s + 1}/{steps}: {t}")):
                    break  # --stop-at-val-loss reached
            if ctrl_c.asked:
                raise KeyboardInterrupt
    except KeyboardInterrupt:
        interrupted = True
        last, done = _settle(coord, metrics, board, bar, last, done)
    finally:
        _close(ctrl_c, board, bar)
    if interrupted:
        print(f"interrupted after {done} steps; saving the latest weights (Ctrl-C again to skip)", file=sys.stderr)
    _save_final(coord, out)
    summary = {"steps": done, "loss": None if last is None else last.loss, "interrupted": interrupted}
    if interrupted:
        raise KeyboardInterrupt(summary)
    return summary


class _Batches:
    """``batch_fn``'s batches, each made once: the next step's is made a step early when the coordinator sends it
    before the current one is done (executors/runtime/step_ahead.py; the loop passes none when an evaluation or the
    end comes between the two). Otherwise ``batch_fn(step)`` is called when step ``step`` starts, as before."""

    def __init__(self, batch_fn: Callable[[int], dict]):
        self.batch_fn = batch_fn
        self._made: dict[int, dict] = {}

    def ahead(self, coord, step: int) -> dict | None:
        """Step ``step``'s batch to send ahead, or None where the run goes in lock step (nothing is made early)."""
        if coord.lock_step_reason() is not None:
            return None
        if step not in self._made:
            self._made[step] = self.batch_fn(step)
        return self._made[step]

    def pop(self, step: int) -> dict:
        return self._made.pop(step) if step in self._made else self.batch_fn(step)


def _settle(coord, metrics: Path, board, bar, last, done: int):
    """On Ctrl-C: a step already sent ahead runs on the CompNodes anyway, so its line is written and it is counted
    (the final weights include it); ``(last report, steps done)``. Nothing to settle, or a coordinator that cannot
    (a second Ctrl-C during a step): unchanged."""
    try:
        r = coord.settle()
    except Exception as e:  # noqa: BLE001 - the weights are still saved; the line says what was not counted
        log.warning("a step sent ahead could not be collected after Ctrl-C: %s", e)
        return last, done
    if r is None:
        return last, done
    with open(metrics, "a") as mf:
        _record(mf, board, bar, r)
    return r, r.step + 1


def _record(mf, board, bar, r) -> None:
    """A step's metrics line written and shown on the progress bar."""
    _write_line(mf, board, r.metrics_line())
    _advance(bar, r)


def _close(ctrl_c, board, bar) -> None:
    """The step loop is over: Ctrl-C's handler back, the live board and the progress bar closed."""
    ctrl_c.restore()
    board.close()
    if bar is not None:
        bar.close()


def _open_metrics(coord, out: Path, first: int, resumed: bool) -> None:
    """The run folder, and on a resume its metrics from step ``first`` on dropped (the line of step ``first - 1``
    restored from its checkpoint when a crash lost it)."""
    from fusion.commands.rundir import restore_committed_line, trim_metrics

    out.mkdir(parents=True, exist_ok=True)
    metrics = out / "metrics.jsonl"
    if resumed:
        trim_metrics(metrics, first)
        if restore_committed_line(metrics, coord.cfg.checkpoint_dir, first):
            log.warning("restored the metrics line of step %d from its checkpoint (a crash had lost it)", first - 1)


def _progress_bar(first: int, steps: int):
    from tqdm import tqdm

    return tqdm(total=steps, initial=first, desc="train", unit="step", file=sys.stderr, dynamic_ncols=True)


def _advance(bar, r) -> None:
    """The progress bar one step on, with the step's loss and samples/s (no bar: nothing)."""
    if bar is not None:
        bar.set_postfix(loss=f"{r.loss:.4f}", samples_s=f"{r.samples_per_s:.1f}")
        bar.update(1)


def _evaluate(coord, evaluation: Evaluation, step: int, mf, board, say: Callable[[str], None]) -> bool:
    """The held-out loss after step ``step`` (the mean over the batches): a metrics line and a line on stderr.
    True when it reached ``evaluation.stop_below`` (``--stop-at-val-loss``): the run stops there."""
    val = float(sum(coord.evaluate(b) for b in evaluation.batches) / len(evaluation.batches))
    _write_line(mf, board, {"step": step, "val_loss": val, "time": time.time()})
    say(f"val_loss {val:.4f} ({len(evaluation.batches)} held-out batches; metrics.jsonl step {step})")
    if evaluation.stop_below is None or val > evaluation.stop_below:
        return False
    say(f"val_loss {val:.4f} <= --stop-at-val-loss {evaluation.stop_below:g}: stopping")
    return True


def _write_line(mf, board, line: dict) -> None:
    """One metrics line into metrics.jsonl (flushed: a crash loses no finished step) and the live board."""
    mf.write(json.dumps(line) + "\n")
    mf.flush()
    board.add(line)


def _save_final(coord, out: Path) -> None:
    """The latest weights as ``out/final.safetensors`` (written beside, then moved: never half a file)."""
    from fusion.plan import save_arrays

    state = coord.fetch_state()
    tmp = out / "final.safetensors.tmp"
    save_arrays(state, tmp, {k: spec.dtype for k, spec in coord.plan.graph.params.items()})
    tmp.replace(out / "final.safetensors")


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
    and then (the Ctrl-C test hung after 'saving the latest weights'). SIGTERM is taken over the same way where the
    command marked its handler ``graceful`` (``fusion run``: CI saw a SIGTERMed run take over 20 s to exit),
    also when SIGINT is ignored (a background job). Outside the main thread nothing changes."""

    def __init__(self, bar=None):
        import signal
        import threading

        self.asked, self.bar, self._previous = False, bar, {}
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._on_signal)
        if getattr(signal.getsignal(signal.SIGTERM), "graceful", False):
            self._previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        import signal

        if self.asked:
            raise KeyboardInterrupt
        self.asked = True
        what = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
        _say(self.bar, f"{what}: stopping after this step ({what} again to stop now)")

    def restore(self) -> None:
        import signal

        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

"""``fusion run --max-restarts N``: a run that restarts its CompNodes itself instead of ending at a failure.

When a CompNode dies, crashes or stops answering (the coordinator's
:class:`~fusion.executors.runtime.coordinator.CompNodeFailure`), :func:`train_with_restarts`
kills every executor (a stopped one included), starts them all again, lets every part reload
the newest complete checkpoint that verifies (the ``--resume`` machinery), and trains on from
there. Steps after that checkpoint are recomputed; the runs are deterministic, so the losses
and weights are the same bits as a run without the failure. Each restart is one event line in
``metrics.jsonl`` (:func:`restart_event`), drawn in ``loss.png``. After ``N`` restarts the
next failure ends the run as without the option (named, exit status 2).

``fusion coordinator --max-restarts N`` cannot start processes (the executors run on other hosts, started by
hand or by a supervisor such as systemd). Its :class:`WaitForParts` "restarts" by waiting: every executor is told
to stop (exit status 1, so that a supervisor with ``Restart=on-failure`` starts it again), a new coordinator
binds the same address, and once a new executor of every part has said hello (within ``--restart-wait``
seconds) each reloads the latest complete checkpoint, as after ``fusion run``'s restart.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from dataclasses import replace
from typing import Callable

from fusion.commands.steploop import train
from fusion.ir.errors import FusionError

#: the ``event`` of a restart's line in metrics.jsonl
RESTART = "restart"


def restart_event(number: int, limit: int, failed_step: int, part: str, reason: str, resumed_step: int | None,
                  recovery_s: float, start_failed: str = "", parts: tuple[str, ...] = (),
                  detected: float | None = None) -> dict:
    """One restart's line in ``metrics.jsonl``.

    number/limit: this is restart ``number`` of at most ``limit``; failed_step: the step that was running
    when ``part`` failed for ``reason``; resumed_step: the first step run again (the checkpoint's step), None
    when the restart's own start-up failed; recovery_s: from the failure being detected to every CompNode
    ready again (or to the start-up failing); start_failed (only then): the failure that ended this restart's
    start-up, which the next restart's line names as its own reason; parts: every part found failed, ``part``
    (the first cause) first; detected: when the failure was detected (``time.time()``), so that a fault's
    detection time can be read from its firing to here (``benchmarks/chaos.py``: ``detect_s``)."""
    line = {"event": RESTART, "restart": number, "max_restarts": limit, "failed_step": failed_step, "part": part,
            "parts": list(parts or (part,)), "reason": reason, "resumed_step": resumed_step,
            "recovery_s": round(recovery_s, 3), "detected": detected, "time": time.time()}
    return {**line, "start_failed": start_failed} if start_failed else line


def _append(out: Path, line: dict) -> None:
    with open(out / "metrics.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")


def train_with_restarts(cluster, batch_fn: Callable[[int], dict], first: int, steps: int, out: Path,
                        progress: bool, max_restarts: int, report: Callable[[str], None],
                        log_every_s: float | None = None, evaluation=None, resume: bool = False) -> dict:
    """Start ``cluster`` (a LocalCluster, ``resume``: from its latest checkpoint) and ``train`` on it, restarting
    it up to ``max_restarts`` times; a failure during the first start-up is restarted too.

    first: the step the run starts at if the first start-up fails before saying (``cluster.start`` returns
    the real one). Returns train's summary plus ``restarts``; the failure that exceeds ``max_restarts`` is
    raised with the count of restarts in its reason."""
    from fusion.executors.runtime.coordinator import CompNodeFailure

    restarts = 0
    failure: CompNodeFailure | None = None
    failed_step = first
    t_fail, t_detected = 0.0, 0.0
    started = False
    while True:
        try:
            if not started:
                started = True
                first = cluster.start(resume=resume)
                report(f"all {len(cluster.plan.parts)} CompNodes ready"
                       + (f"; resuming at step {first} from {out / 'checkpoints'}" if first else ""))
            elif failure is not None:
                try:
                    first = cluster.restart()
                except OSError as e:  # writing the restart's keys, logs or folders (a full disk): one line
                    raise FusionError(f"restart {restarts} of {max_restarts} after {failure}: {e}") from None
                event = restart_event(restarts, max_restarts, failed_step, failure.part, failure.reason, first,
                                      time.monotonic() - t_fail, parts=failure.parts, detected=t_detected)
                _append(out, event)
                report(f"restart {restarts} of {max_restarts}: every CompNode up again after "
                       f"{event['recovery_s']:.1f} s; resuming at step {first}")
                failure = None
            summary = train(cluster.coordinator, batch_fn, first, steps, out, progress, resumed=restarts > 0,
                            log_every_s=log_every_s, evaluation=evaluation)
            return {**summary, "restarts": restarts}
        except CompNodeFailure as e:
            if failure is not None:  # this restart's own start-up failed: its line too (each restart has one)
                _append(out, restart_event(restarts, max_restarts, failed_step, failure.part, failure.reason, None,
                                           time.monotonic() - t_fail, start_failed=str(e), parts=failure.parts,
                                           detected=t_detected))
            if e.lasting:  # a full or read-only disk: a restart would meet it again (and write its keys there)
                raise FusionError(f"{e}: not restarted, a restart would fail the same way; free space on the disk of "
                                  f"{out}, then --resume") from None
            if restarts >= max_restarts:
                if not restarts:
                    raise
                raise CompNodeFailure(e.part, f"{e.reason} (after {restarts} restart{'s' if restarts > 1 else ''}, "
                                              f"--max-restarts {max_restarts})", parts=e.parts) from None
            restarts += 1
            if failure is None:  # (a failure while restarting keeps the step the run had reached)
                failed_step = cluster.coordinator.failed_step(e.part)
            failure, t_fail, t_detected = e, time.monotonic(), time.time()
            report(f"{e}; restarting every CompNode from the latest checkpoint (restart {restarts} of {max_restarts})")


class WaitForParts:
    """The restarts of a standalone coordinator (``fusion coordinator --max-restarts``): it waits for the parts.

    ``coordinator``: the running :class:`~fusion.executors.runtime.coordinator.Coordinator` (bound, started);
    ``make``: a new coordinator for the same plan and options with the given config; ``wait_s``: how long a
    restart waits for a new executor of every part (``--restart-wait``). Used by :func:`train_with_restarts` as
    ``fusion run``'s LocalCluster is: ``.plan``, ``.coordinator``, ``.start()`` and ``.restart()``."""

    def __init__(self, coordinator, make: Callable, wait_s: float, report: Callable[[str], None]):
        self.coordinator, self.make, self.wait_s, self.report = coordinator, make, wait_s, report
        self.plan = coordinator.plan

    def start(self, resume: bool = False) -> int:
        """The first start-up: wait for every part's executor (``--startup-timeout``); returns the first step."""
        return self.coordinator.start(resume=resume)

    def restart(self) -> int:
        """Stop every executor (the parts still running are told to abort: each must reload the checkpoint in a
        fresh process), bind a new coordinator at the same address, wait up to ``wait_s`` for a new executor of
        every part and set them up from the latest complete checkpoint; returns the step the run resumes at.
        A new executor that said hello to the old coordinator while it trained is handed on, not lost."""
        old = self.coordinator
        old.abort("the run restarts from its latest checkpoint (fusion coordinator --max-restarts): "
                  "start this executor again")
        old.close(linger_s=0.5)  # the aborts leave; then nothing more arrives at the old sockets
        hellos = old.pending_hellos()
        cfg = replace(old.cfg, bind=old.address or old.cfg.bind, startup_timeout_s=self.wait_s)  # the port bound
        self.coordinator = new = self.make(cfg)
        new.take_hellos(hellos)
        parts = list(new.parts)
        self.report(f"waiting up to {self.wait_s:.0f} s for a new executor of every part ({', '.join(parts)}) at "
                    f"{new.bind()}: start them again (a supervisor such as systemd with Restart=on-failure does)")
        return new.start(resume=True)

"""The options of training a plan that ``fusion run`` and ``fusion coordinator`` share: the step loop and run
folder (:class:`TrainOptions`) and the data it trains and evaluates on (:class:`DataOptions`)."""
from __future__ import annotations

from dataclasses import dataclass

from fusion.options.field import Section, option
from fusion.options.types import (join_at, non_negative_int, non_negative_seconds, percentage, positive_float,
                                  positive_int, steps_ahead_count)


@dataclass
class TrainOptions(Section):
    """How long to train, checkpoints and resuming, failures, late replicas, and the step log."""

    TITLE = "training"

    steps: int = option("--steps", essential=True, default=10, type=positive_int, help="train until this many steps are done")
    emulate_links: bool = option("--emulate-links", kind="flag", help="delay and rate-limit every link by the plan's alpha/beta (rehearse a plan on one host)")
    checkpoint_every: int = option("--checkpoint-every", essential=True, default=0, type=non_negative_int, metavar="N", help="checkpoint every N steps (0: never)")
    resume: bool = option("--resume", essential=True, kind="flag", help="continue the run in --out from its last complete checkpoint")
    overwrite: bool = option("--overwrite", kind="flag", help="replace the previous run in --out")
    peer_timeout: float = option("--peer-timeout", default=10.0, type=positive_float, help="a CompNode silent this long has failed (s)")
    link_timeout: float = option("--link-timeout", default=2.0, type=non_negative_seconds, metavar="SECONDS", help="a CompNode that dies, stops or is cut off is detected within this long on a quiet host: ZeroMQ heartbeats on the coordinator's link to each CompNode, answered by ZeroMQ's I/O thread even while the CompNode computes (0: off; raise it for links that need longer to send one message; docs/runtime.md)")
    drop_failed_replicas: bool = option("--drop-failed-replicas", kind="flag", help="with data-parallel replicas: when a CompNode dies or falls silent, drop its replica and go on with the others (the step is redone on them with the global batch re-split; metrics.jsonl records the replica and step)")
    join_at: list = option("--join-at", default=[], type=join_at, metavar="STEP:REPLICA", help="DiLoCo: replica REPLICA of the plan starts late and joins the running job before step STEP (an outer boundary, a multiple of --inner-steps): it takes the global weights and outer momentum of a live replica and the global batch is re-split (`fusion run` starts its executors then; under `fusion coordinator` start them by hand, with a --startup-timeout that covers the wait). Repeatable")
    steps_ahead: int = option("--steps-ahead", default=1, type=steps_ahead_count, metavar="N", help="send each step to the CompNodes before the previous one is done, so a part starts it as soon as its own last step is over instead of waiting a round trip and the slowest part (DiLoCo's replicas run their inner steps apart); the same steps and results as lock step. Not with gradient clipping, --drop-failed-replicas, joins or an interleaved schedule, nor across an evaluation (default 1; 0: lock step; docs/runtime.md)")
    no_progress: bool = option("--no-progress", kind="flag", help="no progress bar")
    log_every: float = option("--log-every", default=30.0, type=non_negative_seconds, metavar="SECONDS", help="when stderr is not a terminal (a log file, CI), a one-line step log at most this often, even with --no-progress (0: every step)")

    def check(self) -> None:
        from fusion.ir.errors import FusionError

        seen = set()
        for _, r in self.join_at:
            if r in seen:
                raise FusionError(f"--join-at: replica {r} is given twice")
            seen.add(r)
        late = [(s, r) for s, r in self.join_at if s >= self.steps]
        if late:
            raise FusionError(f"--join-at {late[0][0]}:{late[0][1]}: the run stops after --steps {self.steps}, "
                              f"before step {late[0][0]}")

    def joins(self) -> dict[int, int]:
        """``--join-at`` as replica -> the step it joins before."""
        return {r: s for s, r in self.join_at}


@dataclass
class DataOptions(Section):
    """The training data and the held-out batches a run evaluates on."""

    TITLE = "data"

    data: str = option("--data", essential=True, default="auto", metavar="auto|text|synthetic|text:PATH|FILE.py:FUNCTION", help="training data: auto (generated text corpus for language models, synthetic otherwise), text:PATH[?tokenizer=NAME] (your text file or folder of .txt/.md/.py files; byte-level tokens, or an installed tokenizer available offline; see docs/training.md), or your FUNCTION(step) returning {placeholder: array of all micro-batches}")
    val_split: float = option("--val-split", default=0.0, type=percentage, metavar="PCT", help="with --data text:PATH: hold out the last PCT %% of the text for validation, never trained on")
    eval_every: int = option("--eval-every", default=0, type=non_negative_int, metavar="N", help="every N steps, the loss of --eval-batches held-out batches, forward only through the pipeline (no gradient, no optimizer step), in metrics.jsonl and loss.png (0: never)")
    stop_at_val_loss: float | None = option("--stop-at-val-loss", default=None, type=float, metavar="LOSS", help="stop training after the first evaluation whose held-out loss is <= LOSS (time to a quality: --steps is then the cap); needs --eval-every")
    eval_batches: int = option("--eval-batches", default=4, type=positive_int, metavar="K", help="held-out batches per evaluation (default 4): the corpus's held-out text, other synthetic batches, or your FUNCTION(k, split='val')")

    def check(self) -> None:
        """A text file or a data function's file that does not exist, and a ``--val-split`` that would be silently
        ignored (only ``--data text:PATH`` holds part of its text out), before anything is traced or started."""
        from pathlib import Path

        from fusion.ir.errors import FusionError

        data, val = self.data or "auto", self.val_split or 0.0
        if data.startswith("text:"):
            from fusion.data.text import TextSpec

            path = TextSpec.parse(data).path
            if not path.exists():
                raise FusionError(f"--data {data}: no such file or folder {str(path)!r}")
        elif data not in ("auto", "text", "synthetic") and ":" in data:
            file = data.rpartition(":")[0]
            if file.endswith(".py") and not Path(file).is_file():
                raise FusionError(f"--data {data}: no such file {file!r}")
        if self.stop_at_val_loss is not None and not self.eval_every:
            raise FusionError("--stop-at-val-loss needs --eval-every N (the held-out loss it compares)")
        if val > 0 and not data.startswith("text:"):
            raise FusionError(f"--val-split {val:g} holds out part of --data text:PATH, but --data is {data}: nothing "
                              "would be held out (--eval-every takes its held-out batches from the data source: "
                              "docs/training.md)")

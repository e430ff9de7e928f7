"""Steps sent ahead: the coordinator sends step k+1 to the CompNodes before every ``done`` of step k has arrived.

In lock step a part that finished step k waits a round trip to the coordinator (and the slowest part of the step)
before step k+1 reaches it. Sent ahead, step k+1 waits in its control queue (:meth:`CompNode._serve` takes them in
order), so a part starts it as soon as its own step k is over: the round trip is hidden, and a replica that was
slow in one step and fast in the next no longer holds the others back in each (the point of DiLoCo's inner steps,
where replicas exchange nothing between outer steps; Async Local-SGD, Liu et al. 2024, arXiv 2401.09135, lets
workers run free the same way).

One step ahead (:data:`MAX_AHEAD`) bounds how far any part can be from another: a part receives step k+2 only once
every ``done`` of step k has arrived, so every other part is at step k+1 or later. Every message between parts
(an activation, a gradient, an all-reduce chunk, a pseudo-gradient, a tied gradient) is therefore of the receiver's
iteration or the next one: the inboxes keep those of the next (:func:`accepts`) and refuse anything further, as
before. Nothing is computed differently: the same steps run in the same order on every part, so a run's losses and
weights are bit for bit those of lock step (``tests/executors/runtime/test_step_ahead.py``).

A step is not sent ahead when something between the two steps needs every part to have finished the first
(:func:`lock_step_reason`): an evaluation or the run's end (the step loop passes no next batch then), a
checkpoint (the parts' writes and the next step's traffic would overlap), the
coordinator's own part of a step (gradient clipping's global norm, the failover's go-ahead), a replica joining, an
interleaved schedule (several parts in one process), or a step whose gradients the caller wants back.
"""
from __future__ import annotations

from dataclasses import dataclass

#: how many steps the coordinator sends beyond the one whose ``done`` it waits for
MAX_AHEAD = 1


def accepts(it: int, expected: int) -> bool:
    """Whether a message between parts for iteration ``it`` may be kept by a part at iteration ``expected``: its
    own iteration, or up to :data:`MAX_AHEAD` later (sent by a part that has already started that step)."""
    return expected <= it <= expected + MAX_AHEAD


def expected_text(expected: int) -> str:
    """The iterations a part at ``expected`` keeps messages of, for a refusal's line."""
    return f"this part is at iteration {expected} (it keeps messages of iterations {expected}..{expected + MAX_AHEAD})"


@dataclass(frozen=True)
class Ahead:
    """A step sent before the previous one's ``done`` arrived.

    step: its index (the coordinator's count of completed steps when it runs); rows: the samples it trains on;
    checkpoint: whether the parts save after it; sent_at: ``time.monotonic()`` when it was sent (its
    ``iteration_s`` counts from this or the previous step's last ``done``, whichever is later)."""

    step: int
    rows: int
    checkpoint: bool
    sent_at: float


def lock_step_reason(*, clip: bool, failover: bool, joining: bool, interleaved: bool, want_grads: bool,
                     checkpoint: bool = False) -> str | None:
    """Why the next step may not be sent before this one is done (None: it may)."""
    if checkpoint:  # GPT-2 small: the next step's early activations reached the last part during its 1.5 GB write,
        # and its ZeroMQ I/O thread answered no heartbeat for 1.25 s (a false link failure, 2 of 4 bench_scale runs)
        return "this step is checkpointed: the parts write their state before the next step's messages flow"
    if clip:
        return "gradient clipping: the coordinator sums every part's norm within each step"
    if failover:
        return "--drop-failed-replicas: the coordinator gives each step's go-ahead"
    if joining:
        return "a replica joins at an outer boundary"
    if interleaved:
        return "the interleaved schedule runs several parts in one process"
    if want_grads:
        return "the caller wants this step's gradients"
    return None

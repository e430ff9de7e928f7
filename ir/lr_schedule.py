"""Learning-rate schedules: one pure function ``step -> multiplier of the base lr``, shared by every engine.

The multiplier follows ``torch.optim.lr_scheduler.LambdaLR``: optimizer step ``k`` (0-based, the count of
steps completed before it) runs with ``lr = base_lr * lr_factor(k)``. The shapes are the usual Hugging Face
ones (``transformers.get_constant_schedule_with_warmup``, ``get_linear_schedule_with_warmup``,
``get_cosine_schedule_with_warmup`` with half a cycle):

- ``constant``: ``k / warmup`` during warmup, then 1;
- ``linear``:   ``k / warmup`` during warmup, then ``(total - k) / (total - warmup)``, down to 0 at ``total``;
- ``cosine``:   ``k / warmup`` during warmup, then ``0.5 * (1 + cos(pi * progress))`` with
                ``progress = (k - warmup) / (total - warmup)``, down to 0 at ``total``.

``total`` is the number of training steps the decay spans (HF's ``num_training_steps``); steps past it
stay at 0. Lives in the IR layer so the torch and NumPy engines import the same definition.
"""
from __future__ import annotations

import math

#: the schedule names ``--lr-schedule`` accepts
SCHEDULES = ("constant", "linear", "cosine")


def check_schedule(name: str, warmup_steps: int, total_steps: int) -> str | None:
    """Why ``(name, warmup_steps, total_steps)`` is not a schedule (one line naming the field), or None."""
    if name not in SCHEDULES:
        return f"lr_schedule must be one of {', '.join(SCHEDULES)}, got {name!r}"
    for field, v in (("warmup_steps", warmup_steps), ("total_steps", total_steps)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            return f"{field} must be a whole number >= 0, got {v!r}"
    if name != "constant" and total_steps < 1:
        return f"lr_schedule {name!r} decays over total_steps, which must be >= 1 (got {total_steps})"
    if name != "constant" and warmup_steps > total_steps:
        return f"warmup_steps ({warmup_steps}) exceeds total_steps ({total_steps}) of the {name} schedule"
    return None


def lr_factor(name: str, step: int, warmup_steps: int = 0, total_steps: int = 0) -> float:
    """The multiplier of the base learning rate at optimizer step ``step`` (0-based), as HF's lambdas."""
    if step < warmup_steps:
        return float(step) / float(max(1, warmup_steps))
    if name == "constant":
        return 1.0
    if name == "linear":
        return max(0.0, float(total_steps - step) / float(max(1, total_steps - warmup_steps)))
    if name == "cosine":
        progress = float(step - warmup_steps) / float(max(1, total_steps - warmup_steps))
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress)))
    raise ValueError(f"unknown lr schedule {name!r} (known: {', '.join(SCHEDULES)})")

"""The DP planner's choice of DiLoCo's synchronous warm-up and of the replicas' inner learning rate (issue 34), each
with the one-line reason ``fusion inspect`` prints.

The rules come from the convergence study's tuning (docs/data-parallel.md, "Tuning for 'same loss, sooner'";
4 replicas of a 100k-parameter GPT, inner AdamW at lr 3e-3, H = 20, seeds 100-101 for tuning, 0-2 for the check;
``steps_to_sync_loss_ratio``, lower is better):

* **Warm-up.** A synchronous warm-up of 100 steps (DiLoCo starting from synchronous DP's weights and AdamW state)
  gave the best worst seed of every variant tuned: 1.467 / 1.333 on the tuning seeds (no warm-up: 1.8 / 3.2 at the
  same settings, at best 1.667 worst with any inner lr and outer step tuned), and on seeds 0-2 a median of 1.267
  and a worst of 1.4 against 1.533 and 1.6 without one. 50 steps was worse than 100 (1.633 / 1.7 against 1.533 / 1.533 at inner lr 1.5e-3).
  Those runs spent 100 of their 1000 steps warming up: the planner takes 100 steps, capped at a tenth of the run
  where the run's length is known (a shorter run keeps the measured fraction, not the measured count: an
  extrapolation). Longer warm-ups were not measured, so a longer run still gets 100.
* **Inner lr.** Without a warm-up, halving the inner lr for the replicas' quarter batch (AdamW's square-root rule,
  Malladi et al. 2022, "On the SDEs and Scaling Rules for Adaptive Gradient Algorithms": lr x sqrt(batch ratio))
  helped every outer setting tuned (e.g. 0.867 / 1.8 against 1.8 / 3.2 at outer lr 0.7, momentum 0.5). *With* the
  100-step warm-up it did not: 1.533 / 1.533 against 1.467 / 1.333 at the plan's lr. So the rule is applied only
  when there is no warm-up, and only for AdamW, the optimizer it was measured with. SGD keeps the plan's lr: with
  H = 1, outer lr 1 and no outer momentum DiLoCo with SGD at the plan's lr *is* synchronous DP, which a linear
  rule (lr / R, Goyal et al. 2017) would slow R-fold; nothing was measured for SGD. Muon keeps it too: it ran at
  the synchronous lr inside the replicas (with the warm-up: 1.2 / 1.267 worst on seeds 0-2) and was not measured
  without one.

A value the user gave (``--sync-warmup``, ``--inner-lr``) always wins, recorded as "given by the user".
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

#: the warm-up that gave the best worst seed in the tuning (docs/data-parallel.md)
WARMUP_STEPS = 100
#: the study's runs spent WARMUP_STEPS of their 1000 steps warming up: the cap on a shorter run's warm-up
WARMUP_FRACTION = 0.1
#: optimizers whose inner lr follows the square-root rule without a warm-up (measured with AdamW)
SQRT_RULE = ("adamw",)


@dataclass(frozen=True)
class DiLoCoSetting:
    """What the choice reads: the planned DiLoCo and what the user gave.

    replicas:     R, the replicas the planner chose (each trains on about 1/R of the global batch).
    inner_steps:  H, inner steps per outer step (the planner's).
    optimizer:    the plan's optimizer name (``OptimizerConfig.name``: sgd, adamw, muon).
    lr:           the plan's learning rate (``--lr``), what synchronous DP and the warm-up run at.
    equal_shares: the replicas take equal shares of the batch (the warm-up averages equal shares only).
    steps:        the run's length in steps where it is known at compile time (``fusion run --steps``, else
                  ``--lr-decay-steps``), None where not; ``steps_from`` names the option it came from.
    given_warmup: ``--sync-warmup N`` where the user gave it (None: the planner chooses).
    given_inner_lr: ``--inner-lr X`` where the user gave it (None: the planner chooses).
    """

    replicas: int
    inner_steps: int
    optimizer: str
    lr: float
    equal_shares: bool = True
    steps: int | None = None
    steps_from: str = "--steps"
    given_warmup: int | None = None
    given_inner_lr: float | None = None


@dataclass(frozen=True)
class DiLoCoDefaults:
    """The choice: ``sync_warmup`` N (0: none), ``inner_lr`` (None: the plan's lr), and a one-line reason for each."""

    sync_warmup: int
    warmup_reason: str
    inner_lr: float | None
    inner_lr_reason: str

    def to_dict(self) -> dict:
        return asdict(self)


def choose_warmup(s: DiLoCoSetting) -> tuple[int, str]:
    """N and why (module docstring: 100 steps, at most a tenth of a known run; none with unequal shares)."""
    if s.given_warmup is not None:
        what = f"{s.given_warmup} steps" if s.given_warmup else "none"
        return s.given_warmup, f"{what}: given by the user (--sync-warmup {s.given_warmup})"
    if not s.equal_shares:
        return 0, ("none: the warm-up averages equal shares and the planner gave the replicas unequal ones "
                   "(--sync-warmup N with --replica-shares is refused)")
    why = (f"docs/data-parallel.md tuning: {WARMUP_STEPS} synchronous steps gave the best worst seed "
           "(1.467 vs 1.667 without, steps to synchronous DP's loss)")
    if s.steps is None:
        return WARMUP_STEPS, (f"{WARMUP_STEPS} steps: {why}; the run's length is unknown here, so fusion run needs "
                              f"--steps > {WARMUP_STEPS} (or compile with --sync-warmup N)")
    n = min(WARMUP_STEPS, int(s.steps * WARMUP_FRACTION))
    if n < 1:
        return 0, f"none: a tenth of the {s.steps} steps ({s.steps_from}) is under one step"
    capped = f", capped at a tenth of the {s.steps} steps ({s.steps_from})" if n < WARMUP_STEPS else ""
    return n, f"{n} steps: {why}{capped}"


def choose_inner_lr(s: DiLoCoSetting, warmup: int) -> tuple[float | None, str]:
    """The inner lr (None: the plan's) and why, given the warm-up N chosen (module docstring)."""
    if s.given_inner_lr is not None:
        return s.given_inner_lr, f"{s.given_inner_lr:g}: given by the user (--inner-lr {s.given_inner_lr:g})"
    plan_lr = f"the plan's lr {s.lr:g}"
    if warmup > 0:
        return None, (f"{plan_lr}: after a synchronous warm-up the square-root rule's halved lr was worse "
                      "(worst seed 1.533 vs 1.467, docs/data-parallel.md tuning)")
    if s.optimizer in SQRT_RULE:
        lr = s.lr * math.sqrt(1 / s.replicas)
        return lr, (f"{lr:.4g} = lr {s.lr:g} x sqrt(1/{s.replicas}): {s.optimizer}'s square-root rule for a replica's "
                    "1/R batch; without a warm-up halving it for 4 replicas helped every setting tuned "
                    "(docs/data-parallel.md)")
    if s.optimizer == "sgd":
        return None, (f"{plan_lr}: with SGD, H = 1, outer lr 1 and no outer momentum DiLoCo at the plan's lr is "
                      "synchronous DP (a linear rule lr/R would slow it R-fold); no SGD rule was measured")
    return None, f"{plan_lr}: no inner-lr rule was measured for {s.optimizer} without a warm-up"


def choose(s: DiLoCoSetting) -> DiLoCoDefaults:
    """The planner's warm-up and inner lr for the DiLoCo plan ``s`` describes, each with its reason."""
    n, why_n = choose_warmup(s)
    lr, why_lr = choose_inner_lr(s, n)
    return DiLoCoDefaults(n, why_n, lr, why_lr)

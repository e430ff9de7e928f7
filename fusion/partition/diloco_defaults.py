"""The DP planner's choice of DiLoCo's synchronous warm-up and of the replicas' inner learning rate (issue 34), each
with the one-line reason ``fusion inspect`` prints.

The rules come from the convergence study's two tuning rounds (docs/data-parallel.md, "Tuning for 'same loss,
sooner'" and "A second tuning round"; 4 replicas of a 100k-parameter GPT, synchronous DP with AdamW at lr 3e-3 as
the target; ``steps_to_sync_loss_ratio``, lower is better; tuning seeds 100-104 only, seeds 0-2 for the check):

* **Warm-up.** A synchronous warm-up (DiLoCo starting from synchronous DP's weights and AdamW state) gave the best
  worst seed of every variant tuned. First round (H = 20): 100 steps, 1.467 / 1.333 on seeds 100-101 against
  1.8 / 3.2 without; 50 steps was worse. Second round (H = 10, seeds 100-104): 150 steps beat 100 on every seed at
  the chosen inner lr and outer step (1.167 / 1.133 / 1.2 / 1.133 / 1.1 against 1.233 / 1.133 / 1.3 / 1.233 /
  1.167), and on seeds 0-2 gave 1.1 / 1.133 / 1.067 against 1.133 / 1.167 / 1.1. Those runs spent 150 of their
  900 steps warming up: the planner takes 150 steps, capped at a sixth of the run where its length is known (a
  shorter run keeps the measured fraction, not the measured count: an extrapolation). Longer warm-ups were not
  measured, so a longer run still gets 150.
* **Inner lr.** After a warm-up, AdamW replicas on a quarter of the batch did best at **2/3** of synchronous DP's
  lr (second round, warm-up 100: 2e-3 gave 1.233 / 1.133 / 1.3 / 1.233 / 1.167; 1.5e-3, the square-root rule's
  half, 1.333 / 1.3 / 1.333 / 1.267 / 1.2; 2.5e-3 1.3 / 1.133 / 1.3 / 1.167 / 1.167; the plan's 3e-3 1.333 / 1.2 /
  1.333 with outer momentum 0.5). Without a warm-up, AdamW takes the square-root rule for the replica's 1/R batch
  (Malladi et al. 2022, "On the SDEs and Scaling Rules for Adaptive Gradient Algorithms": lr x sqrt(batch ratio)),
  which helped every outer setting of the first round (e.g. 0.867 / 1.8 against 1.8 / 3.2 at outer lr 0.7,
  momentum 0.5). Both were measured with AdamW only, at one R (4) and one model. SGD keeps the plan's lr: with
  H = 1, outer lr 1 and no outer momentum DiLoCo with SGD at the plan's lr *is* synchronous DP, which a linear
  rule (lr / R, Goyal et al. 2017) would slow R-fold; nothing was measured for SGD. Muon keeps it too: it ran at
  the synchronous lr inside the replicas (with a warm-up: 1.2 / 1.267 worst on seeds 0-2) and was not measured
  otherwise.

A value the user gave (``--sync-warmup``, ``--inner-lr``) always wins, recorded as "given by the user".
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

#: the warm-up that gave the best worst seed in the tuning (docs/data-parallel.md, second round)
WARMUP_STEPS = 150
#: the chosen runs spent WARMUP_STEPS of their 900 steps warming up: the cap on a shorter run's warm-up
WARMUP_FRACTION = 1 / 6
#: optimizers whose inner lr follows the square-root rule without a warm-up (measured with AdamW)
SQRT_RULE = ("adamw",)
#: optimizer -> the factor on the plan's lr after a warm-up (AdamW: 2/3, the second round's best worst seed)
WARMED_FACTOR = {"adamw": 2 / 3}


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
    """N and why (module docstring: 150 steps, at most a sixth of a known run; none with unequal shares)."""
    if s.given_warmup is not None:
        what = f"{s.given_warmup} steps" if s.given_warmup else "none"
        return s.given_warmup, f"{what}: given by the user (--sync-warmup {s.given_warmup})"
    if not s.equal_shares:
        return 0, ("none: the warm-up averages equal shares and the planner gave the replicas unequal ones "
                   "(--sync-warmup N with --replica-shares is refused)")
    why = (f"docs/data-parallel.md tuning: {WARMUP_STEPS} synchronous steps gave the best worst seed "
           "(H = 10, seeds 100-104: 1.2 vs 1.3 with 100, steps to synchronous DP's loss)")
    if s.steps is None:
        return WARMUP_STEPS, (f"{WARMUP_STEPS} steps: {why}; the run's length is unknown here, so fusion run needs "
                              f"--steps > {WARMUP_STEPS} (or compile with --sync-warmup N)")
    n = min(WARMUP_STEPS, int(s.steps * WARMUP_FRACTION))
    if n < 1:
        return 0, f"none: a sixth of the {s.steps} steps ({s.steps_from}) is under one step"
    capped = f", capped at a sixth of the {s.steps} steps ({s.steps_from})" if n < WARMUP_STEPS else ""
    return n, f"{n} steps: {why}{capped}"


def choose_inner_lr(s: DiLoCoSetting, warmup: int) -> tuple[float | None, str]:
    """The inner lr (None: the plan's) and why, given the warm-up N chosen (module docstring)."""
    if s.given_inner_lr is not None:
        return s.given_inner_lr, f"{s.given_inner_lr:g}: given by the user (--inner-lr {s.given_inner_lr:g})"
    plan_lr = f"the plan's lr {s.lr:g}"
    if warmup > 0:
        factor = WARMED_FACTOR.get(s.optimizer)
        if factor is not None:
            lr = s.lr * factor
            return lr, (f"{lr:.4g} = lr {s.lr:g} x 2/3: {s.optimizer} after a synchronous warm-up did best at 2/3 of "
                        "synchronous DP's lr (worst of seeds 100-104 1.3, against 1.333 at 1/2, the square-root "
                        "rule's, and at the plan's lr; docs/data-parallel.md, second tuning round)")
    if s.optimizer == "sgd":
        return None, (f"{plan_lr}: with SGD, H = 1, outer lr 1 and no outer momentum DiLoCo at the plan's lr is "
                      "synchronous DP (a linear rule lr/R would slow it R-fold); no SGD rule was measured")
    if warmup > 0:
        return None, (f"{plan_lr}: {s.optimizer} ran at the synchronous lr inside the replicas after a warm-up; no "
                      "other inner lr was measured for it (docs/data-parallel.md)")
    if s.optimizer in SQRT_RULE:
        lr = s.lr * math.sqrt(1 / s.replicas)
        return lr, (f"{lr:.4g} = lr {s.lr:g} x sqrt(1/{s.replicas}): {s.optimizer}'s square-root rule for a replica's "
                    "1/R batch; without a warm-up halving it for 4 replicas helped every setting tuned "
                    "(docs/data-parallel.md)")
    return None, f"{plan_lr}: no inner-lr rule was measured for {s.optimizer} without a warm-up"


def choose(s: DiLoCoSetting) -> DiLoCoDefaults:
    """The planner's warm-up and inner lr for the DiLoCo plan ``s`` describes, each with its reason."""
    n, why_n = choose_warmup(s)
    lr, why_lr = choose_inner_lr(s, n)
    return DiLoCoDefaults(n, why_n, lr, why_lr)

"""The DP planner's DiLoCo warm-up and inner lr (fusion.partition.diloco_defaults): the rules of the convergence
study's tuning (docs/data-parallel.md), the cap below the run's length, the user's values winning."""
import math

import pytest

from fusion.partition.diloco_defaults import WARMUP_STEPS, DiLoCoSetting, choose


def setting(**kw) -> DiLoCoSetting:
    return DiLoCoSetting(**{"replicas": 4, "inner_steps": 20, "optimizer": "adamw", "lr": 3e-3, **kw})


@pytest.mark.parametrize("steps,n", [(None, 150), (5000, 150), (900, 150), (899, 149), (300, 50), (30, 5), (6, 1),
                                     (5, 0), (1, 0)])
def test_warmup_is_150_steps_capped_at_a_sixth_of_the_run(steps, n):
    d = choose(setting(steps=steps))
    assert d.sync_warmup == n == min(WARMUP_STEPS, (steps if steps is not None else 10 ** 9) // 6)
    assert d.sync_warmup < (steps or n + 1)  # the runtime refuses a warm-up as long as the run
    assert d.warmup_reason.startswith(f"{n} steps: " if n else "none: ")
    if steps is not None and 0 < n < 150:
        assert f"capped at a sixth of the {steps} steps (--steps)" in d.warmup_reason
    if steps is None:
        assert "fusion run needs --steps > 150" in d.warmup_reason
    assert "\n" not in d.warmup_reason + d.inner_lr_reason


def test_the_run_length_names_its_option():
    d = choose(setting(steps=240, steps_from="--lr-decay-steps"))
    assert d.sync_warmup == 40 and "of the 240 steps (--lr-decay-steps)" in d.warmup_reason


def test_with_a_warm_up_adamw_takes_two_thirds_of_the_plans_lr_and_sgd_and_muon_the_plans():
    """The second tuning round: after a warm-up, AdamW replicas did best at 2e-3 against synchronous DP's 3e-3
    (worst tuning seed 1.3; 1.333 at 1.5e-3 and at 3e-3); SGD and Muon keep the plan's lr."""
    d = choose(setting(optimizer="adamw", steps=900))
    assert d.sync_warmup == 150 and d.inner_lr == pytest.approx(2e-3, rel=1e-12)
    assert d.inner_lr_reason.startswith("0.002 = lr 0.003 x 2/3: adamw after a synchronous warm-up")
    sgd = choose(setting(optimizer="sgd", steps=900))
    assert sgd.sync_warmup == 150 and sgd.inner_lr is None and "is synchronous DP" in sgd.inner_lr_reason
    muon = choose(setting(optimizer="muon", steps=900))
    assert muon.sync_warmup == 150 and muon.inner_lr is None
    assert muon.inner_lr_reason.startswith("the plan's lr 0.003: muon ran at the synchronous lr")


@pytest.mark.parametrize("R", [2, 4, 8])
def test_without_a_warm_up_adamw_takes_the_square_root_rule(R):
    d = choose(setting(replicas=R, given_warmup=0))
    assert d.sync_warmup == 0 and d.warmup_reason == "none: given by the user (--sync-warmup 0)"
    assert d.inner_lr == pytest.approx(3e-3 / math.sqrt(R), rel=1e-12)
    assert d.inner_lr_reason.startswith(f"{d.inner_lr:.4g} = lr 0.003 x sqrt(1/{R}): adamw's square-root rule")
    if R == 4:
        assert d.inner_lr == pytest.approx(1.5e-3)  # the tuning's "quarter batch, sqrt rule" row


def test_without_a_warm_up_sgd_and_muon_keep_the_plans_lr():
    sgd = choose(setting(optimizer="sgd", steps=5))  # too short for a warm-up
    assert (sgd.sync_warmup, sgd.inner_lr) == (0, None) and "is synchronous DP" in sgd.inner_lr_reason
    muon = choose(setting(optimizer="muon", given_warmup=0))
    assert muon.inner_lr is None and "no inner-lr rule was measured for muon" in muon.inner_lr_reason


def test_unequal_shares_get_no_warm_up():
    d = choose(setting(equal_shares=False, steps=1000))
    assert d.sync_warmup == 0 and "unequal" in d.warmup_reason
    assert d.inner_lr == pytest.approx(1.5e-3)  # and so the square-root rule


def test_the_users_values_win():
    d = choose(setting(steps=30, given_warmup=25, given_inner_lr=0.02))
    assert (d.sync_warmup, d.inner_lr) == (25, 0.02)
    assert d.warmup_reason == "25 steps: given by the user (--sync-warmup 25)"
    assert d.inner_lr_reason == "0.02: given by the user (--inner-lr 0.02)"
    d = choose(setting(given_inner_lr=0.02))  # the planner's warm-up, the user's lr
    assert (d.sync_warmup, d.inner_lr) == (150, 0.02)
    assert set(d.to_dict()) == {"sync_warmup", "warmup_reason", "inner_lr", "inner_lr_reason"}

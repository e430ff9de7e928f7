"""lambda is fitted by least squares of time against FLOPs (FusionLLM §3.5)."""
import pytest

from fusion.cost.profile import fit_speed


def test_fit_recovers_speed_and_overhead():
    speed, t0 = 2.5e10, 1e-3
    samples = [(f, t0 + f / speed) for f in (1e8, 4e8, 9e8, 2e9)]
    s, o, r2 = fit_speed(samples)
    assert s == pytest.approx(speed, rel=1e-9) and o == pytest.approx(t0, rel=1e-6) and r2 == pytest.approx(1.0)


def test_fit_rejects_unusable_timings():
    with pytest.raises(ValueError, match="two workloads"):
        fit_speed([(1e8, 0.1)])
    with pytest.raises(ValueError, match="do not grow"):
        fit_speed([(1e8, 0.2), (2e8, 0.1)])

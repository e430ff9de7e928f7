"""lambda is fitted by least squares of time against FLOPs (FusionLLM §3.5)."""
import pytest

from fusion.cost.profile import fit_per_unit, fit_speed, profile_message_overhead, profile_node_overhead


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


def test_per_unit_fit_recovers_a_known_overhead():
    """t = c0 + k * c from synthetic timings (chains of k nodes, or k messages) gives back c and c0."""
    c, c0 = 23e-6, 4e-4
    got, got0 = fit_per_unit([(k, c0 + k * c) for k in (8, 32, 64, 128)])
    assert got == pytest.approx(c, rel=1e-9) and got0 == pytest.approx(c0, rel=1e-9)
    # noise that makes the slope negative prices the overhead at nothing, never below
    assert fit_per_unit([(8, 2e-3), (64, 1e-3)])[0] == 0.0
    with pytest.raises(ValueError, match="two or more different counts"):
        fit_per_unit([(8, 1e-3), (8, 2e-3)])


def test_node_and_message_overheads_measured_on_this_host():
    """The real chains and the real loopback socket: positive, and below what a single op or a small message
    could plausibly cost on any host (10 ms). (Which path is cheaper is a benchmark question, not asserted.)"""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        compiled = profile_node_overhead(lengths=(8, 64), repeats=3, min_time=0.05)
        loop = profile_node_overhead(lengths=(8, 64), repeats=3, min_time=0.05, compiled=False)
    finally:
        torch.set_num_threads(threads)
    msg = profile_message_overhead(counts=(10, 60), repeats=2, min_time=0.02)
    assert 0 < compiled < 1e-2 and 0 < loop < 1e-2 and 0 < msg < 1e-2

"""Fit lambda_p for this host from a short warm-up (FusionLLM §3.5).

The actual speed of a device is ``S(p) = lambda_p * S*(p)``. We time a set of
forward + backward steps of Linear layers of growing size (FLOPs counted by
``FlopCounterMode``, so the workload is priced exactly as the estimator prices
a model), then fit by least squares ``t = t0 + FLOPs / S`` and report
``lambda = S / S*``. ``t0`` absorbs the per-call overhead; R^2 says how well a
single speed explains the timings.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)


@dataclass
class Profile:
    """Fitted speed of this host.

    device:         torch device the warm-up ran on.
    peak_flops:     S*(p) the fit is relative to.
    fitted_flops:   S(p) = 1 / slope of time against FLOPs.
    lam:            lambda_p = S(p) / S*(p).
    overhead_s:     t0, the intercept.
    r2:             coefficient of determination of the fit.
    samples:        (FLOPs, seconds) per timed workload.
    """

    device: str
    peak_flops: float
    fitted_flops: float
    lam: float
    overhead_s: float
    r2: float
    samples: list[tuple[float, float]]

    def to_dict(self) -> dict:
        return {"device": self.device, "peak_flops": self.peak_flops, "fitted_flops": self.fitted_flops,
                "lambda": self.lam, "overhead_s": self.overhead_s, "r2": self.r2,
                "samples": [[f, t] for f, t in self.samples]}


def fit_speed(samples: list[tuple[float, float]]) -> tuple[float, float, float]:
    """Least squares ``t = t0 + F / S``: returns (S, t0, R^2)."""
    f = np.array([s[0] for s in samples], dtype=float)
    t = np.array([s[1] for s in samples], dtype=float)
    if len(f) < 2 or np.ptp(f) == 0:
        raise ValueError("need at least two workloads of different FLOPs to fit a speed")
    slope, t0 = np.polyfit(f, t, 1)
    if slope <= 0:
        raise ValueError("timings do not grow with FLOPs; the host is too noisy to fit lambda")
    pred = t0 + slope * f
    ss_res = float(np.sum((t - pred) ** 2))
    ss_tot = float(np.sum((t - t.mean()) ** 2))
    return 1.0 / slope, float(t0), 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0


def profile_host(peak_flops: float, device: str = "cpu", sizes: tuple[int, ...] = (256, 512, 768, 1024),
                 batch: int = 64, repeats: int = 5, dtype: str = "float32", min_time: float = 0.5,
                 threads: int | None = None) -> Profile:
    """Time fwd+bwd of ``Linear(n, n)`` on a (batch, n) input for each n; fit lambda against ``peak_flops``.

    The workloads run round-robin, at least ``repeats`` rounds and at least
    ``min_time`` seconds in all; each keeps its fastest run (on a shared host
    the minimum is the least disturbed measurement, and round-robin spreads a
    disturbed moment over all sizes). ``threads`` sets torch's CPU threads
    for the measurement (None: leave as is).
    """
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    if not peak_flops > 0:
        raise ValueError(f"peak_flops must be > 0, got {peak_flops}")
    dt = getattr(torch, dtype)
    dev = torch.device(device)
    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        steps, flops = [], []
        for n in sizes:
            layer = torch.nn.Linear(n, n, device=dev, dtype=dt)
            x = torch.randn(batch, n, device=dev, dtype=dt, requires_grad=True)
            step = (lambda layer=layer, x=x: layer(x).sum().backward())
            with FlopCounterMode(display=False) as fc:
                step()
            steps.append(step)
            flops.append(float(fc.get_total_flops()))
        best = [float("inf")] * len(sizes)
        spent, rounds = 0.0, 0
        while rounds < repeats or spent < min_time:
            for k, step in enumerate(steps):
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                t = time.perf_counter()
                step()
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                el = time.perf_counter() - t
                best[k] = min(best[k], el)
                spent += el
            rounds += 1
    finally:
        torch.set_num_threads(old_threads)
    samples = list(zip(flops, best))
    for n, (f, t) in zip(sizes, samples):
        log.info("profile n=%d: %.3g FLOP in %.3g s", n, f, t)
    speed, t0, r2 = fit_speed(samples)
    return Profile(str(dev), float(peak_flops), speed, speed / peak_flops, t0, r2, samples)

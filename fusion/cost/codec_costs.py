"""What a codec costs on this host: measured encode + decode time per message, for the estimator (issue 36).

A codec's built-in ``rate`` (dense bytes per second, ``kernels/codecs``) was measured once, on one machine, at
one message size, and prices a 64 KB message and a 4 MB one alike; at bench_wan's message size the fixed work
per message (Python, the small per-block arrays) is a third of the cost. ``fusion profile`` therefore times each
codec the compiler may choose, on this host, through the path the runtime runs (the codec's ``encode_host`` then
``decode_host``, one thread), at two message sizes, and fits ``t = message_s + bytes * byte_s``
(:func:`profile_codecs`). The cluster file keeps the fit per device (``codec_costs``); the compiler prices a
codec by it where present (:func:`codec_seconds`), else by the ``rate``.

Keys (:func:`cost_key`) name a cfg by what changes its cost: the algorithm, its bit width and stochastic
rounding (``quant-4``, ``quant-4-stochastic``, ``hadamard-quant-4``, ``topk``).
"""
from __future__ import annotations

import logging
import time
from typing import Any, Iterable, Mapping

import numpy as np

log = logging.getLogger(__name__)

#: elements per timed message: bench_wan's activation (8 x 32 x 64) and 16 times that
SIZES = (16384, 262144)


def cost_key(cfg: Mapping[str, Any]) -> str:
    """The key a codec cfg's measured cost is stored under (``quant-4``, ``quant-8-stochastic``, ``topk``)."""
    key = str(cfg["algo"])
    if "bits" in cfg:
        key += f"-{int(cfg['bits'])}"
    if cfg.get("rounding") == "stochastic":
        key += "-stochastic"
    return key


def default_cfgs() -> list[dict]:
    """The cfgs ``fusion profile`` times: every stateless built-in codec's ``--compress auto`` candidates for
    activations and gradients (what the compiler chooses among), and Top-K at r = 100."""
    from fusion.kernels.codecs import CODECS, Role

    out: dict[str, dict] = {}
    for name in CODECS.names():
        unit = CODECS.unit(name)
        if unit.stateful:
            continue
        for role in (Role.ACTIVATION, Role.GRADIENT):
            for cfg in unit.auto.get(role, ()):
                out.setdefault(cost_key(cfg), dict(cfg))
    out.setdefault("topk", {"algo": "topk", "ratio": 100})
    return list(out.values())


def profile_codecs(cfgs: Iterable[Mapping[str, Any]] | None = None, sizes: tuple[int, ...] = SIZES,
                   repeats: int = 25, min_time: float = 0.5) -> tuple[tuple[str, float, float], ...]:
    """``(key, message_s, byte_s)`` per cfg: the fastest encode + decode of a float32 N(0, 1) message of each
    size through the codec's host path, round-robin over sizes and codecs (at least ``repeats`` rounds and
    ``min_time`` seconds: on a shared host the minimum of a few runs of a 100 µs call is still loaded), fitted by
    least squares against the dense bytes."""
    from fusion.kernels.codecs import CODECS, CodecContext, Counter, Role

    cfgs = list(cfgs) if cfgs is not None else default_cfgs()
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal(n, dtype=np.float32) for n in sizes]
    counter = Counter()
    jobs = []
    for cfg in cfgs:
        unit = CODECS.unit(cfg["algo"])
        for x in xs:
            def job(unit=unit, cfg=cfg, x=x) -> None:
                ctx = CodecContext(Role.ACTIVATION, "profile", ("x", 0), "peer", 0, None, 0, counter)
                unit.decode_host(unit.encode_host(x, "float32", cfg, ctx), ctx)
            jobs.append(job)
    best = [float("inf")] * len(jobs)
    spent, rounds = 0.0, 0
    while rounds < repeats or spent < min_time:
        for i, job in enumerate(jobs):
            t0 = time.perf_counter()
            job()
            el = time.perf_counter() - t0
            best[i] = min(best[i], el)
            spent += el
        rounds += 1
    out = []
    for j, cfg in enumerate(cfgs):
        times = best[j * len(xs):(j + 1) * len(xs)]
        byte_s, message_s = np.polyfit([float(x.nbytes) for x in xs], times, 1)  # least squares t = m + b * bytes
        byte_s, message_s = max(float(byte_s), 0.0), max(float(message_s), 0.0)  # noise never prices below zero
        out.append((cost_key(cfg), message_s, byte_s))
        log.info("profile codec %s: %.3g s per message + %.3g s per dense byte (%s)", cost_key(cfg),
                 message_s, byte_s, ", ".join(f"{x.nbytes // 1024} KB {t * 1e6:.0f} us"
                                                          for x, t in zip(xs, times)))
    return tuple(out)


def codec_seconds(devices: Iterable[Any], cfg: Mapping[str, Any], nbytes: float) -> float | None:
    """Measured encode + decode seconds of one message of ``nbytes`` dense bytes under ``cfg``: the slowest
    device that measured it (the estimator prices a codec per tensor, not per link); None when none did."""
    key = cost_key(cfg)
    secs = [s for s in (d.codec_seconds(key, nbytes) for d in devices) if s is not None]
    return max(secs) if secs else None


__all__ = ["SIZES", "cost_key", "default_cfgs", "profile_codecs", "codec_seconds"]

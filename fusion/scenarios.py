"""Scenario clusters for tests and benchmarks.

:func:`scenario_dir` finds ``../shared/scenarios`` next to the repository
(CI keeps it there); tests skip when it is absent. :func:`synthetic_cluster`
builds large deterministic clusters (sites of machines scattered on a
plane, links slower with distance) for compile-time benchmarks.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

from .cluster import Cluster, Device, load_cluster

#: Hardware presets used by the synthetic clusters (peak FLOP/s, memory bytes).
GPU_PRESETS = {
    "rtx4090": (165.16e12, 24e9),
    "v100": (125e12, 16e9),
    "rtx2080": (40e12, 8e9),
    "a100": (312e12, 40e9),
}


def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent


def scenario_dir() -> Path | None:
    """``$FUSION_SCENARIOS``, or ``<repo>/../shared/scenarios``, or None."""
    env = os.environ.get("FUSION_SCENARIOS")
    for cand in ([Path(env)] if env else []) + [repo_root().parent / "shared" / "scenarios"]:
        if cand.is_dir() and any(cand.glob("*.json")):
            return cand
    return None


def scenario_names() -> list[str]:
    d = scenario_dir()
    return sorted(p.stem for p in d.glob("*.json")) if d else []


def load_scenario(name: str) -> Cluster:
    d = scenario_dir()
    if d is None:
        raise FileNotFoundError("scenario directory ../shared/scenarios not found")
    return load_cluster(d / f"{name}.json")


def synthetic_cluster(n_devices: int, site_size: int = 8, seed: int = 0) -> Cluster:
    """Sites of ``site_size`` devices on a 10000 km square, deterministic in ``seed``.

    Inside a site: 10 Gbit/s, 0.1 ms. Between sites: latency 1 ms + distance at
    2/3 c (plus 5 ms of routing), bandwidth log-uniform in 50 Mbit/s - 2 Gbit/s
    scaled down by distance. Each site has one GPU type drawn from
    :data:`GPU_PRESETS`.
    """
    rng = np.random.default_rng(seed)
    n_sites = math.ceil(n_devices / site_size)
    xy = rng.uniform(0, 10_000, size=(n_sites, 2))  # km
    kinds = list(GPU_PRESETS)
    site_kind = rng.integers(0, len(kinds), size=n_sites)
    dist = np.linalg.norm(xy[:, None, :] - xy[None, :, :], axis=-1)
    site_lat = 0.005 + dist / 200_000.0  # 200000 km/s in fibre
    base = np.exp(rng.uniform(math.log(50e6), math.log(2e9), size=(n_sites, n_sites)))
    base = np.sqrt(base * base.T)  # symmetric per site pair
    site_bw = base / (1.0 + dist / 2_000.0)
    devices, site_of = [], []
    for i in range(n_devices):
        s = i // site_size
        peak, mem = GPU_PRESETS[kinds[site_kind[s]]]
        devices.append(Device(f"s{s}-{i % site_size}", peak, mem, group=f"s{s}"))
        site_of.append(s)
    site_of = np.array(site_of)
    same = site_of[:, None] == site_of[None, :]
    alpha = np.where(same, 1e-4, site_lat[np.ix_(site_of, site_of)])
    bw = np.where(same, 10e9, site_bw[np.ix_(site_of, site_of)])
    beta = 8.0 / bw
    np.fill_diagonal(alpha, 0.0)
    np.fill_diagonal(beta, 0.0)
    return Cluster(f"synthetic-{n_devices}", devices, alpha, beta, f"synthetic-{n_devices}")

"""Scenario clusters that ship with the package, and synthetic ones.

The measured and synthetic scenarios (``dtfm-*``, ``fusionllm-*``,
``local-4-two-sites``) are data files of the package (``fusion/cluster/data``,
read with :mod:`importlib.resources`), made by
``benchmarks/scenarios/make_scenarios.py`` from its measured inputs. A CLI
``--cluster NAME`` names one of them (:func:`fusion.cluster.load_cluster`).
:func:`synthetic_cluster` builds large deterministic clusters (sites of
machines scattered on a plane, links slower with distance) for compile-time
benchmarks.
"""
from __future__ import annotations

import json
import math
from importlib import resources

import numpy as np

from fusion.cluster.model import Cluster, ClusterError, Device

#: Hardware presets used by the synthetic clusters (peak FLOP/s, memory bytes).
GPU_PRESETS = {
    "rtx4090": (165.16e12, 24e9),
    "v100": (125e12, 16e9),
    "rtx2080": (40e12, 8e9),
    "a100": (312e12, 40e9),
}


def _data():
    return resources.files("fusion.cluster") / "data"


def scenario_names() -> list[str]:
    """Names of the shipped scenarios, sorted."""
    return sorted(f.name.removesuffix(".json") for f in _data().iterdir() if f.name.endswith(".json"))


def load_scenario(name: str) -> Cluster:
    """The shipped scenario ``name``; ClusterError naming the known ones otherwise."""
    if name not in scenario_names():
        raise ClusterError(f"no shipped scenario {name!r}; known: {', '.join(scenario_names())}")
    with resources.as_file(_data() / f"{name}.json") as path:
        return Cluster.from_dict(json.loads(path.read_text()), str(path))


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

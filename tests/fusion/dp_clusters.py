"""Small clusters and a small GPT cost model shared by the DP x PP tests."""
from __future__ import annotations

import functools

import numpy as np

from fusion.cluster.model import Cluster, Device


def two_regions(n_per: int = 4, fast_bps: float = 10e9, slow_bps: float = 100e6, memory: float = 1e12,
                flops: float = 1e12, fast_lat: float = 1e-4, slow_lat: float = 0.03) -> Cluster:
    """Two regions of ``n_per`` identical devices: fast links inside a region, slow ones between."""
    n = 2 * n_per
    devs = [Device(f"{'ab'[i // n_per]}{i % n_per}", flops, memory, group="ab"[i // n_per]) for i in range(n)]
    region = np.arange(n) // n_per
    same = region[:, None] == region[None, :]
    bw = np.where(same, fast_bps, slow_bps)
    alpha = np.where(same, fast_lat, slow_lat)
    np.fill_diagonal(alpha, 0.0)
    return Cluster.from_bandwidth("two-regions", devs, alpha, bw, "two-regions.json")


def matrix_cluster(alpha: np.ndarray, bw_bps: np.ndarray, flops: float = 1e12, memory: float = 1e12) -> Cluster:
    n = len(alpha)
    devs = [Device(f"d{i}", flops, memory) for i in range(n)]
    a = np.array(alpha, dtype=float)
    np.fill_diagonal(a, 0.0)
    bw = np.array(bw_bps, dtype=float)
    np.fill_diagonal(bw, 0.0)
    return Cluster.from_bandwidth("matrix", devs, a, bw, "matrix.json")


@functools.cache
def tiny_gpt():
    """``(model, costs)``: a 4-layer GPT (width 128, 4 heads, vocabulary 1000, 64 tokens) on the meta device and
    its measured node costs, built once per session (the DP cost and planner tests only read it)."""
    from fusion.cost.flops import measure_costs
    from tests.testing_models import gpt_model

    m = gpt_model(4, 128, 4, 1000, 64, 1, device="meta")
    return m, measure_costs(m.graph)


def cost_model(tiny, cluster: Cluster):
    """The cost model of ``tiny`` (:func:`tiny_gpt`) on ``cluster``: one micro-batch row, 1F1B, 2 micro-batches."""
    from fusion.cost.estimate import CostModel

    m, costs = tiny
    return CostModel.build(m.graph, costs, cluster, 1, "1f1b", 2, 1)

"""AdaTopK ratios of Eq. (7) with the wire-cost factor derived from the encoding."""
import math

import numpy as np
import pytest
import torch

from fusion.compress.adatopk import adatopk, sparse_wire_bytes, wire_cost_factor
from fusion.cluster.model import Cluster, Device
from fusion.cost.estimate import CostModel
from fusion.cost.flops import measure_costs
from fusion.ir.builder import GraphBuilder


def test_wire_cost_factor_from_the_encoding():
    assert wire_cost_factor(1000, "float32") == 2.0  # 4-byte values + int32 indices
    assert wire_cost_factor(1000, "float16") == 3.0  # 2-byte values + int32 indices
    assert wire_cost_factor(2**31, "float32") == 3.0  # int64 indices: the paper's 3
    assert wire_cost_factor(2**31 - 1, "float64") == 1.5
    assert sparse_wire_bytes(1000, "float32", 10) == 100 * 8
    assert sparse_wire_bytes(1001, "float32", 10) == 101 * 8  # k = ceil(numel / r)


def _setup():
    """Chain x -> a -> b -> c -> loss over 4 devices whose links get slower: 100 Gbit/s, 100 and 10 Mbit/s."""
    bld = GraphBuilder()
    x, y = bld.input("x"), bld.label("y")
    h = bld.module("a", "torch.nn.Linear", x, in_features=64, out_features=64)
    h = bld.module("b", "torch.nn.Linear", h, in_features=64, out_features=64)
    h = bld.module("c", "torch.nn.Linear", h, in_features=64, out_features=10)
    bld.loss("loss", "torch.nn.functional.cross_entropy", h, y)
    m = bld.build({"x": torch.zeros(32, 64), "y": torch.zeros(32, dtype=torch.long)}, device="meta")
    bps = [1e11, 1e8, 1e7]
    n = 4
    beta = np.full((n, n), 8 / 1e9)
    for i, b in enumerate(bps):
        beta[i, i + 1] = beta[i + 1, i] = 8 / b
    np.fill_diagonal(beta, 0)
    alpha = np.zeros((n, n))
    cl = Cluster("c", [Device(f"d{i}", 1e12, 1e9) for i in range(n)], alpha, beta)
    cm = CostModel.build(m.graph, measure_costs(m.graph), cl)
    node_part = np.array([{"x": 0, "a": 0, "b": 1, "c": 2, "y": 3, "loss": 3}[k] for k in cm.names])
    return cm, node_part


def test_eq7_ratio_per_cut_edge():
    cm, node_part = _setup()
    names = ["part0", "part1", "part2", "part3"]
    comp, wire = adatopk(cm, node_part, [0, 1, 2, 3], names, ratio=100)
    by = {(c.producer, c.src, c.dst): c for c in comp}
    # cut edges: a (32x64 fp32) on the 100 Gbit/s link, b (32x64) at 100 Mbit/s, c (32x10) at 10 Mbit/s;
    # the label y goes nowhere (it lives with the loss)
    t = {"a": 32 * 64 * 4 * 8 / 1e11, "b": 32 * 64 * 4 * 8 / 1e8, "c": 32 * 10 * 4 * 8 / 1e7}
    r_max = max(t.values())
    for prod, src, dst in [("a", "part0", "part1"), ("b", "part1", "part2"), ("c", "part2", "part3")]:
        r = max(1.0, 2.0 * 100 * t[prod] / r_max)
        if r <= 2.0:
            assert (prod, src, dst) not in by  # would not shrink the wire: stays dense
        else:
            assert by[(prod, src, dst)].ratio == pytest.approx(r)
            assert by[(prod, src, dst)].directions == ("fwd", "bwd") or prod == "c"
    assert by[("c", "part2", "part3")].ratio == pytest.approx(200.0)  # the slowest edge gets c * r
    assert ("a", "part0", "part1") not in by
    # the slowest edge's wire bytes shrink by r (up to the ceil)
    k = [key for key in wire if cm.t_key[key[0]][0] == "c"][0]
    assert wire[k][0] == 8 * math.ceil(320 / 200.0)


def test_compression_lowers_predicted_time_and_never_touches_integers():
    cm, node_part = _setup()
    comp, wire = adatopk(cm, node_part, [0, 1, 2, 3], ["p0", "p1", "p2", "p3"], ratio=50)
    dense = cm.evaluate(node_part, [0, 1, 2, 3])
    sparse = cm.evaluate(node_part, [0, 1, 2, 3], wire)
    assert sparse.iteration_s < dense.iteration_s
    # move the label to another part: an int64 tensor now crosses, and is never compressed
    node_part2 = node_part.copy()
    node_part2[cm.index["y"]] = 0
    comp2, _ = adatopk(cm, node_part2, [0, 1, 2, 3], ["p0", "p1", "p2", "p3"], ratio=50)
    assert all(c.producer != "y" for c in comp2)


def test_ratio_must_be_at_least_one():
    cm, node_part = _setup()
    with pytest.raises(ValueError):
        adatopk(cm, node_part, [0, 1, 2, 3], ["p0", "p1", "p2", "p3"], ratio=0.5)

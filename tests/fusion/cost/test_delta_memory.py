"""The memory model counts delta (AQ-SGD) buffers: one decoded activation per training sample, per delta edge,
at the sender and at the receiver, exactly as many bytes as the runtime's buffers hold once every sample
has been seen."""
from pathlib import Path

import numpy as np
import pytest

from fusion.cluster.model import Cluster, Device
from fusion.compile import compile_model
from fusion.compress.policy import request
from fusion.cost.estimate import tensor_bytes
from fusion.executors.reference import ReferenceExecutor
from fusion.ir.opdata import SAMPLE_IDS
from fusion.loader import load_model
from fusion.plan import OptimizerConfig

ROOT = Path(__file__).resolve().parents[3]


def _two(bandwidth_bps: float = 1e6) -> Cluster:
    devs = [Device(f"d{i}", 1e12, 1e12) for i in range(2)]
    alpha = np.full((2, 2), 1e-3) - np.eye(2) * 1e-3
    beta = np.full((2, 2), 8.0 / bandwidth_bps) - np.eye(2) * (8.0 / bandwidth_bps)
    return Cluster("two-slow", devs, alpha, beta, "test")


def test_a_delta_plan_needs_exactly_its_buffers_more_than_the_dense_plan_and_the_runtime_holds_them():
    model = load_model(str(ROOT / "examples/models/gpt.py:tiny"))  # micro-batch of 2 sequences
    samples = 8
    kw = dict(strategy="equal-flops", micro_batches=2)
    dense = compile_model(model, _two(), **kw)
    plan = compile_model(model, _two(), compress=request("delta:bits=2", "none", samples=samples), **kw)
    assert plan.assignment == dense.assignment and plan.predicted["delta_samples"] == samples
    deltas = [c for c in plan.compression if (c.codec("fwd") or {}).get("algo") == "delta"]
    assert deltas, "1 Mbit/s: the cut edges go as deltas"
    want = dict.fromkeys(plan.parts, 0.0)
    for c in deltas:  # per sample: the tensor's bytes over the micro-batch's 2 samples; both ends keep them
        per_end = samples * tensor_bytes(plan.graph, c.producer, c.index) / 2
        want[c.src] += per_end
        want[c.dst] += per_end
    for name in plan.parts:
        got = plan.predicted["parts"][name]
        grew = got["memory_bytes"] - dense.predicted["parts"][name]["memory_bytes"]
        assert grew == pytest.approx(want[name], rel=1e-12) and want[name] > 0
        assert got["delta_buffer_bytes"] == want[name]
        assert plan.parts[name].memory_bytes == got["memory_bytes"]

    # the runtime, after one epoch over the 8 samples, holds exactly those bytes at each part
    ex = ReferenceExecutor(model, plan.assignment, OptimizerConfig("sgd", lr=0.01), micro_batches=2,
                           compression=plan.compression)
    g = np.random.default_rng(0)
    for step in range(2):  # 4 samples per step (2 micro-batches of 2)
        x = g.integers(0, 64, (4, 16))
        ex.step({"idx": x, "targets": np.roll(x, -1, axis=1), SAMPLE_IDS: np.arange(4) + 4 * step})
    for name, part in ex.parts.items():
        held = sum(b.nbytes for b in part.compression.delta.buffers.values())
        assert held == want[name]


def test_op_fence_cuts_elsewhere_when_the_delta_buffers_do_not_fit():
    """Two slow devices (17 GFLOP/s, 1 GB) joined by 20 Mbit/s: with 2-bit deltas over a data set of 1000
    samples (8 MB of buffers per edge end) OP-Fence splits the 4-layer GPT in two; with 10^6 samples the
    buffers (8 GB) fit no split, and it keeps the model on one device instead of producing a plan that
    does not fit."""
    from tests.testing_models import gpt_model

    model = gpt_model(4, 128, 4, 128, 32, 4, device="meta")
    off = np.ones((2, 2)) - np.eye(2)  # between the two devices
    cluster = Cluster("slow-two", [Device(f"d{i}", 1.7e10, 1e9) for i in range(2)], off * 1e-3, off * 8.0 / 20e6,
                      "test")
    small = compile_model(model, cluster, micro_batches=2, compress=request("delta:bits=2", samples=1000))
    assert len(small.parts) == 2 and small.compression
    assert all(p["memory_bytes"] <= p["memory_limit"] for p in small.predicted["parts"].values())
    assert max(p.get("delta_buffer_bytes", 0) for p in small.predicted["parts"].values()) > 0
    large = compile_model(model, cluster, micro_batches=2, compress=request("delta:bits=2", samples=10**6))
    assert len(large.parts) == 1 and not large.compression

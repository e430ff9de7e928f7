"""The tied-gradient sum without extra 154 MB copies (docs/testing.md "Real size"): ``sum_in_order`` makes one
new array with the same bits as the left-to-right sum, and an engine's ``set_grad(..., owned=True)`` keeps that
array's memory as the gradient instead of cloning it; without ``owned`` it still copies (a caller may reuse its
array, or the array may view a received frame)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fusion.executors.engines.numpy.engine import NumpyPart
from fusion.executors.engines.torch.engine import TorchPart
from fusion.executors.runtime.compression import sum_in_order
from fusion.ir.boundary import partition
from fusion.ir.builder import GraphBuilder


def _arrays(n: int, dtype=np.float32) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [(rng.standard_normal(1000) * 10 ** k).astype(dtype) for k in range(n)]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_sum_in_order_is_the_left_to_right_sum_bit_for_bit_in_a_new_array(n):
    gs = _arrays(n)
    before = [g.copy() for g in gs]
    want = gs[0].copy()
    for g in gs[1:]:
        want = want + g  # the order every owner and the reference executor use
    got = sum_in_order(gs)
    assert got.dtype == want.dtype and np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert not any(np.shares_memory(got, g) for g in gs)  # a fresh array: an engine may keep it
    assert all(np.array_equal(g, b) for g, b in zip(gs, before))  # the inputs are left as they were


def test_sum_in_order_promotes_a_wider_dtype_as_plus_does():
    a, b = _arrays(2)
    c = np.linspace(0, 1, 1000)  # float64
    assert sum_in_order([a, b, c]).dtype == np.float64
    np.testing.assert_array_equal(sum_in_order([a, b, c]), (a + b) + c)


def _one_linear_part():
    b = GraphBuilder()
    x = b.input("x")
    b.output("out", b.module("fc", "torch.nn.Linear", x, in_features=4, out_features=3))
    model = b.build({"x": torch.zeros(2, 4)}, seed=0)
    sub = partition(model.graph, {"x": "p0", "fc": "p0", "out": "p0"})["p0"]
    return model, sub


@pytest.mark.parametrize("engine", ["torch", "numpy"])
def test_set_grad_keeps_an_owned_array_and_copies_otherwise(engine):
    model, sub = _one_linear_part()
    part = (TorchPart if engine == "torch" else NumpyPart)(model.graph, sub, model.params)
    name = next(n for n in part.trainable() if n.endswith("weight"))
    g = np.full((3, 4), 2.0, dtype=np.float32)
    part.set_grad(name, g)
    kept = np.asarray(part.grads()[name])
    assert not np.shares_memory(kept, g)
    g[:] = 5.0  # the caller reuses its array: the gradient is unchanged
    assert np.all(np.asarray(part.grads()[name]) == 2.0)
    fresh = sum_in_order([np.ones((3, 4), np.float32), np.ones((3, 4), np.float32)])
    part.set_grad(name, fresh, owned=True)
    kept = np.asarray(part.grads()[name])
    assert np.shares_memory(kept, fresh) and np.all(kept == 2.0)  # no copy of the fresh sum

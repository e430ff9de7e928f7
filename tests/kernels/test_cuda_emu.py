"""The CUDA kernels of the CuPy path, executed on the CPU (``cuda_emu``) by the same driver as on a GPU.

No GPU is lent to this project's CI, so these tests run ``topk_cupy.CUDA_SOURCE``
through a g++ emulation of CUDA's thread model and check every kernel against
its NumPy twin, and ``topk_cupy.select_with`` end to end against the brute-force
reference (the CUDA path must pick the same set as the torch path, ties included).
"""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from fusion.kernels import radix, topk_cupy
from tests.kernels.cuda_emu import CudaEmulator
from tests.kernels.test_topk_kernels import make, reference_indices

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ for the CUDA emulation")


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    return CudaEmulator(tmp_path_factory.mktemp("cuda_emu"))


@pytest.fixture(scope="module")
def small_grid(tmp_path_factory):
    """Few blocks of few threads: every thread loops many times over the grid stride."""
    return CudaEmulator(tmp_path_factory.mktemp("cuda_emu_small"), threads=32, max_blocks=3)


def specials(dtype) -> np.ndarray:
    x = np.random.default_rng(0).standard_normal(5000).astype(dtype)
    x[[3, 70, 900]] = np.nan
    x[[5, 1200]] = -np.inf
    x[[7, 8]] = np.inf
    x[10:20] = -0.0
    x[20] = np.finfo(dtype).tiny / 4  # subnormal
    return x


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_key_kernel_matches_numpy_twin(emu, dtype):
    x = specials(dtype)
    keys = np.empty(x.size, dtype=np.uint64 if dtype == np.float64 else np.uint32)
    bits = 64 if dtype == np.float64 else 32
    emu.launch(f"fusion_topk_keys_f{bits}", x.size, x, keys, x.size)
    np.testing.assert_array_equal(keys, radix.float_keys_np(x))


@pytest.mark.parametrize("grid", ["emu", "small_grid"])
def test_hist_kernel_matches_numpy_along_a_radix_path(grid, request):
    emu = request.getfixturevalue(grid)
    keys = radix.float_keys_np(np.random.default_rng(1).standard_normal(20_000).astype(np.float32))
    want = radix.numpy_hist(keys)
    out = np.zeros(radix.BINS, dtype=np.uint64)
    prefix = mask = 0
    for shift in (24, 16, 8, 0):  # follow the digits of the median key, so later passes match few keys
        out.fill(0)
        emu.launch("fusion_radix_hist_u32", keys.size, keys, keys.size, prefix, mask, shift, out)
        np.testing.assert_array_equal(out.astype(np.int64), want(prefix, mask, shift), err_msg=f"shift {shift}")
        digit = int((np.sort(keys)[keys.size // 2] >> np.uint32(shift)) & np.uint32(0xFF))
        prefix |= digit << shift
        mask |= 0xFF << shift
    assert sum(1 for name, *_ in emu.launches if name == "fusion_radix_hist_u32") >= 4


def test_keep_kernel_takes_lowest_index_ties(emu):
    keys = np.array([5, 3, 5, 9, 5, 1, 5], dtype=np.uint64)
    keep = np.empty(keys.size, dtype=np.bool_)
    emu.launch("fusion_topk_keep_u64", keys.size, keys, keys.size, 5, 2, keep)
    np.testing.assert_array_equal(keep, [True, False, True, True, False, False, False])


@pytest.mark.parametrize("kind", ["normal", "ties", "sparse", "special"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("k", [1, 37, 700, 3000])
def test_select_with_emulated_kernels_matches_reference(emu, kind, dtype, k):
    x = make(kind, 3000, dtype, seed=k)
    got = topk_cupy.select_with(emu.runner(), np.ascontiguousarray(x.numpy()), k)
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, reference_indices(x, k))


def test_select_with_many_grid_strides(small_grid):
    x = make("ties", 20_000, torch.float32, seed=3)
    for k in (1, 999, 20_000):
        got = topk_cupy.select_with(small_grid.runner(), x.numpy(), k)
        np.testing.assert_array_equal(got, reference_indices(x, k))


def test_emulation_catches_a_kernel_bug(tmp_path):
    """The emulated tests can fail: a keep kernel with the wrong tie rule selects a different set."""
    bad = topk_cupy.CUDA_SOURCE.replace("key == kth && i <= last", "key == kth && i >= last")
    assert bad != topk_cupy.CUDA_SOURCE
    emu = CudaEmulator(tmp_path, source=bad)
    x = make("ties", 3000, torch.float32, seed=0)
    with pytest.raises((RuntimeError, AssertionError)):
        np.testing.assert_array_equal(topk_cupy.select_with(emu.runner(), x.numpy(), 700),
                                      reference_indices(x, 700))

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

from fusion.kernels import radix, topk_cupy, topk_torch
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


# ---------------------------------------------------------------- fused path (default on a GPU)

RAW = {torch.float32: (torch.int32, np.uint32, "f32"), torch.float64: (torch.int64, np.uint64, "f64"),
       torch.float16: (torch.int16, np.uint16, "f16"), torch.bfloat16: (torch.int16, np.uint16, "bf16")}


def raw_bits(x: torch.Tensor) -> tuple[np.ndarray, str]:
    int_dt, np_dt, kind = RAW[x.dtype]
    return x.reshape(-1).contiguous().view(int_dt).numpy().view(np_dt), kind


def fused(emu, x: torch.Tensor, k: int, index_dtype: str = "int32", ws=None):
    raw, kind = raw_bits(x)
    vals, idx = topk_cupy.select_fused_with(emu.runner(), raw, kind, k, index_dtype, ws)
    return raw, vals, idx


@pytest.mark.skipif(shutil.which("clang++") is None, reason="clang++ not installed (apt-get install clang)")
def test_emulation_builds_with_clang_too(tmp_path):
    e = CudaEmulator(tmp_path, cxx="clang++")
    x = make("ties", 2000, torch.float32, seed=2)
    np.testing.assert_array_equal(fused(e, x, 300)[2], reference_indices(x, 300))


def test_warp_intrinsics_follow_cuda_semantics(tmp_path):
    """__ballot_sync / __match_any_sync / __popc / __ffs of the shim, lane by lane, against their definitions."""
    src = r'''
extern "C" __global__ void probe(const unsigned int* __restrict__ v, unsigned int* __restrict__ out) {
    const unsigned int t = blockIdx.x * blockDim.x + threadIdx.x;
    const unsigned int ballot = __ballot_sync(0xffffffffu, v[t] & 1u);
    const unsigned int match = __match_any_sync(0xffffffffu, v[t]);
    out[4 * t] = ballot; out[4 * t + 1] = match;
    out[4 * t + 2] = (unsigned int)__popc(match); out[4 * t + 3] = (unsigned int)(__ffs(match) - 1);
}
'''
    e = CudaEmulator(tmp_path, source=src, signatures={"probe": ("ptr", "ptr")}, threads=64, max_blocks=2)
    v = np.random.default_rng(0).integers(0, 5, 128).astype(np.uint32)
    out = np.zeros(4 * 128, dtype=np.uint32)
    e.launch("probe", 128, v, out)
    out = out.reshape(128, 4)
    for t in range(128):
        warp = v[t // 32 * 32: t // 32 * 32 + 32]
        match = sum(1 << lane for lane in range(32) if warp[lane] == v[t])
        assert out[t, 0] == sum(int(warp[lane] & 1) << lane for lane in range(32))
        assert (out[t, 1], out[t, 2], out[t, 3]) == (match, bin(match).count("1"), (match & -match).bit_length() - 1)


@pytest.mark.parametrize("kind", ["normal", "ties", "sparse", "special"])
@pytest.mark.parametrize("dtype", list(RAW), ids=str)
def test_fused_select_is_byte_identical_to_the_cpu_path(emu, kind, dtype):
    """Production launch shape: values and indices equal topk_torch.compress's bytes."""
    x = make(kind, 3000, dtype, seed=7)
    for k in (1, 700, 3000):
        raw, vals, idx = fused(emu, x, k)
        cpu = topk_torch.compress(x, k)
        assert idx.dtype == np.int32 and vals.dtype == raw.dtype
        assert idx.tobytes() == cpu.indices.tobytes(), f"k={k}"
        assert vals.tobytes() == cpu.values.tobytes(), f"k={k}"


def test_fused_many_grid_strides_and_int64_indices(small_grid):
    for dtype in (torch.float32, torch.float16):
        x = make("ties", 20_000, dtype, seed=3)
        for k in (1, 999, 20_000):
            _, vals, idx = fused(small_grid, x, k, "int64")
            assert idx.dtype == np.int64
            np.testing.assert_array_equal(idx, reference_indices(x, k))


def test_fused_exits_early_when_a_bucket_is_taken_whole(emu):
    """1000 elements of magnitude 4 and the rest 1, k = 1000: pass 0 finds the bucket, later passes return."""
    x = torch.ones(5000)
    x[torch.randperm(5000, generator=torch.Generator().manual_seed(0))[:1000]] = -4.0
    ws = np.zeros(topk_cupy.FUSED_WS_TILES + 2 * topk_cupy.MAX_BLOCKS, dtype=np.uint64)
    _, vals, idx = fused(emu, x, 1000, ws=ws)
    np.testing.assert_array_equal(idx, reference_indices(x, 1000))
    assert np.all(vals.view(np.float32) == -4.0)
    key4 = int(radix.float_keys_np(np.float32([4.0]))[0])
    assert ws[2] == 1  # done after the first pass
    assert int(ws[0]) == key4 >> 21 << 21  # only the first 11-bit digit was fixed
    assert ws[3] == 0 and not ws[8:8 + 2048].any()  # the last block left counter and histogram clean
    x[0] = 4.0  # now 1001 candidates at magnitude 4: all passes run and the lowest-index tie is cut
    ws[:] = 0
    _, _, idx = fused(emu, x, 1000, ws=ws)
    np.testing.assert_array_equal(idx, reference_indices(x, 1000))
    assert ws[2] == 0 and int(ws[0]) == key4 and ws[1] == 1000


@pytest.mark.parametrize("bug", [("eq_rank < take", "eq_rank <= take"),
                                 ("(unsigned int)__popc(peers)", "1u")])
def test_fused_emulation_catches_kernel_bugs(tmp_path, bug):
    """A wrong tie cut, or a warp-aggregated histogram that counts one per warp, selects a wrong set."""
    bad = topk_cupy.CUDA_SOURCE.replace(*bug)
    assert bad != topk_cupy.CUDA_SOURCE
    e = CudaEmulator(tmp_path, source=bad)
    x = make("ties", 3000, torch.float32, seed=0)
    with pytest.raises(AssertionError):
        np.testing.assert_array_equal(fused(e, x, 700)[2], reference_indices(x, 700))

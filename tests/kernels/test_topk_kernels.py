"""Tests of fusion.kernels: Top-K selection, sparse wire encoding, codec, error feedback."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from fusion.ir.errors import FusionError, WireError
from fusion.kernels import (CODECS, CodecRegistry, ErrorFeedback, SparsePayload, TopKCodec, compress,
                            decompress, dense_nbytes, index_dtype_for, ratio_to_k, sparse_nbytes,
                            topk_cost_factor)
from fusion.kernels import radix, topk_cupy, topk_host, topk_torch

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


# ---------------------------------------------------------------- reference

def reference_indices(x: torch.Tensor, k: int) -> np.ndarray:
    """Brute force: stable sort on (-|x|, index), NaN below everything; ascending result."""
    a = x.detach().reshape(-1).to(torch.float64).numpy()
    mag = np.abs(a)
    mag = np.where(np.isnan(mag), -1.0, mag)
    order = np.argsort(-mag, kind="stable")  # stable: equal magnitudes keep index order
    return np.sort(order[:k])


def make(kind: str, n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "normal":
        x = torch.randn(n, generator=g, dtype=torch.float64)
    elif kind == "ties":  # few distinct magnitudes, both signs: ties everywhere
        x = torch.randint(-4, 5, (n,), generator=g).to(torch.float64)
    elif kind == "sparse":  # 99.7 % zeros (±0), so the k-th magnitude is 0
        x = torch.randn(n, generator=g, dtype=torch.float64)
        x = torch.where(torch.rand(n, generator=g) < 0.997, torch.zeros(()), x)
        x[::7] = -0.0
    elif kind == "special":  # NaN and inf
        x = torch.randn(n, generator=g, dtype=torch.float64)
        x[torch.randint(0, n, (7,), generator=g)] = float("nan")
        x[torch.randint(0, n, (3,), generator=g)] = float("-inf")
    else:
        raise ValueError(kind)
    return x.to(dtype)


def check_round_trip(x: torch.Tensor, k: int, value_dtype=None):
    p = compress(x, k, value_dtype)
    want = reference_indices(x, k)
    np.testing.assert_array_equal(p.indices.astype(np.int64), want)
    assert p.indices.dtype == np.int32 and p.k == k and p.shape == tuple(x.shape)
    y = decompress(p)
    assert y.dtype == x.dtype and y.shape == x.shape
    flat_x, flat_y = x.reshape(-1), y.reshape(-1)
    kept = torch.zeros(x.numel(), dtype=torch.bool)
    kept[torch.from_numpy(want)] = True
    if value_dtype is None:
        torch.testing.assert_close(flat_y[kept], flat_x[kept], rtol=0, atol=0, equal_nan=True)
    assert torch.all(flat_y[~kept] == 0)
    return p


# ---------------------------------------------------------------- selection

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["normal", "ties", "sparse", "special"])
@pytest.mark.parametrize("n", [1000, 100_003])  # exact path, threshold path
def test_round_trip_keeps_exactly_the_k_largest(dtype, kind, n):
    x = make(kind, n, dtype, seed=n)
    for k in (1, max(1, n // 100), n // 3):
        check_round_trip(x, k)


def test_round_trip_multidim_and_edge_k():
    x = make("normal", 6 * 7 * 11, torch.float32).reshape(6, 7, 11)
    check_round_trip(x, 0)
    check_round_trip(x, x.numel())
    p = check_round_trip(x, 17)
    assert decompress(p).shape == (6, 7, 11)
    empty = compress(torch.empty(0, 3), 0)
    assert empty.k == 0 and decompress(empty).shape == (0, 3)


def test_ties_all_equal_pick_lowest_indices():
    for n in (100, 300_000):
        k = n // 10
        for x in (torch.full((n,), 0.5), torch.zeros(n)):
            p = compress(x, k)
            np.testing.assert_array_equal(p.indices, np.arange(k))


def test_ties_at_threshold_straddle_lowest_index_wins():
    n = 300_000
    g = torch.Generator().manual_seed(3)
    x = torch.rand(n, generator=g) * 0.5  # below the tied level
    hi = torch.randperm(n, generator=g)[:1000]  # strictly above: always kept
    tied = torch.randperm(n, generator=g)[:5000]  # |x| == 2 with both signs
    x[tied] = torch.where(torch.arange(5000) % 2 == 0, 2.0, -2.0)
    x[hi] = 3.0 + torch.rand(1000, generator=g)
    k = 3000  # keeps all 1000 "hi" and the 2000 lowest-index ties
    hi_set = set(hi.tolist())
    tied_left = sorted(set(tied.tolist()) - hi_set)
    want = sorted(hi_set | set(tied_left[: k - len(hi_set)]))
    np.testing.assert_array_equal(compress(x, k).indices, want)
    np.testing.assert_array_equal(compress(x, k).indices, reference_indices(x, k))


def test_selection_is_deterministic_and_sign_blind():
    x = make("ties", 100_000, torch.float32, seed=5)
    a, b = compress(x, 1234), compress(x.clone(), 1234)
    assert a.values.tobytes() == b.values.tobytes() and a.indices.tobytes() == b.indices.tobytes()
    np.testing.assert_array_equal(compress(-x, 1234).indices, a.indices)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["normal", "ties", "sparse", "special"])
def test_torch_device_code_matches_reference(dtype, kind):
    """The torch implementation used for non-CPU tensors, run here on CPU tensors."""
    x = make(kind, 100_003, dtype, seed=6)
    for k in (1, 1000, 33_334):
        np.testing.assert_array_equal(topk_torch.select_device(x, k).numpy(), reference_indices(x, k))


@pytest.mark.parametrize("impl", ["host", "device"])
def test_threshold_path_handles_normal_data_without_fallback(monkeypatch, impl):
    def no_exact(flat, k):
        raise AssertionError("exact fallback used")
    monkeypatch.setattr(topk_host, "_exact", no_exact)
    monkeypatch.setattr(topk_torch, "_exact", no_exact)
    sel = topk_torch.select if impl == "host" else lambda x, k: topk_torch.select_device(x, k)
    for n in (100_000, 1_000_000):
        x = make("normal", n, torch.float32, seed=n)
        np.testing.assert_array_equal(np.asarray(sel(x, n // 100)), reference_indices(x, n // 100))
    x = torch.full((100_000,), 7.0)
    np.testing.assert_array_equal(np.asarray(sel(x, 100)), np.arange(100))


@pytest.mark.parametrize("impl", ["host", "device"])
def test_exact_fallback_when_sample_misleads(monkeypatch, impl):
    monkeypatch.setattr(topk_host, "_estimate_threshold", lambda w, k: np.float32(1e30))
    monkeypatch.setattr(topk_torch, "_estimate_threshold", lambda flat, k: 1e30)
    sel = topk_torch.select if impl == "host" else topk_torch.select_device
    x = make("normal", 50_000, torch.float32, seed=11)
    np.testing.assert_array_equal(np.asarray(sel(x, 500)), reference_indices(x, 500))


def test_rejects_bad_inputs():
    with pytest.raises(FusionError):
        compress(torch.arange(10), 3)  # integer tensor
    with pytest.raises(FusionError):
        compress(torch.randn(10), 11)
    with pytest.raises(FusionError):
        compress(torch.randn(10), 3, value_dtype="int8")


# ---------------------------------------------------------------- wire encoding

def test_index_dtype_int32_below_2_pow_31_else_int64():
    assert index_dtype_for(2**31 - 1) == "int32"
    assert index_dtype_for(2**31) == "int64"
    assert compress(torch.randn(1000), 10).indices.dtype == np.int32
    big = SparsePayload(np.ones(2, np.float32), np.array([0, 2**31 + 5], np.int64), (2**31 + 10,),
                        "float32")
    big.validate()
    assert big.index_dtype == "int64"
    with pytest.raises(WireError, match="needs int64"):
        SparsePayload(np.ones(2, np.float32), np.array([0, 5], np.int32), (2**31,), "float32").validate()
    assert sparse_nbytes(2**31, 10, "float32") == 10 * 12
    assert sparse_nbytes(2**31 - 1, 10, "float32") == 10 * 8


def test_fp16_and_bf16_values():
    x = make("normal", 50_000, torch.float32, seed=2).reshape(100, 500)
    p16 = compress(x, 500, value_dtype="float16")
    assert p16.values.dtype == np.float16 and p16.value_dtype == "float16" and p16.dtype == "float32"
    assert p16.nbytes == 500 * (2 + 4)
    y = decompress(p16)
    idx = torch.from_numpy(p16.indices.astype(np.int64))
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.reshape(-1)[idx], x.reshape(-1)[idx].half().float(), rtol=0, atol=0)

    pbf = compress(x, 500, value_dtype="bfloat16")
    assert pbf.values.dtype == np.uint16 and pbf.value_dtype == "bfloat16"
    np.testing.assert_array_equal(pbf.indices, p16.indices)
    torch.testing.assert_close(decompress(pbf).reshape(-1)[idx],
                               x.reshape(-1)[idx].bfloat16().float(), rtol=0, atol=0)

    xb = x.bfloat16()  # a bfloat16 tensor round-trips exactly
    pb = check_round_trip(xb, 500)
    assert pb.values.dtype == np.uint16


def test_msg_round_trip_and_short_frame():
    p = compress(make("normal", 4000, torch.float16, seed=4).reshape(40, 100), 77)
    header, frames = p.to_msg()
    q = SparsePayload.from_msg(header, frames)
    assert q.shape == p.shape and q.dtype == "float16" and q.k == 77
    torch.testing.assert_close(decompress(q), decompress(p), rtol=0, atol=0)
    with pytest.raises(WireError, match="frame"):
        SparsePayload.from_msg(header, [frames[0][:-2], frames[1]])
    with pytest.raises(WireError, match="malformed"):
        SparsePayload.from_msg({"shape": [3]}, frames)


def _good():
    return dict(values=np.array([1.0, -2.0, 3.0], np.float32), indices=np.array([0, 4, 9], np.int32),
                shape=(2, 5), dtype="float32")


MALFORMED = {
    "index out of range (high)": (dict(indices=np.array([0, 4, 10], np.int32)), "out of range"),
    "index out of range (negative)": (dict(indices=np.array([-1, 4, 9], np.int32)), "out of range"),
    "length mismatch": (dict(indices=np.array([0, 4], np.int32)), "3 values but 2 indices"),
    "int64 indices for a small tensor": (dict(indices=np.array([0, 4, 9], np.int64)), "needs int32"),
    "float indices": (dict(indices=np.array([0, 4, 9], np.float32)), "needs int32"),
    "2-D values": (dict(values=np.ones((3, 1), np.float32)), "values must be 1-D"),
    "2-D indices": (dict(indices=np.array([[0, 4, 9]], np.int32)), "indices must be 1-D"),
    "k > numel": (dict(shape=(2,)), "exceeds numel"),
    "duplicate indices": (dict(indices=np.array([4, 0, 4], np.int32)), "duplicate index 4"),
    "unknown dtype": (dict(dtype="float8"), "unknown dtype"),
    "unknown value dtype": (dict(value_dtype="int8"), "unknown value_dtype"),
    "values dtype mismatch": (dict(values=np.ones(3, np.float64)), "values have dtype float64"),
    "negative shape": (dict(shape=(2, -5)), "bad shape"),
    "not an array": (dict(values=[1.0, 2.0, 3.0]), "numpy array"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_payload_rejected(case):
    SparsePayload(**_good()).validate()  # the base payload is fine
    change, message = MALFORMED[case]
    bad = SparsePayload(**{**_good(), **change})
    with pytest.raises(WireError, match=message):
        bad.validate()
    with pytest.raises(WireError):
        decompress(bad)


def test_unsorted_unique_indices_are_accepted():
    p = SparsePayload(**{**_good(), "indices": np.array([9, 0, 4], np.int32)})
    y = decompress(p).reshape(-1)
    assert y[9] == 1.0 and y[0] == -2.0 and y[4] == 3.0


# ---------------------------------------------------------------- costs and codec

def test_topk_cost_factor():
    assert topk_cost_factor("float32", "int32") == 2.0
    assert topk_cost_factor("float32", "int64") == 3.0  # the paper's constant
    assert topk_cost_factor("float16", "int32", "float32") == 1.5
    assert topk_cost_factor("bfloat16", "int32") == 3.0
    with pytest.raises(ValueError):
        topk_cost_factor("float8", "int32")


def test_wire_bytes_at_r100():
    n = 16_000_000
    k = ratio_to_k(n, 100)
    assert k == 160_000
    assert dense_nbytes(n, "float32") / sparse_nbytes(n, k, "float32") == 50.0
    assert TopKCodec().wire_nbytes(n, "float32", {"algo": "topk", "ratio": 100}) == k * 8


def test_ratio_to_k():
    assert ratio_to_k(1000, 100) == 10
    assert ratio_to_k(1001, 100) == 11
    assert ratio_to_k(5, 100) == 1
    assert ratio_to_k(11, 1.1) == 10  # exact arithmetic; float division would say 11
    assert ratio_to_k(7, 1) == 7
    assert ratio_to_k(0, 10) == 0
    with pytest.raises(FusionError):
        ratio_to_k(10, 0.5)


def test_codec_registry():
    builtin = ["delta", "hadamard-quant", "quant", "sparseloco", "topk"]
    assert "topk" in CODECS and CODECS.names() == builtin
    codec = CODECS.for_cfg({"algo": "topk", "ratio": 10})
    x = make("normal", 2000, torch.float32, seed=9).reshape(20, 100)
    p = codec.encode(x, {"algo": "topk", "ratio": 10})
    assert p.k == 200
    y = codec.decode(p, like=x)
    np.testing.assert_array_equal(torch.nonzero(y.reshape(-1)).squeeze(1).numpy(),
                                  reference_indices(x, 200))
    assert codec.encode(x, {"k": 5, "value_dtype": "float16"}).values.dtype == np.float16
    with pytest.raises(FusionError, match="exactly one"):
        codec.encode(x, {"algo": "topk"})
    with pytest.raises(FusionError, match="unknown compression algo"):
        CODECS.get("powersgd")
    mine = CodecRegistry.with_defaults()
    with pytest.raises(FusionError, match="already registered"):
        mine.register(TopKCodec())
    mine.register(TopKCodec(name="powersgd"))  # any Codec under a new name
    assert "powersgd" in mine
    assert CODECS.names() == builtin  # other registries never touch the built-in one


def test_compress_accepts_numpy():
    a = np.random.default_rng(0).standard_normal(5000).astype(np.float32)
    np.testing.assert_array_equal(compress(a, 50).indices, reference_indices(torch.from_numpy(a), 50))


# ---------------------------------------------------------------- error feedback

def test_error_feedback_is_off_by_default():
    ef = ErrorFeedback()
    x = make("normal", 1000, torch.float32)
    p = ef.compress(("e", 0), x, 10)
    assert ef.residual(("e", 0)) is None and ef.nbytes == 0
    np.testing.assert_array_equal(p.indices, compress(x, 10).indices)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_error_feedback_residual_plus_sent_is_input(dtype):
    ef = ErrorFeedback(enabled=True)
    key = ("edge:a->b", 0)
    owed = torch.zeros(3000, dtype=torch.float32)
    for step in range(5):
        x = make("normal", 3000, dtype, seed=step).reshape(30, 100)
        p = ef.compress(key, x, 60)
        assert p.dtype == str(dtype).removeprefix("torch.") and p.shape == (30, 100)
        sent = decompress(p).float().reshape(-1)
        total_in = x.float().reshape(-1) + owed  # this step's input plus what was owed
        torch.testing.assert_close(ef.residual(key).reshape(-1) + sent, total_in,
                                   rtol=0, atol=0 if dtype == torch.float32 else 1e-6)
        owed = ef.residual(key).reshape(-1)


def test_error_feedback_sum_of_sent_approaches_sum_of_inputs():
    n, k, steps = 2000, 100, 300
    ef_on, ef_off = ErrorFeedback(enabled=True), ErrorFeedback()
    g = torch.Generator().manual_seed(0)
    mean = torch.randn(n, generator=g) * 0.1  # a persistent small signal Top-K alone never sends
    total_in = torch.zeros(n)
    sent_on, sent_off = torch.zeros(n), torch.zeros(n)
    early = None
    for step in range(steps):
        x = mean + torch.randn(n, generator=g)
        total_in += x
        sent_on += decompress(ef_on.compress("s", x, k))
        sent_off += decompress(ef_off.compress("s", x, k))
        if step == 30:
            early = float((sent_on - total_in).norm() / total_in.norm())
    err_on = float((sent_on - total_in).norm() / total_in.norm())
    err_off = float((sent_off - total_in).norm() / total_in.norm())
    torch.testing.assert_close(sent_on + ef_on.residual("s"), total_in, rtol=1e-5, atol=1e-3)
    print(f"relative error of sum(sent): with EF {err_on:.4f}, without {err_off:.4f}")
    assert err_on < 0.1 and err_off > 0.5
    assert err_on < early / 2  # the gap shrinks relative to the sum as the stream goes on


def test_error_feedback_streams_are_separate_and_shape_change_drops(caplog):
    ef = ErrorFeedback(enabled=True)
    ef.compress(("e", 0), torch.ones(100), 10)
    ef.compress(("e", 1), torch.ones(100) * 2, 10)
    assert float(ef.residual(("e", 0)).sum()) == 90.0
    assert float(ef.residual(("e", 1)).sum()) == 180.0
    with caplog.at_level(logging.WARNING, logger="fusion.kernels.error_feedback"):
        ef.compress(("e", 0), torch.ones(50), 10)
    assert "dropped" in caplog.text and ef.residual(("e", 0)).shape == (50,)
    ef.reset(("e", 1))
    assert ef.residual(("e", 1)) is None and ef.nbytes == 50 * 4
    ef.reset()
    assert ef.nbytes == 0


# ---------------------------------------------------------------- CUDA path

@pytest.mark.parametrize("kind", ["normal", "ties", "sparse", "special"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16], ids=lambda d: d.__name__)
def test_radix_select_driver_matches_reference(kind, dtype):
    """The CuPy path's host algorithm, run with a NumPy histogram on CPU."""
    x = make(kind, 20_011, torch.float64, seed=1)
    a = x.numpy().astype(dtype)
    for k in (1, 200, 20_011 // 2, 20_011):
        np.testing.assert_array_equal(radix.select_np(a, k),
                                      reference_indices(torch.from_numpy(a), k))


def test_radix_select_reports_ties():
    keys = np.array([5, 7, 7, 7, 1], np.uint32)
    r = radix.radix_select(radix.numpy_hist(keys), 2, 32)
    assert (r.kth_key, r.take_ties, r.all_ties) == (7, 2, False)
    r = radix.radix_select(radix.numpy_hist(keys), 4, 32)
    assert (r.kth_key, r.take_ties, r.all_ties) == (5, 1, True)


def test_cupy_module_is_import_safe():
    assert isinstance(topk_cupy.available(), bool)
    if topk_cupy._cp is None:
        with pytest.raises(FusionError, match="fusion\\[cuda\\]"):
            topk_cupy.compress(torch.zeros(3), 1)


@pytest.fixture
def cuda():
    cp = pytest.importorskip("cupy")
    if not topk_cupy.available() or not torch.cuda.is_available():
        pytest.skip("no CUDA device visible to both CuPy and torch")
    return cp


@pytest.mark.parametrize("kernel", topk_cupy.KERNELS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["normal", "ties", "sparse", "special"])
def test_cpu_and_cuda_agree(cuda, dtype, kind, kernel):
    x = make(kind, 7 * 42_859, dtype, seed=8).reshape(7, -1)  # 300_013 elements: 7 rows exactly
    for k, vdt in ((1, None), (3000, None), (3000, "float16"), (100_000, "bfloat16"), (x.numel(), None)):
        cpu = topk_torch.compress(x, k, vdt)
        gpu = topk_cupy.compress(x.cuda(), k, vdt, kernel=kernel)
        assert gpu.indices.tobytes() == cpu.indices.tobytes()
        assert gpu.values.tobytes() == cpu.values.tobytes()
        assert (gpu.shape, gpu.dtype, gpu.value_dtype) == (cpu.shape, cpu.dtype, cpu.value_dtype)
        assert compress(x.cuda(), k, vdt).indices.tobytes() == cpu.indices.tobytes()  # dispatch
        dev = topk_torch.compress_device(x.cuda(), k, vdt)  # the torch device path on the GPU
        assert (dev.indices.tobytes(), dev.values.tobytes()) == (cpu.indices.tobytes(), cpu.values.tobytes())
        dense = decompress(gpu, like=x.cuda())
        assert dense.is_cuda and dense.dtype == x.dtype
        torch.testing.assert_close(dense.cpu(), decompress(cpu), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("kernel", topk_cupy.KERNELS)
def test_cuda_accepts_cupy_arrays(cuda, kernel):
    a = cuda.asarray(make("normal", 100_000, torch.float32, seed=12).numpy())
    p = topk_cupy.compress(a, 1000, kernel=kernel)
    np.testing.assert_array_equal(p.indices, reference_indices(torch.from_numpy(cuda.asnumpy(a)), 1000))
    back = topk_cupy.decompress_cupy(p)
    assert isinstance(back, cuda.ndarray) and int(cuda.count_nonzero(back)) == 1000



def test_cuda_fused_path_big_tensor_and_staging_reuse(cuda):
    """16M float32 at r=100 (the issue's size) matches the CPU path; the pinned buffer is reused."""
    x = make("normal", 16_000_000, torch.float32, seed=13)
    k = ratio_to_k(x.numel(), 100)
    cpu = topk_torch.compress(x, k)
    xc = x.cuda()
    from fusion.kernels.staging import staging_for
    st = staging_for(xc.device)
    for rep in range(2):
        gpu = topk_cupy.compress(xc, k, kernel="fused")
        assert gpu.indices.tobytes() == cpu.indices.tobytes() and gpu.values.tobytes() == cpu.values.tobytes()
        if rep == 0:
            allocations = st.allocations  # earlier tests may have grown it already
    assert st.pin and st.buffer.is_pinned() and st.allocations == allocations


# ---------------------------------------------------------------- device encode path (torch)

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["ties", "special"])
def test_device_encode_path_gives_the_host_path_bytes(dtype, kind):
    """compress_device (what CUDA tensors run without CuPy), on CPU tensors here."""
    from fusion.kernels.staging import HostStaging
    staging = HostStaging(pin=False)
    x = make(kind, 97 * 1031, dtype, seed=14).reshape(97, -1)
    for k, vdt in ((0, None), (1, None), (1000, "float16"), (33_336, "bfloat16"), (x.numel(), None)):
        want = topk_torch.compress(x, k, vdt)
        got = topk_torch.compress_device(x, k, vdt, staging=staging)
        assert (got.shape, got.dtype, got.value_dtype) == (want.shape, want.dtype, want.value_dtype)
        assert got.values.dtype == want.values.dtype and got.indices.dtype == want.indices.dtype
        assert got.values.tobytes() == want.values.tobytes(), (k, vdt)
        assert got.indices.tobytes() == want.indices.tobytes(), (k, vdt)


def test_staging_buffer_is_reused_and_never_aliased():
    from fusion.kernels.staging import HostStaging
    staging = HostStaging(pin=False)
    x = make("normal", 50_000, torch.float32, seed=15)
    p1 = topk_torch.compress_device(x, 500, staging=staging)
    buf = staging.buffer.data_ptr()
    saved = p1.values.copy()
    p2 = topk_torch.compress_device(-x, 400, staging=staging)  # smaller message: same buffer
    assert staging.buffer.data_ptr() == buf and staging.allocations == 1
    np.testing.assert_array_equal(p1.values, saved)  # the second message did not overwrite the first
    assert not np.shares_memory(p2.values, staging.buffer.numpy())
    topk_torch.compress_device(x, 40_000, staging=staging)  # larger: grows once
    assert staging.allocations == 2

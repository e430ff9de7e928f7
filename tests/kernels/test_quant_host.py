"""The in-place NumPy host path of quant / hadamard-quant (``kernels/quant_host.py``) gives the shared algorithm's
bytes (``encode_core`` / ``decode_core`` over ``NumpyOps``, the path it replaced) on hard inputs, and reuses its
buffers instead of allocating per message."""
from __future__ import annotations

import numpy as np
import pytest

from fusion.kernels import quant as Q, quant_host as H
from fusion.ir.errors import FusionError


def _reference(a: np.ndarray, cfg: Q.QuantConfig) -> Q.QuantPayload:
    flat = Q.NumpyOps.widen(a, a.dtype.name)
    exp, s16, o16, packed = Q.encode_core(Q.NumpyOps, flat, flat.size, cfg)
    return Q.QuantPayload(a.shape, a.dtype.name, cfg.bits, cfg.block, cfg.rounding, cfg.hadamard, exp, s16, o16, packed)


def _inputs():
    rng = np.random.default_rng(7)
    yield "normal", rng.standard_normal((3, 37, 11)).astype(np.float32)
    x = rng.standard_normal(1000).astype(np.float32)
    x[::97] = 40.0
    yield "outliers", x
    yield "zeros-and-negzero", np.array([0.0, -0.0] * 50 + [-0.0] * 7, dtype=np.float32)
    yield "constant", np.full(130, -3.25, dtype=np.float32)
    yield "tiny", (rng.standard_normal(300) * 1e-41).astype(np.float32)  # float32 subnormals
    yield "huge-f64", rng.standard_normal(200) * 1e300
    yield "small-f64", rng.standard_normal(200) * 1e-310  # subnormal float64: two-multiply scaling
    yield "mixed-f64", np.concatenate([rng.standard_normal(100) * 1e-300, [1e300, -1e300]])
    yield "float16", rng.standard_normal(333).astype(np.float16)
    yield "one", np.array([5.0], dtype=np.float32)
    yield "short-tail", rng.standard_normal(64 * 3 + 5).astype(np.float64)


CFGS = [dict(bits=b, block=blk, rounding=r) for b in (2, 4, 8) for blk in (1, 16, 64) for r in ("nearest", "stochastic")]


@pytest.mark.parametrize("hadamard", [False, True])
@pytest.mark.parametrize("cfg", CFGS, ids=lambda c: f"{c['bits']}b-{c['block']}-{c['rounding'][:4]}")
def test_host_path_gives_the_shared_algorithms_bytes(cfg, hadamard):
    qc = Q.QuantConfig.from_cfg({**cfg, "seed": 11}, hadamard)
    for name, a in _inputs():
        assert H.fast_path(a.size, a.dtype.name)
        fast, ref = H.quantize(a, qc), _reference(a, qc)
        assert fast.to_msg() == ref.to_msg(), name
        y = H.dequantize(fast)
        y64_ref = Q.decode_core(Q.NumpyOps, ref.scales, ref.offsets, ref.codes, ref)
        assert H.dequantize_f64(fast).tobytes() == y64_ref.tobytes(), name
        y_ref = Q.finish(Q.NumpyOps, y64_ref, ref.dtype)
        assert y.dtype == y_ref.dtype and y.tobytes() == y_ref.reshape(a.shape).tobytes(), name


@pytest.mark.parametrize("hadamard", [False, True])
def test_nan_and_inf_are_refused(hadamard):
    qc = Q.QuantConfig.from_cfg({"bits": 4}, hadamard)
    for bad in (np.nan, np.inf, -np.inf):
        a = np.zeros(100, dtype=np.float32)
        a[70] = bad
        with pytest.raises(FusionError, match="NaN or inf"):
            H.quantize(a, qc)


def test_steady_state_messages_allocate_no_scratch():
    ws = H.QuantScratch()
    qc = Q.QuantConfig.from_cfg({"bits": 4, "rounding": "stochastic"}, False)
    a = np.random.default_rng(0).standard_normal(4096).astype(np.float32)
    p = Q.QuantPayload(a.shape, "float32", 4, 64, "stochastic", False, *H.encode(a, qc, ws))
    H.decode(p, ws)
    grown = ws.grown
    for _ in range(3):
        out = H.encode(a, qc, ws)
        y = H.decode(p, ws)
    assert ws.grown == grown
    assert not any(np.shares_memory(y, b) or np.shares_memory(out[3], b) for b in ws.buffers.values())


@pytest.mark.parametrize("up", [True, False])
def test_f16_round_matches_the_bit_arithmetic_on_every_float16(up):
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    h = h[np.isfinite(h)].astype(np.float64)
    rng = np.random.default_rng(0)
    v = np.concatenate([h, h * (1 + 1e-6), h * (1 - 1e-6), h + 1e-9, h - 1e-9, rng.standard_normal(10000) * 100])
    v = v[np.abs(v) < 65504]
    assert H.f16_round(v, up).view(np.uint16).tobytes() == Q.f16_round(Q.NumpyOps, v, up).view(np.uint16).tobytes()


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_and_unpack_match_the_shared_ones(bits):
    rng = np.random.default_rng(bits)
    for n in (1, 2, 3, 5, 8, 1001, 4096):
        codes = rng.integers(0, 1 << bits, n, dtype=np.uint8)
        packed = H.pack_into(codes, bits)
        assert packed.tobytes() == Q.pack(Q.NumpyOps, codes, bits).tobytes()
        out = np.full(n, 255, dtype=np.uint8)
        H.unpack_into(packed, bits, out)
        assert out.tobytes() == Q.unpack(Q.NumpyOps, packed, bits, n).tobytes() == codes.tobytes()


def test_huge_messages_do_not_stay_in_the_scratch(monkeypatch):
    monkeypatch.setattr(H, "KEEP_MAX_BYTES", 8 * 1000)
    ws = H.QuantScratch()
    qc = Q.QuantConfig.from_cfg({"bits": 4, "rounding": "stochastic"}, True)
    a = np.random.default_rng(1).standard_normal(5000).astype(np.float32)
    p = Q.QuantPayload(a.shape, "float32", 4, 64, "stochastic", True, *H.encode(a, qc, ws))
    assert p.to_msg() == _reference(a, qc).to_msg()
    assert all(b.nbytes <= 8 * 1000 for b in ws.buffers.values())


def test_decode_clips_where_the_values_reach_the_dtypes_range():
    """float16 output of values near its limit: the clip runs (the bound says it may matter) and the bytes match."""
    qc = Q.QuantConfig.from_cfg({"bits": 8, "block": 16}, False)
    a = np.array([65504.0, -65504.0, 65000.0, 1.0] * 8, dtype=np.float16)
    p = H.quantize(a, qc)
    assert H._largest_decoded(p) >= Q._scaled_limit("float16", p.scale_exp)  # so the clip runs
    ref = Q.finish(Q.NumpyOps, Q.decode_core(Q.NumpyOps, p.scales, p.offsets, p.codes, p), "float16")
    assert H.dequantize(p).tobytes() == ref.reshape(a.shape).tobytes()
    assert np.isfinite(H.dequantize(p).astype(np.float32)).all()

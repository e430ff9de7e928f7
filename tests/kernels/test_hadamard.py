"""``hadamard-quant``: the rotation, the per-block L2 error bound, NumPy/torch byte identity, wire."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fusion.ir.errors import FusionError, WireError
from fusion.kernels import CODECS, QuantPayload
from fusion.kernels import quant as Q
from fusion.kernels import quant_torch as QT
from tests.kernels.codec_helpers import make_tensor, opdata_round_trip, payload_bytes, to_numpy, ulp, widen
from tests.kernels.test_quant import both

EPS = 1e-9


def sylvester(n: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / math.sqrt(n)


@pytest.mark.parametrize("block", [1, 2, 8, 64, 128])
def test_fwht_is_the_orthonormal_hadamard_matrix_and_its_own_inverse(block):
    x = np.random.default_rng(block).standard_normal((5, block))
    y = Q.fwht(Q.NumpyOps, x, block)
    np.testing.assert_allclose(y, x @ sylvester(block).T, rtol=0, atol=1e-12)
    np.testing.assert_allclose(Q.fwht(Q.NumpyOps, y, block), x, rtol=0, atol=1e-12)
    yt = Q.fwht(QT._ops(torch.device("cpu")), torch.from_numpy(x), block)
    assert yt.numpy().tobytes() == y.tobytes()  # same butterflies, same bits


def check_l2_bound(x: torch.Tensor, p: QuantPayload) -> None:
    """Per block: ||y64 - x||_2 <= sqrt(block) * step / 2 (nearest), < sqrt(block) * step (stochastic)."""
    B, n, e = p.block, p.numel, p.scale_exp
    x64 = widen(to_numpy(x).reshape(-1), p.dtype)
    y64 = Q.dequantize_f64(p)
    err = np.zeros(p.nblocks * B)
    err[:n] = Q.mul_pow2(y64, -e) - Q.mul_pow2(x64, -e)  # in units of 2**scale_exp: no overflow
    l2 = np.sqrt((err.reshape(-1, B) ** 2).sum(axis=1))
    step_u = p.scales.astype(np.float64)
    k = 0.5 if p.rounding == "nearest" else 1.0
    assert np.all(l2 <= math.sqrt(B) * step_u * k * (1 + EPS)), float(np.max(l2 / (math.sqrt(B) * step_u)))
    step = Q.mul_pow2(step_u, e)
    with np.errstate(over="ignore"):  # float64 near its max: the scaled check above is the tight one
        per_elem = np.repeat(math.sqrt(B) * step * k * (1 + EPS), B)[:n]
    out = widen(Q.dequantize(p).reshape(-1), p.dtype)
    with np.errstate(over="ignore"):  # |out - x| may overflow for float64 near its max: compare halves
        assert np.all(np.abs(out / 2 - x64 / 2) <= per_elem / 2 + ulp(y64, p.dtype))


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_error_bound_and_identical_bytes(dtype, bits, rounding):
    for n, block in ((1, 64), (100, 16), (1000, 64), (777, 128)):
        x = make_tensor("heavy", n, dtype, seed=n * bits)
        p = both(x, {"bits": bits, "block": block, "rounding": rounding, "seed": 9}, hadamard=True)
        assert p.hadamard and p.codes.size == math.ceil(p.nblocks * block * bits / 8)
        check_l2_bound(x, p)
        assert to_numpy(QT.dequantize(p)).tobytes() == Q.dequantize(p).tobytes()


@pytest.mark.parametrize("kind", ["zeros", "constant", "huge", "denormal"])
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
def test_special_values(kind, dtype):
    x = make_tensor(kind, 200, dtype, seed=1)
    p = both(x, {"bits": 4, "block": 32}, hadamard=True)
    check_l2_bound(x, p)
    assert torch.isfinite(QT.dequantize(p)).all()


def test_rotation_shrinks_the_error_of_a_block_with_an_outlier():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64 * 256, generator=g) * 0.01
    x[::64] = 10.0  # one outlier per block: plain quant's step is 10/L
    cfg = {"bits": 4, "block": 64}
    e_plain = (QT.dequantize(QT.quantize(x, cfg)) - x).pow(2).mean()
    e_rot = (QT.dequantize(QT.quantize(x, cfg, hadamard=True)) - x).pow(2).mean()
    assert e_rot < 0.5 * e_plain


def test_tail_block_is_zero_padded_and_only_real_elements_come_back():
    x = torch.randn(3, 7)  # 21 elements, block 16: two blocks, 11 padding coefficients
    p = both(x, {"bits": 8, "block": 16}, hadamard=True)
    assert p.nblocks == 2 and p.codes.size == 32
    y = QT.dequantize(p)
    assert y.shape == (3, 7)
    assert (y - x).abs().max() < 0.05 * x.abs().max()


def test_wire_round_trip_and_malformed():
    x = torch.randn(10, 10)
    cfg = {"algo": "hadamard-quant", "bits": 2, "block": 32}
    p = CODECS.get("hadamard-quant").encode(x, cfg)
    back = opdata_round_trip(p, cfg)
    assert back.hadamard and payload_bytes(back) == payload_bytes(p)
    assert torch.equal(CODECS.get("hadamard-quant").decode(back), QT.dequantize(p))
    head, frames = p.to_msg()
    with pytest.raises(WireError, match="power of two"):
        QuantPayload.from_msg({**head, "block": 48}, frames)
    with pytest.raises(WireError, match="codes frame has"):  # 100 codes would do for plain quant, not 128
        QuantPayload.from_msg(head, [frames[0], frames[1], frames[2][:25]])


def test_cfg_requires_a_power_of_two_block():
    with pytest.raises(FusionError, match="hadamard-quant cfg: block must be a power of two, got 48"):
        CODECS.get("hadamard-quant").wire_nbytes(100, "float32", {"block": 48})
    assert CODECS.get("quant").wire_nbytes(100, "float32", {"block": 48}) > 0

"""The ``quant`` codec: error bound, NumPy/torch byte identity, bit packing, wire, malformed payloads, cfg."""
from __future__ import annotations

import math
import subprocess
import sys

import msgpack
import numpy as np
import pytest
import torch

from fusion.ir.errors import FusionError, WireError
from fusion.ir.opdata import OpData
from fusion.ir.wire import decode_opdata, encode_opdata
from fusion.kernels import CODECS, CodecRegistry, QuantCodec, QuantPayload
from fusion.kernels import quant as Q
from fusion.kernels import quant_torch as QT
from tests.kernels.codec_helpers import (TORCH_DTYPES, make_tensor, opdata_round_trip, payload_bytes, to_numpy,
                                         ulp, widen)

DTYPES = list(TORCH_DTYPES)
KINDS = ["normal", "heavy", "zeros", "constant", "huge", "denormal"]
EPS = 1e-12  # float64 rounding of x - offset and of offset + code * scale, relative to a step


def both(x: torch.Tensor, cfg: dict, hadamard: bool = False) -> QuantPayload:
    """Encode with the NumPy and the torch path, assert identical wire bytes, return the payload."""
    dtype = str(x.dtype).removeprefix("torch.")
    pn = Q.quantize(to_numpy(x), cfg, dtype=dtype, hadamard=hadamard)
    pt = QT.quantize(x, cfg, hadamard=hadamard)
    assert payload_bytes(pn) == payload_bytes(pt), (dtype, cfg, hadamard)
    return pn


def check_bound(x: torch.Tensor, p: QuantPayload) -> None:
    """|decoded - x| <= step/2 (nearest) or < step (stochastic), per element; output cast adds <= 1 ulp."""
    dtype = p.dtype
    x64 = widen(to_numpy(x).reshape(-1), dtype)
    y64 = Q.dequantize_f64(p)
    step = Q.step_sizes(p)
    err = np.abs(y64 - x64)
    if p.rounding == "nearest":
        assert np.all(err <= step * (0.5 + EPS)), float(np.max(err / np.maximum(step, 1e-300)))
    else:
        assert np.all((err < step * (1 + EPS)) | (err == 0)), float(np.max(err / np.maximum(step, 1e-300)))
    out = widen(Q.dequantize(p).reshape(-1), dtype)
    slack = step * (0.5 if p.rounding == "nearest" else 1.0) * (1 + EPS) + ulp(y64, dtype)
    assert np.all(np.abs(out - x64) <= slack)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_round_trip_error_within_half_a_step(dtype, bits, rounding):
    for n, block in ((1, 64), (100, 7), (1000, 64), (2049, 128)):
        for kind in ("normal", "heavy"):
            x = make_tensor(kind, n, dtype, seed=n + bits)
            p = both(x, {"bits": bits, "block": block, "rounding": rounding, "seed": n})
            assert p.nblocks == math.ceil(n / block) and p.codes.size == math.ceil(n * bits / 8)
            check_bound(x, p)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["zeros", "constant", "huge", "denormal"])
def test_special_values_keep_the_bound_and_the_bytes(dtype, kind):
    for bits in (2, 8):
        for rounding in ("nearest", "stochastic"):
            x = make_tensor(kind, 300, dtype, seed=bits)
            p = both(x, {"bits": bits, "block": 32, "rounding": rounding})
            check_bound(x, p)
            y = QT.dequantize(p)
            assert torch.isfinite(y).all() and y.dtype == x.dtype
            assert to_numpy(y).tobytes() == Q.dequantize(p).tobytes()


def test_constant_and_zero_blocks_decode_exactly_when_float16_holds_them():
    x = torch.tensor([0.0] * 64 + [2.5] * 64 + [-0.75] * 10)
    p = both(x, {"bits": 2, "block": 64})
    assert torch.equal(QT.dequantize(p), x)


def test_multidim_shapes_and_empty_tensor():
    for shape in [(3, 5, 7), (0,), (4, 0, 2), (1, 1)]:
        x = torch.randn(shape)
        p = both(x, {"bits": 4, "block": 16})
        y = QT.dequantize(p)
        assert y.shape == x.shape and y.dtype == x.dtype
        assert Q.dequantize(p).shape == x.shape


def test_nan_and_inf_are_refused_at_encode():
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = torch.randn(100)
        x[17] = bad
        with pytest.raises(FusionError, match="NaN or inf"):
            QT.quantize(x, {"bits": 8})
        with pytest.raises(FusionError, match="NaN or inf"):
            Q.quantize(x.numpy(), {"bits": 8})


def test_bit_packing_is_little_endian_within_a_byte():
    # codes 0..L in order, block of 1 element each -> code = value - offset
    ops = Q.NumpyOps
    assert Q.pack(ops, np.array([0, 1, 2, 3, 3], dtype=np.uint8), 2).tolist() == [0b11100100, 0b00000011]
    assert Q.pack(ops, np.array([0x1, 0xF, 0xA], dtype=np.uint8), 4).tolist() == [0xF1, 0x0A]
    assert Q.pack(ops, np.array([7, 200], dtype=np.uint8), 8).tolist() == [7, 200]
    for bits in (2, 4, 8):
        codes = np.random.default_rng(bits).integers(0, 1 << bits, 37).astype(np.uint8)
        packed = Q.pack(ops, codes, bits)
        assert packed.size == math.ceil(37 * bits / 8)
        np.testing.assert_array_equal(Q.unpack(ops, packed, bits, 37), codes)
        tp = Q.pack(QT._ops(torch.device("cpu")), torch.from_numpy(codes), bits)
        np.testing.assert_array_equal(tp.numpy(), packed)


def test_codes_follow_the_documented_formula():
    x = torch.tensor([0.0, 1.0, 2.0, 3.0, 1.4, 1.6])
    p = both(x, {"bits": 2, "block": 6})
    assert p.offsets.tolist() == [0.0] and p.scales.astype(np.float64).tolist() == [1.0 * 2.0 ** -p.scale_exp]
    codes = Q.unpack(Q.NumpyOps, p.codes, 2, 6)
    assert codes.tolist() == [0, 1, 2, 3, 1, 2]


def test_scale_and_offset_are_float16_rounded_outwards():
    x = make_tensor("heavy", 4096, "float32", seed=3)
    p = both(x, {"bits": 4, "block": 64})
    x64 = x.numpy().astype(np.float64).reshape(-1, 64)
    off = Q.mul_pow2(p.offsets.astype(np.float64), p.scale_exp)
    top = off + 15 * Q.mul_pow2(p.scales.astype(np.float64), p.scale_exp)
    assert np.all(off <= x64.min(axis=1)) and np.all(top >= x64.max(axis=1))


def test_stochastic_rounding_is_seeded_and_unbiased():
    x = torch.linspace(-1, 1, 512)
    cfg = {"bits": 2, "block": 512, "rounding": "stochastic"}
    a, b = both(x, {**cfg, "seed": 1}), both(x, {**cfg, "seed": 1})
    assert payload_bytes(a) == payload_bytes(b)
    assert payload_bytes(a) != payload_bytes(both(x, {**cfg, "seed": 2}))
    mean = np.mean([Q.dequantize_f64(Q.quantize(x.numpy(), {**cfg, "seed": s})) for s in range(200)], axis=0)
    step = float(Q.step_sizes(a)[0])
    assert np.abs(mean - x.numpy()).max() < 0.25 * step  # nearest would be off by up to step/2
    assert abs(float(np.mean(mean - x.numpy()))) < 0.02 * step


def test_hash_is_identical_in_numpy_and_torch_beyond_2_to_the_32():
    for seed in (0, 1, 2**63 + 12345):
        for start in (0, 2**32 - 3, 5 * 2**32):
            un = Q.hash_uniform(Q.NumpyOps, seed, 1000, start)
            ut = Q.hash_uniform(QT._ops(torch.device("cpu")), seed, 1000, start)
            assert un.tobytes() == ut.numpy().tobytes()
            assert 0.0 <= un.min() and un.max() < 1.0 and 0.4 < un.mean() < 0.6


def test_wire_round_trip_through_opdata():
    x = make_tensor("heavy", 3 * 5 * 11, "bfloat16").reshape(3, 5, 11)
    for bits in (2, 4, 8):
        cfg = {"algo": "quant", "bits": bits, "block": 16}
        p = CODECS.get("quant").encode(x, cfg)
        back = opdata_round_trip(p, cfg)
        assert isinstance(back, QuantPayload) and payload_bytes(back) == payload_bytes(p)
        assert torch.equal(CODECS.get("quant").decode(back).view(torch.int16), QT.dequantize(p).view(torch.int16))


def test_codec_encodes_numpy_arrays_with_the_same_bytes():
    x = torch.randn(999)
    c = QuantCodec()
    assert payload_bytes(c.encode(x.numpy(), {"bits": 4})) == payload_bytes(c.encode(x, {"bits": 4}))
    with pytest.raises(FusionError, match="expected a hadamard QuantPayload"):
        CODECS.get("hadamard-quant").decode(c.encode(x, {}))


@pytest.mark.parametrize("algo", ["quant", "hadamard-quant"])
def test_wire_nbytes_is_exact_frames_plus_header_estimate(algo):
    codec = CODECS.get(algo)
    for n, bits, block in ((1, 2, 64), (1000, 4, 64), (4097, 2, 128), (10, 8, 1)):
        cfg = {"algo": algo, "bits": bits, "block": block}
        p = codec.encode(torch.randn(n), cfg)
        assert codec.wire_nbytes(n, "float32", cfg) == p.nbytes + Q.HEADER_NBYTES
        frames = encode_opdata(OpData(
            name="h", index=None, op_users=(), actual_user=(), is_grad=False, local_iter=0, micro_batch=0,
            src="a", dst="b", payload=p, compress_cfg=cfg))
        assert len(msgpack.packb(msgpack.unpackb(frames[0])["h"]["payload"])) < Q.HEADER_NBYTES


@pytest.mark.parametrize("cfg,msg", [
    ({"bits": 3}, "quant cfg: bits must be one of 2, 4, 8, got 3"),
    ({"bits": True}, "bits must be one of 2, 4, 8, got True"),
    ({"block": 0}, "quant cfg: block must be an int"),
    ({"block": 2.0}, "block must be an int"),
    ({"rounding": "floor"}, "quant cfg: rounding must be 'nearest' or 'stochastic', got 'floor'"),
    ({"seed": -1}, "quant cfg: seed must be an int in"),
    ({"ratio": 10}, r"quant cfg: unknown key\(s\) \['ratio'\]"),
])
def test_cfg_errors_name_the_key_and_value(cfg, msg):
    with pytest.raises(FusionError, match=msg):
        CODECS.get("quant").wire_nbytes(100, "float32", cfg)
    with pytest.raises(FusionError, match=msg):
        CODECS.get("quant").encode(torch.randn(10), cfg)


def test_registry_defaults_and_unknown_dtype():
    reg = CodecRegistry.with_defaults()
    assert reg.names() == ["delta", "hadamard-quant", "quant", "sparseloco", "topk"]
    assert reg.for_cfg({"algo": "quant"}) == QuantCodec()
    with pytest.raises(FusionError, match="int64"):
        reg.get("quant").wire_nbytes(10, "int64", {})
    with pytest.raises(FusionError, match="dtype int64 is not supported"):
        QT.quantize(torch.arange(10), {})


# ---------------------------------------------------------------- malformed payloads

def _good() -> QuantPayload:
    return Q.quantize(np.random.default_rng(0).standard_normal((10, 13)).astype(np.float32),
                      {"bits": 2, "block": 16})


def _replace(p: QuantPayload, **kw) -> QuantPayload:
    fields = {f: getattr(p, f) for f in QuantPayload.__dataclass_fields__}
    return QuantPayload(**{**fields, **kw})


BAD_PAYLOADS = {
    "bits": (dict(bits=3), "bits must be one of 2, 4, 8, got 3"),
    "block zero": (dict(block=0), "block must be an int"),
    "block negative": (dict(block=-4), "block must be an int"),
    "hadamard block": (dict(hadamard=True, block=12), "power of two"),
    "dtype": (dict(dtype="int8"), "unknown dtype 'int8'"),
    "shape negative": (dict(shape=(10, -13)), "bad shape"),
    "shape float": (dict(shape=(10.0, 13)), "bad shape"),
    "rounding": (dict(rounding="up"), "unknown rounding"),
    "scale_exp": (dict(scale_exp=5000), "scale_exp must be"),
    "scale count": (dict(scales=np.ones(8, np.float16)), r"8 scales for ceil\(130 / 16\) = 9 blocks"),
    "offset count": (dict(offsets=np.ones(10, np.float16)), r"10 offsets for ceil\(130 / 16\) = 9 blocks"),
    "codes short": (dict(codes=np.zeros(32, np.uint8)), "codes frame has 32 bytes, 130 codes of 2 bits need 33"),
    "codes long": (dict(codes=np.zeros(34, np.uint8)), "codes frame has 34 bytes"),
    "scale inf": (dict(scales=np.array([1, 1, np.inf, 1, 1, 1, 1, 1, 1], np.float16)), "non-finite scale"),
    "scale nan": (dict(scales=np.array([np.nan] * 9, np.float16)), "non-finite scale"),
    "offset nan": (dict(offsets=np.array([np.nan] * 9, np.float16)), "non-finite scale or offset"),
    "scale negative": (dict(scales=-np.ones(9, np.float16)), "negative scale"),
    # on the wire a frame is bytes: 9 float32s read as 18 float16 scales
    "scales dtype": (dict(scales=np.ones(9, np.float32)), "scales must be a 1-D float16 array", "18 scales"),
    "pad bits": (dict(codes=np.full(33, 0xFF, np.uint8)), "unused high bits"),
}


@pytest.mark.parametrize("case", list(BAD_PAYLOADS))
def test_malformed_payloads_raise_wire_error(case):
    kw, msg, *wire_msg = BAD_PAYLOADS[case]
    bad = _replace(_good(), **kw)
    with pytest.raises(WireError, match=msg):
        bad.validate()
    with pytest.raises(WireError, match=msg):
        Q.dequantize(bad)
    # the same payload received from a peer: from_msg and the wire both refuse it
    head, frames = _replace(_good(), **{k: v for k, v in kw.items() if isinstance(v, np.ndarray)}).to_msg()
    head.update({k: (list(v) if isinstance(v, tuple) else v) for k, v in kw.items() if not isinstance(v, np.ndarray)})
    msg = wire_msg[0] if wire_msg else msg
    with pytest.raises(WireError, match=msg):
        QuantPayload.from_msg(head, frames)
    if case in ("scale count", "codes short", "bits", "pad bits"):
        good_frames = encode_opdata(OpData(
            name="h", index=None, op_users=(), actual_user=(), is_grad=False, local_iter=0, micro_batch=0,
            src="a", dst="b", payload=_good(), compress_cfg=None))
        outer = msgpack.unpackb(good_frames[0])
        outer["h"]["payload"].update(head)
        arrays = [np.frombuffer(f, np.uint8) for f in frames]
        outer["t"] = [{"d": "uint8", "s": [a.size]} for a in arrays]
        with pytest.raises(WireError, match=msg):
            decode_opdata([msgpack.packb(outer), *arrays])


def test_malformed_headers_and_frame_counts():
    head, frames = _good().to_msg()
    with pytest.raises(WireError, match="malformed header"):
        QuantPayload.from_msg({k: v for k, v in head.items() if k != "bits"}, frames)
    with pytest.raises(WireError, match="malformed header"):
        QuantPayload.from_msg(head, frames[:2])
    with pytest.raises(WireError, match="malformed header"):
        QuantPayload.from_msg({**head, "shape": 7}, frames)
    with pytest.raises(WireError, match="not whole float16s"):
        QuantPayload.from_msg(head, [frames[0][:-1], frames[1], frames[2]])
    with pytest.raises(WireError, match="needs 3 tensor frames"):
        Q.WIRE_CODEC.decode(head, [np.frombuffer(f, np.uint8) for f in frames[:2]])
    with pytest.raises(WireError, match="bits must be"):
        QuantPayload.from_msg({**head, "bits": "8"}, frames)


def test_numpy_path_never_imports_torch():
    """quant and delta encode, decode and cross the wire in a process where ``import torch`` fails."""
    code = r'''
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked: " + name)
sys.meta_path.insert(0, Block())
try:
    import torch
    raise SystemExit("torch imported")
except ImportError:
    pass
import numpy as np
from fusion.ir import wire
from fusion.ir.opdata import OpData
from fusion.kernels import quant as Q, delta as D
x = np.random.default_rng(0).standard_normal((4, 33)).astype(np.float32)
for h in (False, True):
    p = Q.quantize(x, {"bits": 4, "block": 16, "rounding": "stochastic"}, hadamard=h)
    od = OpData(name="h", index=None, op_users=(), actual_user=(), is_grad=False, local_iter=0,
                micro_batch=0, src="a", dst="b", payload=p)
    back = wire.decode_opdata([bytes(f) if isinstance(f, bytes) else f.tobytes() for f in wire.encode_opdata(od)])
    assert np.abs(Q.dequantize(back.payload) - x).max() < 1
s, r = D.DeltaBuffer({"bits": 2}), D.DeltaBuffer({"bits": 2})
for step in range(3):
    p = s.encode(x + step, [5, 1, 9, 2])
    y = r.decode(p)
assert all((s.state_dict()[k] == r.state_dict()[k]).all() for k in (5, 1, 9, 2))
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
'''
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_decode_cast_rounds_through_float32_in_both_paths(dtype):
    """float64 -> float16/bfloat16 rounds via float32 (torch's own conversion does; a direct NumPy cast
    would differ on these values, which sit just above a tie of the narrow type)."""
    m = {"float16": 11, "bfloat16": 8, "float32": 24}[dtype]
    y = np.array([1 + 2.0 ** -m + 2.0 ** -40, -(1 + 2.0 ** -m + 2.0 ** -40), 3 + 2.0 ** -(m - 1) + 2.0 ** -45,
                  1e-5 + 2.0 ** -60, 0.0, -0.0, 65504.0])
    a = Q.finish(Q.NumpyOps, y, dtype)
    b = to_numpy(QT.TorchOps.narrow(torch.from_numpy(y), dtype))
    assert a.tobytes() == b.tobytes()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the torch path on CUDA tensors)")
@pytest.mark.parametrize("hadamard", [False, True])
def test_cuda_tensors_give_the_numpy_bytes(hadamard):
    from fusion.kernels import DeltaBuffer, TorchDeltaBuffer

    for dtype in ("float32", "bfloat16", "float16"):
        x = make_tensor("heavy", 10_000, dtype, seed=4)
        for bits in (2, 4, 8):
            cfg = {"bits": bits, "block": 64, "rounding": "stochastic", "seed": 77}
            pn = Q.quantize(to_numpy(x), cfg, dtype=dtype, hadamard=hadamard)
            pc = QT.quantize(x.cuda(), cfg, hadamard=hadamard)
            assert payload_bytes(pn) == payload_bytes(pc)
            y = QT.dequantize(pc, device="cuda")
            assert y.is_cuda and to_numpy(y).tobytes() == Q.dequantize(pn).tobytes()
    s, r = TorchDeltaBuffer({"bits": 2}, device="cuda"), DeltaBuffer({"bits": 2})
    x = torch.randn(4, 100)
    for step in range(3):
        r.decode(s.encode((x + step).cuda(), [1, 2, 3, 4]))
    assert all(s.state_dict()[k].tobytes() == r.state_dict()[k].tobytes() for k in (1, 2, 3, 4))

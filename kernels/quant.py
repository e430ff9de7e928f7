"""Block-wise uniform quantisation (``"quant"``) and its Hadamard-rotated variant (``"hadamard-quant"``).

This module is the NumPy path, the payload and its wire form. It never
imports torch, so a NumPy-engine CompNode can encode and decode; the torch
path (CPU and CUDA tensors) is :mod:`fusion.kernels.quant_torch`, which runs
the *same* algorithm (:func:`encode_core` / :func:`decode_core`, written once
against a tiny array-ops interface) and gives byte-identical payloads.

Algorithm (``bits`` in {2, 4, 8}, ``L = 2**bits - 1`` levels above zero)
---------------------------------------------------------------------------
1. Widen the flat tensor to float64 (exact for every input dtype). Refuse NaN
   and inf with :class:`FusionError`: a quantised block has no way to carry them.
2. ``hadamard-quant`` only: cut into blocks of ``block`` (a power of two), pad
   the last block with zeros and rotate every block by the orthonormal
   Walsh-Hadamard transform ``H / sqrt(block)`` (the random-rotation trick of
   QuIP#/TAH-Quant: a rotation spreads outliers over the block, so the block's
   range, hence its step, shrinks). The rotation runs in float64 in both
   paths with the same butterfly order, so the rotated values are
   bit-identical (every butterfly is one IEEE add or subtract).
3. A per-payload power-of-two exponent ``scale_exp`` is chosen from the largest
   magnitude ``m`` so that ``m * 2**-scale_exp < 2**14``: scales and offsets are
   stored as float16 in units of ``2**scale_exp``, which keeps them finite for
   any float32/float64 magnitude (float16 overflows at 65504) and uses float16's
   full precision for small tensors. Scaling by a power of two is exact (but
   for results in float64's subnormal range). ``hadamard-quant`` scales once
   before the rotation (so the butterflies cannot overflow float64) and once
   after it; ``scale_exp`` is the sum.
4. Per block (the last block of ``quant`` may be short): ``offset`` is the
   block minimum rounded *down* to float16, ``scale`` is ``(max - offset) / L``
   rounded *up* to float16. So ``offset <= min`` and ``offset + L*scale >= max``
   hold for the stored float16 values, and the codes are computed from those
   stored values: the error bound below is about what the decoder really does.
5. ``t = (x - offset) / scale`` (0 where ``scale == 0``, a constant block);
   ``nearest``: ``code = floor(t + 0.5)``; ``stochastic``: ``code = floor(t + u)``
   with ``u`` in [0, 1) from :func:`hash_uniform` of (seed, element index), a
   counter-based integer hash computed identically in NumPy and torch (int64
   arithmetic, no overflow); codes are clipped to [0, L].
6. Decode: ``y = (offset + code * scale) * 2**scale_exp`` in float64, clipped to
   the output dtype's finite range, cast to float32 and then (float16/bfloat16,
   round to nearest even) to the output dtype; ``hadamard-quant`` applies the
   inverse rotation (the same transform) before the clip and drops the padding.

Error bounds (``step`` = the block's decoded scale ``scale * 2**scale_exp``)
--------------------------------------------------------------------------
* ``quant``, nearest: ``|y64 - x| <= step / 2`` per element; stochastic:
  ``|y64 - x| < step``. ``y64`` is the float64 value before the cast to the
  output dtype; the bound holds up to float64 rounding of ``x - offset`` and of
  the decode sum (relative 2**-52, the tests allow 1e-12 of a step). The
  returned value adds the cast's rounding: at most one ulp of the output
  dtype at ``y`` (double rounding through float32 included), and clipping to
  the finite range only moves ``y`` towards ``x``.
* ``step`` itself is at least ``(max - min) / L`` and exceeds it only by the
  float16 rounding of scale (relative 2**-10) and of offset (``|min| * 2**-10``
  divided by ``L``); blocks whose scale falls below float16's normal range
  (range under ``2**-14`` of ``2**scale_exp``, i.e. about ``2**-28`` of the
  tensor's largest magnitude) get a subnormal scale: the bound still holds,
  with a coarser step.
* ``hadamard-quant``: the bounds hold per *rotated coefficient*; the rotation
  is orthonormal, so per block ``||y - x||_2 <= sqrt(block) * step / 2``
  (nearest; ``< sqrt(block) * step`` stochastic), padding included, plus the
  output cast. Per element that is at most ``sqrt(block) * step / 2``.

Wire layout (payload type ``"quant"``)
--------------------------------------
Header map: ``shape`` (list of ints), ``dtype`` (original dtype name),
``bits``, ``block``, ``rounding``, ``hadamard`` (bool), ``scale_exp`` (int).
Frames: ``[scales, offsets, codes]``: ``nblocks = ceil(numel / block)``
float16 scales, as many float16 offsets, and the packed codes as uint8.
``quant`` packs ``numel`` codes, ``hadamard-quant`` ``nblocks * block`` (the
padding's coefficients are real data after rotation). Codes are packed
little-endian within a byte: element ``j`` sits in byte ``j // (8 // bits)`` at
bit offset ``(j % (8 // bits)) * bits`` (2 bits: 4 codes a byte, element 0 in
bits 0-1; 4 bits: 2 a byte, element 0 in the low nibble; 8 bits: one a byte).
Unused high bits of the last byte are zero (checked on receipt).
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from fusion.ir.errors import FusionError, WireError
from fusion.ir.wire import PayloadCodec, register_payload_codec

from fusion.kernels.dtypes import VALUE_DTYPES

#: Allowed bit widths.
BITS = (2, 4, 8)
#: Allowed rounding modes.
ROUNDINGS = ("nearest", "stochastic")
#: Default elements per block (one float16 scale and offset each: 0.5 bit per element at 64).
DEFAULT_BLOCK = 64
#: Largest block (hadamard-quant rotates a whole block at once).
MAX_BLOCK = 1 << 20
#: Estimate of the wire-header bytes of one payload, for the cost model: its msgpack meta map
#: (~90 bytes measured for a 2-D tensor) plus the descriptors of its three frames (~52).
HEADER_NBYTES = 160
#: Scaled magnitudes stay below 2**SCALED_LOG2 (float16 holds up to 65504, codes add up to one L*scale).
SCALED_LOG2 = 14
#: Range of ``scale_exp``: wide enough for every float64 (subnormals included) after a rotation.
SCALE_EXP_MIN, SCALE_EXP_MAX = -1200, 1100
#: Largest finite value of each output dtype.
MAX_FINITE = {
    "float64": sys.float_info.max,
    "float32": float(np.finfo(np.float32).max),
    "float16": 65504.0,
    "bfloat16": float(np.array([0x7F7F0000], dtype=np.uint32).view(np.float32)[0]),
}
#: Multiplier of the integer hash (< 2**27, so 32-bit x multiplier fits int64 without overflow).
HASH_MUL = 0x45D9F3B
M32 = 0xFFFFFFFF

_CFG_KEYS = {"algo", "bits", "block", "rounding", "seed"}


# ---------------------------------------------------------------------------- config

@dataclass(frozen=True)
class QuantConfig:
    """A validated ``compress_cfg`` of ``quant`` / ``hadamard-quant``.

    bits:     code width, 2, 4 or 8 (cfg key ``bits``, default 8).
    block:    elements per block, each with its own float16 scale and offset
              (``block``, default 64); a power of two for ``hadamard-quant``.
    rounding: ``"nearest"`` (default) or ``"stochastic"`` (unbiased; ``rounding``).
    seed:     non-negative int < 2**64 seeding the stochastic rounding's hash
              (``seed``, default 0). Give each message its own seed (e.g. from
              step and micro-batch): the noise is a pure function of (seed, index).
    hadamard: rotate blocks first (set by the algo name, not a cfg key).
    """

    bits: int = 8
    block: int = DEFAULT_BLOCK
    rounding: str = "nearest"
    seed: int = 0
    hadamard: bool = False

    @property
    def algo(self) -> str:
        return "hadamard-quant" if self.hadamard else "quant"

    @property
    def levels(self) -> int:
        """Largest code, ``2**bits - 1``."""
        return (1 << self.bits) - 1

    @classmethod
    def from_cfg(cls, cfg: Mapping[str, Any], hadamard: bool = False) -> "QuantConfig":
        """Validate a cfg dict; FusionError naming the bad key and value (``algo`` is ignored)."""
        algo = "hadamard-quant" if hadamard else "quant"
        if not isinstance(cfg, Mapping):
            raise FusionError(f"{algo} cfg must be a map, got {type(cfg).__name__}")
        unknown = sorted(set(cfg) - _CFG_KEYS)
        if unknown:
            raise FusionError(f"{algo} cfg: unknown key(s) {unknown}; known: {sorted(_CFG_KEYS)}")
        bits = cfg.get("bits", 8)
        if isinstance(bits, bool) or bits not in BITS:
            raise FusionError(f"{algo} cfg: bits must be one of 2, 4, 8, got {bits!r}")
        block = cfg.get("block", DEFAULT_BLOCK)
        if not _is_int(block) or not 0 < block <= MAX_BLOCK:
            raise FusionError(f"{algo} cfg: block must be an int in [1, {MAX_BLOCK}], got {block!r}")
        if hadamard and block & (block - 1):
            raise FusionError(f"{algo} cfg: block must be a power of two, got {block!r}")
        rounding = cfg.get("rounding", "nearest")
        if rounding not in ROUNDINGS:
            raise FusionError(f"{algo} cfg: rounding must be 'nearest' or 'stochastic', got {rounding!r}")
        seed = cfg.get("seed", 0)
        if not _is_int(seed) or not 0 <= seed < 1 << 64:
            raise FusionError(f"{algo} cfg: seed must be an int in [0, 2**64), got {seed!r}")
        return cls(int(bits), int(block), rounding, int(seed), hadamard)

    def with_seed(self, seed: int) -> "QuantConfig":
        """The same config with another seed (per-message stochastic rounding)."""
        return QuantConfig.from_cfg({"bits": self.bits, "block": self.block,
                                     "rounding": self.rounding, "seed": seed}, self.hadamard)


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def nblocks(numel: int, block: int) -> int:
    """Blocks of a ``numel``-element tensor: ``ceil(numel / block)``."""
    return -(-numel // block)


def ncodes(numel: int, block: int, hadamard: bool) -> int:
    """Codes a payload packs: ``numel``, or whole (padded) blocks for hadamard-quant."""
    return nblocks(numel, block) * block if hadamard else numel


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes of ``n`` packed ``bits``-bit codes."""
    return -(-n * bits // 8)


def quant_nbytes(numel: int, cfg: QuantConfig) -> int:
    """Exact bytes of a payload's three frames (header excluded)."""
    nb = nblocks(numel, cfg.block)
    return 4 * nb + packed_nbytes(ncodes(numel, cfg.block, cfg.hadamard), cfg.bits)


def scale_exp_for(maxabs: float) -> int:
    """``scale_exp`` for a largest magnitude: ``maxabs * 2**-scale_exp < 2**14`` (0 for an all-zero tensor)."""
    if maxabs == 0.0:
        return 0
    e = math.frexp(maxabs)[1]  # maxabs < 2**e; e in [-1073, 1024] for a finite float64
    return e - SCALED_LOG2


def mul_pow2(x, e: int):
    """``x * 2**e`` as one or two multiplies by finite powers of two (exact unless the result is subnormal)."""
    if -1000 <= e <= 1000:
        return x * math.ldexp(1.0, e)
    return x * math.ldexp(1.0, e // 2) * math.ldexp(1.0, e - e // 2)


def hadamard_norm(block: int) -> float:
    """The orthonormal Walsh-Hadamard factor ``1 / sqrt(block)`` (one Python float, used by both paths)."""
    return 1.0 / math.sqrt(block)


def _mix_int(h: int) -> int:
    h = (((h >> 16) ^ h) * HASH_MUL) & M32
    h = (((h >> 16) ^ h) * HASH_MUL) & M32
    return (h >> 16) ^ h


def seed_keys(seed: int) -> tuple[int, int]:
    """Two 32-bit keys derived from a 64-bit seed (Python ints, shared by both paths)."""
    return _mix_int((seed & M32) ^ 0x9E3779B9), _mix_int(((seed >> 32) & M32) ^ 0x85EBCA6B)


# ---------------------------------------------------------------------------- the shared algorithm

class NumpyOps:
    """The array operations :func:`encode_core` / :func:`decode_core` need, on NumPy arrays.

    ``fusion.kernels.quant_torch.TorchOps`` is the torch twin; every method
    does the same IEEE operations in the same order, so both paths agree bit
    for bit. Arithmetic operators (+ - * / >> ^ & |) are used directly.
    """

    @staticmethod
    def isfinite_all(x) -> bool:
        return bool(np.isfinite(x).all())

    @staticmethod
    def maxabs(x) -> float:
        return float(np.abs(x).max()) if x.size else 0.0

    @staticmethod
    def pad_edge(x, total: int):
        return np.concatenate([x, np.full(total - x.size, x[-1])]) if total > x.size else x

    @staticmethod
    def pad_zero(x, total: int):
        return np.concatenate([x, np.zeros(total - x.size, dtype=x.dtype)]) if total > x.size else x

    @staticmethod
    def stack2(a, b):
        return np.stack((a, b), axis=2)

    @staticmethod
    def stack_cols(cols):
        return np.stack(cols, axis=1)

    @staticmethod
    def row_min(x2):
        return x2.min(axis=1)

    @staticmethod
    def row_max(x2):
        return x2.max(axis=1)

    @staticmethod
    def floor(x):
        return np.floor(x)

    @staticmethod
    def clip(x, lo: float, hi: float):
        return np.clip(x, lo, hi)

    @staticmethod
    def where(c, a, b):
        return np.where(c, a, b)

    @staticmethod
    def f64_to_f16(x):
        return x.astype(np.float32).astype(np.float16)

    @staticmethod
    def f16_to_f64(h):
        return h.astype(np.float64)

    @staticmethod
    def f16_bits(h):
        return h.view(np.uint16).astype(np.int32)

    @staticmethod
    def f16_from_bits(u):
        return u.astype(np.uint16).view(np.float16)

    @staticmethod
    def arange_i64(start: int, n: int):
        return np.arange(start, start + n, dtype=np.int64)

    @staticmethod
    def i64_to_f64(x):
        return x.astype(np.float64)

    @staticmethod
    def f64_to_u8(x):
        return x.astype(np.uint8)

    @staticmethod
    def u8_to_f64(x):
        return x.astype(np.float64)

    @staticmethod
    def zeros_u8(n: int):
        return np.zeros(n, dtype=np.uint8)

    @staticmethod
    def cat(xs):
        return np.concatenate(xs)

    @staticmethod
    def to_host(x) -> np.ndarray:
        return np.ascontiguousarray(x)

    @staticmethod
    def from_host(a: np.ndarray, like=None):
        return a

    @staticmethod
    def widen(x, dtype: str):
        """Flat float64 copy of a host array (bfloat16 given as uint16 bits)."""
        flat = np.ascontiguousarray(x).reshape(-1)
        if dtype == "bfloat16":
            return (flat.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        return flat.astype(np.float64)

    @staticmethod
    def narrow(y, dtype: str):
        """float64 -> ``dtype`` (already clipped to its finite range); via float32, RNE; bfloat16 as uint16 bits."""
        if dtype == "float64":
            return y
        f = y.astype(np.float32)
        if dtype == "float32":
            return f
        if dtype == "float16":
            return f.astype(np.float16)
        b = f.view(np.uint32)
        return ((b + (((b >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)


def f16_round(ops, v, up: bool):
    """float64 ``v`` (|v| < 65504) rounded to float16 towards +inf (``up``) or -inf; exact when representable."""
    h = ops.f64_to_f16(v)
    back = ops.f16_to_f64(h)
    need = back < v if up else back > v
    u = ops.f16_bits(h)
    neg = u >= 0x8000
    mag_zero = (u & 0x7FFF) == 0
    if up:  # towards +inf: positive grows, negative shrinks in magnitude, -0 -> +min subnormal
        nxt = ops.where(neg, ops.where(mag_zero, u * 0 + 1, u - 1), u + 1)
    else:  # towards -inf: negative grows in magnitude, positive shrinks, +0 -> -min subnormal
        nxt = ops.where(neg, u + 1, ops.where(mag_zero, u * 0 + 0x8001, u - 1))
    return ops.f16_from_bits(ops.where(need, nxt, u))


def _mix(h):
    h = ((h >> 16) ^ h) * HASH_MUL & M32
    h = ((h >> 16) ^ h) * HASH_MUL & M32
    return (h >> 16) ^ h


def hash_uniform(ops, seed: int, n: int, start: int = 0):
    """``n`` floats in [0, 1) for element indices ``start .. start+n-1``: a pure function of (seed, index).

    ``h = mix(mix((i mod 2**32) ^ k1) ^ (i >> 32) ^ k2)``, ``u = h / 2**32``, where
    ``mix`` is the two-round xorshift-multiply integer hash (multiplier
    ``0x45d9f3b``) and ``k1, k2`` come from the seed (:func:`seed_keys`). All in
    int64 with values below 2**32, so products stay below 2**59: identical in
    NumPy and torch on any device.
    """
    k1, k2 = seed_keys(seed)
    i = ops.arange_i64(start, n)
    h = _mix((i & M32) ^ k1)
    h = _mix(h ^ (i >> 32) ^ k2)
    return ops.i64_to_f64(h) * (1.0 / 4294967296.0)


def fwht(ops, x2, block: int):
    """Orthonormal Walsh-Hadamard transform of each row of a float64 ``(nblocks, block)`` array.

    Butterflies ``(a + b, a - b)`` for h = 1, 2, 4, ..., then one multiply by
    :func:`hadamard_norm`. The transform is its own inverse (up to rounding).
    """
    nb = x2.shape[0]
    h = 1
    while h < block:
        y = x2.reshape(nb, block // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        x2 = ops.stack2(a + b, a - b).reshape(nb, block)
        h *= 2
    return x2 * hadamard_norm(block) if block > 1 else x2


def pack(ops, codes, bits: int):
    """Pack uint8 codes (< 2**bits), little-endian within each byte (see module docstring)."""
    per = 8 // bits
    if per == 1:
        return codes
    n = codes.shape[0]
    pad = (-n) % per
    if pad:
        codes = ops.cat([codes, ops.zeros_u8(pad)])
    c2 = codes.reshape(-1, per)
    out = c2[:, 0]
    for j in range(1, per):
        out = out | (c2[:, j] << (j * bits))
    return out


def unpack(ops, packed, bits: int, n: int):
    """The first ``n`` codes of a packed uint8 array, as uint8."""
    per = 8 // bits
    if per == 1:
        return packed[:n]
    mask = (1 << bits) - 1
    return ops.stack_cols([(packed >> (j * bits)) & mask for j in range(per)]).reshape(-1)[:n]


def encode_core(ops, flat64, numel: int, cfg: QuantConfig):
    """Quantise a flat float64 array (``ops``'s kind) -> (scale_exp, scales f16, offsets f16, packed codes u8).

    Results stay on the array's device; only the caller moves them to the host.
    """
    if not ops.isfinite_all(flat64):
        raise FusionError(f"{cfg.algo}: the tensor holds NaN or inf, which cannot be quantised")
    block, L = cfg.block, cfg.levels
    nb = nblocks(numel, block)
    total = nb * block
    if cfg.hadamard:  # scale first (exactly, by a power of two) so the butterflies cannot overflow
        e_in = scale_exp_for(ops.maxabs(flat64))
        v2 = fwht(ops, mul_pow2(ops.pad_zero(flat64, total).reshape(nb, block), -e_in), block)
        extra = scale_exp_for(ops.maxabs(v2))
        v2, exp = mul_pow2(v2, -extra), e_in + extra
    else:  # repeating the last element leaves the short block's min and max unchanged
        v2 = ops.pad_edge(flat64, total).reshape(nb, block)
        exp = scale_exp_for(ops.maxabs(v2))
        v2 = mul_pow2(v2, -exp)
    # + 0.0 turns -0.0 into +0.0: NumPy and torch may pick either zero as the min/max of {0.0, -0.0}
    off16 = f16_round(ops, ops.row_min(v2) + 0.0, up=False)
    off = ops.f16_to_f64(off16)
    scale16 = f16_round(ops, (ops.row_max(v2) + 0.0 - off) / float(L) + 0.0, up=True)
    scale = ops.f16_to_f64(scale16)
    safe = ops.where(scale > 0, scale, scale * 0 + 1.0)
    t = (v2 - off[:, None]) / safe[:, None]
    if cfg.rounding == "nearest":
        t = t + 0.5
    else:
        t = t + hash_uniform(ops, cfg.seed, total).reshape(nb, block)
    codes = ops.f64_to_u8(ops.clip(ops.floor(t), 0.0, float(L))).reshape(-1)
    if not cfg.hadamard:
        codes = codes[:numel]
    return exp, scale16, off16, pack(ops, codes, cfg.bits)


def _scaled_limit(dtype: str, exp: int) -> float:
    """``MAX_FINITE[dtype] * 2**-exp``, or inf when that overflows float64 (no clipping needed then)."""
    try:
        return math.ldexp(MAX_FINITE[dtype], -exp)
    except OverflowError:
        return math.inf


def decode_core(ops, scales16, offsets16, packed, p: "QuantPayload"):
    """Flat float64 reconstruction of a validated payload, clipped to ``p.dtype``'s finite range.

    Works in units of ``2**scale_exp`` (rotation and clip included) and scales
    last, so nothing overflows to inf on the way.
    """
    block, numel = p.block, p.numel
    nb = nblocks(numel, block)
    total = nb * block
    n = ncodes(numel, block, p.hadamard)
    codes = ops.u8_to_f64(unpack(ops, packed, p.bits, n))
    if not p.hadamard:
        codes = ops.pad_zero(codes, total)
    y = ops.f16_to_f64(offsets16)[:, None] + codes.reshape(nb, block) * ops.f16_to_f64(scales16)[:, None]
    if p.hadamard:
        y = fwht(ops, y, block)
    lim = _scaled_limit(p.dtype, p.scale_exp)
    if lim != math.inf:
        y = ops.clip(y, -lim, lim)
    return mul_pow2(y, p.scale_exp).reshape(-1)[:numel]


def finish(ops, y64, dtype: str):
    """Cast a (clipped) float64 reconstruction to ``dtype`` (see :meth:`NumpyOps.narrow`)."""
    return ops.narrow(y64, dtype)


def clip_cast(ops, y64, dtype: str):
    """Clip float64 values to ``dtype``'s finite range, then cast as :func:`finish` does."""
    lim = MAX_FINITE[dtype]
    return ops.narrow(ops.clip(y64, -lim, lim), dtype)


# ---------------------------------------------------------------------------- payload

@dataclass(frozen=True)
class QuantPayload:
    """A block-quantised tensor (``quant``, or ``hadamard-quant`` when ``hadamard``).

    shape:     shape of the dense tensor.
    dtype:     dtype name of the dense tensor, restored by decode.
    bits:      code width (2, 4 or 8).
    block:     elements per block (rotation size too when ``hadamard``).
    rounding:  ``"nearest"`` or ``"stochastic"`` (informational: decode is the same).
    hadamard:  blocks were rotated by the orthonormal Walsh-Hadamard transform.
    scale_exp: scales and offsets are in units of ``2**scale_exp``.
    scales:    float16, one per block (``ceil(numel / block)``), finite, >= 0.
    offsets:   float16, one per block, finite (the block minimum rounded down).
    codes:     uint8, the packed codes (see the module docstring for the bit order).
    """

    shape: tuple[int, ...]
    dtype: str
    bits: int
    block: int
    rounding: str
    hadamard: bool
    scale_exp: int
    scales: np.ndarray
    offsets: np.ndarray
    codes: np.ndarray

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(self.shape))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nblocks(self) -> int:
        return nblocks(self.numel, self.block)

    @property
    def nbytes(self) -> int:
        """Bytes of the three frames (the payload's share of the wire)."""
        return int(self.scales.nbytes + self.offsets.nbytes + self.codes.nbytes)

    def validate(self) -> "QuantPayload":
        """Check the payload is well formed; return it, or raise :class:`WireError` naming the fault."""
        if self.dtype not in VALUE_DTYPES:
            raise WireError(f"quant payload: unknown dtype {self.dtype!r}; known: {sorted(VALUE_DTYPES)}")
        if not all(_is_int(s) and s >= 0 for s in self.shape) or len(self.shape) > 32:
            raise WireError(f"quant payload: bad shape {self.shape!r} (need non-negative ints)")
        if not _is_int(self.bits) or self.bits not in BITS:
            raise WireError(f"quant payload: bits must be one of 2, 4, 8, got {self.bits!r}")
        if not _is_int(self.block) or not 0 < self.block <= MAX_BLOCK:
            raise WireError(f"quant payload: block must be an int in [1, {MAX_BLOCK}], got {self.block!r}")
        if not isinstance(self.hadamard, (bool, np.bool_)):
            raise WireError(f"quant payload: hadamard must be a bool, got {self.hadamard!r}")
        if self.hadamard and self.block & (self.block - 1):
            raise WireError(f"quant payload: hadamard block must be a power of two, got {self.block}")
        if self.rounding not in ROUNDINGS:
            raise WireError(f"quant payload: unknown rounding {self.rounding!r}")
        if not _is_int(self.scale_exp) or not SCALE_EXP_MIN <= self.scale_exp <= SCALE_EXP_MAX:
            raise WireError(f"quant payload: scale_exp must be an int in [{SCALE_EXP_MIN}, {SCALE_EXP_MAX}], "
                            f"got {self.scale_exp!r}")
        nb = self.nblocks
        for name, want in (("scales", np.float16), ("offsets", np.float16), ("codes", np.uint8)):
            arr = getattr(self, name)
            if not isinstance(arr, np.ndarray) or arr.ndim != 1 or arr.dtype != want:
                desc = f"{arr.dtype} {arr.shape}" if isinstance(arr, np.ndarray) else type(arr).__name__
                raise WireError(f"quant payload: {name} must be a 1-D {np.dtype(want)} array, got {desc}")
        for name in ("scales", "offsets"):
            if getattr(self, name).size != nb:
                raise WireError(f"quant payload: {getattr(self, name).size} {name} for "
                                f"ceil({self.numel} / {self.block}) = {nb} blocks")
        n = ncodes(self.numel, self.block, self.hadamard)
        want_bytes = packed_nbytes(n, self.bits)
        if self.codes.size != want_bytes:
            raise WireError(f"quant payload: codes frame has {self.codes.size} bytes, {n} codes of "
                            f"{self.bits} bits need {want_bytes}")
        if nb:
            if not bool(np.isfinite(self.scales).all()) or not bool(np.isfinite(self.offsets).all()):
                raise WireError("quant payload: non-finite scale or offset")
            if bool((self.scales < 0).any()):
                raise WireError("quant payload: negative scale")
        used = (n * self.bits) % 8
        if used and int(self.codes[-1]) >> used:
            raise WireError("quant payload: unused high bits of the last code byte are not zero")
        return self

    def header(self) -> dict[str, Any]:
        """The msgpack-able header map."""
        return {"shape": [int(s) for s in self.shape], "dtype": self.dtype, "bits": int(self.bits),
                "block": int(self.block), "rounding": self.rounding, "hadamard": bool(self.hadamard),
                "scale_exp": int(self.scale_exp)}

    def arrays(self) -> list[np.ndarray]:
        """The three frames as arrays ``[scales, offsets, codes]``."""
        return [np.ascontiguousarray(self.scales), np.ascontiguousarray(self.offsets),
                np.ascontiguousarray(self.codes)]

    def to_msg(self) -> tuple[dict[str, Any], list[bytes]]:
        """A msgpack-able header and the raw frames ``[scales, offsets, codes]``."""
        return self.header(), [a.tobytes() for a in self.arrays()]

    @classmethod
    def from_msg(cls, header: Mapping[str, Any], frames: list) -> "QuantPayload":
        """Rebuild from :meth:`to_msg` output (bytes-like frames); validates, raises :class:`WireError`."""
        try:
            if not isinstance(header, Mapping):
                raise TypeError(f"header is a {type(header).__name__}")
            shape = header["shape"]
            if not isinstance(shape, (list, tuple)):
                raise TypeError(f"shape is a {type(shape).__name__}")
            fields = dict(shape=tuple(shape), dtype=header["dtype"], bits=header["bits"],
                          block=header["block"], rounding=header["rounding"],
                          hadamard=header["hadamard"], scale_exp=header["scale_exp"])
            sbuf, obuf, cbuf = frames
        except (KeyError, TypeError, ValueError) as e:
            raise WireError(f"quant payload: malformed header or frames: {e!r}") from None
        bufs = [as_bytes(b) for b in (sbuf, obuf, cbuf)]
        for name, b in (("scales", bufs[0]), ("offsets", bufs[1])):
            if b.size % 2:
                raise WireError(f"quant payload: {name} frame of {b.size} bytes is not whole float16s")
        p = cls(**fields, scales=bufs[0].view("<f2").astype(np.float16, copy=False),
                offsets=bufs[1].view("<f2").astype(np.float16, copy=False), codes=bufs[2])
        return p.validate()


def as_bytes(buf) -> np.ndarray:
    """A flat uint8 view of a frame (bytes, memoryview, zmq buffer or array of any shape, empty included)."""
    if isinstance(buf, np.ndarray):
        return np.ascontiguousarray(buf).reshape(-1).view(np.uint8)
    try:
        return np.frombuffer(buf, dtype=np.uint8)
    except (TypeError, ValueError) as e:
        raise WireError(f"frame is not a byte buffer: {e}") from None


# ---------------------------------------------------------------------------- NumPy API

def quantize(arr: np.ndarray, cfg: QuantConfig | Mapping[str, Any], dtype: str | None = None,
             hadamard: bool | None = None) -> QuantPayload:
    """Quantise a float NumPy array (torch-free). ``dtype="bfloat16"``: ``arr`` holds bfloat16 bits (uint16).

    ``cfg``: a :class:`QuantConfig` or a cfg dict (then ``hadamard`` picks the
    variant, default False). Raises FusionError on NaN/inf or a bad dtype.
    """
    if not isinstance(cfg, QuantConfig):
        cfg = QuantConfig.from_cfg(cfg, bool(hadamard))
    a = np.asarray(arr)
    name = dtype or a.dtype.name
    if name not in VALUE_DTYPES or (name == "bfloat16") != (a.dtype == np.uint16):
        raise FusionError(f"{cfg.algo}: cannot quantise a {a.dtype} array as {name!r}; "
                          f"floating dtypes only: {sorted(VALUE_DTYPES)} (bfloat16 as uint16 bits)")
    flat = NumpyOps.widen(a, name)
    exp, s16, o16, packed = encode_core(NumpyOps, flat, flat.size, cfg)
    return QuantPayload(tuple(a.shape), name, cfg.bits, cfg.block, cfg.rounding, cfg.hadamard, exp,
                        s16, o16, packed)


def dequantize_f64(p: QuantPayload) -> np.ndarray:
    """The flat float64 reconstruction (before the cast to ``p.dtype``); validates first."""
    p.validate()
    return decode_core(NumpyOps, p.scales, p.offsets, p.codes, p)


def dequantize(p: QuantPayload) -> np.ndarray:
    """The dense NumPy array of a payload in ``p.dtype`` (bfloat16 as uint16 bits); validates first."""
    return finish(NumpyOps, dequantize_f64(p), p.dtype).reshape(p.shape)


def step_sizes(p: QuantPayload) -> np.ndarray:
    """Each element's quantisation step ``scale * 2**scale_exp`` (float64, flat; per coefficient for hadamard)."""
    s = mul_pow2(p.scales.astype(np.float64), p.scale_exp)
    return np.repeat(s, p.block)[:ncodes(p.numel, p.block, p.hadamard)]


# ---------------------------------------------------------------------------- wire

def _wire_encode(p: QuantPayload) -> tuple[dict, list[np.ndarray]]:
    return p.header(), p.arrays()


def _wire_decode(meta: dict, arrays: list[np.ndarray]) -> QuantPayload:
    if len(arrays) != 3:
        raise WireError(f"quant payload needs 3 tensor frames (scales, offsets, codes), got {len(arrays)}")
    if any(a.ndim != 1 for a in arrays):
        raise WireError(f"quant payload frames must be 1-D, got shapes {[list(a.shape) for a in arrays]}")
    return QuantPayload.from_msg(meta, [as_bytes(a) for a in arrays])


#: Registered with the wire at import, as ``"sparse"`` is (header + [scales, offsets, codes]).
WIRE_CODEC = register_payload_codec(
    PayloadCodec("quant", lambda p: isinstance(p, QuantPayload), _wire_encode, _wire_decode))

__all__ = ["BITS", "ROUNDINGS", "DEFAULT_BLOCK", "HEADER_NBYTES", "QuantConfig", "QuantPayload",
           "quantize", "dequantize", "dequantize_f64", "step_sizes", "quant_nbytes", "nblocks",
           "hash_uniform", "fwht", "pack", "unpack", "NumpyOps"]

"""The fast NumPy host path of ``quant`` / ``hadamard-quant``: the same IEEE operations as
:func:`fusion.kernels.quant.encode_core` / ``decode_core``, in place, on reused buffers.

Why it exists: on a CPU part the host path encodes every activation and gradient that crosses a compressed
edge, and the shared algorithm (written once against an array-ops interface so NumPy and torch give the same
bytes) builds a fresh float64 temporary for almost every operation: at 1M elements the temporaries, their page
faults and ``min``/``max`` over 64-element rows cost more than the arithmetic (``docs/kernels.md``, "Codec CPU
cost"). This module computes the *same values in the same order*:

* the tensor is widened once into a float64 work buffer, and every later step (the power-of-two scaling, the
  Walsh-Hadamard butterflies, ``x - offset``, ``/ scale``, ``+ 0.5`` or ``+ u``, ``clip``; a truncating
  cast stands for ``floor``) writes
  back into it (``out=``);
* block minima and maxima come from ``np.minimum.reduceat`` over the flat buffer (the same values as
  ``min(axis=1)``: ``min`` is exact), and the tensor's largest magnitude from them (``max(|x|) =
  max(max x, -min x)``); the per-block minimum of the *scaled* values is the scaled minimum (scaling by a power
  of two is monotone), so the scaled block is never reduced again;
* the stochastic-rounding hash runs in place on uint32 buffers;
* buffers live in a :class:`QuantScratch` that only grows; each thread has its own (:func:`scratch`), so a
  sender's encode and a receiver's decode never share one. What a payload or a decoded tensor holds is always
  freshly allocated: scratch never escapes.

:func:`quantize` / :func:`dequantize` are the host path's entry points (the codecs' ``encode_host`` /
``decode_host``, ``delta``'s NumPy buffers); anything off the fast path (an empty tensor, more than 2**32
elements, bfloat16 input) runs :func:`quant.quantize` / :func:`quant.dequantize`, the shared algorithm. ``tests/kernels/test_quant_host.py`` checks both give the same bytes; the golden test pins them.
"""
from __future__ import annotations

import math
import sys
import threading
from dataclasses import dataclass, field

import numpy as np

from fusion.ir.errors import FusionError
from fusion.kernels import quant as Q

#: Elements of a tensor the in-place hash handles (indices below 2**32: ``i >> 32`` is 0).
HASH_LIMIT = 1 << 32
#: Largest buffer a thread's scratch keeps between messages (a message of up to 4M elements reuses its float64
#: buffers; a larger one allocates them for itself, as the shared algorithm does, so a thread that once encoded a
#: huge tensor does not hold ~50 bytes per element of it for good).
KEEP_MAX_BYTES = 32 << 20


@dataclass
class QuantScratch:
    """Work buffers reused across messages (one per thread: :func:`scratch`); they only grow, by half again.

    ``grown`` counts (re)allocations, so a test can see that steady-state messages allocate none here.
    """

    buffers: dict = field(default_factory=dict)
    grown: int = 0

    def take(self, name: str, n: int, dtype) -> np.ndarray:
        """A 1-D view of ``n`` elements of buffer ``name`` (its contents are whatever the last user left); a
        buffer over :data:`KEEP_MAX_BYTES` is allocated for this message only, never kept."""
        if n * np.dtype(dtype).itemsize > KEEP_MAX_BYTES:
            return np.empty(n, dtype=dtype)
        buf = self.buffers.get(name)
        if buf is None or buf.size < n or buf.dtype != dtype:
            size = max(n, int(1.5 * buf.size) if buf is not None and buf.dtype == dtype else n)
            buf = self.buffers[name] = np.empty(size, dtype=dtype)
            self.grown += 1
        return buf[:n]

    def starts(self, total: int, block: int) -> np.ndarray:
        """Block start offsets ``0, block, 2*block, ... < total`` (for ``reduceat``)."""
        key = ("starts", block)
        s = self.buffers.get(key)
        if s is None or s.size * block < total:
            s = self.buffers[key] = np.arange(0, max(total, 2 * (s.size * block if s is not None else 0)), block,
                                              dtype=np.intp)
            self.grown += 1
        return s[:-(-total // block)]

    def arange(self, n: int) -> np.ndarray:
        """``0 .. n-1`` as uint32 (the element indices the hash mixes; fewer than 2**32)."""
        if 4 * n > KEEP_MAX_BYTES:
            return np.arange(n, dtype=np.uint32)
        a = self.buffers.get("arange")
        if a is None or a.size < n:
            a = self.buffers["arange"] = np.arange(max(n, int(1.5 * (a.size if a is not None else 0))),
                                                   dtype=np.uint32)
            self.grown += 1
        return a[:n]


_LOCAL = threading.local()


def scratch() -> QuantScratch:
    """This thread's scratch buffers."""
    s = getattr(_LOCAL, "scratch", None)
    if s is None:
        s = _LOCAL.scratch = QuantScratch()
    return s


# ---------------------------------------------------------------------------- pieces

def _mul_pow2_inplace(x: np.ndarray, e: int) -> None:
    """``x *= 2**e`` exactly as :func:`quant.mul_pow2` computes it (one or two multiplies)."""
    if -1000 <= e <= 1000:
        np.multiply(x, math.ldexp(1.0, e), out=x)
    else:
        np.multiply(x, math.ldexp(1.0, e // 2), out=x)
        np.multiply(x, math.ldexp(1.0, e - e // 2), out=x)


def _block_min_max(flat: np.ndarray, block: int, ws: QuantScratch) -> tuple[np.ndarray, np.ndarray]:
    starts = ws.starts(flat.size, block)
    return np.minimum.reduceat(flat, starts), np.maximum.reduceat(flat, starts)


def _largest(lo: np.ndarray, hi: np.ndarray) -> float:
    """``max(|x|)`` from block minima and maxima; NaN when any is NaN."""
    return max(float(hi.max()), -float(lo.min())) if lo.size else 0.0


def f16_round(v: np.ndarray, up: bool) -> np.ndarray:
    """:func:`quant.f16_round` (float64 ``v`` to float16 towards +inf or -inf) with ``np.nextafter`` for the step
    to the neighbouring float16: the same bits (every float16 checked in the tests), a third of the operations."""
    h = v.astype(np.float32).astype(np.float16)
    back = h.astype(np.float64)
    need = back < v if up else back > v
    with np.errstate(over="ignore"):  # 65504 rounded up is inf, as the bit arithmetic gives it
        return np.where(need, np.nextafter(h, np.float16(np.inf if up else -np.inf)), h)


def _finite_range(lo: float, hi: float, cfg: Q.QuantConfig) -> tuple[float, float]:
    """``(lo, hi)``, or FusionError when either is NaN or infinite (the tensor holds one)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise FusionError(f"{cfg.algo}: the tensor holds NaN or inf, which cannot be quantised")
    return lo, hi


def fwht_inplace(x2: np.ndarray, block: int, ws: QuantScratch) -> np.ndarray:
    """:func:`quant.fwht` of each row of ``x2``, written back into ``x2`` (returned): the same butterflies in the
    same order, on a transposed copy (``(block, nblocks)``), so every butterfly is one long contiguous run of
    ``h * nblocks`` elements instead of ``nblocks * block / h`` runs of ``h``."""
    nb = x2.shape[0]
    a = ws.take("fwht_a", x2.size, np.float64).reshape(block, nb)
    b = ws.take("fwht_b", x2.size, np.float64).reshape(block, nb)
    np.copyto(a, x2.T)
    h = 1
    while h < block:
        src = a.reshape(block // (2 * h), 2, h * nb)
        dst = b.reshape(block // (2 * h), 2, h * nb)
        np.add(src[:, 0], src[:, 1], out=dst[:, 0])
        np.subtract(src[:, 0], src[:, 1], out=dst[:, 1])
        a, b = b, a
        h *= 2
    if block > 1:
        np.multiply(a, Q.hadamard_norm(block), out=a)
    np.copyto(x2, a.T)
    return x2


def _mix_inplace(h: np.ndarray, t: np.ndarray) -> None:
    for _ in range(2):  # h = ((h >> 16) ^ h) * MUL & M32, twice
        np.right_shift(h, 16, out=t)
        np.bitwise_xor(h, t, out=h)
        np.multiply(h, Q.HASH_MUL, out=h)  # modulo 2**32: the & M32
    np.right_shift(h, 16, out=t)  # then (h >> 16) ^ h
    np.bitwise_xor(h, t, out=h)


def add_hash_uniform(t2: np.ndarray, seed: int, ws: QuantScratch) -> None:
    """``t2 += quant.hash_uniform(seed, t2.size)`` (flat element order), in place; ``t2.size < 2**32``.

    In uint32, not the shared algorithm's int64: every value is below 2**32, shifts and xors are the same, and
    ``(h * MUL) & M32`` is the product modulo 2**32, which uint32 multiplication gives by wrapping: the same
    numbers, half the bytes per pass."""
    n = t2.size
    k1, k2 = Q.seed_keys(seed)
    h, tmp = ws.take("hash", n, np.uint32), ws.take("hash_tmp", n, np.uint32)
    np.bitwise_xor(ws.arange(n), k1, out=h)  # (i & M32) ^ k1, i < 2**32
    _mix_inplace(h, tmp)
    np.bitwise_xor(h, k2, out=h)  # ^ (i >> 32) (zero here) ^ k2
    _mix_inplace(h, tmp)
    u = ws.take("hash_u", n, np.float64)
    np.multiply(h, 1.0 / 4294967296.0, out=u, dtype=np.float64)
    np.add(t2.reshape(-1), u, out=t2.reshape(-1))


#: unsigned integer holding one packed byte's ``8 // bits`` codes, one per byte (little-endian hosts)
_WORD = {4: np.uint16, 2: np.uint32}
_LITTLE = sys.byteorder == "little"


def pack_into(codes: np.ndarray, bits: int) -> np.ndarray:
    """:func:`quant.pack` into a fresh array (the payload's). On a little-endian host the ``8 // bits`` codes of
    an output byte are read as one integer (code ``j`` in its byte ``j``) and folded with shifts: code ``j`` moves
    from bit ``8 j`` to bit ``bits * j`` by ``>> j * (8 - bits)``, and what else the shifts bring lands above bit 7,
    which the cast to uint8 drops. Three contiguous passes instead of strided ones."""
    per = 8 // bits
    if per == 1:
        return codes.copy()
    n = codes.size
    nbytes = -(-n // per)
    out = np.empty(nbytes, dtype=np.uint8)
    whole = n // per
    if _LITTLE:
        w = codes[:whole * per].view(_WORD[bits])
        acc = w.copy()
        for j in range(1, per):
            np.bitwise_or(acc, w >> (j * (8 - bits)), out=acc)
        np.copyto(out[:whole], acc, casting="unsafe")
    else:
        c2 = codes[:whole * per].reshape(whole, per)
        np.copyto(out[:whole], c2[:, 0])
        for j in range(1, per):
            np.bitwise_or(out[:whole], np.left_shift(c2[:, j], j * bits), out=out[:whole])
    if whole < nbytes:  # the last, partly used byte
        tail = codes[whole * per:]
        out[-1] = sum(int(c) << (j * bits) for j, c in enumerate(tail))
    return out


def unpack_into(packed: np.ndarray, bits: int, dst: np.ndarray) -> None:
    """The first ``dst.size`` codes of ``packed`` into ``dst`` (uint8), as :func:`quant.unpack` gives them (on a
    little-endian host: each byte widened to one integer, code ``j`` shifted up to its byte ``j`` and masked)."""
    per = 8 // bits
    n = dst.size
    if per == 1:
        np.copyto(dst, packed[:n])
        return
    whole = n // per
    mask = (1 << bits) - 1
    src = packed[:whole]
    if _LITTLE:
        word = _WORD[bits]
        w = dst[:whole * per].view(word)
        np.copyto(w, src)
        for j in range(1, per):
            np.bitwise_or(w, src.astype(word) << (j * (8 - bits)), out=w)
        np.bitwise_and(w, word(int.from_bytes(bytes([mask] * per), "little")), out=w)
    else:
        c2 = dst[:whole * per].reshape(whole, per)
        for j in range(per):
            np.bitwise_and(np.right_shift(src, j * bits), mask, out=c2[:, j])
    if whole * per < n:
        last = int(packed[whole])
        for j in range(n - whole * per):
            dst[whole * per + j] = (last >> (j * bits)) & mask


# ---------------------------------------------------------------------------- encode / decode

def fast_path(numel: int, dtype: str) -> bool:
    """Whether :func:`encode` / :func:`decode` take the in-place path (else the shared algorithm runs)."""
    return 0 < numel < HASH_LIMIT and dtype in ("float32", "float64", "float16")


def encode(a: np.ndarray, cfg: Q.QuantConfig, ws: QuantScratch | None = None):
    """``(scale_exp, scales f16, offsets f16, packed codes u8)`` of a float32/float64/float16 array: the bytes of
    :func:`quant.encode_core` on its float64 widening."""
    ws = ws or scratch()
    flat = np.ascontiguousarray(a).reshape(-1)
    numel, block, L = flat.size, cfg.block, cfg.levels
    nb = Q.nblocks(numel, block)
    total = nb * block
    buf = ws.take("x", total, np.float64)
    np.copyto(buf[:numel], flat)  # exact widening
    if cfg.hadamard:
        lo_in, hi_in = _finite_range(float(flat.min()), float(flat.max()), cfg)
        buf[numel:] = 0.0
        e_in = Q.scale_exp_for(max(hi_in, -lo_in))
        _mul_pow2_inplace(buf, -e_in)
        v2 = fwht_inplace(buf.reshape(nb, block), block, ws)
        vflat = v2.reshape(-1)
        lo, hi = _block_min_max(vflat, block, ws)
        extra = Q.scale_exp_for(_largest(lo, hi))
        _mul_pow2_inplace(vflat, -extra)
        exp = e_in + extra
        lo, hi = Q.mul_pow2(lo, -extra), Q.mul_pow2(hi, -extra)
    else:
        buf[numel:] = buf[numel - 1]  # the short block repeats its last element: its min and max stay
        lo, hi = _block_min_max(buf, block, ws)  # NaN in a block makes its min and max NaN
        lo_in, hi_in = _finite_range(float(lo.min()), float(hi.max()), cfg)
        exp = Q.scale_exp_for(max(hi_in, -lo_in))
        _mul_pow2_inplace(buf, -exp)
        lo, hi = Q.mul_pow2(lo, -exp), Q.mul_pow2(hi, -exp)  # min/max of the scaled blocks: scaling is monotone
        v2 = buf.reshape(nb, block)
    off16 = f16_round(lo + 0.0, up=False)
    off = off16.astype(np.float64)
    scale16 = f16_round((hi + 0.0 - off) / float(L) + 0.0, up=True)
    scale = scale16.astype(np.float64)
    safe = np.where(scale > 0, scale, 1.0)
    np.subtract(v2, off[:, None], out=v2)
    np.divide(v2, safe[:, None], out=v2)
    if cfg.rounding == "nearest":
        np.add(v2, 0.5, out=v2)
    else:
        add_hash_uniform(v2, cfg.seed, ws)
    # clip(floor(t), 0, L) == trunc(clip(t, 0, L)): both are L above L, 0 below 0, floor = trunc in between;
    # the cast to uint8 truncates, so the floor pass goes
    np.clip(v2, 0.0, float(L), out=v2)
    codes = ws.take("codes", total, np.uint8)
    np.copyto(codes, v2.reshape(-1), casting="unsafe")
    if not cfg.hadamard:
        codes = codes[:numel]
    return exp, scale16, off16, pack_into(codes, cfg.bits)


def _largest_decoded(p: Q.QuantPayload) -> float:
    """An upper bound of ``|offset + code * scale|`` over a ``quant`` payload's blocks: ``|offset| + L * scale``
    (``code * scale`` is exact in float64; the sum's one rounding is covered by the relative 2**-40 added)."""
    if not p.scales.size:
        return 0.0
    L = (1 << p.bits) - 1
    b = np.abs(p.offsets.astype(np.float64)) + L * p.scales.astype(np.float64)
    return float(b.max()) * (1.0 + 2.0 ** -40)


def decode(p: Q.QuantPayload, ws: QuantScratch | None = None, f64: bool = False) -> np.ndarray:
    """The flat array of a validated payload in ``p.dtype``: the bytes of ``finish(decode_core(...))``;
    ``f64``: the float64 reconstruction before the cast (``decode_core``'s own values)."""
    ws = ws or scratch()
    block, numel = p.block, p.numel
    nb = Q.nblocks(numel, block)
    total = nb * block
    n = Q.ncodes(numel, block, p.hadamard)
    codes = ws.take("codes", total, np.uint8)
    unpack_into(p.codes, p.bits, codes[:n])
    codes[n:] = 0
    y = ws.take("y", total, np.float64).reshape(nb, block)
    np.multiply(codes.reshape(nb, block), p.scales.astype(np.float64)[:, None], out=y, dtype=np.float64)
    np.add(y, p.offsets.astype(np.float64)[:, None], out=y)  # offset + code * scale (addition commutes)
    if p.hadamard:
        y = fwht_inplace(y, block, ws)
    lim = Q._scaled_limit(p.dtype, p.scale_exp)
    if lim != math.inf and (p.hadamard or _largest_decoded(p) >= lim):
        np.clip(y, -lim, lim, out=y)  # else no element can reach lim: the clip would change nothing
    flat = y.reshape(-1)[:numel]
    e = p.scale_exp
    if p.dtype == "float32" and -1000 <= e <= 1000 and not f64:  # the last multiply and the cast in one pass
        out = np.empty(numel, dtype=np.float32)
        np.multiply(flat, math.ldexp(1.0, e), out=out, dtype=np.float64, casting="same_kind")
        return out
    _mul_pow2_inplace(flat, e)
    if f64 or p.dtype == "float64":
        return flat.copy()  # the scratch buffer never escapes
    return Q.NumpyOps.narrow(flat, p.dtype)


# ---------------------------------------------------------------------------- the host API

def quantize(arr: np.ndarray, cfg, dtype: str | None = None, hadamard: bool | None = None) -> Q.QuantPayload:
    """:func:`quant.quantize` (same arguments, same bytes), in place where :func:`fast_path` allows."""
    a = np.asarray(arr)
    name = dtype or a.dtype.name
    if not fast_path(a.size, name) or (name == "bfloat16") != (a.dtype == np.uint16):
        return Q.quantize(a, cfg, dtype=dtype, hadamard=hadamard)
    if not isinstance(cfg, Q.QuantConfig):
        cfg = Q.QuantConfig.from_cfg(cfg, bool(hadamard))
    exp, s16, o16, packed = encode(a, cfg)
    return Q.QuantPayload(tuple(a.shape), name, cfg.bits, cfg.block, cfg.rounding, cfg.hadamard, exp,
                          s16, o16, packed)


def dequantize(p: Q.QuantPayload) -> np.ndarray:
    """:func:`quant.dequantize` (same values), in place where :func:`fast_path` allows; validates first."""
    if not fast_path(p.numel, p.dtype):
        return Q.dequantize(p)
    p.validate()
    return decode(p).reshape(p.shape)


def dequantize_f64(p: Q.QuantPayload) -> np.ndarray:
    """:func:`quant.dequantize_f64` (same values), in place where :func:`fast_path` allows; validates first."""
    if not fast_path(p.numel, p.dtype):
        return Q.dequantize_f64(p)
    p.validate()
    return decode(p, f64=True)


__all__ = ["quantize", "dequantize", "dequantize_f64", "QuantScratch", "scratch", "fast_path", "encode", "decode", "fwht_inplace", "add_hash_uniform",
           "pack_into", "unpack_into"]

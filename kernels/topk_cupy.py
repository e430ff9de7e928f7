"""Top-K selection and the sparse codec on CUDA with CuPy kernels (radix select, no sort).

CuPy is optional (``pip install 'fusion[cuda]'``): this module imports without
it, :func:`available` says whether it can run, and every other entry point
raises :class:`fusion.ir.errors.FusionError` with the reason when it cannot.

Selection (same set as ``topk_torch``, same tie rule):

All device code is :data:`CUDA_SOURCE` (raw CUDA C, compiled by CuPy with
NVRTC at first use; the tests compile it for sm_80/sm_90 without a GPU).

1. one kernel maps each element to an unsigned magnitude key
   (``radix.float_keys_np`` is its NumPy twin): float16/bfloat16/float32 give
   32-bit keys, float64 64-bit keys;
2. :func:`fusion.kernels.radix.radix_select` finds the k-th largest key with
   one 256-bin shared-memory histogram kernel per 8-bit digit (4 passes for
   32-bit keys), copying 256 counts to the host after each;
3. if only some of the keys equal to the k-th are kept, the index of the last
   kept tie is the ``take_ties``-th entry of ``flatnonzero(key == kth)``;
4. a mask kernel keeps ``key > kth`` and the ties up to that index, and
   ``flatnonzero`` turns it into ascending indices.

Inputs are CUDA torch tensors (shared with CuPy through DLPack, on torch's
current stream) or CuPy arrays.
"""
from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from fusion.ir.errors import FusionError

from fusion.kernels.dtypes import (VALUE_DTYPES, dtype_name, index_dtype_for, torch_dtype, values_from_numpy,
                     values_to_numpy)
from fusion.kernels.radix import BINS, radix_select
from fusion.kernels.sparse import SparsePayload

log = logging.getLogger(__name__)

try:  # optional dependency: never fail at import time
    import cupy as _cp
    _IMPORT_ERROR: str | None = None
except Exception as e:  # ImportError, or a CuPy build that cannot load CUDA libraries
    _cp = None
    _IMPORT_ERROR = f"{type(e).__name__}: {e}"

#: Threads per block and the most blocks of a launch (every kernel is a grid-stride loop).
THREADS, MAX_BLOCKS = 256, 1024

_PRELUDE = r"""
#define FUSION_GRID_STRIDE(i, n) \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
         i += (long long)blockDim.x * gridDim.x)

extern "C" __global__ void fusion_topk_keys_f32(
        const float* __restrict__ x, unsigned int* __restrict__ keys, const long long n) {
    FUSION_GRID_STRIDE(i, n) {
        const unsigned int b = __float_as_uint(x[i]) & 0x7fffffffu;
        keys[i] = (b > 0x7f800000u) ? 0u : b + 1u;  /* NaN -> 0, else |x| bits + 1 */
    }
}

extern "C" __global__ void fusion_topk_keys_f64(
        const double* __restrict__ x, unsigned long long* __restrict__ keys, const long long n) {
    FUSION_GRID_STRIDE(i, n) {
        const unsigned long long b = ((unsigned long long)__double_as_longlong(x[i])) & 0x7fffffffffffffffULL;
        keys[i] = (b > 0x7ff0000000000000ULL) ? 0ULL : b + 1ULL;
    }
}
"""

_PER_KEY = r"""
extern "C" __global__ void fusion_radix_hist_SUFFIX(
        const KEY* __restrict__ keys, const long long n, const KEY prefix, const KEY mask,
        const int shift, unsigned long long* __restrict__ hist) {
    __shared__ unsigned int local[256];
    for (int b = threadIdx.x; b < 256; b += blockDim.x) local[b] = 0u;
    __syncthreads();
    FUSION_GRID_STRIDE(i, n) {
        const KEY key = keys[i];
        if ((key & mask) == prefix) {
            atomicAdd(&local[(unsigned int)(key >> shift) & 0xffu], 1u);
        }
    }
    __syncthreads();
    for (int b = threadIdx.x; b < 256; b += blockDim.x) {
        const unsigned int c = local[b];
        if (c) atomicAdd(&hist[b], (unsigned long long)c);
    }
}

extern "C" __global__ void fusion_topk_keep_SUFFIX(
        const KEY* __restrict__ keys, const long long n, const KEY kth, const long long last,
        bool* __restrict__ keep) {
    FUSION_GRID_STRIDE(i, n) {
        const KEY key = keys[i];
        keep[i] = (key > kth) || (key == kth && i <= last);  /* ties: the lowest indices */
    }
}
"""

_FUSED = r"""
/* ---- fused radix select (default path): every pass on the device, no host sync ----
 * Workspace ws (unsigned long long, zeroed before the first pass):
 *   ws[0] prefix of the k-th key found so far (the full k-th key after the last pass)
 *   ws[1] how many keys equal to that prefix are still to take
 *   ws[2] done: the k-th key's bucket is taken whole, select every key >= ws[0]
 *   ws[3] blocks finished in the current pass (the last one scans the histogram)
 *   ws[8 .. 8+2048) global histogram of the current digit (left zeroed by each pass)
 *   ws[2056 + b], ws[2056 + gridDim.x + b]: keys > k-th and == k-th in tile b */
#define FUSION_FULL_MASK 0xffffffffu
#define FUSION_NO_BIN 0xffffffffu
#define FUSION_RADIX_BITS 11
#define FUSION_RADIX_BINS 2048
#define FUSION_WS_PREFIX 0
#define FUSION_WS_REMAIN 1
#define FUSION_WS_DONE 2
#define FUSION_WS_COUNTER 3
#define FUSION_WS_HIST 8
#define FUSION_WS_TILES 2056

/* Raw bits of one element -> order-preserving magnitude key: |x| bits + 1, NaN -> 0.
 * float16/bfloat16 keep 16-bit keys (same order as their exact float32 widening). */
struct FusionF32 { typedef unsigned int In; typedef unsigned int Key; enum { BITS = 32 };
    static __device__ __forceinline__ Key key(In b) { b &= 0x7fffffffu; return b > 0x7f800000u ? 0u : b + 1u; } };
struct FusionF64 { typedef unsigned long long In; typedef unsigned long long Key; enum { BITS = 64 };
    static __device__ __forceinline__ Key key(In b) {
        b &= 0x7fffffffffffffffULL; return b > 0x7ff0000000000000ULL ? 0ULL : b + 1ULL; } };
struct FusionF16 { typedef unsigned short In; typedef unsigned int Key; enum { BITS = 16 };
    static __device__ __forceinline__ Key key(In b) { const Key m = b & 0x7fffu; return m > 0x7c00u ? 0u : m + 1u; } };
struct FusionBF16 { typedef unsigned short In; typedef unsigned int Key; enum { BITS = 16 };
    static __device__ __forceinline__ Key key(In b) { const Key m = b & 0x7fffu; return m > 0x7f80u ? 0u : m + 1u; } };

/* One radix pass: histogram of the current digit over the keys matching the prefix
 * (shared memory, one atomic per distinct bin of a warp); the last block to finish
 * scans the global histogram, narrows the prefix in ws and clears the histogram. */
template <class T>
__device__ __forceinline__ void fusion_radix_pass(const typename T::In* __restrict__ x, const long long n,
                                                  const long long k, const int pass,
                                                  unsigned long long* __restrict__ ws) {
    typedef typename T::Key Key;
    __shared__ unsigned int hist[FUSION_RADIX_BINS];
    __shared__ unsigned long long sums[1024];
    __shared__ unsigned int is_last;
    if (ws[FUSION_WS_DONE]) return;  /* an earlier pass fixed the selection: early exit */
    const int hi = (int)T::BITS - FUSION_RADIX_BITS * pass;
    const int width = hi < FUSION_RADIX_BITS ? hi : FUSION_RADIX_BITS;
    const int shift = hi - width;
    const unsigned int bins = 1u << width;
    const Key hmask = hi >= (int)(8 * sizeof(Key)) ? (Key)0 : (Key)(~(Key)0 << hi);
    const Key prefix = (Key)ws[FUSION_WS_PREFIX];
    const unsigned long long need = pass == 0 ? (unsigned long long)k : ws[FUSION_WS_REMAIN];
    for (unsigned int b = threadIdx.x; b < bins; b += blockDim.x) hist[b] = 0u;
    __syncthreads();
    const unsigned int lane = threadIdx.x & 31u;
    const long long stride = (long long)blockDim.x * gridDim.x;
    for (long long base = (long long)blockIdx.x * blockDim.x; base < n; base += stride) {
        const long long i = base + threadIdx.x;  /* whole warps iterate together */
        unsigned int bin = FUSION_NO_BIN;
        if (i < n) {
            const Key key = T::key(x[i]);
            if ((key & hmask) == prefix) bin = (unsigned int)(key >> shift) & (bins - 1u);
        }
        const unsigned int peers = __match_any_sync(FUSION_FULL_MASK, bin);
        if (bin != FUSION_NO_BIN && lane == (unsigned int)(__ffs(peers) - 1))
            atomicAdd(&hist[bin], (unsigned int)__popc(peers));
    }
    __syncthreads();
    unsigned long long* ghist = ws + FUSION_WS_HIST;
    for (unsigned int b = threadIdx.x; b < bins; b += blockDim.x)
        if (hist[b]) atomicAdd(&ghist[b], (unsigned long long)hist[b]);
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) is_last = atomicAdd(&ws[FUSION_WS_COUNTER], 1ULL) == gridDim.x - 1u;
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    /* the last block: suffix sums over the bins, the k-th key's digit is where they cross `need` */
    volatile unsigned long long* vh = ghist;
    const unsigned int per = (bins + blockDim.x - 1u) / blockDim.x;
    const unsigned int lo = threadIdx.x * per;
    const unsigned int end = lo + per < bins ? lo + per : bins;
    unsigned long long mine = 0;
    for (unsigned int b = lo; b < end; ++b) mine += vh[b];
    sums[threadIdx.x] = mine;
    __syncthreads();
    for (unsigned int off = 1; off < blockDim.x; off <<= 1) {
        const unsigned long long add = threadIdx.x + off < blockDim.x ? sums[threadIdx.x + off] : 0ULL;
        __syncthreads();
        sums[threadIdx.x] += add;
        __syncthreads();
    }
    unsigned long long above = sums[threadIdx.x] - mine;  /* keys in the bins above this thread's */
    for (unsigned int b = end; b-- > lo;) {
        const unsigned long long c = vh[b];
        if (above < need && above + c >= need) {  /* exactly one thread of the block gets here */
            const unsigned long long left = need - above;
            ws[FUSION_WS_PREFIX] = (unsigned long long)prefix | ((unsigned long long)b << shift);
            ws[FUSION_WS_REMAIN] = left;
            if (c == left) ws[FUSION_WS_DONE] = 1ULL;  /* the whole bucket is kept */
        }
        above += c;
    }
    __syncthreads();
    for (unsigned int b = threadIdx.x; b < bins; b += blockDim.x) ghist[b] = 0ULL;
    if (threadIdx.x == 0) ws[FUSION_WS_COUNTER] = 0ULL;
}

/* Block b owns the contiguous tile [begin, end) (a multiple of blockDim.x long), so
 * tiles in block order are index order: the compaction is ascending. */
__device__ __forceinline__ void fusion_tile(const long long n, long long* begin, long long* end) {
    const long long per = ((n + gridDim.x - 1) / gridDim.x + blockDim.x - 1) / blockDim.x * blockDim.x;
    *begin = per * blockIdx.x;
    *end = *begin + per < n ? *begin + per : n;
}

/* Per tile: how many keys are above the k-th key, and how many equal it. */
template <class T>
__device__ __forceinline__ void fusion_topk_count(const typename T::In* __restrict__ x, const long long n,
                                                  unsigned long long* __restrict__ ws) {
    typedef typename T::Key Key;
    __shared__ unsigned int tile_gt, tile_eq;
    const Key kth = (Key)ws[FUSION_WS_PREFIX];
    const bool done = ws[FUSION_WS_DONE] != 0ULL;
    if (threadIdx.x == 0) { tile_gt = 0u; tile_eq = 0u; }
    __syncthreads();
    long long begin, end;
    fusion_tile(n, &begin, &end);
    unsigned int gt = 0u, eq = 0u;
    for (long long i = begin + threadIdx.x; i < end; i += blockDim.x) {
        const Key key = T::key(x[i]);
        gt += done ? key >= kth : key > kth;
        eq += !done && key == kth;
    }
    if (gt) atomicAdd(&tile_gt, gt);
    if (eq) atomicAdd(&tile_eq, eq);
    __syncthreads();
    if (threadIdx.x == 0) {
        ws[FUSION_WS_TILES + blockIdx.x] = tile_gt;
        ws[FUSION_WS_TILES + gridDim.x + blockIdx.x] = tile_eq;
    }
}

/* Fused gather + compaction: every kept element writes its value bits and index at its
 * rank in index order; ties at the k-th key are kept for the lowest indices only. */
template <class T, class Idx>
__device__ __forceinline__ void fusion_topk_write(const typename T::In* __restrict__ x, const long long n,
                                                  const long long k, const unsigned long long* __restrict__ ws,
                                                  typename T::In* __restrict__ vals, Idx* __restrict__ idx) {
    typedef typename T::Key Key;
    __shared__ unsigned long long before_gt, before_eq;
    __shared__ unsigned int warp_eq[32], warp_sel[32];
    const Key kth = (Key)ws[FUSION_WS_PREFIX];
    const bool done = ws[FUSION_WS_DONE] != 0ULL;
    const unsigned long long take = done ? ~0ULL : ws[FUSION_WS_REMAIN];
    if (threadIdx.x == 0) { before_gt = 0ULL; before_eq = 0ULL; }
    __syncthreads();
    unsigned long long g = 0ULL, q = 0ULL;
    for (unsigned int b = threadIdx.x; b < blockIdx.x; b += blockDim.x) {
        g += ws[FUSION_WS_TILES + b];
        q += ws[FUSION_WS_TILES + gridDim.x + b];
    }
    if (g) atomicAdd(&before_gt, g);
    if (q) atomicAdd(&before_eq, q);
    __syncthreads();
    unsigned long long eq_seen = before_eq;
    unsigned long long out = before_gt + (eq_seen < take ? eq_seen : take);
    long long begin, end;
    fusion_tile(n, &begin, &end);
    const unsigned int lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const unsigned int below = (1u << lane) - 1u;  /* lanes before this one */
    for (long long base = begin; base < end; base += blockDim.x) {  /* uniform over the block */
        const long long i = base + threadIdx.x;
        typename T::In v = 0;
        bool is_gt = false, is_eq = false;
        if (i < end) {
            v = x[i];
            const Key key = T::key(v);
            is_gt = done ? key >= kth : key > kth;
            is_eq = !done && key == kth;
        }
        const unsigned int eq_bits = __ballot_sync(FUSION_FULL_MASK, is_eq);
        if (lane == 0u) warp_eq[warp] = (unsigned int)__popc(eq_bits);
        __syncthreads();
        unsigned long long eq_rank = eq_seen + (unsigned int)__popc(eq_bits & below);
        unsigned int eq_chunk = 0u;
        for (unsigned int w = 0; w < warps; ++w) {
            if (w < warp) eq_rank += warp_eq[w];
            eq_chunk += warp_eq[w];
        }
        const bool keep = is_gt || (is_eq && eq_rank < take);
        const unsigned int keep_bits = __ballot_sync(FUSION_FULL_MASK, keep);
        if (lane == 0u) warp_sel[warp] = (unsigned int)__popc(keep_bits);
        __syncthreads();
        unsigned long long pos = out + (unsigned int)__popc(keep_bits & below);
        unsigned int sel_chunk = 0u;
        for (unsigned int w = 0; w < warps; ++w) {
            if (w < warp) pos += warp_sel[w];
            sel_chunk += warp_sel[w];
        }
        if (keep && pos < (unsigned long long)k) { vals[pos] = v; idx[pos] = (Idx)i; }  /* never past k */
        eq_seen += eq_chunk;
        out += sel_chunk;
        __syncthreads();  /* warp_eq / warp_sel are rewritten by the next chunk */
    }
}
"""

_FUSED_PER_TYPE = r"""
extern "C" __global__ void fusion_topk_pass_SUFFIX(
        const IN* __restrict__ x, const long long n, const long long k, const int pass,
        unsigned long long* __restrict__ ws) {
    fusion_radix_pass<TRAITS>(x, n, k, pass, ws);
}

extern "C" __global__ void fusion_topk_count_SUFFIX(
        const IN* __restrict__ x, const long long n, unsigned long long* __restrict__ ws) {
    fusion_topk_count<TRAITS>(x, n, ws);
}

extern "C" __global__ void fusion_topk_write_SUFFIX_i32(
        const IN* __restrict__ x, const long long n, const long long k, const unsigned long long* __restrict__ ws,
        IN* __restrict__ vals, int* __restrict__ idx) {
    fusion_topk_write<TRAITS, int>(x, n, k, ws, vals, idx);
}

extern "C" __global__ void fusion_topk_write_SUFFIX_i64(
        const IN* __restrict__ x, const long long n, const long long k, const unsigned long long* __restrict__ ws,
        IN* __restrict__ vals, long long* __restrict__ idx) {
    fusion_topk_write<TRAITS, long long>(x, n, k, ws, vals, idx);
}
"""

#: Fused-path element kinds: (kernel suffix, traits struct, raw C type, NumPy raw dtype, key bits).
FUSED_KINDS = {
    "f32": ("FusionF32", "unsigned int", "uint32", 32),
    "f64": ("FusionF64", "unsigned long long", "uint64", 64),
    "f16": ("FusionF16", "unsigned short", "uint16", 16),
    "bf16": ("FusionBF16", "unsigned short", "uint16", 16),
}
#: Radix digit of the fused path (AIR top-k's 11 bits: 3 passes for 32-bit keys) and its workspace.
FUSED_DIGIT_BITS, FUSED_WS_TILES = 11, 2056


def _fused_source() -> str:
    out = [_FUSED]
    for suf, (traits, ctype, _, _) in FUSED_KINDS.items():
        out.append(_FUSED_PER_TYPE.replace("SUFFIX", suf).replace("TRAITS", traits).replace("IN", ctype))
    return "".join(out)


#: All device code of the CUDA path, one NVRTC translation unit with no headers.
#: CuPy compiles it at first use; ``tests/kernels/test_cuda_source.py`` compiles
#: it with NVRTC for sm_80 and sm_90 on any machine, GPU or not.
CUDA_SOURCE = _PRELUDE + "".join(_PER_KEY.replace("SUFFIX", suf).replace("KEY", ctype)
                                 for suf, ctype in (("u32", "unsigned int"), ("u64", "unsigned long long"))) \
    + _fused_source()

#: Host-side type of each kernel parameter, in order: ``"ptr"`` for a device
#: array, else the NumPy scalar type the launch casts the value to. A RawKernel
#: passes scalars by their NumPy size, so a mismatch with the C signature would
#: corrupt arguments silently; the NVRTC test checks this table against the
#: parameter sizes in the compiled PTX.
SIGNATURES: dict[str, tuple[str, ...]] = {
    "fusion_topk_keys_f32": ("ptr", "ptr", "int64"),
    "fusion_topk_keys_f64": ("ptr", "ptr", "int64"),
    "fusion_radix_hist_u32": ("ptr", "int64", "uint32", "uint32", "int32", "ptr"),
    "fusion_radix_hist_u64": ("ptr", "int64", "uint64", "uint64", "int32", "ptr"),
    "fusion_topk_keep_u32": ("ptr", "int64", "uint32", "int64", "ptr"),
    "fusion_topk_keep_u64": ("ptr", "int64", "uint64", "int64", "ptr"),
    **{name: sig for suf in FUSED_KINDS for name, sig in (
        (f"fusion_topk_pass_{suf}", ("ptr", "int64", "int64", "int32", "ptr")),
        (f"fusion_topk_count_{suf}", ("ptr", "int64", "ptr")),
        (f"fusion_topk_write_{suf}_i32", ("ptr", "int64", "int64", "ptr", "ptr", "ptr")),
        (f"fusion_topk_write_{suf}_i64", ("ptr", "int64", "int64", "ptr", "ptr", "ptr")))},
}


def available() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    if _cp is None:
        return False
    try:
        return _cp.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no driver, no device
        return False


def _require():
    """The cupy module, or a FusionError saying why it cannot be used."""
    if _cp is None:
        raise FusionError("topk_cupy: CuPy is not importable "
                          f"({_IMPORT_ERROR}); install it with pip install 'fusion[cuda]'")
    if not available():
        raise FusionError("topk_cupy: CuPy is installed but no CUDA device is visible")
    return _cp


@functools.lru_cache(maxsize=None)
def _module():
    return _require().RawModule(code=CUDA_SOURCE)


def grid_blocks(n: int, threads: int = THREADS, max_blocks: int = MAX_BLOCKS) -> int:
    """Blocks of a launch over ``n`` elements: one element per thread, capped (the kernels grid-stride)."""
    return max(1, min(max_blocks, (n + threads - 1) // threads))


def _launch(name: str, n: int, *args) -> None:
    """Launch kernel ``name`` over ``n`` elements, casting scalars as :data:`SIGNATURES` says."""
    sig = SIGNATURES[name]
    if len(args) != len(sig):
        raise RuntimeError(f"topk_cupy: {name} takes {len(sig)} arguments, got {len(args)}")
    cast = tuple(a if t == "ptr" else np.dtype(t).type(a) for a, t in zip(args, sig))
    _module().get_function(name)((grid_blocks(n),), (THREADS,), cast)


@dataclass(frozen=True)
class KernelRunner:
    """What the selection driver needs to run :data:`CUDA_SOURCE`.

    xp:      the array module of the device arrays (``cupy``; ``numpy`` for a CPU
             emulation of the kernels, as in ``tests/kernels/cuda_emu.py``).
    launch:  ``launch(name, n, *args)`` runs kernel ``name`` over ``n`` elements.
    to_host: device array -> NumPy array (waits for the device).
    """

    xp: Any
    launch: Callable[..., None]
    to_host: Callable[[Any], np.ndarray]


def select_with(run: KernelRunner, flat, k: int):
    """Ascending int64 indices of the k largest ``|flat|`` (1-D float32/float64, 1 <= k <= n), by radix select."""
    xp, n = run.xp, int(flat.size)
    bits = 64 if flat.dtype == xp.float64 else 32
    key_t, suffix = (xp.uint64, "u64") if bits == 64 else (xp.uint32, "u32")
    keys = xp.empty(n, dtype=key_t)
    run.launch(f"fusion_topk_keys_f{bits}", n, flat, keys, n)
    hist_dev = xp.zeros(BINS, dtype=xp.uint64)

    def hist(prefix: int, mask: int, shift: int) -> np.ndarray:
        hist_dev.fill(0)
        run.launch(f"fusion_radix_hist_{suffix}", n, keys, n, prefix, mask, shift, hist_dev)
        return run.to_host(hist_dev).astype(np.int64)

    res = radix_select(hist, k, bits)
    if res.all_ties:
        last = n - 1
    else:
        last = int(xp.flatnonzero(keys == key_t(res.kth_key))[res.take_ties - 1])
    keep = xp.empty(n, dtype=xp.bool_)
    run.launch(f"fusion_topk_keep_{suffix}", n, keys, n, res.kth_key, last, keep)
    idx = xp.flatnonzero(keep)
    if int(idx.size) != k:  # would be a bug in the kernels, not a user error
        raise RuntimeError(f"topk_cupy: selected {int(idx.size)} elements, expected k={k}")
    return idx.astype(xp.int64, copy=False)


def fused_passes(kind: str) -> int:
    """Radix passes of the fused path for element kind ``kind`` (f32: 3, f64: 6, f16/bf16: 2)."""
    return -(-FUSED_KINDS[kind][3] // FUSED_DIGIT_BITS)


def select_fused_with(run: KernelRunner, raw, kind: str, k: int, index_dtype: str = "int32", ws=None):
    """(values, indices) of the k largest magnitudes, fused path, all on the device.

    ``raw`` is the tensor's bits as a 1-D contiguous unsigned array (uint32 for
    float32, uint64 for float64, uint16 for float16/bfloat16), ``kind`` one of
    :data:`FUSED_KINDS`, 1 <= k <= n. Launches ``fused_passes(kind)`` radix
    passes, a tile-count kernel and the gather/compaction kernel, with no host
    synchronisation between them: the k-th key's prefix stays in the device
    workspace. Returns ``values`` (raw bits, ``raw``'s dtype) and ``indices``
    (``index_dtype``), both length k, ascending index order, ties to the lower index.
    The workspace (``ws``, zeroed, ``FUSED_WS_TILES + 2 * MAX_BLOCKS`` uint64) ends
    holding the k-th key (``ws[0]``), the ties taken (``ws[1]``) and the early-exit flag (``ws[2]``).
    """
    xp, n = run.xp, int(raw.size)
    if raw.dtype != np.dtype(FUSED_KINDS[kind][2]):
        raise FusionError(f"topk_cupy: {kind} needs {FUSED_KINDS[kind][2]} bits, got {raw.dtype}")
    if not 1 <= k <= n:
        raise FusionError(f"topk: k={k} must be in [1, numel={n}] on the fused path")
    if ws is None:  # callers may pass their own zeroed workspace (the tests read it back)
        ws = xp.zeros(FUSED_WS_TILES + 2 * MAX_BLOCKS, dtype=xp.uint64)
    for p in range(fused_passes(kind)):
        run.launch(f"fusion_topk_pass_{kind}", n, raw, n, k, p, ws)
    run.launch(f"fusion_topk_count_{kind}", n, raw, n, ws)
    vals = xp.empty(k, dtype=raw.dtype)
    idx = xp.empty(k, dtype=xp.int32 if index_dtype == "int32" else xp.int64)
    run.launch(f"fusion_topk_write_{kind}_{'i32' if index_dtype == 'int32' else 'i64'}", n, raw, n, k, ws, vals, idx)
    return vals, idx


def select_cupy(x, k: int):
    """Ascending int64 flat indices (a CuPy array) of the k largest ``|x|``.

    ``x`` is a CuPy array of float16/float32/float64; ties go to the lower
    flat index, NaN ranks lowest (as in ``topk_torch``).
    """
    cp = _require()
    flat = x.reshape(-1)
    n = int(flat.size)
    if not 0 <= k <= n:
        raise FusionError(f"topk: k={k} must be in [0, numel={n}]")
    if k == 0:
        return cp.empty(0, dtype=cp.int64)
    if flat.dtype == cp.float16:
        flat = flat.astype(cp.float32)  # exact; keys are built from float32 bits
    if flat.dtype not in (cp.float32, cp.float64):
        raise FusionError(f"topk: dtype {flat.dtype} is not supported on the CuPy path")
    return select_with(KernelRunner(cp, _launch, cp.asnumpy), cp.ascontiguousarray(flat), k)


def _stream_ctx(t):
    """Run CuPy on torch's current stream of ``t``'s device, so no extra sync is needed."""
    import torch

    cp = _require()
    return cp.cuda.ExternalStream(torch.cuda.current_stream(t.device).cuda_stream)


#: Which CUDA selection ``compress`` runs: ``"fused"`` (default: device-resident radix
#: passes + fused gather, verified by NVRTC and the CPU emulation, not yet timed on a GPU) or
#: ``"legacy"`` (8-bit passes with a host round trip per pass, the path measured in issue 13).
#: ``FUSION_TOPK_CUDA=legacy`` selects the old one process-wide.
KERNELS = ("fused", "legacy")
DEFAULT_KERNEL = os.environ.get("FUSION_TOPK_CUDA", "fused")

#: torch dtype name -> (fused kind, torch integer dtype of the same width, CuPy unsigned dtype name).
_RAW = {"float32": ("f32", "int32", "uint32"), "float64": ("f64", "int64", "uint64"),
        "float16": ("f16", "int16", "uint16"), "bfloat16": ("bf16", "int16", "uint16")}


def _fused_device(cp, flat_raw, kind: str, k: int, n: int):
    """Fused selection on a CuPy raw-bits array: (values bits, wire indices), both CuPy, on the device."""
    return select_fused_with(KernelRunner(cp, _launch, cp.asnumpy), flat_raw, kind, k, index_dtype_for(n))


def compress(x, k: int, value_dtype: str | None = None, kernel: str | None = None) -> SparsePayload:
    """Keep the k largest-magnitude elements of a CUDA torch tensor or CuPy array.

    Same result, byte for byte, as ``topk_torch.compress`` on the same data.
    ``kernel`` picks the selection (:data:`KERNELS`, default :data:`DEFAULT_KERNEL`).
    The fused path gathers the values on the device, casts them to
    ``value_dtype`` there, and copies only the k values and k indices to
    pinned host buffers reused across messages (one stream synchronisation).
    """
    import torch

    cp = _require()
    kernel = DEFAULT_KERNEL if kernel is None else kernel
    if kernel not in KERNELS:
        raise FusionError(f"topk_cupy: unknown kernel {kernel!r}; known: {KERNELS}")
    if isinstance(x, torch.Tensor):
        if not x.is_cuda:
            raise FusionError(f"topk_cupy: tensor is on {x.device}, not CUDA; use topk_torch")
        dtype = dtype_name(x.dtype)
    elif isinstance(x, cp.ndarray):
        dtype = dtype_name(x.dtype)
    else:
        raise FusionError(f"topk_cupy: expected a CUDA torch.Tensor or cupy.ndarray, "
                          f"got {type(x).__name__}")
    if dtype not in VALUE_DTYPES:
        raise FusionError(f"topk: dtype {dtype} is not supported; floating dtypes only")
    vdt = dtype if value_dtype is None else value_dtype
    if vdt not in VALUE_DTYPES:
        raise FusionError(f"topk: unknown value_dtype {vdt!r}; known: {sorted(VALUE_DTYPES)}")
    n = int(x.numel() if isinstance(x, torch.Tensor) else x.size)
    if not 0 <= k <= n:
        raise FusionError(f"topk: k={k} must be in [0, numel={n}]")
    if kernel == "fused" and k > 0:
        return _compress_fused(cp, x, k, dtype, vdt)
    return _compress_legacy(cp, x, k, dtype, vdt)


def _compress_fused(cp, x, k: int, dtype: str, vdt: str) -> SparsePayload:
    import torch

    from fusion.kernels.staging import staging_for

    kind, int_dt, raw_dt = _RAW[dtype]
    n = int(x.numel() if isinstance(x, torch.Tensor) else x.size)
    if isinstance(x, torch.Tensor):
        flat = x.detach().reshape(-1).contiguous()
        device, stream = x.device, torch.cuda.current_stream(x.device)
        with cp.cuda.Device(x.device.index), _stream_ctx(x):
            raw = cp.from_dlpack(flat.view(getattr(torch, int_dt))).view(raw_dt)
            vals, idx = _fused_device(cp, raw, kind, k, n)
            values = torch.from_dlpack(vals.view(int_dt)).view(x.dtype)
            index = torch.from_dlpack(idx)
    else:  # a CuPy array: share it with torch to use the same cast and staging
        with x.device:
            raw = cp.ascontiguousarray(x.reshape(-1)).view(raw_dt)
            vals, idx = _fused_device(cp, raw, kind, k, n)
            values = torch.from_dlpack(vals.view(int_dt)).view(torch_dtype(dtype))
            index = torch.from_dlpack(idx)
            device, stream = values.device, torch.cuda.current_stream(values.device)
    if vdt != dtype:  # on the device, with torch's rounding (as the CPU path)
        values = values.to(torch_dtype(vdt))
    values_np, index_np = staging_for(device).to_host([values, index], stream)
    if vdt == "bfloat16":
        values_np = values_np.view(np.uint16)
    return SparsePayload(values_np, index_np, tuple(x.shape), dtype, vdt)


def _compress_legacy(cp, x, k: int, dtype: str, vdt: str) -> SparsePayload:
    import torch

    if isinstance(x, torch.Tensor):
        flat = x.detach().reshape(-1)
        wide = flat.float() if dtype in ("float16", "bfloat16") else flat.contiguous()
        with cp.cuda.Device(x.device.index), _stream_ctx(x):
            idx = select_cupy(cp.from_dlpack(wide), k)
            idx_t = torch.from_dlpack(idx)
            values = flat[idx_t]
            index_np = cp.asnumpy(idx.astype(cp.int32 if index_dtype_for(flat.numel()) == "int32"
                                             else cp.int64))
    else:
        with x.device:
            flat = x.reshape(-1)
            idx = select_cupy(flat, k)
            values = torch.from_numpy(cp.asnumpy(flat[idx]))
            index_np = cp.asnumpy(idx.astype(cp.int32 if index_dtype_for(flat.size) == "int32"
                                             else cp.int64))
    return SparsePayload(values_to_numpy(values, vdt), index_np, tuple(x.shape), dtype, vdt)


def decompress_cupy(p: SparsePayload, device: int | None = None):
    """The dense tensor of a payload as a CuPy array on CUDA device ``device`` (default: current).

    bfloat16 tensors come back as their raw bits in an ``int16`` array (CuPy
    has no bfloat16); :func:`decompress` views them as torch bfloat16.
    """
    cp = _require()
    p.validate()
    # value dtype -> dense dtype on the host (k elements), with torch's rounding
    dense_vals = values_to_numpy(values_from_numpy(p.values, p.value_dtype)
                                 .to(torch_dtype(p.dtype)), p.dtype)
    np_dt = np.int16 if p.dtype == "bfloat16" else VALUE_DTYPES[p.dtype].numpy
    with cp.cuda.Device(device if device is not None else cp.cuda.Device().id):
        out = cp.zeros(p.numel, dtype=np_dt)
        if p.k:
            out[cp.asarray(p.indices)] = cp.asarray(dense_vals.view(np_dt))
    return out.reshape(p.shape)


def decompress(p: SparsePayload, device=None):
    """The dense tensor of a payload as a CUDA torch tensor (``device``: torch device or index)."""
    import torch

    _require()
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if dev.type != "cuda":
        raise FusionError(f"topk_cupy: decompress needs a CUDA device, got {dev}")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    out = torch.from_dlpack(decompress_cupy(p, index))
    return out.view(torch.bfloat16) if p.dtype == "bfloat16" else out


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
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from fusion.ir.errors import FusionError

from .dtypes import (VALUE_DTYPES, dtype_name, index_dtype_for, torch_dtype, values_from_numpy,
                     values_to_numpy)
from .radix import BINS, radix_select
from .sparse import SparsePayload

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

#: All device code of the CUDA path, one NVRTC translation unit with no headers.
#: CuPy compiles it at first use; ``tests/kernels/test_cuda_source.py`` compiles
#: it with NVRTC for sm_80 and sm_90 on any machine, GPU or not.
CUDA_SOURCE = _PRELUDE + "".join(_PER_KEY.replace("SUFFIX", suf).replace("KEY", ctype)
                                 for suf, ctype in (("u32", "unsigned int"), ("u64", "unsigned long long")))

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


def compress(x, k: int, value_dtype: str | None = None) -> SparsePayload:
    """Keep the k largest-magnitude elements of a CUDA torch tensor or CuPy array.

    Same result, byte for byte, as ``topk_torch.compress`` on the same data.
    """
    import torch

    cp = _require()
    if isinstance(x, torch.Tensor):
        if not x.is_cuda:
            raise FusionError(f"topk_cupy: tensor is on {x.device}, not CUDA; use topk_torch")
        dtype = dtype_name(x.dtype)
        if dtype not in VALUE_DTYPES:
            raise FusionError(f"topk: dtype {dtype} is not supported; floating dtypes only")
        flat = x.detach().reshape(-1)
        wide = flat.float() if dtype in ("float16", "bfloat16") else flat.contiguous()
        with cp.cuda.Device(x.device.index), _stream_ctx(x):
            idx = select_cupy(cp.from_dlpack(wide), k)
            idx_t = torch.from_dlpack(idx)
            values = flat[idx_t]
            index_np = cp.asnumpy(idx.astype(cp.int32 if index_dtype_for(flat.numel()) == "int32"
                                             else cp.int64))
    elif isinstance(x, cp.ndarray):
        dtype = dtype_name(x.dtype)
        if dtype not in VALUE_DTYPES:
            raise FusionError(f"topk: dtype {dtype} is not supported; floating dtypes only")
        with x.device:
            flat = x.reshape(-1)
            idx = select_cupy(flat, k)
            values = torch.from_numpy(cp.asnumpy(flat[idx]))
            index_np = cp.asnumpy(idx.astype(cp.int32 if index_dtype_for(flat.size) == "int32"
                                             else cp.int64))
    else:
        raise FusionError(f"topk_cupy: expected a CUDA torch.Tensor or cupy.ndarray, "
                          f"got {type(x).__name__}")
    vdt = dtype if value_dtype is None else value_dtype
    if vdt not in VALUE_DTYPES:
        raise FusionError(f"topk: unknown value_dtype {vdt!r}; known: {sorted(VALUE_DTYPES)}")
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


"""Top-K selection and the sparse codec on CUDA with CuPy kernels (radix select, no sort).

CuPy is optional (``pip install 'fusion[cuda]'``): this module imports without
it, :func:`available` says whether it can run, and every other entry point
raises :class:`fusion.ir.errors.FusionError` with the reason when it cannot.

Selection (same set as ``topk_torch``, same tie rule):

1. one elementwise kernel maps each element to an unsigned magnitude key
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

#: Threads per block and the most blocks of the histogram kernel (grid-stride loop).
THREADS, MAX_BLOCKS = 256, 1024

_HIST_SRC = r"""
extern "C" __global__ void fusion_radix_hist_KEYNAME(
        const KEY* __restrict__ keys, const long long n, const KEY prefix, const KEY mask,
        const int shift, unsigned long long* __restrict__ hist) {
    __shared__ unsigned int local[256];
    for (int b = threadIdx.x; b < 256; b += blockDim.x) local[b] = 0u;
    __syncthreads();
    const long long stride = (long long)blockDim.x * gridDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
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
"""


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
def _key_kernel(bits: int):
    cp = _require()
    if bits == 32:
        return cp.ElementwiseKernel(
            "float32 x", "uint32 key",
            "unsigned int b = __float_as_uint(x) & 0x7fffffffu;"
            " key = (b > 0x7f800000u) ? 0u : b + 1u;",
            "fusion_topk_key32")
    return cp.ElementwiseKernel(
        "float64 x", "uint64 key",
        "unsigned long long b = ((unsigned long long)__double_as_longlong(x)) & 0x7fffffffffffffffULL;"
        " key = (b > 0x7ff0000000000000ULL) ? 0ULL : b + 1ULL;",
        "fusion_topk_key64")


@functools.lru_cache(maxsize=None)
def _hist_kernel(bits: int):
    cp = _require()
    ctype, name = ("unsigned int", "u32") if bits == 32 else ("unsigned long long", "u64")
    src = _HIST_SRC.replace("KEYNAME", name).replace("KEY", ctype)
    return cp.RawKernel(src, f"fusion_radix_hist_{name}")


@functools.lru_cache(maxsize=None)
def _keep_kernel():
    cp = _require()
    return cp.ElementwiseKernel(
        "T key, T kth, int64 last", "bool keep",
        "keep = (key > kth) || (key == kth && (long long)i <= last);",
        "fusion_topk_keep")


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
    bits = 64 if flat.dtype == cp.float64 else 32
    key_t = np.uint64 if bits == 64 else np.uint32
    keys = _key_kernel(bits)(flat)
    hist_dev = cp.zeros(BINS, dtype=cp.uint64)
    blocks = max(1, min(MAX_BLOCKS, (n + THREADS - 1) // THREADS))
    kernel = _hist_kernel(bits)

    def hist(prefix: int, mask: int, shift: int) -> np.ndarray:
        hist_dev.fill(0)
        kernel((blocks,), (THREADS,),
               (keys, np.int64(n), key_t(prefix), key_t(mask), np.int32(shift), hist_dev))
        return cp.asnumpy(hist_dev).astype(np.int64)

    res = radix_select(hist, k, bits)
    kth = key_t(res.kth_key)
    if res.all_ties:
        last = n - 1
    else:
        last = int(cp.flatnonzero(keys == kth)[res.take_ties - 1])
    idx = cp.flatnonzero(_keep_kernel()(keys, kth, np.int64(last)))
    if int(idx.size) != k:  # would be a bug in the kernels, not a user error
        raise RuntimeError(f"topk_cupy: selected {int(idx.size)} elements, expected k={k}")
    return idx


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


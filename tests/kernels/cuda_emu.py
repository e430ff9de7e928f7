"""Run ``topk_cupy.CUDA_SOURCE`` on the CPU: a small emulation of CUDA's thread model.

For machines without a GPU (this project's CI): g++ compiles the CUDA source
text unchanged, with a shim that gives it CUDA's names:

* a launch runs ``blockDim.x`` real threads (``std::thread``); the blocks of the
  grid run one after another, so a ``__shared__`` array is a function ``static``
  owned by the one running block;
* ``__syncthreads()`` is a barrier (mutex + condition variable, C++11, so it
  builds without ``<barrier>``) over the block's threads;
* ``atomicAdd`` is the compiler's ``__atomic_fetch_add``; ``__threadfence`` a
  sequentially consistent fence; ``__float_as_uint`` / ``__double_as_longlong``
  reinterpret bits; ``__popc`` / ``__ffs`` are the compiler builtins;
* ``__ballot_sync`` / ``__match_any_sync``: the 32 lanes of a warp
  (``threadIdx.x / 32``) meet at a per-warp barrier, publish their argument,
  meet again once all have read; only the full mask is allowed (the kernels
  call them from loops whole warps run together), anything else aborts.

g++ and clang++ both build it with ``-std=c++20 -Wall -Wextra -Werror``.

This executes the kernels' logic (indexing, grid-stride loops, barriers,
atomics, warp votes, the tie rule) on real threads. It says nothing about speed, and the
GPU's weaker memory model, warp scheduling and
independent thread scheduling within a warp are not reproduced (blocks run
one after another, so the last-block-done pattern is trivially ordered here).
"""
from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np

from fusion.kernels import topk_cupy

SHIM = r"""
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

struct dim3 { unsigned int x, y, z; };
static thread_local dim3 threadIdx, blockIdx;
static dim3 blockDim, gridDim;

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static

/* A reusable barrier on C++20 atomic wait/notify (futexes on Linux; no <barrier> needed).
 * The acq_rel counter and the release/acquire generation order every thread's writes
 * before the barrier with every read after it. */
class FusionEmuBarrier {
  public:
    explicit FusionEmuBarrier(unsigned int n) : n_(n) {}
    void arrive_and_wait() {
        const unsigned int gen = gen_.load(std::memory_order_acquire);
        if (count_.fetch_add(1, std::memory_order_acq_rel) + 1 == n_) {
            count_.store(0, std::memory_order_relaxed);
            gen_.fetch_add(1, std::memory_order_acq_rel);
            gen_.notify_all();
        } else {
            for (int spin = 0; spin < 64 && gen_.load(std::memory_order_acquire) == gen; ++spin)
                std::this_thread::yield();
            while (gen_.load(std::memory_order_acquire) == gen) gen_.wait(gen, std::memory_order_acquire);
        }
    }
  private:
    const unsigned int n_;
    std::atomic<unsigned int> count_{0}, gen_{0};
};

/* One warp: its 32 lanes meet at `bar` for every *_sync intrinsic and exchange values in `slot`. */
struct FusionEmuWarp {
    FusionEmuWarp() : bar(32) {}
    FusionEmuBarrier bar;
    unsigned long long slot[32];
};
static FusionEmuBarrier* fusion_emu_block_barrier;
static thread_local FusionEmuWarp* fusion_emu_warp;

static inline void __syncthreads() { fusion_emu_block_barrier->arrive_and_wait(); }
static inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
static inline unsigned int atomicAdd(unsigned int* p, unsigned int v) {
    return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}
static inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
    return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}
static inline unsigned int __float_as_uint(float x) { unsigned int u; std::memcpy(&u, &x, 4); return u; }
static inline long long __double_as_longlong(double x) { long long u; std::memcpy(&u, &x, 8); return u; }
static inline int __popc(unsigned int x) { return __builtin_popcount(x); }
static inline int __ffs(int x) { return __builtin_ffs(x); }

/* Warp intrinsics, for converged warps only: the kernels call them with the full mask from
 * loops that whole warps run together; anything else aborts the emulation. */
static inline void fusion_emu_full_mask(unsigned int mask, const char* what) {
    if (mask != 0xffffffffu) { std::fprintf(stderr, "cuda_emu: %s with a partial mask\n", what); std::abort(); }
}
static inline unsigned int __ballot_sync(unsigned int mask, int pred) {
    fusion_emu_full_mask(mask, "__ballot_sync");
    FusionEmuWarp& w = *fusion_emu_warp;
    const unsigned int lane = threadIdx.x & 31u;
    w.slot[lane] = pred != 0;
    w.bar.arrive_and_wait();
    unsigned int bits = 0;
    for (unsigned int l = 0; l < 32; ++l) bits |= (w.slot[l] ? 1u : 0u) << l;
    w.bar.arrive_and_wait();  /* nobody overwrites a slot before every lane has read them all */
    return bits;
}
static inline unsigned int __match_any_sync(unsigned int mask, unsigned int value) {
    fusion_emu_full_mask(mask, "__match_any_sync");
    FusionEmuWarp& w = *fusion_emu_warp;
    const unsigned int lane = threadIdx.x & 31u;
    w.slot[lane] = value;
    w.bar.arrive_and_wait();
    unsigned int bits = 0;
    for (unsigned int l = 0; l < 32; ++l) bits |= (w.slot[l] == value ? 1u : 0u) << l;
    w.bar.arrive_and_wait();
    return bits;
}

template <typename... P, typename... A>
static void fusion_emu_launch(void (*kernel)(P...), unsigned int grid, unsigned int block, A... args) {
    if (block == 0 || block % 32 != 0 || block > 1024) {
        std::fprintf(stderr, "cuda_emu: blockDim.x=%u is not a multiple of 32 in [32, 1024]\n", block);
        std::abort();
    }
    blockDim = {block, 1, 1};
    gridDim = {grid, 1, 1};
    FusionEmuBarrier bar(block);
    fusion_emu_block_barrier = &bar;
    std::vector<FusionEmuWarp> warps(block / 32);
    std::vector<std::thread> threads;
    for (unsigned int t = 0; t < block; ++t)
        threads.emplace_back([&, t] {
            threadIdx = {t, 0, 0};
            fusion_emu_warp = &warps[t / 32];
            for (unsigned int b = 0; b < grid; ++b) {
                blockIdx = {b, 0, 0};
                kernel(args...);
                bar.arrive_and_wait();  // the next block starts once this one has finished
            }
        });
    for (auto& th : threads) th.join();
}
"""

#: Warnings are errors: the source must build cleanly with current g++ and clang.
CXXFLAGS = ("-Wall", "-Wextra", "-Werror")

_CTYPES = {"ptr": ctypes.c_void_p, "int32": ctypes.c_int32, "int64": ctypes.c_int64,
           "uint32": ctypes.c_uint32, "uint64": ctypes.c_uint64}


def _wrappers(source: str) -> str:
    """``emu_<kernel>(grid, block, <the kernel's parameters>)`` for every kernel of ``source``."""
    out = []
    for name, params in re.findall(r'extern "C" __global__ void (\w+)\(([^)]*)\)', source):
        names = [re.findall(r"\w+", p)[-1] for p in params.split(",")]
        out.append(f'extern "C" void emu_{name}(unsigned int grid, unsigned int block, {params}) '
                   f'{{ fusion_emu_launch({name}, grid, block, {", ".join(names)}); }}')
    return "\n".join(out)


class CudaEmulator:
    """The kernels of ``source`` compiled for the CPU; :meth:`runner` plugs them into ``select_with``."""

    def __init__(self, workdir: Path, source: str = topk_cupy.CUDA_SOURCE,
                 signatures: dict[str, tuple[str, ...]] = topk_cupy.SIGNATURES,
                 threads: int = topk_cupy.THREADS, max_blocks: int = topk_cupy.MAX_BLOCKS, cxx: str = "g++"):
        if max_blocks > topk_cupy.MAX_BLOCKS:  # the fused path's workspace has MAX_BLOCKS tiles
            raise ValueError(f"max_blocks {max_blocks} > topk_cupy.MAX_BLOCKS")
        cxx = shutil.which(cxx)
        if cxx is None:
            raise RuntimeError("no C++ compiler to build the CUDA emulation")
        src = Path(workdir) / "cuda_emu.cpp"
        lib = Path(workdir) / "cuda_emu.so"
        src.write_text(SHIM + source + "\n" + _wrappers(source))
        self.cxx = cxx
        r = subprocess.run([cxx, "-std=c++20", "-O2", "-pthread", "-shared", "-fPIC", *CXXFLAGS,
                            str(src), "-o", str(lib)], capture_output=True, text=True, timeout=180)
        if r.returncode:
            raise RuntimeError(f"{cxx} failed to build the CUDA emulation:\n{r.stderr[-4000:]}")
        self.lib = ctypes.CDLL(str(lib))
        self.signatures, self.threads, self.max_blocks = signatures, threads, max_blocks
        for name, sig in signatures.items():
            fn = getattr(self.lib, f"emu_{name}")
            fn.argtypes = [ctypes.c_uint, ctypes.c_uint, *(_CTYPES[t] for t in sig)]
            fn.restype = None
        self.launches: list[tuple[str, int, int]] = []

    def launch(self, name: str, n: int, *args) -> None:
        """Same contract as ``topk_cupy._launch``: grid-stride over ``n`` with the module's block shape."""
        sig = self.signatures[name]
        if len(args) != len(sig):
            raise RuntimeError(f"{name} takes {len(sig)} arguments, got {len(args)}")
        blocks = topk_cupy.grid_blocks(n, self.threads, self.max_blocks)
        conv = []
        for a, t in zip(args, sig):
            if t == "ptr":
                if not (isinstance(a, np.ndarray) and a.flags.c_contiguous):
                    raise TypeError(f"{name}: device arguments must be C-contiguous arrays, got {type(a).__name__}")
                conv.append(a.ctypes.data)
            else:
                conv.append(int(np.dtype(t).type(a)))
        self.launches.append((name, blocks, self.threads))
        getattr(self.lib, f"emu_{name}")(blocks, self.threads, *conv)

    def runner(self) -> topk_cupy.KernelRunner:
        return topk_cupy.KernelRunner(np, self.launch, np.asarray)

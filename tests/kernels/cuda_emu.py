"""Run ``topk_cupy.CUDA_SOURCE`` on the CPU: a small emulation of CUDA's thread model.

For machines without a GPU (this project's CI): g++ compiles the CUDA source
text unchanged, with a shim that gives it CUDA's names:

* a launch runs ``blockDim.x`` real threads (``std::thread``); the blocks of the
  grid run one after another, so a ``__shared__`` array is a function ``static``
  owned by the one running block;
* ``__syncthreads()`` is a ``std::barrier`` over the block's threads;
* ``atomicAdd`` is GCC's ``__atomic_fetch_add``; ``__float_as_uint`` /
  ``__double_as_longlong`` reinterpret bits.

This executes the kernels' logic (indexing, grid-stride loops, barriers,
atomics, the tie rule) on real threads. It says nothing about speed, and the
GPU's weaker memory model and warp scheduling are not reproduced.
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
#include <barrier>
#include <cstring>
#include <thread>
#include <vector>

struct dim3 { unsigned int x, y, z; };
static thread_local dim3 threadIdx, blockIdx;
static dim3 blockDim, gridDim;
static std::barrier<>* fusion_emu_barrier;

#define __global__
#define __shared__ static

static inline void __syncthreads() { fusion_emu_barrier->arrive_and_wait(); }
static inline unsigned int atomicAdd(unsigned int* p, unsigned int v) {
    return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}
static inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
    return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}
static inline unsigned int __float_as_uint(float x) { unsigned int u; std::memcpy(&u, &x, 4); return u; }
static inline long long __double_as_longlong(double x) { long long u; std::memcpy(&u, &x, 8); return u; }

template <typename... P, typename... A>
static void fusion_emu_launch(void (*kernel)(P...), unsigned int grid, unsigned int block, A... args) {
    blockDim = {block, 1, 1};
    gridDim = {grid, 1, 1};
    std::barrier<> bar(block);
    fusion_emu_barrier = &bar;
    std::vector<std::thread> threads;
    for (unsigned int t = 0; t < block; ++t)
        threads.emplace_back([&, t] {
            threadIdx = {t, 0, 0};
            for (unsigned int b = 0; b < grid; ++b) {
                blockIdx = {b, 0, 0};
                kernel(args...);
                bar.arrive_and_wait();  // the next block starts once this one has finished
            }
        });
    for (auto& th : threads) th.join();
}
"""

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
                 threads: int = topk_cupy.THREADS, max_blocks: int = topk_cupy.MAX_BLOCKS):
        cxx = shutil.which("g++")
        if cxx is None:
            raise RuntimeError("no g++ to build the CUDA emulation")
        src = Path(workdir) / "cuda_emu.cpp"
        lib = Path(workdir) / "cuda_emu.so"
        src.write_text(SHIM + source + "\n" + _wrappers(source))
        subprocess.run([cxx, "-std=c++20", "-O2", "-pthread", "-shared", "-fPIC", "-Wall", "-Werror",
                        "-Wno-unused-function", str(src), "-o", str(lib)], check=True, capture_output=True, text=True,
                       timeout=120)
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

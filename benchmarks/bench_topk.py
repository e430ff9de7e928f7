"""Benchmark the Top-K kernels: wire reduction, CPU speed and (when present) GPU speed.

Run:  python benchmarks/bench_topk.py [--reps 7]

Prints one human line per measurement, then a final JSON line:

  wire_reduction_r100      dense bytes / sparse payload bytes, 16M float32, r=100
                           (higher is better; int32 indices make it ~50, the
                           paper's int64 indices would make it ~33)
  cpu_speed_vs_torch_topk  {"1M": t_ours / t_torch_topk, "16M": ...} on CPU, r=100
                           (LOWER is better; < 1 means ours is faster). t_ours is
                           the full ``topk_torch.compress`` (selection, gather,
                           payload arrays); t_torch_topk is
                           ``torch.topk(x.abs().flatten(), k)``.
  gpu_speed_vs_torch_topk  t_torch_topk / t_cupy at 16M float32, r=100 on CUDA
                           (HIGHER is better; > 1 means ours is faster), or null
                           without a GPU + CuPy. t_cupy is device-side selection
                           plus the value gather (``select_cupy`` + ``x[idx]``),
                           like torch.topk which returns values and indices on the
                           device; the full compress (with the copy to host) is
                           printed on its own line.
  gpu_device               CUDA device name, or null

"M" is 10**6 elements. Times are medians of --reps runs after one warm-up,
with torch's default thread count.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time

import numpy as np
import torch

from fusion.kernels import dense_nbytes, ratio_to_k, topk_cupy, topk_torch

log = logging.getLogger("bench_topk")

RATIO = 100
SIZES = {"1M": 1_000_000, "16M": 16_000_000}


def median_times(fns: dict, reps: int, sync=lambda: None) -> dict[str, float]:
    """Median seconds of each callable; calls are interleaved so drift hits all alike."""
    for f in fns.values():  # warm-up
        f()
        sync()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, f in fns.items():
            sync()
            t0 = time.perf_counter()
            f()
            sync()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def busy_cpu_seconds() -> float | None:
    """Non-idle CPU seconds of the whole machine so far (Linux /proc/stat), or None."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def check_same_set(ours: np.ndarray, x: torch.Tensor, k: int) -> None:
    """Random normal data has no ties at the k-th magnitude, so the sets must match torch.topk."""
    ref = np.sort(torch.topk(x.abs().flatten(), k).indices.cpu().numpy())
    if not np.array_equal(np.sort(ours.astype(np.int64)), ref):
        raise SystemExit("bench_topk: selection differs from torch.topk")


def bench_wire() -> float:
    n = SIZES["16M"]
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    p = topk_torch.compress(x, ratio_to_k(n, RATIO))
    dense = dense_nbytes(n, "float32")
    print(f"wire  16M float32 r={RATIO}: dense {dense} B, sparse {p.nbytes} B "
          f"(k={p.k}, {p.values.dtype} values + {p.indices.dtype} indices) -> {dense / p.nbytes:.3f}x")
    return dense / p.nbytes


def bench_cpu(reps: int) -> dict[str, float]:
    out = {}
    for label, n in SIZES.items():
        x = torch.randn(n, generator=torch.Generator().manual_seed(1))
        k = ratio_to_k(n, RATIO)
        check_same_set(topk_torch.compress(x, k).indices, x, k)
        t = median_times({
            "torch_topk": lambda: torch.topk(x.abs().flatten(), k),
            "ours_compress": lambda: topk_torch.compress(x, k),
            "ours_select": lambda: topk_torch.select(x, k),
        }, reps)
        out[label] = t["ours_compress"] / t["torch_topk"]
        print(f"cpu   {label:>3} float32 k={k}: torch.topk {t['torch_topk'] * 1e3:8.2f} ms | "
              f"ours compress {t['ours_compress'] * 1e3:7.2f} ms, select only "
              f"{t['ours_select'] * 1e3:7.2f} ms | ours/torch {out[label]:.3f} "
              f"({torch.get_num_threads()} threads)")
    return out


def bench_gpu(reps: int) -> tuple[float | None, str | None]:
    if not (torch.cuda.is_available() and topk_cupy.available()):
        print("gpu   skipped: no CUDA device visible to both torch and CuPy")
        return None, None
    import cupy as cp

    name = torch.cuda.get_device_name()
    n = SIZES["16M"]
    k = ratio_to_k(n, RATIO)
    x = torch.randn(n, device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    xc = cp.from_dlpack(x)
    check_same_set(topk_cupy.compress(x, k).indices, x, k)

    def ours_device():
        idx = topk_cupy.select_cupy(xc, k)
        return xc[idx]

    t = median_times({
        "torch_topk": lambda: torch.topk(x.abs().flatten(), k),
        "cupy_select": ours_device,
        "cupy_compress": lambda: topk_cupy.compress(x, k),
        "torch_path_compress": lambda: topk_torch.compress(x, k),
    }, reps, sync=lambda: (torch.cuda.synchronize(), cp.cuda.Device().synchronize()))
    speed = t["torch_topk"] / t["cupy_select"]
    print(f"gpu   16M float32 k={k} on {name}: torch.topk {t['torch_topk'] * 1e3:.3f} ms | "
          f"cupy select+gather {t['cupy_select'] * 1e3:.3f} ms (torch/ours {speed:.2f}x) | "
          f"cupy compress incl. copy to host {t['cupy_compress'] * 1e3:.3f} ms | "
          f"torch-path compress on GPU {t['torch_path_compress'] * 1e3:.3f} ms")
    return speed, name


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7, help="timed repetitions per measurement")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    log.info("torch %s, %d CPU threads", torch.__version__, torch.get_num_threads())
    busy0, cpu0, t0 = busy_cpu_seconds(), time.process_time(), time.perf_counter()
    result = {
        "wire_reduction_r100": round(bench_wire(), 4),
        "cpu_speed_vs_torch_topk": {k: round(v, 4) for k, v in bench_cpu(args.reps).items()},
    }
    gpu_speed, gpu_name = bench_gpu(args.reps)
    result["gpu_speed_vs_torch_topk"] = None if gpu_speed is None else round(gpu_speed, 4)
    result["gpu_device"] = gpu_name
    wall = time.perf_counter() - t0
    busy1 = busy_cpu_seconds()
    if busy0 is not None and busy1 is not None:  # CPU time other processes took meanwhile
        others = max(0.0, (busy1 - busy0) - (time.process_time() - cpu0)) / wall
        print(f"load  other processes used {others:.2f} of {os.cpu_count()} CPUs during the run"
              + (" -- machine busy, CPU timings are unreliable" if others > 0.25 else ""))
    log.info("done in %.1f s", wall)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

"""Benchmark the quantising codecs against Top-K: encode + decode time per MB, before and after the in-place host path.

Run:  OMP_NUM_THREADS=1 python benchmarks/bench_codecs.py [--reps 7] [--sizes 16384,1000000]
      (from a checkout other than the installed one: PYTHONPATH=. in front)

For every size (default: 16384 float32 elements, one bench_wan activation message of the small GPT, 8 x 32 x 64;
and 1M) and every codec the runtime's host path runs (``quant`` 2/4/8 bits nearest, 4 bits stochastic,
``hadamard-quant`` 4 bits, block 64; ``delta`` 4 bits in steady state: 8 rows re-sent with 1 % changes; Top-K at
r = 100) it measures encode and decode of one message:

  before_us_per_mb / after_us_per_mb   encode + decode microseconds per MB of dense float32 (best of --reps, the
                                       two paths interleaved in the same run, so host load hits both alike)
  speedup                              before / after (higher is better)
  encode_us / decode_us                the after path's best encode and decode, microseconds per message

"before" is the shared algorithm (``quant.quantize`` / ``quant.dequantize``: ``encode_core`` / ``decode_core``
over ``NumpyOps``, the host path before issue 36); "after" is what the codecs run now (``quant_host``). Both give
the same bytes (checked here, and pinned by ``tests/kernels/test_codec_golden.py``). Top-K has one path (its
before equals its after: the anchor). x is N(0, 1) with 0.1 % outliers of magnitude 20. The last line is JSON
with the 1-minute load average before and after the run (``os.getloadavg``): quote ratios, not absolute times,
from a loaded host.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time

import numpy as np
import torch

from fusion.kernels import DeltaBuffer, quant as Q, quant_host as QH, topk_torch
from fusion.kernels.sparse import ratio_to_k


def best_us(fns: dict, reps: int) -> dict:
    """Best time (microseconds) of each function, the functions interleaved round by round after a warm-up."""
    for fn in fns.values():
        fn()
    best = {k: math.inf for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[k] = min(best[k], time.perf_counter() - t0)
    return {k: 1e6 * v for k, v in best.items()}


def errors(y: np.ndarray, x: np.ndarray) -> dict:
    e = np.abs(y.astype(np.float64) - x.astype(np.float64)) / float(x.std())
    return {"mean_err": float(e.mean()), "max_err": float(e.max())}


def _row(x: np.ndarray, t: dict, payload_nbytes: int) -> dict:
    mb = x.nbytes / 1e6
    before = (t["before_enc"] + t["before_dec"]) / mb
    after = (t["after_enc"] + t["after_dec"]) / mb
    return {"before_us_per_mb": before, "after_us_per_mb": after, "speedup": before / after,
            "encode_us": t["after_enc"], "decode_us": t["after_dec"], "compression": x.nbytes / payload_nbytes}


def bench_quant(x: np.ndarray, cfg: dict, hadamard: bool, reps: int) -> dict:
    qc = Q.QuantConfig.from_cfg(cfg, hadamard)
    p, p_old = QH.quantize(x, qc), Q.quantize(x, qc)
    assert p.to_msg() == p_old.to_msg(), "the host path's bytes differ from the shared algorithm's"
    assert QH.dequantize(p).tobytes() == Q.dequantize(p).tobytes(), "decoded values differ"
    t = best_us({"before_enc": lambda: Q.quantize(x, qc), "after_enc": lambda: QH.quantize(x, qc),
                 "before_dec": lambda: Q.dequantize(p), "after_dec": lambda: QH.dequantize(p)}, reps)
    return {**_row(x, t, p.nbytes), **errors(QH.dequantize(p), x)}


class _SharedDelta(DeltaBuffer):
    """``delta``'s NumPy buffer on the shared algorithm (the path before issue 36)."""

    def _quantize(self, x, cfg, dtype):
        return Q.quantize(x, cfg, dtype=dtype)

    def _dequantize_f64(self, p):
        return Q.dequantize_f64(p)


def bench_delta(x: np.ndarray, bits: int, reps: int) -> dict:
    """Steady state: every row a delta. x viewed as 8 rows; each message adds 1 % noise to the last."""
    rows = x.reshape(8, -1)
    ids = np.arange(8)
    cfg = {"bits": bits, "block": 64}
    rng = np.random.default_rng(1)
    noisy = [rows + np.float32(0.01) * rng.standard_normal(rows.shape, dtype=np.float32) for _ in range(2)]
    t: dict = {}
    for name, make in (("before", lambda: _SharedDelta(cfg)), ("after", lambda: DeltaBuffer(cfg))):
        s, r = make(), make()
        r.decode(s.encode(rows, ids))  # first visit
        enc = dec = math.inf
        for i in range(reps + 1):
            t0 = time.perf_counter()
            p = s.encode(noisy[i % 2], ids)
            t1 = time.perf_counter()
            r.decode(p)
            t2 = time.perf_counter()
            if i:
                enc, dec = min(enc, t1 - t0), min(dec, t2 - t1)
        t[f"{name}_enc"], t[f"{name}_dec"] = 1e6 * enc, 1e6 * dec
        t[f"{name}_payload"] = p
    assert t["before_payload"].to_msg() == t["after_payload"].to_msg(), "delta payloads differ"
    return _row(x, t, t["after_payload"].nbytes)


def bench_topk(x: np.ndarray, reps: int) -> dict:
    xt = torch.from_numpy(x)
    k = ratio_to_k(x.size, 100)
    p = topk_torch.compress(xt, k)
    t = best_us({"enc": lambda: topk_torch.compress(xt, k), "dec": lambda: topk_torch.decompress(p)}, reps)
    t = {"before_enc": t["enc"], "after_enc": t["enc"], "before_dec": t["dec"], "after_dec": t["dec"]}
    return {**_row(x, t, p.nbytes), **errors(topk_torch.decompress(p).numpy(), x)}


CODECS = (("quant-2", {"bits": 2, "block": 64}, False), ("quant-4", {"bits": 4, "block": 64}, False),
          ("quant-8", {"bits": 8, "block": 64}, False),
          ("quant-4-stochastic", {"bits": 4, "block": 64, "rounding": "stochastic", "seed": 5}, False),
          ("hadamard-quant-4", {"bits": 4, "block": 64}, True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--sizes", default="16384,1000000", help="elements per message (comma-separated)")
    args = ap.parse_args()
    load0 = os.getloadavg()[0]
    result: dict = {"benchmark": "codecs", "dtype": "float32", "block": 64, "torch_threads": torch.get_num_threads(),
                    "sizes": {}}
    for n in [int(v) for v in args.sizes.split(",")]:
        g = torch.Generator().manual_seed(0)
        xt = torch.randn(n, generator=g)
        out_idx = torch.randint(0, n, (max(1, n // 1000),), generator=g)
        xt[out_idx] = 20.0 * torch.sign(torch.randn(out_idx.numel(), generator=g))
        x = xt.numpy()
        rows = {"topk-r100": bench_topk(x, args.reps)}
        for name, cfg, had in CODECS:
            rows[name] = bench_quant(x, cfg, had, args.reps)
        rows["delta-4"] = bench_delta(x, 4, args.reps)
        for name, r in rows.items():
            print(f"n={n:>8} {name:<20} before {r['before_us_per_mb']:9.0f} us/MB  after {r['after_us_per_mb']:9.0f}"
                  f" us/MB  x{r['speedup']:.2f}  (enc {r['encode_us']:.0f} us, dec {r['decode_us']:.0f} us)",
                  flush=True)
        result["sizes"][str(n)] = rows
    result["load_1min"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
    print(json.dumps(result, default=lambda v: round(v, 4) if isinstance(v, float) else str(v),
                     allow_nan=False).replace("Infinity", "null"))


if __name__ == "__main__":
    main()

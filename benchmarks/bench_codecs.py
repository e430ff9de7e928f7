"""Benchmark the quantising codecs against Top-K on one 1M-element float32 tensor.

Run:  OMP_NUM_THREADS=1 python benchmarks/bench_codecs.py [--reps 5] [--n 1000000]
      (from a checkout other than the installed one: PYTHONPATH=. in front)

For ``quant`` and ``hadamard-quant`` at 2, 4 and 8 bits (block 64, nearest
rounding), and ``delta`` at 2 and 4 bits (steady state: one micro-batch of 8
rows re-sent with small changes), measures:

  encode_ms / decode_ms   median ms of the NumPy path and of the torch (CPU) path
  bytes                   payload frame bytes (headers excluded)
  compression             dense float32 bytes / payload bytes (higher is better)
  mean_err / max_err      mean and max |decoded - x| divided by std(x)

The anchor is Top-K at r = 100 in the same run: ``torch.topk`` of ``|x|``
plus the value gather (what a plain-torch Top-K codec costs), and the fusion
codec's ``topk_torch.compress`` / ``decompress`` (int32 indices).

x is N(0, 1) with 0.1 % outliers of magnitude 20 (activations have outliers;
this is what the Hadamard rotation is for). Times are medians of --reps runs
after one warm-up, on whatever threads torch is given (set OMP_NUM_THREADS).
The final line is JSON.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from fusion.kernels import DeltaBuffer, TorchDeltaBuffer, quant as Q, quant_torch as QT, topk_torch
from fusion.kernels.sparse import ratio_to_k


def median_ms(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(ts)


def errors(y: np.ndarray, x: np.ndarray) -> dict:
    e = np.abs(y.astype(np.float64) - x.astype(np.float64)) / float(x.std())
    return {"mean_err": float(e.mean()), "max_err": float(e.max())}


def bench_quant(x: torch.Tensor, bits: int, hadamard: bool, reps: int) -> dict:
    cfg = Q.QuantConfig.from_cfg({"bits": bits, "block": 64}, hadamard)
    xn = x.numpy()
    p = Q.quantize(xn, cfg)
    pt = QT.quantize(x, cfg)
    assert p.to_msg() == pt.to_msg(), "NumPy and torch payloads differ"
    out = {
        "numpy_encode_ms": median_ms(lambda: Q.quantize(xn, cfg), reps),
        "numpy_decode_ms": median_ms(lambda: Q.dequantize(p), reps),
        "torch_encode_ms": median_ms(lambda: QT.quantize(x, cfg), reps),
        "torch_decode_ms": median_ms(lambda: QT.dequantize(p), reps),
        "bytes": p.nbytes,
        "compression": xn.nbytes / p.nbytes,
    }
    out.update(errors(Q.dequantize(p), xn))
    return out


def bench_delta(x: torch.Tensor, bits: int, reps: int) -> dict:
    """Steady state: every row a delta. x viewed as 8 rows; each round adds 1 % noise."""
    rows = x.reshape(8, -1)
    ids = np.arange(8)
    cfg = {"bits": bits, "block": 64}
    g = torch.Generator().manual_seed(1)
    noise = [rows + 0.01 * torch.randn(rows.shape, generator=g) for _ in range(reps + 2)]
    res = {}
    for name, make in (("numpy", lambda: DeltaBuffer(cfg)), ("torch", lambda: TorchDeltaBuffer(cfg))):
        s, r = make(), make()
        conv = (lambda t: t.numpy()) if name == "numpy" else (lambda t: t)
        r.decode(s.encode(conv(rows), ids))  # first visit
        enc, dec, payloads = [], [], []
        for t in noise:
            t0 = time.perf_counter()
            p = s.encode(conv(t), ids)
            t1 = time.perf_counter()
            y = r.decode(p)
            t2 = time.perf_counter()
            enc.append(t1 - t0)
            dec.append(t2 - t1)
            payloads.append(p)
        res[f"{name}_encode_ms"] = 1e3 * statistics.median(enc[1:])
        res[f"{name}_decode_ms"] = 1e3 * statistics.median(dec[1:])
        yn = y if name == "numpy" else y.numpy()
        if name == "numpy":
            res["bytes"] = payloads[-1].nbytes
            res["compression"] = noise[-1].numpy().nbytes / payloads[-1].nbytes
            res.update(errors(yn, noise[-1].numpy()))
    return res


def bench_topk(x: torch.Tensor, reps: int) -> dict:
    flat = x.reshape(-1)
    k = ratio_to_k(flat.numel(), 100)

    def torch_topk():
        idx = torch.topk(flat.abs(), k).indices
        return flat[idx], idx

    p = topk_torch.compress(x, k)
    y = topk_torch.decompress(p).numpy()
    out = {
        "torch_topk_ms": median_ms(torch_topk, reps),
        "fusion_encode_ms": median_ms(lambda: topk_torch.compress(x, k), reps),
        "fusion_decode_ms": median_ms(lambda: topk_torch.decompress(p), reps),
        "bytes": p.nbytes,
        "compression": x.numpy().nbytes / p.nbytes,
    }
    out.update(errors(y, x.numpy()))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--n", type=int, default=1_000_000)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.n, generator=g)
    out_idx = torch.randint(0, args.n, (args.n // 1000,), generator=g)
    x[out_idx] = 20.0 * torch.sign(torch.randn(out_idx.numel(), generator=g))
    result = {"benchmark": "codecs", "numel": args.n, "dtype": "float32", "block": 64,
              "torch_threads": torch.get_num_threads(), "topk_r100": bench_topk(x, args.reps)}
    print("topk r=100", {k: round(v, 4) for k, v in result["topk_r100"].items()}, flush=True)
    for algo, had in (("quant", False), ("hadamard-quant", True)):
        for bits in (2, 4, 8):
            r = bench_quant(x, bits, had, args.reps)
            result[f"{algo}_{bits}"] = r
            print(algo, bits, {k: round(v, 4) for k, v in r.items()}, flush=True)
    for bits in (2, 4):
        r = bench_delta(x, bits, args.reps)
        result[f"delta_{bits}"] = r
        print("delta", bits, {k: round(v, 4) for k, v in r.items()}, flush=True)
    rounded = {k: ({kk: round(vv, 4) if isinstance(vv, float) else vv for kk, vv in v.items()}
                   if isinstance(v, dict) else v) for k, v in result.items()}
    print(json.dumps(rounded))


if __name__ == "__main__":
    main()

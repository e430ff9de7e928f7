"""Where one message's codec time goes, at bench_wan's message size (issue 36): per codec, the runtime's host call
(``Codec.encode_host`` / ``decode_host`` with a :class:`CodecContext`, as ``CompressionTable`` calls it), the kernel
alone, the wire (``wire.encode_opdata``, the frames a message sends, and ``decode_opdata`` back), the Python work
around the kernel (config parsing, the context's seed), and the bytes allocated per encode (``tracemalloc``
peak). "before" runs the shared algorithm (``quant.quantize`` / ``dequantize``, the host path before issue 36),
"after" the in-place host path (``quant_host``); both interleaved, best of --reps.

    OMP_NUM_THREADS=1 python benchmarks/profile_codecs.py [--shape 8,32,64] [--reps 200]

Prints one human line per codec and one JSON line (with the 1-minute load average).
"""
from __future__ import annotations

import argparse
import json
import os
import tracemalloc

import numpy as np
import torch

from fusion.ir import wire
from fusion.ir.opdata import OpData
from fusion.kernels import quant as Q, quant_host as QH
from fusion.kernels.codecs import CODECS, CodecContext, Counter, Role
from fusion.kernels.error_feedback import ErrorFeedback

from bench_codecs import best_us  # noqa: E402  (this folder: the same interleaved best-of timing)

CASES = (("quant-4", {"algo": "quant", "bits": 4, "block": 64}, False),
         ("quant-8", {"algo": "quant", "bits": 8, "block": 64}, False),
         ("quant-4-stochastic", {"algo": "quant", "bits": 4, "block": 64, "rounding": "stochastic"}, False),
         ("hadamard-quant-4", {"algo": "hadamard-quant", "bits": 4, "block": 64}, False),
         ("topk-r100", {"algo": "topk", "ratio": 100}, False),
         ("topk-r100-error-feedback", {"algo": "topk", "ratio": 100}, True))


def peak_bytes(fn) -> int:
    fn()
    tracemalloc.start()
    fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def profile(name: str, cfg: dict, ef: bool, x: np.ndarray, reps: int) -> dict:
    unit = CODECS.unit(cfg["algo"])
    counter = Counter()
    feedback = ErrorFeedback(enabled=True) if ef else None
    ctx = lambda: CodecContext(Role.ACTIVATION, "p0", ("h", 0), "p1", 0, None, 3, counter, feedback)  # noqa: E731
    p = unit.encode_host(x, "float32", cfg, ctx())
    od = OpData("h", 0, ("y",), ("y",), False, 0, 0, src="p0", dst="p1", payload=p, compress_cfg=cfg)
    frames = wire.encode_opdata(od, "opdata")
    fns = {"call_enc": lambda: unit.encode_host(x, "float32", cfg, ctx()),
           "call_dec": lambda: unit.decode_host(p),
           "wire_enc": lambda: wire.encode_opdata(od, "opdata"),
           "wire_dec": lambda: wire.decode_opdata([bytes(f) if not isinstance(f, bytes) else f for f in frames])}
    row: dict = {}
    if cfg["algo"] in ("quant", "hadamard-quant"):
        qc = Q.QuantConfig.from_cfg(cfg, unit.hadamard)
        fns.update({"kernel_enc": lambda: QH.encode(x, qc), "kernel_dec": lambda: QH.decode(p),
                    "before_enc": lambda: Q.quantize(x, qc), "before_dec": lambda: Q.dequantize(p),
                    "parse_cfg": lambda: unit._seeded(cfg, ctx())})
        row["alloc_enc_before_b"] = peak_bytes(lambda: Q.quantize(x, qc))
    row.update({k: round(v, 1) for k, v in best_us(fns, reps).items()})
    row["alloc_enc_b"] = peak_bytes(lambda: unit.encode_host(x, "float32", cfg, ctx()))
    row["wire_bytes"] = sum(len(memoryview(f).cast("B")) for f in frames)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="8,32,64", help="one message's shape (bench_wan's small GPT: 8,32,64)")
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    shape = tuple(int(v) for v in args.shape.split(","))
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).numpy()
    load0 = os.getloadavg()[0]
    out = {"benchmark": "profile_codecs", "shape": list(shape), "dense_bytes": x.nbytes, "codecs": {}}
    for name, cfg, ef in CASES:
        r = profile(name, cfg, ef, x, args.reps)
        out["codecs"][name] = r
        print(name, r, flush=True)
    out["load_1min"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
    print(json.dumps(out))


if __name__ == "__main__":
    main()

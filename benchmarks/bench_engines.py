"""Engines side by side on the ONNX-imported tiny transformer.

Exports ``examples/models/tiny_transformer.py`` with ``torch.onnx.export``,
imports it, and times training steps (2 micro-batches) on: the torch engine
(anchor), the NumPy engine, and torch + NumPy parts in one process. Prints
human lines, then one JSON line of step-time ratios against the anchor
measured in this run, plus the largest loss difference between engines.

    python benchmarks/bench_engines.py [--steps 20] [--batch 8] [--d 64]
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import tempfile
import time
from pathlib import Path

import torch

from fusion.executors.optim import OptimizerConfig
from fusion.executors.reference import ReferenceExecutor
from fusion.ir.onnx_import import load_onnx

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8, help="micro-batch size")
    ap.add_argument("--d", type=int, default=64, help="model width")
    ap.add_argument("--seq", type=int, default=32)
    args = ap.parse_args()
    spec = importlib.util.spec_from_file_location("tt", ROOT / "examples/models/tiny_transformer.py")
    tt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tt)
    torch.manual_seed(0)
    vocab = 256
    module = tt.TinyTransformer(vocab=vocab, d=args.d, heads=4, seq=args.seq, layers=2).eval()
    ex_args = (torch.randint(0, vocab, (args.batch, args.seq)), torch.randint(0, vocab, (args.batch, args.seq)))
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "tt.onnx"
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            torch.onnx.export(module, ex_args, str(path), dynamo=True, optimize=False)
        t_export = time.perf_counter() - t0
        t0 = time.perf_counter()
        model = load_onnx(path)
        t_import = time.perf_counter() - t0
    print(f"tiny transformer d={args.d} seq={args.seq} micro-batch={args.batch}: {len(model.graph.nodes)} nodes, "
          f"{sum(p.trainable for p in model.graph.params.values())} trainable tensors; export {t_export:.2f}s, import {t_import:.3f}s")
    names = list(model.graph.nodes)
    half = {n: ("a" if i < len(names) // 2 else "b") for i, n in enumerate(names)}
    configs = {
        "torch": (None, None),
        "numpy": (None, {"p0": "numpy"}),
        "torch+numpy": (half, {"a": "torch", "b": "numpy"}),
    }
    g = torch.Generator().manual_seed(1)
    batch = {"idx": torch.randint(0, vocab, (2 * args.batch, args.seq), generator=g),
             "targets": torch.randint(0, vocab, (2 * args.batch, args.seq), generator=g)}
    times, losses = {}, {}
    for name, (assign, engines) in configs.items():
        ex = ReferenceExecutor(model, assign, OptimizerConfig("adamw", lr=1e-3), micro_batches=2, engines=engines)
        ex.step(batch)  # warm-up
        t0 = time.perf_counter()
        losses[name] = [ex.step(batch).loss for _ in range(args.steps)]
        times[name] = (time.perf_counter() - t0) / args.steps
        print(f"  {name:12s} {times[name] * 1e3:8.2f} ms/step   final loss {losses[name][-1]:.6f}")
    diff = max(abs(a - b) / abs(b) for name in losses for a, b in zip(losses[name], losses["torch"]))
    print(json.dumps({"bench": "engines", "anchor": "torch", "anchor_ms_per_step": round(times["torch"] * 1e3, 3),
                      "ratio_numpy": round(times["numpy"] / times["torch"], 3),
                      "ratio_torch+numpy": round(times["torch+numpy"] / times["torch"], 3),
                      "max_rel_loss_diff": diff, "steps": args.steps}))


if __name__ == "__main__":
    main()

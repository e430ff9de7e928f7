"""Engines side by side on the ONNX-imported tiny transformer.

Exports ``examples/models/tiny_transformer.py`` with ``torch.onnx.export``,
imports it, and times training steps (2 micro-batches) on: the torch engine
(anchor), the NumPy engine, and torch + NumPy parts in one process. Prints
human lines, then one JSON line of step-time ratios against the anchor
measured in this run, plus the largest loss difference between engines.

    python benchmarks/bench_engines.py [--steps 20] [--batch 8] [--d 64]

Both engines run single-threaded (torch.set_num_threads(1), OPENBLAS/OMP
threads 1 unless set) so the comparison is per core, not per thread pool.
"""
from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import importlib.util  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from fusion.plan import OptimizerConfig  # noqa: E402
from fusion.executors.reference import ReferenceExecutor  # noqa: E402
from fusion.ir.onnx.importer import load_onnx  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8, help="micro-batch size")
    ap.add_argument("--d", type=int, default=64, help="model width")
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds (the best is kept)")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
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
    executors = {}
    for name, (assign, engines) in configs.items():
        executors[name] = ReferenceExecutor(model, assign, OptimizerConfig("adamw", lr=1e-3), micro_batches=2, engines=engines)
    times = {name: float("inf") for name in configs}
    losses = {name: [] for name in configs}
    per_round = max(1, args.steps // args.rounds)
    for _ in range(args.rounds):  # interleaved rounds, best round kept: robust to a busy shared machine
        for name, ex in executors.items():
            t0 = time.perf_counter()
            losses[name] += [ex.step(batch).loss for _ in range(per_round)]
            times[name] = min(times[name], (time.perf_counter() - t0) / per_round)
    for name in configs:
        print(f"  {name:12s} {times[name] * 1e3:8.2f} ms/step (best of {args.rounds} rounds)   final loss {losses[name][-1]:.6f}")
    diff = max(abs(a - b) / abs(b) for name in losses for a, b in zip(losses[name], losses["torch"]))
    print(json.dumps({"bench": "engines", "anchor": "torch", "anchor_ms_per_step": round(times["torch"] * 1e3, 3),
                      "ratio_numpy": round(times["numpy"] / times["torch"], 3),
                      "ratio_torch+numpy": round(times["torch+numpy"] / times["torch"], 3),
                      "max_rel_loss_diff": diff, "steps": args.steps}))


if __name__ == "__main__":
    main()

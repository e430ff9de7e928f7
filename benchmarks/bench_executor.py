"""Overhead of the reference executor against eager PyTorch on one GPT training step.

Both sides run the same traced GPT (examples/models/gpt.py) from the same
weights in the same process with the same thread count: eager PyTorch does
forward + backward + AdamW step on the module; fusion does the same step
through ``ReferenceExecutor`` (one part: the torch engine runs the OP-DAG
node by node). Repetitions are interleaved (eager, ours, ours, eager, ...)
and the medians are compared. Wall-clock time is the headline; the thread's
CPU time is printed too, because on a shared machine other processes stretch
wall-clock time but not the CPU time this thread spends.

    python benchmarks/bench_executor.py [--model small] [--reps 30] [--threads 1]

Prints human-readable lines, then one JSON line:
``{"overhead_vs_eager": ours/eager, "ours_ms": ..., "eager_ms": ..., "model": ..., "threads": ...}``.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _load_gpt():
    spec = importlib.util.spec_from_file_location("fusion_examples_gpt", ROOT / "examples" / "models" / "gpt.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small", choices=["tiny", "small"], help="GPT size from examples/models/gpt.py")
    p.add_argument("--batch", type=int, default=8, help="sequences per step (one micro-batch)")
    p.add_argument("--reps", type=int, default=30, help="timed repetitions of each side")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads for both sides")
    args = p.parse_args(argv)

    from fusion.executors.optim import OptimizerConfig, torch_optimizer
    from fusion.executors.reference import ReferenceExecutor
    from fusion.ir.trace import trace

    torch.set_num_threads(args.threads)
    gpt = _load_gpt()
    cfg = {"tiny": gpt.TINY, "small": gpt.SMALL}[args.model]
    module, example = gpt.gpt_model(cfg, batch=args.batch, seed=0)
    model = trace(module, example)
    opt_cfg = OptimizerConfig("adamw", lr=1e-3)
    ours = ReferenceExecutor(model, None, opt_cfg)
    eager_opt = torch_optimizer(opt_cfg, module.parameters())
    n_params = sum(p.numel() for p in module.parameters())
    print(f"model: GPT {args.model} ({cfg.n_layer} layers, width {cfg.d_model}, {cfg.seq_len} tokens, "
          f"vocab {cfg.vocab}, {n_params / 1e6:.2f} M parameters), batch {args.batch}, "
          f"{len(model.graph)} graph nodes, {args.threads} thread(s)")

    g = torch.Generator().manual_seed(1)
    batches = [{"idx": torch.randint(0, cfg.vocab, (args.batch, cfg.seq_len), generator=g),
                "targets": torch.randint(0, cfg.vocab, (args.batch, cfg.seq_len), generator=g)} for _ in range(4)]

    def eager_step(b):
        eager_opt.zero_grad(set_to_none=True)
        loss = module(**b)
        loss.backward()
        eager_opt.step()
        return loss.item()

    def ours_step(b):
        return ours.step(b).loss

    # same weights, same batches: the two sides must agree (a benchmark of a wrong result is worthless)
    diffs = [abs(eager_step(b) - ours_step(b)) for b in batches[: args.warmup]]
    print(f"warm-up: |loss(eager) - loss(fusion)| max {max(diffs):.2e}")
    times: dict[str, list[float]] = {"eager": [], "ours": []}
    cpu: dict[str, list[float]] = {"eager": [], "ours": []}
    sides = {"eager": eager_step, "ours": ours_step}
    for i in range(args.reps):
        order = ("eager", "ours") if i % 2 == 0 else ("ours", "eager")
        for side in order:
            b = batches[i % len(batches)]
            t0, c0 = time.perf_counter(), time.thread_time()
            sides[side](b)
            times[side].append(time.perf_counter() - t0)
            cpu[side].append(time.thread_time() - c0)
    eager_ms = statistics.median(times["eager"]) * 1e3
    ours_ms = statistics.median(times["ours"]) * 1e3
    print(f"eager PyTorch step:    median {eager_ms:8.2f} ms  (min {min(times['eager']) * 1e3:.2f})")
    print(f"fusion reference step: median {ours_ms:8.2f} ms  (min {min(times['ours']) * 1e3:.2f})")
    eager_cpu = statistics.median(cpu["eager"]) * 1e3
    ours_cpu = statistics.median(cpu["ours"]) * 1e3
    print(f"thread CPU time:       median {eager_cpu:8.2f} ms eager, {ours_cpu:.2f} ms fusion "
          f"({ours_cpu / eager_cpu:.3f}x)")
    print(f"overhead: {ours_ms / eager_ms:.3f}x eager wall-clock (target <= 1.10, goal 1.05)")
    result = {"overhead_vs_eager": round(ours_ms / eager_ms, 4), "ours_ms": round(ours_ms, 3),
              "eager_ms": round(eager_ms, 3), "model": f"gpt-{args.model}-b{args.batch}", "threads": args.threads,
              "cpu_overhead_vs_eager": round(ours_cpu / eager_cpu, 4)}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

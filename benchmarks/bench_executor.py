"""Overhead of the reference executor against eager PyTorch on one GPT training step.

Both sides run the same traced GPT (examples/models/gpt.py) from the same
weights in the same process with the same thread count: eager PyTorch does
forward + backward + AdamW step on the module; fusion does the same step
through ``ReferenceExecutor`` (one part: the torch engine runs the OP-DAG
node by node). Repetitions are interleaved (eager, ours, ours, eager, ...)
and the medians are compared. Wall-clock time is the headline; the thread's
CPU time is printed too, because on a shared machine other processes stretch
wall-clock time but not the CPU time this thread spends.

Three fusion sides run interleaved with eager: ``compiled`` (the default: the
part's forward is one generated fx function), ``interpreted`` (the node-by-node
loop, ``compiled=False``) and, with ``--torch-compile``, ``torch.compile`` of the
part module (``compile=True``).

    python benchmarks/bench_executor.py [--model small] [--reps 30] [--threads 1] [--torch-compile]

Prints human-readable lines, then one JSON line:
``{"overhead_vs_eager": compiled/eager, "overhead_vs_eager_interpreted": ..., "ours_ms": ..., "eager_ms": ..., ...}``.
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
sys.path.insert(0, str(ROOT))  # measure the checkout this script is in, not another installed copy


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
    p.add_argument("--torch-compile", action="store_true", help="also time torch.compile of the part (compile=True)")
    args = p.parse_args(argv)

    from fusion.executors.engines.torch.optimizer import torch_optimizer
    from fusion.plan import OptimizerConfig
    from fusion.executors.reference import ReferenceExecutor
    from fusion.ir.trace import trace

    torch.set_num_threads(args.threads)
    gpt = _load_gpt()
    cfg = {"tiny": gpt.TINY, "small": gpt.SMALL}[args.model]
    module, example = gpt.gpt_model(cfg, batch=args.batch, seed=0)
    model = trace(module, example)
    opt_cfg = OptimizerConfig("adamw", lr=1e-3)
    ours = {"compiled": ReferenceExecutor(model, None, opt_cfg),
            "interpreted": ReferenceExecutor(model, None, opt_cfg, engine_options={"*": {"compiled": False}})}
    if args.torch_compile:
        ours["torch.compile"] = ReferenceExecutor(model, None, opt_cfg, engine_options={"*": {"compile": True}})
    assert ours["compiled"].engines["p0"].compiled and not ours["interpreted"].engines["p0"].compiled
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

    # same weights, same batches: every side must agree (a benchmark of a wrong result is worthless)
    sides = {"eager": eager_step, **{k: (lambda b, ex=ex: ex.step(b).loss) for k, ex in ours.items()}}
    t0 = time.perf_counter()
    losses = {k: [f(b) for b in batches[: args.warmup]] for k, f in sides.items()}
    diffs = {k: max(abs(a - b) for a, b in zip(v, losses["eager"])) for k, v in losses.items() if k != "eager"}
    print(f"warm-up ({time.perf_counter() - t0:.1f} s): |loss(eager) - loss(fusion)| max " +
          ", ".join(f"{k} {d:.2e}" for k, d in diffs.items()))
    names = list(sides)
    times: dict[str, list[float]] = {k: [] for k in names}
    cpu: dict[str, list[float]] = {k: [] for k in names}
    for i in range(args.reps):
        order = names[i % len(names):] + names[:i % len(names)]  # rotate who goes first
        for side in order:
            b = batches[i % len(batches)]
            t0, c0 = time.perf_counter(), time.thread_time()
            sides[side](b)
            times[side].append(time.perf_counter() - t0)
            cpu[side].append(time.thread_time() - c0)
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    cms = {k: statistics.median(v) * 1e3 for k, v in cpu.items()}
    for k in names:
        print(f"{k:>14} step: median {ms[k]:8.2f} ms (min {min(times[k]) * 1e3:.2f}), thread CPU {cms[k]:8.2f} ms, "
              f"{ms[k] / ms['eager']:.3f}x eager wall, {cms[k] / cms['eager']:.3f}x CPU")
    result = {"overhead_vs_eager": round(ms["compiled"] / ms["eager"], 4),
              "overhead_vs_eager_interpreted": round(ms["interpreted"] / ms["eager"], 4),
              "ours_ms": round(ms["compiled"], 3), "interpreted_ms": round(ms["interpreted"], 3),
              "eager_ms": round(ms["eager"], 3), "model": f"gpt-{args.model}-b{args.batch}", "threads": args.threads,
              "cpu_overhead_vs_eager": round(cms["compiled"] / cms["eager"], 4),
              "cpu_overhead_vs_eager_interpreted": round(cms["interpreted"] / cms["eager"], 4),
              "reps": args.reps}
    if "torch.compile" in ms:
        result["overhead_vs_eager_torch_compile"] = round(ms["torch.compile"] / ms["eager"], 4)
        result["torch_compile_ms"] = round(ms["torch.compile"], 3)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

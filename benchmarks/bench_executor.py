"""Overhead of the reference executor against eager PyTorch on one GPT training step.

Both sides run the same traced GPT (examples/models/gpt.py) from the same
weights in the same process with the same thread count: eager PyTorch does
forward + backward + AdamW step on the module; fusion does the same step
through ``ReferenceExecutor`` (one part: the torch engine runs the OP-DAG).

Measured in paired rounds: each round runs one step of eager and of every
fusion side back to back (the order rotates from round to round), the round's
ratio fusion/eager is taken, and the headline is the median of those per-round
ratios. Load from other processes drifts over seconds, a round lasts a few
hundred milliseconds, so both sides of a ratio see the same load; a ratio of
two medians taken over the whole run does not have that property. Wall-clock
time is the headline; the thread's CPU time (which other processes do not
stretch) and the minor page faults per step are printed for each side.

``--heap steady`` (the default) raises glibc's mmap/trim thresholds for the
whole process before anything is measured (:mod:`fusion.executors.runtime.heap`,
what ``fusion executor`` does too), so neither side page-faults its tensors in
anew every step; ``--heap default`` leaves the allocator as it is.

Three fusion sides are measured: ``compiled`` (the default: the part's
forward is one generated fx function), ``interpreted`` (the node-by-node
loop, ``compiled=False``) and, with ``--torch-compile``, ``torch.compile`` of the
part module (``compile=True``).

    python benchmarks/bench_executor.py [--model small] [--rounds 60] [--threads 1] [--heap steady|default] [--torch-compile]

Prints human-readable lines, then one JSON line:
``{"overhead_vs_eager": median per-round compiled/eager, "overhead_vs_eager_interpreted": ..., "heap": ..., ...}``.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import resource
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


def _minor_faults() -> int:
    """Minor page faults of this thread so far (of the process where RUSAGE_THREAD is missing)."""
    who = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)
    return resource.getrusage(who).ru_minflt


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small", choices=["tiny", "small"], help="GPT size from examples/models/gpt.py")
    p.add_argument("--batch", type=int, default=8, help="sequences per step (one micro-batch)")
    p.add_argument("--rounds", "--reps", dest="rounds", type=int, default=60,
                   help="paired rounds (one timed step of every side each)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads for both sides")
    p.add_argument("--heap", default="steady", choices=["steady", "default"],
                   help="steady: raise glibc's mmap/trim thresholds for both sides first; default: leave the allocator")
    p.add_argument("--torch-compile", action="store_true", help="also time torch.compile of the part (compile=True)")
    args = p.parse_args(argv)

    from fusion.executors.engines.torch.optimizer import torch_optimizer
    from fusion.plan import OptimizerConfig
    from fusion.executors.reference import ReferenceExecutor
    from fusion.ir.trace import trace

    from fusion.executors.runtime.heap import steady_heap

    if args.rounds < 2:
        p.error("--rounds must be at least 2")
    # before any tensor exists: both sides run on the same allocator settings
    heap = "steady" if args.heap == "steady" and steady_heap() else "default"
    if heap != args.heap:
        print(f"--heap {args.heap}: not available here (no glibc mallopt); measuring with the default heap")
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
    faults: dict[str, int] = {k: 0 for k in names}
    for i in range(args.rounds):
        order = names[i % len(names):] + names[:i % len(names)]  # rotate who goes first
        b = batches[i % len(batches)]
        for side in order:
            f0 = _minor_faults()
            t0, c0 = time.perf_counter(), time.thread_time()
            sides[side](b)
            times[side].append(time.perf_counter() - t0)
            cpu[side].append(time.thread_time() - c0)
            faults[side] += _minor_faults() - f0
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    cms = {k: statistics.median(v) * 1e3 for k, v in cpu.items()}
    pf = {k: round(v / args.rounds, 1) for k, v in faults.items()}
    # per-round ratios: both steps of a ratio ran within the same few hundred milliseconds
    wall_r = {k: [a / e for a, e in zip(times[k], times["eager"])] for k in names}
    cpu_r = {k: [a / e for a, e in zip(cpu[k], cpu["eager"])] for k in names}
    wr = {k: statistics.median(v) for k, v in wall_r.items()}
    cr = {k: statistics.median(v) for k, v in cpu_r.items()}
    print(f"{args.rounds} paired rounds, heap {heap}")
    for k in names:
        q1, _, q3 = statistics.quantiles(wall_r[k], n=4)
        print(f"{k:>14} step: median {ms[k]:8.2f} ms (min {min(times[k]) * 1e3:.2f}), thread CPU {cms[k]:8.2f} ms, "
              f"{pf[k]:7.1f} minor faults/step; per round vs eager: wall {wr[k]:.3f}x (IQR {q1:.3f}-{q3:.3f}), "
              f"CPU {cr[k]:.3f}x")
    result = {"overhead_vs_eager": round(wr["compiled"], 4),
              "overhead_vs_eager_interpreted": round(wr["interpreted"], 4),
              "ours_ms": round(ms["compiled"], 3), "interpreted_ms": round(ms["interpreted"], 3),
              "eager_ms": round(ms["eager"], 3), "model": f"gpt-{args.model}-b{args.batch}", "threads": args.threads,
              "cpu_overhead_vs_eager": round(cr["compiled"], 4),
              "cpu_overhead_vs_eager_interpreted": round(cr["interpreted"], 4),
              "heap": heap, "rounds": args.rounds, "page_faults_per_step": pf}
    if "torch.compile" in ms:
        result["overhead_vs_eager_torch_compile"] = round(wr["torch.compile"], 4)
        result["torch_compile_ms"] = round(ms["torch.compile"], 3)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

"""``fusion coordinator PLAN --bind ADDR --steps N``: drive executors started by hand on other hosts.

Also home of :func:`train`, the step loop shared with ``fusion run``:
progress bar (step, loss, samples/s), metrics JSONL, final weights.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)


def add_common(p: argparse.ArgumentParser) -> None:
    """Options shared by ``run`` and ``coordinator``."""
    p.add_argument("--steps", type=int, default=10, help="train until this many steps are done (default 10)")
    p.add_argument("--emulate-links", action="store_true",
                   help="delay and rate-limit every link by the plan's alpha/beta (rehearse a plan on one host)")
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="N", help="checkpoint every N steps (0: never)")
    p.add_argument("--resume", action="store_true", help="continue from the last complete checkpoint")
    p.add_argument("--data", default="auto", metavar="auto|text|synthetic|FILE.py:FUNCTION",
                   help="training data: auto (generated text corpus for language models, synthetic otherwise), "
                        "or your FUNCTION(step) returning {placeholder: array of all micro-batches}")
    p.add_argument("--peer-timeout", type=float, default=10.0, help="a CompNode silent this long has failed (s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_parser(sub) -> None:
    p = sub.add_parser("coordinator", help="coordinate executors started with `fusion executor` (multi-host runs)",
                       description="Bind ADDR, wait for one `fusion executor` per part of PLAN, and train.")
    p.add_argument("plan", help="plan directory")
    p.add_argument("--bind", required=True, help="address to listen on, e.g. tcp://*:5555")
    p.add_argument("--out", default="runs/coordinator", help="metrics, checkpoints and final weights go here")
    add_common(p)
    p.set_defaults(run=run)


def train(coord, batch_fn: Callable[[int], dict], first: int, steps: int, out: Path, progress: bool = True) -> dict:
    """Run steps ``first..steps-1``; append metrics to ``out/metrics.jsonl``; save ``out/final.safetensors``."""
    from ..plan import save_arrays

    out.mkdir(parents=True, exist_ok=True)
    bar = None
    if progress and first < steps:
        from tqdm import tqdm

        bar = tqdm(total=steps, initial=first, desc="train", unit="step", file=sys.stderr, dynamic_ncols=True)
    last = None
    with open(out / "metrics.jsonl", "a") as mf:
        for step in range(first, steps):
            r = coord.step(batch_fn(step))
            last = r
            parts = {p: {"forward_s": round(sum(s["forward_s"]), 6), "backward_s": round(sum(s["backward_s"]), 6),
                         "idle_s": round(s["idle_s"], 6), "rejected": s["rejected"],
                         "bytes_sent": sum(v["bytes"] for v in s["sent"].values())} for p, s in r.parts.items()}
            mf.write(json.dumps({"step": r.step, "loss": r.loss, "iteration_s": round(r.iteration_s, 6),
                                 "samples_per_s": round(r.samples_per_s, 3), "time": time.time(), "parts": parts}) + "\n")
            mf.flush()
            if bar is not None:
                bar.set_postfix(loss=f"{r.loss:.4f}", samples_s=f"{r.samples_per_s:.1f}")
                bar.update(1)
    if bar is not None:
        bar.close()
    state = coord.fetch_state()
    tmp = out / "final.safetensors.tmp"
    save_arrays(state, tmp, {k: spec.dtype for k, spec in coord.plan.graph.params.items()})
    tmp.replace(out / "final.safetensors")
    return {"steps": steps, "loss": None if last is None else last.loss}


def run(args: argparse.Namespace) -> int:
    from ..data import make_batches
    from ..executors.coordinator import Coordinator, CoordinatorConfig
    from ..plan import load_plan

    plan = load_plan(args.plan)
    out = Path(args.out)
    cfg = CoordinatorConfig(bind=args.bind, emulate_links=args.emulate_links, checkpoint_dir=str(out / "checkpoints"),
                            checkpoint_every=args.checkpoint_every, peer_timeout_s=args.peer_timeout)
    coord = Coordinator(plan, cfg)
    try:
        print(f"coordinator listening on {coord.bind()}; waiting for {len(plan.parts)} executors: {', '.join(plan.parts)}",
              file=sys.stderr)
        first = coord.start(resume=args.resume)
        train(coord, make_batches(plan, args.data, plan.seed), first, args.steps, out, not args.no_progress)
        coord.stop()
        time.sleep(0.5)  # let stop messages leave before the sockets close
    finally:
        coord.close()
    return 0

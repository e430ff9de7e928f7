"""Measured data parallelism: samples/s of 2 replicas x 2 stages against 1 x 2 on ``local-4-two-sites``.

Run:  OMP_NUM_THREADS=1 python benchmarks/bench_dp_measured.py [--steps 6] [--warmup 2] [--micro 4]
      (from a checkout other than the installed one: PYTHONPATH=. in front)

The model is the tiny GPT of ``examples/models/gpt.py:tiny`` (micro-batches of 2 rows), cut into two
contiguous stages. Every run is real CompNode processes on loopback with ``--emulate-links``: each
link is delayed and rate-limited by the cluster's alpha/beta (1 Gbit/s and 1 ms inside a site,
20 Mbit/s and 30 ms between the two sites), gradient all-reduce chunks included.

* anchor ``1x2``: one pipeline on cpu-0 -> cpu-1 (site a), ``--micro`` micro-batches per step;
* ``2x2``: that pipeline plus a second on cpu-2 -> cpu-3 (site b), the same micro-batches per replica
  (twice the global batch), each stage's two replicas averaging gradients across the 20 Mbit/s link;
* ``2x2_same_global``: the same grid at the anchor's global batch (half the micro-batches per replica);
* ``2x2_quant8``: ``2x2`` with the gradient exchange quantised to 8 bits (``--dp-codec quant:bits=8``, lossy).

samples/s = rows per step / median iteration seconds over ``--steps`` steps after ``--warmup``.
Final JSON line: samples/s of each and the ratios ``dp2x2_over_1x2``, ``dp2x2_same_global_over_1x2`` and
``dp2x2_quant8_over_1x2``.
The host's cores are shared by every CompNode (4 processes for 2x2), so the ratio is a lower bound of
what 4 separate machines would see.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "examples" / "clusters" / "local-4-two-sites.yaml"
MODEL = f"{ROOT / 'examples' / 'models' / 'gpt.py'}:tiny"


def make_plan(grid: list[list[str]], micro: int, out: Path, dp_codec: dict | None = None) -> Path:
    from fusion.cluster import load_cluster
    from fusion.executors.reference import contiguous_parts
    from fusion.ir.boundary import part_order
    from fusion.loader import load_model
    from fusion.plan import OptimizerConfig, save_plan
    from fusion.replicas import compile_replicated

    model = load_model(MODEL)
    asg = contiguous_parts(model.graph, 2)
    order = part_order(model.graph, asg)
    cut = {n: order.index(p) for n, p in asg.items()}
    rows = 2
    plan = compile_replicated(model, load_cluster(CLUSTER), cut, grid, micro_batches=micro,
                              global_batch=len(grid) * micro * rows, optimizer=OptimizerConfig("sgd", lr=0.01),
                              dp_codec=dp_codec)
    return save_plan(plan, out, params=model.params)


def measure(plan_dir: Path, run_dir: Path, steps: int, warmup: int) -> dict:
    from local_runs import emulated_steps

    plan, reports = emulated_steps(plan_dir, run_dir, steps, warmup)
    it = statistics.median(r.iteration_s for r in reports)
    rows = reports[0].samples
    return {"parts": len(plan.parts), "rows_per_step": rows, "iteration_s": round(it, 5),
            "samples_per_s": round(rows / it, 3), "losses": [round(r.loss, 5) for r in reports]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--micro", type=int, default=4, help="micro-batches per replica (even)")
    args = ap.parse_args(argv)
    t0 = time.time()
    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        two = [["cpu-0", "cpu-1"], ["cpu-2", "cpu-3"]]
        cases = {"1x2": ([["cpu-0", "cpu-1"]], args.micro, None),
                 "2x2": (two, args.micro, None),
                 "2x2_same_global": (two, args.micro // 2, None),
                 "2x2_quant8": (two, args.micro, {"algo": "quant", "bits": 8})}
        for name, (grid, micro, codec) in cases.items():
            plan = make_plan(grid, micro, tmp / f"{name}.plan", codec)
            res[name] = measure(plan, tmp / f"{name}.run", args.steps, args.warmup)
            print(f"{name}: {res[name]['parts']} CompNodes, {res[name]['rows_per_step']} rows/step, "
                  f"{res[name]['iteration_s']:.4f} s/iteration, {res[name]['samples_per_s']:.1f} samples/s",
                  file=sys.stderr, flush=True)
    anchor = res["1x2"]["samples_per_s"]
    print(json.dumps({"bench": "dp_measured", "cluster": "local-4-two-sites", "emulate_links": True,
                      "model": "examples/models/gpt.py:tiny", "steps": args.steps,
                      "samples_per_s": {k: v["samples_per_s"] for k, v in res.items()},
                      "iteration_s": {k: v["iteration_s"] for k, v in res.items()},
                      "dp2x2_over_1x2": round(res["2x2"]["samples_per_s"] / anchor, 3),
                      "dp2x2_same_global_over_1x2": round(res["2x2_same_global"]["samples_per_s"] / anchor, 3),
                      "dp2x2_quant8_over_1x2": round(res["2x2_quant8"]["samples_per_s"] / anchor, 3),
                      "wall_s": round(time.time() - t0, 1)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

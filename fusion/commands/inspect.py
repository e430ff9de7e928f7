"""``fusion inspect PLAN``: print what a plan does and draw it."""
from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("inspect", help="print a plan's parts and cut edges, and draw it as a PNG",
                       description="Print a table (part -> device, nodes, FLOPs, memory, predicted compute and "
                                   "communication) and the cut edges (bytes, link, ratio); write a PNG of the "
                                   "partitioned DAG and the device clusters.")
    p.add_argument("plan", help="plan directory (or its plan.json)")
    p.add_argument("--png", help="where to write the picture (default: PLAN/plan.png)")
    p.add_argument("--no-png", action="store_true", help="only print the table")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from fusion.inspect import draw_plan, plan_report
    from fusion.plan import load_plan

    plan = load_plan(args.plan)
    print(plan_report(plan))
    from fusion.executors.runtime.plandigest import plan_digest

    print(f"\ndigest {plan_digest(args.plan)} (SHA-256 of plan.json, weights and plugins; the executors and the "
          "coordinator of a run compare it at hello)")
    if not args.no_png:
        base = Path(args.plan)
        png = Path(args.png) if args.png else (base if base.is_dir() else base.parent) / "plan.png"
        print(f"\nwrote {draw_plan(plan, png)}")
    return 0

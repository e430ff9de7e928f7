"""``fusion inspect PLAN``: print what a plan does and draw it."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fusion.options.commands import Inspect


def run(args: "Inspect") -> int:
    """``fusion inspect`` with its options (:class:`fusion.options.commands.Inspect`)."""
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

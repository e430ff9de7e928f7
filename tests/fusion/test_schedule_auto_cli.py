"""``--schedule auto`` on the command line (issue 17): ``fusion run MODEL`` trains the schedule the
compiler priced fastest, exactly as if that schedule had been given; bad values are one line, exit 2."""
import numpy as np

from fusion.plan import load_plan
from tests.fusion.test_run_cli import _fusion, _losses, _run_model

ARGS = ("--strategy", "equal-flops", "--micro-batches", "4", "--steps", "2")


def test_run_with_schedule_auto_trains_the_chosen_schedule(cli, tmp_path):
    r, out = _run_model(cli, tmp_path / "auto", *ARGS, "--schedule", "auto")
    assert r.returncode == 0, r.stderr[-3000:]
    plan = load_plan(out / "plan")
    prices = plan.predicted["schedules"]
    assert len(plan.parts) > 1 and set(prices) == {"gpipe", "1f1b", "zb1"}
    fit = {n: v["iteration_s"] for n, v in prices.items() if v["fits"]}
    assert prices[plan.schedule]["iteration_s"] == min(fit.values())
    r2, out2 = _run_model(cli, tmp_path / "fixed", *ARGS, "--schedule", plan.schedule)
    assert r2.returncode == 0, r2.stderr[-3000:]
    assert load_plan(out2 / "plan").assignment == plan.assignment
    a, b = _losses(out), _losses(out2)
    assert len(a) == 2 and np.allclose(a, b, rtol=1e-6, atol=0), (a, b)
    shown = _fusion(cli, "inspect", str(out / "plan"))
    assert shown.returncode == 0 and f"{plan.schedule}*" in shown.stdout and "schedules (auto" in shown.stdout


def test_bad_schedule_values_exit_2_with_one_line(cli, tmp_path):
    (tmp_path / "c.json").write_text("{}")
    r = _fusion(cli, "compile", "m.py:f", "--cluster", str(tmp_path / "c.json"), "--schedule", "zigzag",
                "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "--schedule" in r.stderr, r.stderr
    r, _ = _run_model(cli, tmp_path / "dp", "--strategy", "dp", "--global-batch", "8", "--schedule", "auto")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "--schedule auto" in r.stderr

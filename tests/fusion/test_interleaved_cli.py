"""``fusion compile --schedule interleaved --virtual-stages V`` (issue 17) through the in-process CLI: the
plan it writes loads and checks, ``fusion inspect`` shows the virtual stages; bad input is one line, exit 2."""
from pathlib import Path

import pytest

from fusion.cli import main
from fusion.plan import load_plan
from tests.fusion.cli_helpers import one_line

ROOT = Path(__file__).resolve().parents[2]
LOCAL = str(ROOT / "examples" / "clusters" / "local-4-two-sites.yaml")
GPT = f"{ROOT / 'examples' / 'models' / 'gpt.py'}:tiny"


def test_compile_interleaved_writes_a_plan_that_loads_and_inspect_shows_its_virtual_stages(tmp_path, capsys):
    out = tmp_path / "plan"
    assert main(["compile", GPT, "--cluster", LOCAL, "--strategy", "equal-flops", "--schedule", "interleaved",
                 "--virtual-stages", "2", "--micro-batches", "8", "-o", str(out)]) == 0
    said = capsys.readouterr().out
    assert "8 parts on 4 of 4 devices (equal-flops), 2 virtual stages per device (interleaved 1F1B)" in said
    plan = load_plan(out)
    plan.check("reloaded")
    assert plan.schedule == "interleaved" and plan.micro_batches == 8
    assert plan.lanes() == {f"cpu-{r}": [f"part{r}", f"part{r + 4}"] for r in range(4)}
    assert set(plan.predicted["schedules"]) == {"interleaved"}
    assert main(["inspect", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "schedules (fixed, simulated): interleaved* " in shown
    assert "virtual stages (interleaved 1F1B, 2 chunks per device, one executor per device): cpu-0: part0, part4 (" in shown
    rows = {line.split()[0]: line.split() for line in shown.splitlines() if line.startswith("part")}
    assert rows["part4"][2:4] == ["cpu-0", "1/2"] and rows["part3"][2:4] == ["cpu-3", "0/2"]
    assert (out / "plan.png").stat().st_size > 0


def test_auto_with_virtual_stages_prices_interleaved_on_its_own_cut(tmp_path, capsys):
    out = tmp_path / "plan"
    assert main(["compile", GPT, "--cluster", LOCAL, "--strategy", "equal-flops", "--schedule", "auto",
                 "--virtual-stages", "2", "--micro-batches", "8", "-o", str(out)]) == 0
    prices = load_plan(out).predicted["schedules"]
    assert set(prices) == {"gpipe", "1f1b", "zb1", "interleaved"}
    plan = load_plan(out)
    fit = {n: v["iteration_s"] for n, v in prices.items() if v["fits"]}
    assert prices[plan.schedule]["iteration_s"] == min(fit.values())
    assert len(plan.parts) == (8 if plan.schedule == "interleaved" else 4)


@pytest.mark.parametrize("args,says", [
    (["--strategy", "equal-flops", "--schedule", "1f1b", "--virtual-stages", "2"],
     "--virtual-stages 2: virtual stages are chunks of interleaved 1F1B; give --schedule interleaved (or auto), not 1f1b"),
    (["--strategy", "equal-flops", "--schedule", "interleaved", "--micro-batches", "6"],
     "--micro-batches 6 is not a multiple of the 4 devices of the interleaved pipeline (2 virtual stages x 4 devices)"),
    (["--schedule", "interleaved", "--virtual-stages", "2", "--micro-batches", "8"],
     "strategy opfence cuts a DAG, not a chain of chunks round-robin over devices; use --strategy equal-flops"),
    (["--strategy", "equal-flops", "--schedule", "interleaved", "--micro-batches", "8", "--replicas", "2"],
     "--replicas 2: interleaved 1F1B runs one pipeline"),
    (["--strategy", "dp", "--global-batch", "8", "--schedule", "interleaved"],
     "the dp planner plans data-parallel replicas, which interleaved 1F1B does not run"),
])
def test_bad_interleaved_input_is_one_line_exit_2(tmp_path, capsys, args, says):
    assert main(["compile", GPT, "--cluster", LOCAL, *args, "-o", str(tmp_path / "o")]) == 2
    assert says in one_line(capsys)
    assert not (tmp_path / "o").exists()


def test_virtual_stages_below_one_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["compile", GPT, "--cluster", LOCAL, "--schedule", "interleaved", "--virtual-stages", "0",
              "-o", str(tmp_path / "o")])
    assert e.value.code == 2 and "argument --virtual-stages: must be at least 1, got 0" in one_line(capsys)


def test_run_mirrors_the_flags_and_a_plan_refuses_them(tmp_path, capsys):
    assert main(["run", GPT, "--cluster", LOCAL, "--virtual-stages", "2", "--out", str(tmp_path / "r")]) == 2
    assert "--virtual-stages 2: virtual stages are chunks of interleaved 1F1B" in one_line(capsys)
    plan = tmp_path / "plan"
    assert main(["compile", GPT, "--cluster", LOCAL, "--strategy", "equal-flops", "--schedule", "interleaved",
                 "--micro-batches", "4", "-o", str(plan)]) == 0
    capsys.readouterr()
    assert main(["run", str(plan), "--virtual-stages", "2", "--out", str(tmp_path / "r2")]) == 2
    assert "--virtual-stages only apply when compiling a MODEL" in one_line(capsys)


GPT_DATA = '''
import numpy as np

def tokens(step):
    g = np.random.default_rng([5, step])
    return {"idx": g.integers(0, 64, (8, 16)), "targets": g.integers(0, 64, (8, 16))}
'''


def test_run_trains_an_interleaved_plan_like_the_reference(tmp_path, capsys):
    """`fusion run MODEL --schedule interleaved`: one executor per device (2 parts each) trains the compiled plan
    exactly as the in-process reference executor runs it (losses rtol 1e-5), with one log per device."""
    import json

    import numpy as np

    from fusion.executors.reference import ReferenceExecutor
    from fusion.loader import load_function, load_model
    from fusion.plan import OptimizerConfig

    (tmp_path / "data.py").write_text(GPT_DATA)
    out = tmp_path / "run"
    assert main(["run", GPT, "--cluster", str(ROOT / "examples" / "clusters" / "local-4-one-site.yaml"),
                 "--strategy", "equal-flops", "--schedule", "interleaved", "--micro-batches", "4", "--steps", "3",
                 "--data", f"{tmp_path / 'data.py'}:tokens", "--out", str(out), "--no-progress"]) == 0
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    plan = load_plan(out / "plan")
    assert sorted(p.name for p in (out / "logs").iterdir()) == [f"part{r}+part{r + 4}.log" for r in range(4)]
    ref = ReferenceExecutor(load_model(GPT), plan.assignment, OptimizerConfig(**plan.optimizer),
                            micro_batches=plan.micro_batches, schedule="interleaved",
                            devices={p: part.device for p, part in plan.parts.items()})
    data = load_function(f"{tmp_path / 'data.py'}:tokens")
    np.testing.assert_allclose(losses, [ref.step(data(s)).loss for s in range(3)], rtol=1e-5)

"""Option values are checked before the model is traced (issue 26).

Before: ``--lr -1``, ``--compress-ratio 0`` and ``--engine part0=jax`` were refused only after a 6-15 s trace
and compile (or not at all: ``--lr -1`` trained)."""
import time

import pytest

from fusion.cli import main
from tests.fusion.cli_helpers import one_line

MODEL = "examples/models/gpt.py:small"  # a trace of seconds: a check after it could not pass the time bound


@pytest.mark.parametrize("cmd", ["run", "compile"])
@pytest.mark.parametrize("opt, words", [
    (["--lr", "-1"], "--lr -1.0: must be a positive number"),
    (["--compress-ratio", "0"], "--compress-ratio 0.0: must be at least 1"),
    (["--engine", "part0=jax"], "--engine part0=jax: unknown engine 'jax' (known: numpy, torch)"),
    (["--momentum", "1.5"], "--momentum 1.5: must be in [0, 1)"),
])
def test_bad_option_values_are_one_line_before_the_trace(tmp_path, capsys, cmd, opt, words):
    out = ["--out", str(tmp_path / "r")] if cmd == "run" else ["-o", str(tmp_path / "p")]
    t = time.monotonic()
    assert main([cmd, MODEL, "--cluster", "examples/clusters/local-4-one-site.yaml", *opt, *out]) == 2
    took = time.monotonic() - t
    assert words in one_line(capsys)
    assert took < 1.0, took  # a trace of gpt.py:small alone takes seconds
    assert not (tmp_path / "r").exists() and not (tmp_path / "p").exists()


def test_run_config_results_on_stdout_step_log_and_csv(cli, tmp_path):
    """One run from a config file (the command line overrides its --steps): the result is the one line on stdout;
    stderr, not a terminal, gets a step log although --no-progress; metrics.csv holds metrics.jsonl's steps.
    Before: stdout was empty, nothing was printed per step with --no-progress, there was no CSV and no --config."""
    import csv
    import json
    from pathlib import Path

    from tests.fusion.cli_helpers import cnn_model

    repo = Path(__file__).resolve().parents[2]
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"target: {cnn_model(tmp_path)}\ncluster: {repo / 'examples/clusters/local-4-one-site.yaml'}\n"
                   "steps: 50\nmicro_batches: 1\nlr: 0.05\nno-progress: true\ntrace: 'off'\ninsecure: true\n"
                   "log-every: 0\ndata: synthetic\n")
    out = tmp_path / "run"
    r = cli.run(["run", "--config", str(cfg), "--steps", "3", "--out", str(out)], tmp_path, 280)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    assert r.stdout.splitlines() == [f"done: 3 steps, final loss {rows[-1]['loss']:.6g}, run folder {out}"], r.stdout
    assert [ln.split()[1] for ln in r.stderr.splitlines() if ln.startswith("step ")] == ["1/3", "2/3", "3/3"], r.stderr
    with open(out / "metrics.csv") as f:
        table = list(csv.DictReader(f))
    assert [int(t["step"]) for t in table] == [0, 1, 2]
    assert [float(t["loss"]) for t in table] == [row["loss"] for row in rows]
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        assert not (out / "tensorboard").exists()  # skipped without the package
    else:
        assert any((out / "tensorboard").iterdir())


@pytest.mark.parametrize("text, words", [
    ("stepz: 3\n", "unknown option 'stepz'"),
    ("no-progress: 1\n", "'no-progress' is a flag: true or false"),
    ("[1, 2]\n", "expected a mapping"),
    ("steps: 0\n", "'steps' (--steps): must be at least 1, got 0"),
    ("optimizer: adam\n", "'optimizer' (--optimizer): invalid choice 'adam'"),
])
def test_bad_run_configs_are_one_line(tmp_path, capsys, text, words):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(text)
    assert main(["run", "x.py:f", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err and str(cfg) in err, err


def test_the_command_line_overrides_the_config(tmp_path):
    from fusion.options import parse

    cfg = tmp_path / "run.yaml"
    cfg.write_text("target: a.py:f\nsteps: 5\nlr: 0.1\nengine: [numpy, part0=torch]\ninsecure: true\n")
    o = parse(["run", "--config", str(cfg), "--lr", "0.2"])[1]
    assert (o.target, o.train.steps, o.compile.lr, o.compile.engine, o.launch.insecure) == \
        ("a.py:f", 5, 0.2, ["numpy", "part0=torch"], True)
    o = parse(["-v", "run", "b.py:g", "--config", str(cfg), "--steps", "7", "--engine", "part1=numpy"])[1]
    assert (o.target, o.train.steps, o.compile.engine) == ("b.py:g", 7, ["numpy", "part0=torch", "part1=numpy"])


def test_stop_at_val_loss_ends_the_run_at_the_first_evaluation_that_reaches_it(tmp_path, capsys):
    """Time to a quality (issue 36): --steps is the cap, the run stops after the first held-out loss <= LOSS."""
    import json as _json
    from pathlib import Path

    from fusion.cli import main as _main

    ROOT = Path(__file__).resolve().parents[2]

    plan = tmp_path / "p"
    assert _main(["compile", str(ROOT / "examples/models/gpt.py:tiny"), "--cluster", "local-4-two-sites", "-o", str(plan)]) == 0
    out = tmp_path / "r"
    assert _main(["run", str(plan), "--steps", "8", "--eval-every", "2", "--stop-at-val-loss", "1e9",
                  "--out", str(out), "--no-progress"]) == 0
    lines = [_json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if "loss" in x] == [0, 1] and sum("val_loss" in x for x in lines) == 1
    assert _main(["run", str(plan), "--steps", "2", "--stop-at-val-loss", "1", "--out", str(out),
                  "--overwrite"]) == 2
    assert "--stop-at-val-loss needs --eval-every" in capsys.readouterr().err

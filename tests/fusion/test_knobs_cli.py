"""``--lr-schedule``, ``--warmup-steps``, ``--lr-decay-steps``, ``--clip-grad-norm``: a bad value is one line naming the
option, exit status 2, before the model is traced (in-process, through the CLI's parser)."""
import json

import numpy as np

import pytest

from fusion.cli import main
from fusion.cluster.scenarios import load_scenario

#: a model file that leaves a mark when it is imported: tracing it would import it
MODEL = '''
import pathlib
pathlib.Path(__file__).with_name("traced").write_text("imported")
def fn():
    raise AssertionError("never traced")
'''


@pytest.fixture
def files(tmp_path):
    (tmp_path / "model.py").write_text(MODEL)
    cluster = tmp_path / "cluster.json"
    cluster.write_text(json.dumps(load_scenario("local-4-two-sites").to_dict()))
    return tmp_path, [f"{tmp_path / 'model.py'}:fn", "--cluster", str(cluster), "--out", str(tmp_path / "run")]


@pytest.mark.parametrize("command", ["run", "compile"])
@pytest.mark.parametrize("args,option", [
    (["--lr-schedule", "exponential"], "--lr-schedule"),
    (["--warmup-steps", "-1"], "--warmup-steps"),
    (["--warmup-steps", "two"], "--warmup-steps"),
    (["--lr-decay-steps", "0"], "--lr-decay-steps"),
    (["--clip-grad-norm", "0"], "--clip-grad-norm"),
    (["--clip-grad-norm", "nan"], "--clip-grad-norm"),
    (["--clip-grad-norm", "inf"], "--clip-grad-norm"),
    (["--lr", "-1"], "--lr"),
    (["--lr-schedule", "cosine", "--lr-decay-steps", "4", "--warmup-steps", "5"], "--warmup-steps"),
    (["--lr-decay-steps", "4"], "--lr-decay-steps"),  # with the constant schedule it would be ignored
])
def test_bad_knob_is_one_line_naming_the_option_before_tracing(files, capsys, command, args, option):
    tmp, target = files
    if command == "compile":
        target = [target[0], "--cluster", target[2], "-o", str(tmp / "plan")]
    try:
        rc = main([command, *target, *args])
    except SystemExit as e:  # argparse's own check of the value
        rc = e.code
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and option in err, err
    assert not (tmp / "traced").exists() and not (tmp / "run").exists()


def test_compile_needs_the_decay_length_of_a_decaying_schedule(files, capsys):
    tmp, target = files
    rc = main(["compile", target[0], "--cluster", target[2], "-o", str(tmp / "plan"), "--lr-schedule", "linear"])
    err = capsys.readouterr().err
    assert rc == 2 and "--lr-decay-steps" in err and not (tmp / "traced").exists()


def test_run_warmup_longer_than_the_run_is_refused(files, capsys):
    tmp, target = files
    rc = main(["run", *target, "--lr-schedule", "cosine", "--warmup-steps", "11", "--steps", "10"])
    err = capsys.readouterr().err
    assert rc == 2 and "--warmup-steps 11" in err and not (tmp / "traced").exists()


@pytest.mark.parametrize("args,option", [(["--eval-every", "-1"], "--eval-every"),
                                         (["--eval-every", "1", "--eval-batches", "0"], "--eval-batches")])
def test_bad_eval_option_is_one_line(files, capsys, args, option):
    tmp, target = files
    with pytest.raises(SystemExit) as e:
        main(["run", *target, *args])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and option in err, err
    assert not (tmp / "traced").exists()


DATA_SRC = '''
import numpy as np
def batches(step):
    r = np.random.default_rng(step)
    return {"x": r.standard_normal((4, 3, 6, 6)).astype("float32"), "y": r.integers(0, 5, 4)}
'''


def test_data_function_without_split_is_refused_for_evaluation(tmp_path, capsys):
    from tests.fusion.cli_helpers import cnn_model

    model = cnn_model(tmp_path)
    (tmp_path / "data.py").write_text(DATA_SRC)
    cluster = tmp_path / "cluster.json"
    cluster.write_text(json.dumps(load_scenario("local-4-two-sites").to_dict()))
    rc = main(["run", model, "--cluster", str(cluster), "--out", str(tmp_path / "run"), "--micro-batches", "2",
               "--data", f"{tmp_path / 'data.py'}:batches", "--eval-every", "1", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "split='val'" in err and "batches" in err.splitlines()[-1]


def test_run_with_knobs_and_evaluation_writes_them_and_eval_leaves_the_weights_alone(tmp_path, capsys):
    """``fusion run`` with warmup + cosine, a clip and --eval-every: the plan holds the knobs, metrics.jsonl the
    norms and held-out losses, loss.png is drawn; the final weights are bit for bit those of the same run without
    evaluation."""
    from tests.fusion.cli_helpers import cnn_model

    model = cnn_model(tmp_path)
    cluster = tmp_path / "cluster.json"
    cluster.write_text(json.dumps(load_scenario("local-4-two-sites").to_dict()))
    common = ["run", model, "--cluster", str(cluster), "--strategy", "equal-count", "--micro-batches", "2",
              "--steps", "3", "--data", "synthetic", "--no-progress", "--trace", "off", "--optimizer", "adamw",
              "--lr-schedule", "cosine", "--warmup-steps", "1", "--clip-grad-norm", "0.05"]
    assert main([*common, "--out", str(tmp_path / "a"), "--eval-every", "2", "--eval-batches", "2"]) == 0
    err = capsys.readouterr().err
    assert "step 2/3: val_loss" in err and "metrics.jsonl step 1)" in err  # printed: steps done; stored: 0-based
    assert main([*common, "--out", str(tmp_path / "b")]) == 0
    plan = json.loads((tmp_path / "a" / "plan" / "plan.json").read_text())
    assert {k: plan["optimizer"][k] for k in ("lr_schedule", "warmup_steps", "total_steps", "clip_grad_norm")} == \
        {"lr_schedule": "cosine", "warmup_steps": 1, "total_steps": 3, "clip_grad_norm": 0.05}
    assert len(plan["parts"]) >= 2
    lines = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if "loss" in m]
    assert [m["step"] for m in steps] == [0, 1, 2] and all(m["grad_norm"] > 0.05 for m in steps)  # the clip binds
    # the schedule as it ran (0.01 base, warmup 1, cosine over 3 steps): 0, then the base, then half of it
    assert [m["lr"] for m in steps] == pytest.approx([0.0, 0.01, 0.005])
    vals = [m for m in lines if "val_loss" in m]
    assert [m["step"] for m in vals] == [1] and np.isfinite(vals[0]["val_loss"])
    assert (tmp_path / "a" / "loss.png").stat().st_size > 0
    assert (tmp_path / "a" / "final.safetensors").read_bytes() == (tmp_path / "b" / "final.safetensors").read_bytes()

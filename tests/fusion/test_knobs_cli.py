"""``--lr-schedule``, ``--warmup-steps``, ``--lr-decay-steps``, ``--clip-grad-norm``: a bad value is one line naming the
option, exit status 2, before the model is traced (in-process, through the CLI's parser)."""
import json

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

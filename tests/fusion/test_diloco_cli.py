"""`fusion compile/run --dp-sync diloco` through the real CLI: the plan's dp_sync, bad options as one line (exit 2)."""
from pathlib import Path

import pytest

from fusion.cli import main
from fusion.plan import load_plan
from tests.fusion.cli_helpers import cnn_model as _model, one_line as _one_line

ROOT = Path(__file__).resolve().parents[2]
LOCAL = str(ROOT / "examples" / "clusters" / "local-4-two-sites.yaml")


def test_compile_writes_the_diloco_sync_into_the_plan(tmp_path, capsys):
    out = tmp_path / "d.plan"
    assert main(["compile", _model(tmp_path), "--cluster", LOCAL, "--replicas", "2", "--global-batch", "8",
                 "--dp-sync", "diloco", "--inner-steps", "5", "--outer-lr", "0.5", "--outer-momentum", "0.8",
                 "--no-nesterov", "--pseudo-codec", "quant:bits=4", "--pseudo-error-feedback", "-o", str(out)]) == 0
    s = load_plan(out).dp_sync
    assert (s.mode, s.inner_steps, s.outer_lr, s.outer_momentum, s.nesterov, s.codec, s.error_feedback) == (
        "diloco", 5, 0.5, 0.8, False, {"algo": "quant", "bits": 4}, True)
    assert main(["compile", _model(tmp_path), "--cluster", LOCAL, "--replicas", "2", "--dp-sync", "diloco",
                 "-o", str(tmp_path / "e.plan")]) == 0
    s = load_plan(tmp_path / "e.plan").dp_sync
    assert (s.mode, s.inner_steps, s.outer_lr, s.outer_momentum, s.nesterov, s.codec) == ("diloco", 20, 0.7, 0.9, True, None)
    assert load_plan(out.parent / "e.plan").dp_codec is None
    capsys.readouterr()


BAD = [  # (options, what the one line says)
    (["--replicas", "2", "--dp-sync", "diloco", "--inner-steps", "0"], "--inner-steps 0: DiLoCo takes at least one"),
    (["--dp-sync", "diloco"], "--dp-sync diloco needs --replicas 2 or more"),
    (["--replicas", "2", "--dp-sync", "diloco", "--pseudo-codec", "hadamard-quant:bits=4"],
     "codec 'hadamard-quant' is not allowed for pseudo-gradients"),
    (["--replicas", "2", "--dp-sync", "diloco", "--pseudo-codec", "delta:bits=8"], "not allowed for pseudo-gradients"),
    (["--replicas", "2", "--dp-sync", "diloco", "--pseudo-codec", "quant:bits=2"], "take bits=8 or bits=4, got bits=2"),
    (["--replicas", "2", "--dp-sync", "diloco", "--pseudo-codec", "nope"], "unknown codec 'nope'"),
    (["--replicas", "2", "--dp-sync", "diloco", "--pseudo-error-feedback"], "--pseudo-error-feedback needs a lossy"),
    (["--replicas", "2", "--dp-sync", "diloco", "--dp-codec", "quant:bits=8"], "use --pseudo-codec"),
    (["--replicas", "2", "--dp-sync", "diloco", "--outer-momentum", "1"], "--outer-momentum must be < 1"),
    (["--replicas", "2", "--dp-sync", "diloco", "--outer-lr", "-1"], "--outer-lr must be a finite number >= 0"),
    (["--replicas", "2", "--inner-steps", "4"], "--inner-steps is an option of --dp-sync diloco"),
    (["--replicas", "2", "--dp-sync", "diloco", "--sync-fragments", "2"], "not built in the runtime yet"),
]


@pytest.mark.parametrize("opts,says", BAD, ids=[" ".join(b[0][2:]) or "one-replica" for b in BAD])
def test_bad_dp_sync_options_exit_2_with_one_line_before_the_model_is_traced(tmp_path, capsys, opts, says):
    # the model file does not exist: the options are refused before anything loads it
    assert main(["compile", str(tmp_path / "missing.py:nothing"), "--cluster", LOCAL, *opts,
                 "-o", str(tmp_path / "x")]) == 2
    assert says in _one_line(capsys)
    assert main(["run", str(tmp_path / "missing.py:nothing"), "--cluster", LOCAL, *opts, "--out",
                 str(tmp_path / "run")]) == 2
    assert says in _one_line(capsys)
    assert not (tmp_path / "x").exists() and not (tmp_path / "run").exists()

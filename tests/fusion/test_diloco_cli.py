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
    assert "DiLoCo H=5 outer lr 0.5 momentum 0.8 pseudo-gradients quant:bits=4" in capsys.readouterr().out
    s = load_plan(out).dp_sync
    assert (s.mode, s.inner_steps, s.outer_lr, s.outer_momentum, s.nesterov, s.codec, s.error_feedback) == (
        "diloco", 5, 0.5, 0.8, False, {"algo": "quant", "bits": 4}, True)
    assert main(["compile", _model(tmp_path), "--cluster", LOCAL, "--replicas", "2", "--dp-sync", "diloco",
                 "-o", str(tmp_path / "e.plan")]) == 0
    s = load_plan(tmp_path / "e.plan").dp_sync
    assert (s.mode, s.inner_steps, s.outer_lr, s.outer_momentum, s.nesterov, s.codec) == ("diloco", 20, 0.7, 0.6, True, None)
    assert load_plan(out.parent / "e.plan").dp_codec is None
    assert main(["compile", _model(tmp_path), "--cluster", LOCAL, "--replicas", "2", "--global-batch", "8",
                 "--dp-sync", "diloco", "--replica-shares", "0=3", "-o", str(tmp_path / "f.plan")]) == 0
    assert load_plan(tmp_path / "f.plan").dp_sync.shares == {0: 3.0}
    assert main(["compile", _model(tmp_path), "--cluster", LOCAL, "--replicas", "2", "--global-batch", "8",
                 "--dp-sync", "diloco", "--replica-shares", "0=9", "-o", str(tmp_path / "g.plan")]) == 2
    assert "--replica-shares: replica 1's share 1 of 4 micro-batches per step gives it none" in _one_line(capsys)
    capsys.readouterr()


def test_sparseloco_codec_brings_its_outer_step(tmp_path, capsys):
    """``--pseudo-codec sparseloco:...`` (SparseLoCo, arXiv 2508.15706): error feedback on without being asked and
    no outer momentum (its error feedback replaces it), unless ``--outer-momentum`` is given."""
    out = tmp_path / "s.plan"
    assert main(["compile", _model(tmp_path), "--cluster", LOCAL, "--replicas", "2", "--global-batch", "8",
                 "--dp-sync", "diloco", "--pseudo-codec", "sparseloco:chunk=64,k=8,beta=0.9", "-o", str(out)]) == 0
    s = load_plan(out).dp_sync
    assert (s.codec, s.error_feedback, s.outer_momentum) == (
        {"algo": "sparseloco", "chunk": 64, "k": 8, "beta": 0.9}, True, 0.0)
    assert main(["compile", _model(tmp_path), "--cluster", LOCAL, "--replicas", "2", "--global-batch", "8",
                 "--dp-sync", "diloco", "--pseudo-codec", "sparseloco", "--outer-momentum", "0.3",
                 "-o", str(tmp_path / "t.plan")]) == 0
    s = load_plan(tmp_path / "t.plan").dp_sync
    assert (s.codec, s.error_feedback, s.outer_momentum) == ({"algo": "sparseloco"}, True, 0.3)
    capsys.readouterr()


@pytest.mark.parametrize("extra", [["--pseudo-codec", "sparseloco"], ["--outer-delay", "1"]])
def test_an_outer_momentum_given_equal_to_the_default_is_still_given(tmp_path, capsys, extra):
    """``--outer-momentum 0.6`` is the user's choice even though 0.6 is the default: SparseLoCo and the eager step
    keep it instead of putting their own 0 (a given value was told from a left-out one by ``!= 0.6`` before)."""
    for given, want in (([], 0.0), (["--outer-momentum", "0.6"], 0.6)):
        out = tmp_path / f"m{len(given)}.plan"
        assert main(["compile", _model(tmp_path), "--cluster", LOCAL, "--replicas", "2", "--global-batch", "8",
                     "--dp-sync", "diloco", *extra, *given, "-o", str(out)]) == 0
        assert load_plan(out).dp_sync.outer_momentum == want, given
    capsys.readouterr()


def test_outer_delay_1_is_eager_unless_outer_overlap_delayed(tmp_path, capsys):
    """``--outer-delay 1`` writes the eager outer step (dp_sync.overlap "eager", written into plan.json) with its own
    outer momentum 0 unless ``--outer-momentum`` is given; ``--outer-overlap delayed`` asks for the naive one (not
    written, the shipped outer momentum); the compile line names the variant; a plan with delay 1 and no
    ``overlap`` in plan.json (every plan before the field) loads as the delayed step, what it ran."""
    import json

    from fusion.options.compile import DEFAULT_OUTER_MOMENTUM, EAGER_OUTER_MOMENTUM

    cases = (([], "eager", EAGER_OUTER_MOMENTUM), (["--outer-overlap", "delayed"], "delayed", DEFAULT_OUTER_MOMENTUM),
             (["--outer-overlap", "eager"], "eager", EAGER_OUTER_MOMENTUM),
             (["--outer-momentum", "0.3"], "eager", 0.3))
    for extra, want, momentum in cases:
        out = tmp_path / f"{want}{len(extra)}{momentum}.plan"
        assert main(["compile", _model(tmp_path), "--cluster", LOCAL, "--replicas", "2", "--dp-sync", "diloco",
                     "--inner-steps", "4", "--outer-delay", "1", *extra, "-o", str(out)]) == 0
        assert f"outer step one round late ({want})" in capsys.readouterr().out
        s = load_plan(out).dp_sync
        assert (s.delay, s.overlap, s.outer_momentum) == (1, want, momentum)
    assert main(["compile", _model(tmp_path), "--cluster", LOCAL, "--replicas", "2", "--dp-sync", "diloco",
                 "-o", str(tmp_path / "d0.plan")]) == 0
    assert "one round late" not in capsys.readouterr().out
    d0 = json.loads((tmp_path / "d0.plan" / "plan.json").read_text())["dp_sync"]
    assert "overlap" not in d0 and d0["outer_momentum"] == DEFAULT_OUTER_MOMENTUM  # delay 0: as before the field
    assert "overlap" not in json.loads((tmp_path / f"delayed2{DEFAULT_OUTER_MOMENTUM}.plan" / "plan.json").read_text())["dp_sync"]
    old = tmp_path / f"eager0{EAGER_OUTER_MOMENTUM}.plan" / "plan.json"
    assert json.loads(old.read_text())["dp_sync"]["overlap"] == "eager"
    d = json.loads(old.read_text())
    del d["dp_sync"]["overlap"]
    old.write_text(json.dumps(d))
    assert load_plan(old.parent).dp_sync.overlap == "delayed"


BAD = [  # (options, what the one line says)
    (["--replicas", "2", "--dp-sync", "diloco", "--inner-steps", "0"], "--inner-steps 0: DiLoCo takes at least one"),
    (["--dp-sync", "diloco"], "--dp-sync diloco needs --replicas 2 or more"),
    (["--replicas", "2", "--dp-sync", "diloco", "--pseudo-codec", "delta:bits=8"],
     "delta cannot compress pseudo-gradients"),
    (["--replicas", "2", "--dp-sync", "diloco", "--pseudo-codec", "quant:bits=3"], "bits must be one of 2, 4, 8, got 3"),
    (["--replicas", "2", "--dp-sync", "auto"], "--dp-sync auto is the --strategy dp planner's choice"),
    (["--replicas", "2", "--dp-sync", "diloco", "--inner-steps", "10,20"], "a list of H is for the --strategy dp"),
    (["--replicas", "2", "--dp-sync", "diloco", "--pseudo-codec", "nope"], "unknown codec 'nope'"),
    (["--replicas", "2", "--dp-sync", "diloco", "--pseudo-codec", "sparseloco:k=0"],
     "--pseudo-codec 'sparseloco:k=0': sparseloco cfg: k 0 must be an integer 1..chunk (4096)"),
    (["--replicas", "2", "--dp-sync", "diloco", "--pseudo-error-feedback"], "--pseudo-error-feedback needs a lossy"),
    (["--replicas", "2", "--dp-sync", "diloco", "--dp-codec", "quant:bits=8"], "runs only in its synchronous warm-up"),
    (["--replicas", "2", "--dp-sync", "diloco", "--outer-momentum", "1"], "--outer-momentum must be < 1"),
    (["--replicas", "2", "--dp-sync", "diloco", "--outer-lr", "-1"], "--outer-lr must be a finite number >= 0"),
    (["--replicas", "2", "--inner-steps", "4"], "--inner-steps is an option of --dp-sync diloco"),
    (["--replicas", "2", "--dp-sync", "diloco", "--outer-delay", "2"], "--outer-delay 2: an outer step is applied at once (0)"),
    (["--replicas", "2", "--outer-delay", "1"], "--outer-delay is an option of --dp-sync diloco"),
    (["--replicas", "2", "--dp-sync", "diloco", "--outer-delay", "1", "--outer-overlap", "lazy"],
     "--outer-overlap lazy: expected eager"),
    (["--replicas", "2", "--dp-sync", "diloco", "--outer-delay", "0", "--outer-overlap", "delayed"],
     "--outer-overlap delayed is an option of --outer-delay 1"),
    (["--replicas", "2", "--outer-overlap", "eager"], "--outer-overlap is an option of --dp-sync diloco"),
    (["--replicas", "2", "--dp-sync", "diloco", "--inner-steps", "2", "--sync-fragments", "3"],
     "--sync-fragments 3: streaming fragments must number 1 .. --inner-steps (2)"),
    (["--replicas", "2", "--dp-sync", "diloco", "--replica-shares", "2=1"], "names replica 2; there are 2"),
    (["--replicas", "2", "--dp-sync", "diloco", "--replica-shares", "1=x"], "expected REPLICA=SHARE items"),
    (["--replicas", "2", "--dp-sync", "diloco", "--replica-shares", "1=0"], "--replica-shares: every share must be"),
    (["--replicas", "2", "--replica-shares", "1=2"], "--replica-shares is an option of --dp-sync diloco"),
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


DATA_SRC = '''
import json, os, signal
from pathlib import Path
import numpy as np

def batches(step):
    if step == int(os.environ["DILOCO_AT"]):  # before this step: kill or stop replica 1's CompNode
        pids = json.loads((Path(os.environ["DILOCO_RUN"]) / "pids.json").read_text())
        os.killpg(pids["r1.part0"], getattr(signal, os.environ["DILOCO_SIG"]))
    g = np.random.default_rng([3, step])
    return {"x": g.standard_normal((8, 3, 6, 6)).astype(np.float32), "y": g.integers(0, 5, 8).astype(np.int64)}
'''


def _batch(step):
    import numpy as np

    g = np.random.default_rng([3, step])
    return {"x": g.standard_normal((8, 3, 6, 6)).astype(np.float32), "y": g.integers(0, 5, 8).astype(np.int64)}


def _cnn_loss(P, batch):
    import torch
    import torch.nn.functional as F

    h = torch.flatten(F.conv2d(batch["x"], P["conv.weight"], P["conv.bias"], padding=1), 1)
    return F.cross_entropy(F.linear(h, P["fc.weight"], P["fc.bias"]), batch["y"])


@pytest.mark.parametrize("sig,at", [("SIGKILL", 2), ("SIGSTOP", 3)], ids=["killed-mid-window", "stopped-at-outer-step"])
def test_a_replica_that_dies_or_stops_leaves_and_the_others_go_on(cli, tmp_path, sig, at):
    """`fusion run --dp-sync diloco --drop-failed-replicas`: replica 1 is killed (or stopped) before step ``at``;
    it leaves there (its inner steps since the last outer step are lost), the survivor takes the whole global
    batch and goes on; metrics.jsonl and loss.png record it, every loss and the final weights equal the
    plain-PyTorch DiLoCo reference with the same drop, and no step is lost or applied twice."""
    import json

    import numpy as np
    import torch

    from fusion.loader import load_model
    from fusion.plan import DPSync, load_weights
    from tests.executors.runtime.test_diloco import diloco_reference

    (tmp_path / "data.py").write_text(DATA_SRC)
    out = tmp_path / "run"
    r = cli.run(["run", _model(tmp_path), "--cluster", LOCAL, "--out", str(out),
                 "--replicas", "2", "--global-batch", "8", "--optimizer", "sgd", "--lr", "0.1", "--momentum", "0.9",
                 "--dp-sync", "diloco", "--inner-steps", "2", "--steps", "6", "--no-progress",
                 "--drop-failed-replicas", "--peer-timeout", "4", "--data", f"{tmp_path / 'data.py'}:batches"],
                Path.cwd(), 300, env={"DILOCO_RUN": str(out), "DILOCO_AT": str(at), "DILOCO_SIG": sig})
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"dropped replica 1 at step {at}" in r.stderr
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(6))
    (drop,) = lines[at]["dropped"]
    assert drop["replica"] == 1 and drop["part"] == "r1.part0" and drop["redone"]
    assert [x["step"] for x in lines if "outer" in x] == [1, 3, 5]
    assert [x["outer"]["replicas"] for x in lines if "outer" in x] == [2] + [1, 1]
    assert (out / "loss.png").exists()
    model = load_model(_model(tmp_path))
    sgd = (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))  # the plan's inner optimizer
    want = diloco_reference(model, _cnn_loss, [_batch(s) for s in range(6)], 2, 2, sgd,
                            DPSync("diloco", inner_steps=2), drop=(at, 1))
    np.testing.assert_allclose([x["loss"] for x in lines], [w[0] for w in want], rtol=1e-5)
    final = load_weights(out / "final.safetensors")
    for k, v in want[-1][1].items():
        np.testing.assert_allclose(final[k], v, rtol=1e-4, atol=1e-6, err_msg=k)



def test_outer_momentum_default_and_old_plans():
    """The default outer momentum is 0.6 (docs/data-parallel.md: 0.9 never reached synchronous DP's loss in the
    convergence study's tuning); plans keep what they were written with: the field is always written, and a
    dp_sync without it (written by hand) loads as 0.9, the default it was written under."""
    from fusion.plan import DPSync

    assert DPSync("diloco").outer_momentum == 0.6
    assert DPSync.from_dict({"mode": "diloco", "inner_steps": 5}).outer_momentum == 0.9
    for mu in (0.9, 0.6, 0.0):
        d = DPSync("diloco", inner_steps=5, outer_momentum=mu).to_dict()
        assert d["outer_momentum"] == mu and DPSync.from_dict(d).outer_momentum == mu

"""`fusion run --dp-sync diloco --join-at STEP:REPLICA` through the real CLI: a third replica joins a running
two-replica job at an outer step (recorded, the losses and weights equal the plain-PyTorch reference with the
same join, `--resume` after it bit-exact), and join schedules that cannot run are one line, exit 2."""
import json
from pathlib import Path

import numpy as np
import pytest

from fusion.cli import main
from tests.fusion.cli_helpers import cnn_model as _model, one_line as _one_line

ROOT = Path(__file__).resolve().parents[2]
LOCAL = str(ROOT / "examples" / "clusters" / "local-4-two-sites.yaml")

DATA_SRC = '''
import numpy as np

def batches(step):
    g = np.random.default_rng([3, step])
    return {"x": g.standard_normal((12, 3, 6, 6)).astype(np.float32), "y": g.integers(0, 5, 12).astype(np.int64)}
'''

RUN = ["--replicas", "3", "--global-batch", "12", "--optimizer", "sgd", "--lr", "0.1", "--momentum", "0.9",
       "--dp-sync", "diloco", "--inner-steps", "2", "--steps", "6", "--no-progress", "--join-at", "2:2"]


def _batch(step):
    g = np.random.default_rng([3, step])
    return {"x": g.standard_normal((12, 3, 6, 6)).astype(np.float32), "y": g.integers(0, 5, 12).astype(np.int64)}


def test_a_replica_joins_at_an_outer_step_and_resume_after_the_join_is_bit_exact(cli, tmp_path):
    """Replicas 0 and 1 start (3 of the global batch's 6 micro-batches each); before step 2, after the first
    outer step, replica 2's executor starts, takes the global weights and outer momentum of replica 0 and
    the batch is re-split 2/2/2. metrics.jsonl records it, the outer steps average 2, then 3 replicas, and
    every loss and the final weights equal the plain-PyTorch DiLoCo reference with the same join. A resume
    from the checkpoint of step 4 (after the join: all three replicas saved) replays steps 4-5 bit for bit."""
    import torch

    from fusion.executors.runtime import checkpoint
    from fusion.loader import load_model
    from fusion.plan import DPSync, load_weights
    from tests.executors.runtime.test_diloco import diloco_reference
    from tests.fusion.test_diloco_cli import _cnn_loss

    (tmp_path / "data.py").write_text(DATA_SRC)
    out = tmp_path / "run"
    cmd = ["run", _model(tmp_path), "--cluster", LOCAL, "--out", str(out), *RUN,
           "--checkpoint-every", "4", "--data", f"{tmp_path / 'data.py'}:batches"]
    r = cli.run(cmd, Path.cwd(), 300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "replica 2 joined at step 2 (global weights and outer momentum from part0)" in r.stderr
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(6))
    assert [x.get("joined") for x in lines] == [None, None, [{"replica": 2, "step": 2, "parts": ["r2.part0"],
                                                             "from": ["part0"], "replicas": 3, "micro_batches": 2}],
                                                None, None, None]
    assert [x["outer"]["replicas"] for x in lines if "outer" in x] == [2, 3, 3]
    assert (out / "loss.png").exists()
    complete = json.loads((checkpoint.step_dir(out / "checkpoints", 4) / checkpoint.COMPLETE).read_text())
    assert sorted(complete["parts"]) == ["part0", "r1.part0", "r2.part0"] and complete["joined"][0]["replica"] == 2
    model = load_model(_model(tmp_path))
    sgd = (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))  # the plan's inner optimizer
    want = diloco_reference(model, _cnn_loss, [_batch(s) for s in range(6)], 3, 2, sgd,
                            DPSync("diloco", inner_steps=2), join=(2, 2))
    np.testing.assert_allclose([x["loss"] for x in lines], [w[0] for w in want], rtol=1e-5)
    final = load_weights(out / "final.safetensors")
    for k, v in want[-1][1].items():
        np.testing.assert_allclose(final[k], v, rtol=1e-4, atol=1e-6, err_msg=k)

    r = cli.run([*cmd, "--resume"], Path.cwd(), 300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming at step 4" in r.stderr and "joined" not in r.stderr  # all three start: the join is behind
    again = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in again] == list(range(6))
    assert [x["loss"] for x in again[4:]] == [x["loss"] for x in lines[4:]]
    resumed = load_weights(out / "final.safetensors")
    for k, v in final.items():
        np.testing.assert_array_equal(resumed[k], v, err_msg=k)


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """Three compiled plans of three one-stage replicas, DiLoCo with H = 2: 2 micro-batches per replica, 1, and 2
    with the delayed outer step."""
    d = tmp_path_factory.mktemp("join-plans")
    (d / "data.py").write_text(DATA_SRC)
    for name, rows, more in (("p.plan", "12", []), ("q.plan", "6", []), ("d.plan", "12", ["--outer-delay", "1"])):
        assert main(["compile", _model(d), "--cluster", LOCAL, "--replicas", "3", "--global-batch", rows,
                     "--dp-sync", "diloco", "--inner-steps", "2", *more, "-o", str(d / name)]) == 0
    return d


BAD = [  # (plan, run options, what the one line says)
    ("p.plan", ["--join-at", "3:2"], "step 3 is not an outer boundary (a multiple of --inner-steps 2"),
    ("p.plan", ["--join-at", "2:3"], "the plan has no replica 3 (replicas 0..2)"),
    ("p.plan", ["--join-at", "2:x"], "expected STEP:REPLICA"),
    ("p.plan", ["--join-at", "20:2"], "the run stops after --steps 6, before step 20"),
    ("p.plan", ["--join-at", "2:2", "--join-at", "4:2"], "replica 2 is given twice"),
    ("p.plan", ["--join-at", "2:0", "--join-at", "2:1", "--join-at", "2:2"], "every replica would start late"),
    ("q.plan", ["--join-at", "2:2"], "the global batch of 3 micro-batches does not divide over the 2 replicas "
                                     "training from step 0"),
    ("p.plan", ["--join-at", "2:2", "--ray", "127.0.0.1:1"], "--join-at with --ray is not built"),
    ("d.plan", ["--join-at", "2:2"], "joining with the delayed outer step (--outer-delay 1) is not built"),
]


@pytest.mark.parametrize("plan,opts,says", BAD, ids=[" ".join(b[1]) for b in BAD])
def test_a_join_schedule_that_cannot_run_is_one_line_before_anything_starts(plans, tmp_path, capsys, plan, opts, says):
    try:
        rc = main(["run", str(plans / plan), "--steps", "6", *opts, "--out", str(tmp_path / "run"),
                   "--data", f"{plans / 'data.py'}:batches"])
    except SystemExit as e:  # argparse's own error (a malformed STEP:REPLICA): also one line, status 2
        rc = e.code
    assert rc == 2
    assert says in _one_line(capsys)
    assert not (tmp_path / "run").exists()


def test_a_join_without_diloco_is_one_line_before_the_model_is_traced(tmp_path, capsys):
    # the model file does not exist: the option is refused before anything loads it
    assert main(["run", str(tmp_path / "missing.py:nothing"), "--cluster", LOCAL, "--replicas", "3", "--join-at", "2:2",
                 "--out", str(tmp_path / "run")]) == 2
    assert "--join-at: a replica joins a DiLoCo run (--dp-sync diloco with --replicas 2 or more)" in _one_line(capsys)
    assert not (tmp_path / "run").exists()


def test_a_joiner_whose_part_is_not_in_the_plan_is_one_line(plans, capsys):
    """`fusion executor PLAN --node r3.part0` for a plan of three replicas: refused naming the part (exit 2)."""
    plan = plans / "p.plan"
    assert main(["executor", str(plan), "--node", "r3.part0", "--coordinator", "tcp://127.0.0.1:9", "--insecure"]) == 2
    assert "plan has no part 'r3.part0' (parts: part0, r1.part0, r2.part0)" in _one_line(capsys)

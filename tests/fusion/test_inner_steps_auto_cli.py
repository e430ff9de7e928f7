"""`--inner-steps auto[:H]` through the real CLI (issue 34): each DiLoCo replica's inner steps per round from its
predicted speed, written into the plan, shown by `fusion inspect`, run by `fusion run` equal to the plain-PyTorch
reference; bad inputs (no speed estimate, combinations not built) one line, exit 2."""
import json
from pathlib import Path

import pytest

from fusion.cli import main
from fusion.plan import load_plan
from tests.fusion.cli_helpers import cnn_model as _model, one_line as _one_line

ROOT = Path(__file__).resolve().parents[2]
LOCAL = str(ROOT / "examples" / "clusters" / "local-4-two-sites.yaml")


def _cluster(tmp_path, fast: str = "200 GFLOPS", extra: str = "") -> str:
    """local-4-two-sites with cpu-0 four times as fast as the others (``fast``), ``extra`` added to its entry."""
    text = Path(LOCAL).read_text().replace("{name: cpu-0, group: site-a, peak_flops: 50 GFLOPS",
                                           f"{{name: cpu-0, group: site-a, peak_flops: {fast}{extra}")
    assert fast in text
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    return str(path)


def test_compile_gives_each_replica_its_h_by_predicted_speed(tmp_path, capsys):
    out = tmp_path / "a.plan"
    assert main(["compile", _model(tmp_path), "--cluster", _cluster(tmp_path), "--replicas", "2", "--global-batch",
                 "8", "--dp-sync", "diloco", "--inner-steps", "auto:8", "-o", str(out)]) == 0
    assert "DiLoCo H=8 (by speed: r0 8, r1 2)" in capsys.readouterr().out
    plan = load_plan(out)
    devices = [plan.parts[p].device for p in ("part0", "r1.part0")]
    assert devices[0] == "cpu-0" and devices[1] != "cpu-0"
    pr = plan.predicted["inner_steps_auto"]
    t0, t1 = pr["step_s"]
    assert t1 / t0 == pytest.approx(4, rel=0.05)  # compute-bound: the devices' speed ratio
    assert plan.dp_sync.inner_steps == 8 and plan.dp_sync.inner_steps_per_replica == {0: 8, 1: 2} == {
        r: max(1, int(8 * t0 / t + 0.5)) for r, t in enumerate(pr["step_s"])}
    # a round: 6 steps at the fast pace, 2 at the slow one, against 8 slow steps with equal H
    assert pr["round_s"] == pytest.approx(6 * t0 + 2 * t1) and pr["round_s_equal_h"] == pytest.approx(8 * t1)
    assert pr["fastest_wait_s"] < pr["fastest_wait_s_equal_h"]
    assert main(["inspect", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "inner steps by speed (H per round): r0 8 (" in shown and "r1 2 (" in shown
    assert "predicted round:" in shown and "fastest replica waits" in shown
    # `auto` alone: the fastest takes DiLoCo's default 20; equal speeds are no error: every replica gets H
    assert main(["compile", _model(tmp_path), "--cluster", LOCAL, "--replicas", "2", "--global-batch", "8",
                 "--dp-sync", "diloco", "--inner-steps", "auto", "-o", str(tmp_path / "b.plan")]) == 0
    assert load_plan(tmp_path / "b.plan").dp_sync.inner_steps_per_replica == {0: 20, 1: 20}
    # unequal shares: replica 0 runs 3 micro-batches per step, so its step is priced 3/2 of two
    assert main(["compile", _model(tmp_path), "--cluster", _cluster(tmp_path), "--replicas", "2", "--global-batch",
                 "8", "--dp-sync", "diloco", "--replica-shares", "0=3", "--inner-steps", "auto:8",
                 "-o", str(tmp_path / "c.plan")]) == 0
    c = load_plan(tmp_path / "c.plan")
    assert c.predicted["inner_steps_auto"]["step_s"][0] == pytest.approx(1.5 * t0)
    assert c.predicted["inner_steps_auto"]["step_s"][1] == pytest.approx(0.5 * t1)
    assert c.dp_sync.inner_steps_per_replica == {0: 8, 1: 6}  # 8 x 1.5 t0 / (0.5 x 4 t0) = 6
    capsys.readouterr()


def test_the_rule():
    from fusion.inner_steps import inner_steps_by_speed, parse_auto, round_prices

    assert inner_steps_by_speed([1.0, 2.0, 3.0, 100.0], 12) == {0: 12, 1: 6, 2: 4, 3: 1}
    assert inner_steps_by_speed([2.0, 1.0], 5) == {0: 3, 1: 5}  # 2.5 rounds half up
    assert inner_steps_by_speed([1.0, 1.0], 7) == {0: 7, 1: 7}
    assert parse_auto("auto", 20) == 20 and parse_auto("auto:3", 20) == 3 and parse_auto("4", 20) is None
    p = round_prices([1.0, 4.0], {0: 8, 1: 2}, 8, [1, 1])
    assert (p["round_s"], p["round_s_equal_h"], p["fastest_wait_s"], p["fastest_wait_s_equal_h"]) == (14, 32, 6, 24)
    assert p["micro_batches_per_s"] == 10 / 14 and p["micro_batches_per_s_equal_h"] == 16 / 32


def _data(tmp_path) -> str:
    (tmp_path / "data.py").write_text('''
import numpy as np

def batches(step):
    g = np.random.default_rng([3, step])
    return {"x": g.standard_normal((8, 3, 6, 6)).astype(np.float32), "y": g.integers(0, 5, 8).astype(np.int64)}
''')
    return f"{tmp_path / 'data.py'}:batches"


def test_fusion_run_with_auto_h_equals_the_reference(cli, tmp_path):
    """`fusion run --inner-steps auto:4` on a cluster where replica 1 is 4x slower: H = 4 and 1; metrics.jsonl
    names the idle part in steps 0-2 of each round, every loss and the final weights equal the plain-PyTorch
    reference (rtol 1e-5 / 1e-4)."""
    import numpy as np
    import torch

    from fusion.loader import load_model
    from fusion.plan import DPSync, load_weights
    from tests.executors.runtime.test_inner_steps_auto import reference
    from tests.fusion.test_diloco_cli import _batch, _cnn_loss

    out = tmp_path / "run"
    r = cli.run(["run", _model(tmp_path), "--cluster", _cluster(tmp_path), "--out", str(out), "--replicas", "2",
                 "--global-batch", "8", "--optimizer", "sgd", "--lr", "0.1", "--momentum", "0.9", "--dp-sync",
                 "diloco", "--inner-steps", "auto:4", "--steps", "8", "--no-progress", "--data", _data(tmp_path)],
                Path.cwd(), 300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert load_plan(out / "plan").dp_sync.inner_steps_per_replica == {0: 4, 1: 1}
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x.get("idle_parts", []) for x in lines] == [["r1.part0"]] * 3 + [[]] + [["r1.part0"]] * 3 + [[]]
    assert [x["step"] for x in lines if "outer" in x] == [3, 7]
    sync = load_plan(out / "plan").dp_sync
    assert isinstance(sync, DPSync)
    want = reference(load_model(_model(tmp_path)), _cnn_loss, [_batch(s) for s in range(8)], [2, 2], {0: 4, 1: 1},
                     sync, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    np.testing.assert_allclose([x["loss"] for x in lines], [w[0] for w in want], rtol=1e-5)
    final = load_weights(out / "final.safetensors")
    for k, v in want[-1][1].items():
        np.testing.assert_allclose(final[k], v, rtol=1e-4, atol=1e-6, err_msg=k)


BAD = [  # (options, what the one line says)
    (["--inner-steps", "auto:0"], "--inner-steps auto:0: the fastest replica takes at least one"),
    (["--inner-steps", "autox"], "--inner-steps autox: expected auto or auto:H"),
    (["--inner-steps", "auto", "--sync-fragments", "2"], "--inner-steps auto with --sync-fragments 2 is not built"),
    (["--inner-steps", "auto", "--outer-delay", "1"], "--inner-steps auto with --outer-delay 1 is not built"),
    (["--inner-steps", "auto", "--sync-warmup", "3"], "--inner-steps auto with --sync-warmup 3 is not built"),
]


@pytest.mark.parametrize("opts,says", BAD, ids=[" ".join(b[0][1:]) for b in BAD])
def test_bad_auto_options_exit_2_with_one_line_before_the_model_is_traced(tmp_path, capsys, opts, says):
    for cmd, out in (("compile", "-o"), ("run", "--out")):
        assert main([cmd, str(tmp_path / "missing.py:nothing"), "--cluster", LOCAL, "--replicas", "2",
                     "--dp-sync", "diloco", *opts, out, str(tmp_path / "x")]) == 2
        assert says in _one_line(capsys)
    assert main(["compile", str(tmp_path / "missing.py:nothing"), "--cluster", LOCAL, "--strategy", "dp",
                 "--global-batch", "8", "--dp-sync", "diloco", "--inner-steps", "auto", "-o", str(tmp_path / "x")]) == 2
    assert "--inner-steps auto with --strategy dp is not built" in _one_line(capsys)
    assert not (tmp_path / "x").exists()


def test_auto_h_without_a_speed_estimate_is_one_line(tmp_path, capsys):
    """cpu-0 carries a measured speed (lambda from fusion profile), replica 1's device only its nominal peak: the
    predicted step times do not compare, so replica 1 has no speed estimate."""
    cluster = _cluster(tmp_path, "200 GFLOPS", ", lambda: 0.5")
    assert main(["compile", _model(tmp_path), "--cluster", cluster, "--replicas", "2", "--global-batch", "8",
                 "--dp-sync", "diloco", "--inner-steps", "auto", "-o", str(tmp_path / "a.plan")]) == 2
    line = _one_line(capsys)
    assert "--inner-steps auto: replica 1's device(s) cpu-" in line and "have no measured speed" in line
    assert "there is no speed estimate" in line
    assert not (tmp_path / "a.plan").exists()


def test_a_plan_with_bad_per_replica_h_or_a_join_is_refused_by_fusion_run(tmp_path, capsys):
    plan = tmp_path / "a.plan"
    assert main(["compile", _model(tmp_path), "--cluster", _cluster(tmp_path), "--replicas", "2", "--global-batch",
                 "8", "--dp-sync", "diloco", "--inner-steps", "auto:4", "-o", str(plan)]) == 0
    capsys.readouterr()
    assert main(["run", str(plan), "--steps", "8", "--join-at", "4:1", "--out", str(tmp_path / "j")]) == 2
    assert "--join-at: joining with per-replica inner steps (--inner-steps auto) is not built" in _one_line(capsys)
    d = json.loads((plan / "plan.json").read_text())
    d["dp_sync"]["inner_steps_per_replica"] = {"0": 4, "1": 9}
    (plan / "plan.json").write_text(json.dumps(d))
    assert main(["run", str(plan), "--steps", "4", "--out", str(tmp_path / "r")]) == 2
    assert "dp_sync.inner_steps_per_replica: replica 1's H must be an integer in 1 .. inner_steps (4), got 9" in \
        _one_line(capsys)

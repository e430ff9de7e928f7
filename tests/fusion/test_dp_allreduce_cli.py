"""`fusion compile/run --dp-allreduce ring|tree|auto` through the real CLI; a bad value exits 2 with one line."""
from pathlib import Path

from fusion.cli import main
from fusion.plan import load_plan
from tests.fusion.cli_helpers import cnn_model as _model, one_line as _one_line

ROOT = Path(__file__).resolve().parents[2]
LOCAL = str(ROOT / "examples" / "clusters" / "local-4-two-sites.yaml")


def test_bad_dp_allreduce_exits_2_with_one_line(tmp_path, capsys):
    m = _model(tmp_path)
    assert main(["compile", m, "--cluster", LOCAL, "--replicas", "3", "--dp-allreduce", "star",
                 "-o", str(tmp_path / "a")]) == 2
    assert "--dp-allreduce 'star': expected ring, tree or auto" in _one_line(capsys)
    assert not (tmp_path / "a").exists()
    assert main(["run", m, "--cluster", LOCAL, "--replicas", "3", "--dp-allreduce", "binomial", "--steps", "1",
                 "--out", str(tmp_path / "r")]) == 2
    assert "--dp-allreduce 'binomial'" in _one_line(capsys)


def test_compile_records_the_algorithm_per_group_and_inspect_shows_it(tmp_path, capsys):
    m = _model(tmp_path)
    ring, tree, auto = (tmp_path / f"{x}.plan" for x in ("ring", "tree", "auto"))
    assert main(["compile", m, "--cluster", LOCAL, "--replicas", "3", "-o", str(ring)]) == 0
    assert load_plan(ring).dp_algo == {}  # the default: the ring, as plans were before
    assert main(["compile", m, "--cluster", LOCAL, "--replicas", "3", "--dp-allreduce", "tree", "-o", str(tree)]) == 0
    plan = load_plan(tree)
    assert plan.dp_algo == {"part0": "tree"} and plan.dp_algo_of("r2.part0") == "tree"
    priced = plan.predicted["dp_allreduce"]["part0"]
    assert priced["algo"] == "tree" and priced["tree_s"] > 0 and priced["ring_s"] > 0 and priced["grad_bytes"] > 0
    assert main(["compile", m, "--cluster", LOCAL, "--replicas", "3", "--dp-allreduce", "auto", "-o", str(auto)]) == 0
    p = load_plan(auto).predicted["dp_allreduce"]["part0"]  # auto: the cheaper of the two priced times
    assert p["algo"] == ("tree" if p["tree_s"] < p["ring_s"] else "ring") == load_plan(auto).dp_algo_of("part0")
    capsys.readouterr()
    assert main(["inspect", str(tree)]) == 0
    out = capsys.readouterr().out
    assert "part0: tree over part0 (" in out and "rooted at part0" in out and "predicted)" in out
    assert main(["inspect", str(ring)]) == 0
    assert "part0: ring part0 (" in capsys.readouterr().out

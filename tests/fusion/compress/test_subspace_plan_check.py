"""``Plan.check`` validates ``plan.json``'s ``subspace`` (issue 35, :func:`fusion.plan.check_subspace`): a hand-edited
plan whose subspace record disagrees with itself or with the graph is refused on load with one line naming the
field, exit 2 through ``fusion inspect PLAN`` and ``fusion run PLAN``."""
from __future__ import annotations

import json

import pytest

from fusion.plan import Plan, PlanError
from tests.executors.runtime.test_subspace_gpt import subspace_plan
from tests.fusion.cli_helpers import one_line


@pytest.fixture(scope="module")
def plan_dict(tmp_path_factory):
    _, _, plan = subspace_plan(tmp_path_factory.mktemp("sub"), 2)
    d = plan.to_dict()
    assert d["subspace"]["cuts"], "the fixture's plan must cut the stream"
    Plan.from_dict(json.loads(json.dumps(d)))  # the compiler's own plan passes
    return d


def _edit(d, change):
    e = json.loads(json.dumps(d))
    change(e["subspace"], e)
    return e


def _param(e, name):
    return next(p for p in e["graph"]["params"] if p["name"] == name)




EDITS = [
    ("rank = width", lambda s, _: s.update(rank=s["width"]), r"subspace\.rank must be an integer k with 1 <= k < the width 32, got 32"),
    ("rank > width", lambda s, _: s.update(rank=40), r"subspace\.rank .* got 40"),
    ("rank 0", lambda s, _: s.update(rank=0), r"subspace\.rank .* got 0"),
    ("rank negative", lambda s, _: s.update(rank=-3), r"subspace\.rank .* got -3"),
    ("rank a string", lambda s, _: s.update(rank="8"), r"subspace\.rank .* got '8'"),
    ("seed missing", lambda s, _: s.pop("seed"), r"subspace\.seed is missing \(the seed U and T are drawn from\)"),
    ("seed a float", lambda s, _: s.update(seed=1.5), r"subspace\.seed must be an integer >= 0"),
    ("width missing", lambda s, _: s.pop("width"), r"subspace\.width is missing"),
    ("table_std 0", lambda s, _: s.update(table_std=0), r"subspace\.table_std must be a finite number > 0"),
    ("dtype", lambda s, _: s.update(dtype="int64"), r"subspace\.dtype must be float32 or float64"),
    ("ids not an input", lambda s, _: s.update(ids=s["stream"][1]), r"subspace\.ids must be '' or an input node"),
    ("U resized", lambda s, e: _param(e, "subspace.U").update(shape=[32, 4]),
     r"subspace: graph parameter 'subspace\.U' must exist with shape \[32, 8\], not trainable"),
    ("U trainable", lambda s, e: _param(e, "subspace.U").update(trainable=True),
     r"graph parameter 'subspace\.U' must exist"),
    ("stream names no node", lambda s, _: s["stream"].append("nowhere"), r"subspace\.stream .* 'nowhere' is not one"),
    ("cut off the stream", lambda s, _: s["cuts"][0].update(producer="idx"),
     r"subspace\.cuts\[0\]\.producer 'idx' is not on the residual stream"),
    ("cut from another part", lambda s, _: s["cuts"][0].update(producer=s["stream"][-1]),
     r"subspace\.cuts\[0\]\.src 'part0' must be the part of the producer 'add_4' \(assignment: 'part1'\)"),
    ("cut to its own part", lambda s, _: s["cuts"][0].update(dsts=["part0"]), r"subspace\.cuts\[0\]\.dsts must list"),
    ("cut to an unknown part", lambda s, _: s["cuts"][0].update(dsts=["part7"]), r"subspace\.cuts\[0\]\.dsts"),
    ("coords not k wide", lambda s, _: s["cuts"][0].update(coords=s["cuts"][0]["producer"]),
     r"subspace\.cuts\[0\]\.coords '.*' must be a node on part 'part0' whose output is 8 wide"),
    ("output on the wrong part", lambda s, _: s["cuts"][0].update(outputs=[s["cuts"][0]["coords"]]),
     r"subspace\.cuts\[0\]\.outputs: '.*' must be a node on part 'part1' \(assignment: 'part0'\)"),
    ("cut field missing", lambda s, _: s["cuts"][0].pop("coords"), r"subspace\.cuts\[0\]\.coords is missing"),
    ("writer names no node", lambda s, _: s["writers"][0].update(node="gone"), r"subspace\.writers\[0\]\.node"),
    ("not a map", lambda s, e: e.update(subspace=[1, 2]), r"subspace: must be a map"),
]


@pytest.mark.parametrize("what,change,message", EDITS, ids=[e[0] for e in EDITS])
def test_hand_edited_subspace_is_refused_naming_the_field(plan_dict, what, change, message):
    with pytest.raises(PlanError, match=message):
        Plan.from_dict(_edit(plan_dict, change))


def test_cli_refuses_it_in_one_line(tmp_path, capsys, plan_dict):
    from fusion.cli import main
    from fusion.plan import save_plan

    plan_dir = tmp_path / "plan"
    save_plan(Plan.from_dict(json.loads(json.dumps(plan_dict))), plan_dir)
    text = json.loads((plan_dir / "plan.json").read_text())
    text["subspace"]["rank"] = 32
    (plan_dir / "plan.json").write_text(json.dumps(text))
    for cmd in (["inspect", str(plan_dir), "--no-png"], ["run", str(plan_dir), "--steps", "1"]):
        assert main(cmd) == 2, cmd
        line = one_line(capsys)
        assert "subspace.rank must be an integer k with 1 <= k < the width 32, got 32" in line, (cmd, line)

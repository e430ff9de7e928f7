"""A traced `transformers` model trained by `fusion run` on four CompNode processes
matches the in-process reference executor (issue 18)."""
import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers", reason="transformers is a test-only dependency (pip install -e .[test])")

REPO = Path(__file__).resolve().parents[2]
DATA_SRC = '''
import numpy as np

def tokens(step):
    g = np.random.default_rng(step)
    return {"input_ids": g.integers(0, 64, (4, 8)), "labels": g.integers(0, 64, (4, 8))}
'''


def test_loader_takes_module_example_and_trace_options(tmp_path):
    from fusion.ir.errors import FusionError
    from fusion.loader import load_model

    model = load_model(f"{REPO / 'tests/ir/hf_models.py'}:llama")
    assert [n.name for n in model.graph.nodes.values() if n.kind.value == "label"] == ["labels"]
    (tmp_path / "bad.py").write_text("from tests.ir.hf_models import entry\n"
                                     "def bad():\n    m, e, _ = entry('gpt2')\n    return m, e, {'labelz': ()}\n")
    with pytest.raises(FusionError, match=r"unknown trace option\(s\) \['labelz'\]"):
        load_model(f"{tmp_path / 'bad.py'}:bad")


def test_traced_llama_trains_on_four_compnodes_like_the_reference(cli, tmp_path):
    from fusion.plan import OptimizerConfig
    from fusion.executors.reference import ReferenceExecutor
    from fusion.loader import load_function, load_model
    from fusion.plan import load_plan

    (tmp_path / "data.py").write_text(DATA_SRC)
    spec = f"{REPO / 'tests/ir/hf_models.py'}:llama"
    out = tmp_path / "run"
    r = cli.run(["run", spec, "--cluster", "examples/clusters/local-4-two-sites.yaml", "--strategy", "equal-count",
                 "--micro-batches", "2", "--steps", "3", "--optimizer", "adamw", "--lr", "0.001",
                 "--data", f"{tmp_path / 'data.py'}:tokens", "--out", str(out), "--no-progress"], REPO, 280)
    assert r.returncode == 0, r.stderr[-3000:]
    plan = load_plan(out / "plan")
    assert len(plan.parts) == 4
    losses = [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    ref = ReferenceExecutor(load_model(spec), plan.assignment, OptimizerConfig(**plan.optimizer),
                            micro_batches=plan.micro_batches)
    tokens = load_function(f"{tmp_path / 'data.py'}:tokens")
    want = [ref.step(tokens(s)).loss for s in range(3)]
    np.testing.assert_allclose(losses, want, rtol=1e-5)

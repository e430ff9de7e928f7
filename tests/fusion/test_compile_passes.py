"""The compiler as passes (fusion/passes): ``compile_model`` runs :data:`PASSES` in their documented order, and no
pass changes the cost model of the state it was given or leaves codec prices on the state's plain cost model."""
import re

import pytest

from fusion.cluster import load_cluster
from fusion.compress.policy import request
from fusion.loader import load_model
from fusion.passes import steps

CLUSTER = "examples/clusters/local-4-two-sites.yaml"
WATCHED = ("schedule", "recompute_all", "codec_prices", "tied_wire", "tied_codec_s", "flops", "timed")


def test_the_docstring_lists_the_passes_in_their_order():
    documented = re.findall(r"^    (\w+) {2,}", steps.__doc__, re.M)
    assert documented == [p.__name__ for p in steps.PASSES]


@pytest.mark.parametrize("kw", [dict(strategy="equal-flops", compress=request("quant:bits=4"), tied_codec="auto"),
                                dict(strategy="equal-flops", compress_ratio=10.0, schedule="auto", virtual_stages=2)])
def test_compile_model_runs_every_pass_in_order_and_none_changes_its_input(monkeypatch, kw):
    from fusion.compile import compile_model

    ran = []

    def watched(p):
        def run(state):
            before = None if state.cm is None else {k: getattr(state.cm, k) for k in WATCHED}
            out = p(state)
            if before is not None:
                assert all(getattr(state.cm, k) is v for k, v in before.items()), f"{p.__name__} changed the cost model"
            if out.cm is not None:
                assert out.cm.codec_prices is None and out.cm.tied_wire is None, f"{p.__name__} priced the plain model"
            ran.append(p.__name__)
            return out
        return run

    monkeypatch.setattr(steps, "PASSES", tuple(watched(p) for p in steps.PASSES))
    monkeypatch.setattr("fusion.compile.PASSES", steps.PASSES)
    plan = compile_model(load_model("examples/models/gpt.py:tiny"), load_cluster(CLUSTER), micro_batches=4, **kw)
    assert ran == ["shapes", "subspace_writers", "costs", "node_times", "codec_prices", "partition", "schedule",
                   "bottleneck", "subspace_cut", "recompute", "tied_codec", "compression", "assemble"]
    assert plan.predicted["iteration_s"] > 0 and plan.compression

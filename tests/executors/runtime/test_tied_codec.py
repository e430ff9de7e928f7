"""The tied-parameter gradient exchange through a codec (``Plan.tied_codec``, ``fusion compile --tied-codec``).

The tiny GPT (tied embedding / LM head) cut so that the tied weight is held by two parts: with
``quant:bits=8`` each owner sends its gradient quantised and both sum the decoded gradients in part order.
The multi-process run equals the in-process reference executor with the same codec exactly (the same NumPy
quantiser on the same bytes), both owners end with identical weights, and the codec really ran.
"""

import numpy as np
import pytest

from fusion.executors.reference import ReferenceExecutor
from fusion.executors.runtime.compression import TiedCodec, sum_in_order
from fusion.executors.runtime.control import Fetch
from fusion.ir.errors import FusionError, WireError
from fusion.plan import OptimizerConfig
from tests.executors.dist_models import TWO_SITES_YAML
from tests.executors.runtime.test_distributed_gpt import REPO, _gpt_module

Q8 = {"algo": "quant", "bits": 8}
OPT = OptimizerConfig("sgd", lr=0.1, momentum=0.9)
TIED = "transformer.wte.weight"


def _plan(tmp_path, tied_codec):
    from fusion.cluster import load_cluster
    from fusion.compile import compile_model
    from fusion.ir.trace import trace

    module, example = _gpt_module().tiny()
    model = trace(module, example)
    (tmp_path / "c.yaml").write_text(TWO_SITES_YAML)
    plan = compile_model(model, load_cluster(str(tmp_path / "c.yaml")), strategy="equal-flops", micro_batches=2,
                         optimizer=OPT, tied_codec=tied_codec)
    owners = {plan.assignment[n] for n in model.graph.param_users()[TIED]}
    assert owners == {"part0", "part1"}, "the tied embedding should be held by both parts"
    return model, plan


def test_tied_gpt_processes_with_quant8_equal_the_reference_and_owners_stay_identical(tmp_path):
    from fusion.data.batches import make_batches
    from fusion.executors.runtime.coordinator import CoordinatorConfig
    from fusion.executors.runtime.launcher import LocalCluster
    from fusion.plan import save_plan

    from fusion.inspect import plan_report

    model, plan = _plan(tmp_path, Q8)
    assert plan.tied_codec == Q8
    report = plan_report(plan)
    assert "tied parameters (1; gradients exchanged between their owners each step, codec quant:bits=8)" in report
    assert f"  {TIED}: part0, part1" in report
    plan_dir = save_plan(plan, tmp_path / "plan", params=model.params)
    batch_fn = make_batches(plan, "text", seed=0)
    batches = [batch_fn(s) for s in range(4)]
    with LocalCluster(plan_dir, tmp_path / "run", CoordinatorConfig(peer_timeout_s=20), threads=1, trace=False) as lc:
        lc.start()
        losses = [lc.coordinator.step(b).loss for b in batches]
        co = lc.coordinator
        for p in plan.parts:  # each owner's own copy of the weights, not the merged view fetch_state gives
            co.transport.send(p, Fetch().frames())
        got = co._collect("state", list(plan.parts), 60.0, "fetching parameters")

    ref = ReferenceExecutor(model, plan.assignment, OPT, micro_batches=2, tied_codec=Q8)
    expected = [ref.step(b).loss for b in batches]
    assert losses == expected  # exactly: the same quantiser on the same bytes, the same summation order
    w = ref.engines["part0"].state()[TIED]
    np.testing.assert_array_equal(ref.engines["part1"].state()[TIED], w)
    for p in plan.parts:  # both owner processes hold the reference's tied weight, bit for bit
        np.testing.assert_array_equal(got[p].arrays[TIED], w)
    exact = ReferenceExecutor(_plan(tmp_path, None)[0], plan.assignment, OPT, micro_batches=2)
    dense = [exact.step(b).loss for b in batches]
    assert dense[0] == expected[0] and dense[1:] != expected[1:]  # the codec changed the summed gradient
    np.testing.assert_allclose(expected, dense, rtol=2e-3)  # ... by 8-bit quantisation noise only


def test_owners_sum_decoded_gradients_in_one_order():
    t = TiedCodec.from_cfg(Q8)
    g = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)
    h = np.random.default_rng(1).standard_normal((64, 32)).astype(np.float32)
    # what part0 computes (its own decoded + part1's decoded) equals what part1 computes
    d0, d1 = (t.decode(t.encode(x, "float32", "w", o, 3), (64, 32), "float32", "t") for x, o in ((g, "p0"), (h, "p1")))
    np.testing.assert_array_equal(sum_in_order([d0, d1]), d0 + d1)
    assert np.abs(d0 - g).max() <= np.abs(g).max() / 127 + 1e-6 and not np.array_equal(d0, g)
    with pytest.raises(WireError, match="expected a quant payload"):
        t.decode(g, (64, 32), "float32", "gradient of 'w' from p1")
    with pytest.raises(WireError, match=r"the parameter is float32\[32, 64\]"):
        t.decode(t.encode(g, "float32", "w", "p0", 0), (32, 64), "float32", "gradient of 'w' from p1")


@pytest.mark.parametrize("cfg,why", [({"algo": "delta"}, "cannot compress tied-parameter gradients"),
                                     ({"algo": "nosuch"}, "unknown codec 'nosuch'"),
                                     ({"algo": "quant", "bits": 3}, "bits")])
def test_bad_tied_codecs_are_refused(cfg, why):
    with pytest.raises(FusionError, match=why):
        TiedCodec.from_cfg(cfg)


@pytest.mark.parametrize("value,why", [("delta:bits=4", "cannot compress tied-parameter gradients"),
                                       ("quant:bits=3", "bits"), ("zip", "unknown codec 'zip'")])
def test_bad_tied_codec_flags_are_one_line_errors(value, why):
    import argparse

    from fusion.commands.compile import _tied_codec

    with pytest.raises(FusionError, match=why) as e:
        _tied_codec(argparse.Namespace(tied_codec=value))
    assert "--tied-codec" in str(e.value) and "\n" not in str(e.value)
    assert _tied_codec(argparse.Namespace(tied_codec="none")) is None
    assert _tied_codec(argparse.Namespace(tied_codec="quant:bits=8")) == Q8
    # --compress auto lets the compiler compress the tied exchange too, where it pays; an explicit value wins
    assert _tied_codec(argparse.Namespace(tied_codec=None, compress="auto")) == "auto"
    assert _tied_codec(argparse.Namespace(tied_codec="none", compress="auto")) is None
    assert _tied_codec(argparse.Namespace(tied_codec=None, compress="quant:bits=4")) is None


def test_auto_takes_8_bit_quant_only_where_it_shortens_the_iteration(tmp_path):
    from fusion.cluster import load_cluster
    from fusion.compile import compile_model
    from fusion.ir.trace import trace

    model = trace(*_gpt_module().tiny())
    slow = compile_model(model, load_cluster(str(REPO / "examples/clusters/local-4-two-sites.yaml")),
                         strategy="equal-flops", micro_batches=2, optimizer=OPT, tied_codec="auto")
    exact = compile_model(model, load_cluster(str(REPO / "examples/clusters/local-4-two-sites.yaml")),
                          strategy="equal-flops", micro_batches=2, optimizer=OPT)
    assert slow.tied_codec == {"algo": "quant", "bits": 8}  # the owners part0 and part3 sit on two sites
    assert slow.predicted["sync_s"] < exact.predicted["sync_s"] and slow.predicted["iteration_s"] < exact.predicted["iteration_s"]
    (tmp_path / "fast.yaml").write_text(TWO_SITES_YAML.replace("latency: 30 ms, bandwidth: 20 Mbit/s",
                                                            "latency: 0.01 ms, bandwidth: 400 Gbit/s"))
    fast = compile_model(model, load_cluster(str(tmp_path / "fast.yaml")), strategy="equal-flops", micro_batches=2,
                         optimizer=OPT, tied_codec="auto")
    assert len(fast.parts) == 2 and fast.tied_codec is None  # encoding would cost more than the link saves


def test_compile_refuses_a_bad_tied_codec_with_exit_2_and_one_line(cli, tmp_path):
    (tmp_path / "c.yaml").write_text(TWO_SITES_YAML)
    r = cli.run(["compile", f"{REPO}/examples/models/gpt.py:tiny", "--cluster", str(tmp_path / "c.yaml"),
                 "--tied-codec", "delta:bits=4", "-o", str(tmp_path / "p")], tmp_path, 120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "--tied-codec" in r.stderr and "cannot compress tied-parameter gradients" in r.stderr
    assert not (tmp_path / "p").exists()

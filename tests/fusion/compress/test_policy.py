"""--compress: parsing codec specs, and compressing only the cut edges where the cost model says it pays."""
from pathlib import Path

import numpy as np
import pytest

from fusion.cluster.model import Cluster, Device
from fusion.compile import compile_model
from fusion.compress.policy import AUTO_BWD, AUTO_FWD, CompressSpecError, parse_spec, request
from tests.testing_models import gpt_model

ROOT = Path(__file__).resolve().parents[3]


def test_specs_parse_into_codec_cfgs():
    assert parse_spec("quant:bits=4,block=32") == {"algo": "quant", "bits": 4, "block": 32}
    assert parse_spec("topk:ratio=100") == {"algo": "topk", "ratio": 100}
    assert parse_spec("none") is None and parse_spec("auto") == "auto"
    r = request("quant:bits=4", "none")
    assert r.fwd == {"algo": "quant", "bits": 4} and r.bwd is None
    assert request("auto").fwd == "auto" == request("auto").bwd
    assert request("auto", "none").bwd is None and request("quant:bits=4", "auto").bwd == "auto"
    assert request("auto").candidates("fwd") == [c for c in AUTO_FWD if c["algo"] != "delta"]  # no samples: no delta
    assert request("auto", samples=512).candidates("fwd") == list(AUTO_FWD)
    assert request("auto", samples=512).candidates("bwd") == list(AUTO_BWD)
    assert request("hadamard-quant:bits=4").bwd == {"algo": "hadamard-quant", "bits": 4}  # bwd follows fwd
    assert request(None, None) is None and request("none") is None


@pytest.mark.parametrize("spec,match", [
    ("zip", "unknown codec 'zip'"), ("quant:bits=3", "bits must be one of"), ("quant:bits", "expected KEY=VALUE"),
    ("quant:colour=red", "colour"), ("delta:bits=3", "bits must be one of"), ("delta:first_visit=zip", "first_visit"),
])
def test_bad_specs_say_what_is_wrong(spec, match):
    with pytest.raises(CompressSpecError, match=match):
        parse_spec(spec)


def test_delta_is_for_activations_and_gives_the_gradients_8_bit_quant():
    r = request("delta:bits=2", samples=100)
    assert r.fwd == {"algo": "delta", "bits": 2} and r.bwd == {"algo": "quant", "bits": 8, "block": 64}
    assert request("delta:bits=4", "none", samples=100).bwd is None
    with pytest.raises(CompressSpecError, match="activations only"):
        request("quant:bits=8", "delta:bits=4")


def _two_devices(bandwidth_bps: float) -> Cluster:
    devs = [Device(f"d{i}", 1e12, 1e9) for i in range(2)]
    alpha = np.full((2, 2), 1e-3) - np.eye(2) * 1e-3
    beta = np.full((2, 2), 8.0 / bandwidth_bps) - np.eye(2) * (8.0 / bandwidth_bps)
    return Cluster(f"two-{bandwidth_bps:g}", devs, alpha, beta, "test")


@pytest.mark.parametrize("bandwidth,compressed", [(20e6, True), (100e9, False)])
def test_edges_are_compressed_only_where_it_pays(bandwidth, compressed):
    model = gpt_model(2, 64, 4, 128, 32, 4, device="meta")
    plan = compile_model(model, _two_devices(bandwidth), strategy="equal-flops", micro_batches=2,
                         compress=request("quant:bits=8"))
    assert len(plan.parts) == 2
    assert bool(plan.compression) is compressed
    if compressed:
        assert plan.predicted["iteration_s"] < plan.predicted["dense_iteration_s"]
        assert all(c.codec("fwd") == {"algo": "quant", "bits": 8} for c in plan.compression)


@pytest.mark.parametrize("spec,line", [
    ("quant:bits=3", "--compress 'quant:bits=3': quant cfg: bits must be one of 2, 4, 8, got 3"),
    ("delta:bits=2", "--compress delta:bits=2: delta (AQ-SGD) keeps one activation per training sample at both "
                     "ends of every delta edge, and the compiler sizes those buffers by the data set: give --samples "
                     "N (the number of distinct sample ids your data gives)"),
])
def test_cli_refuses_a_bad_compress_value_in_one_line(cli, tmp_path, spec, line):
    r = cli.run(["compile", str(ROOT / "examples/models/gpt.py:tiny"), "--cluster", "local-4-two-sites",
                 "--compress", spec, "-o", str(tmp_path / "p")], Path.cwd(), 120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [f"fusion compile: error: {line}"]
    assert not (tmp_path / "p").exists()


def test_delta_needs_the_data_set_size():
    with pytest.raises(CompressSpecError, match="give --samples N"):
        request("delta:bits=4")


def test_the_estimator_prices_every_cut_with_its_codec_as_the_policy_chooses():
    """Compression-aware partitioning: with codec prices set, ``CostModel.evaluate`` (what OP-Fence scores
    candidate cuts with) compresses exactly the edges ``choose`` compresses afterwards, adds their encode and
    decode time, and prices the cut below dense on a slow link and as dense on a fast one."""
    from fusion.compress.policy import choose, codec_prices
    from fusion.cost.estimate import CostModel
    from fusion.cost.flops import measure_costs
    from fusion.partition.baselines import BASELINES
    from fusion.partition.chain import build_chain

    model = gpt_model(2, 64, 4, 128, 32, 4, device="meta")
    for bandwidth, cheaper in ((20e6, True), (100e9, False)):
        cm = CostModel.build(model.graph, measure_costs(model.graph), _two_devices(bandwidth), 2)
        part = BASELINES["equal-flops"](cm, build_chain(cm))
        req = request("quant:bits=4", "quant:bits=8")
        edges, wire = choose(cm, part.node_part, part.part_device, ["part0", "part1"], req)
        dense = cm.evaluate(part.node_part, part.part_device)
        cm.codec_prices = codec_prices(cm, req)
        priced = cm.evaluate(part.node_part, part.part_device)
        assert cm.evaluate(part.node_part, part.part_device, priced=False).iteration_s == dense.iteration_s
        assert (priced.iteration_s < dense.iteration_s) is cheaper and bool(edges) is cheaper
        fast, _ = cm.evaluate(part.node_part, part.part_device, detail=False)  # OP-Fence's call
        assert fast == pytest.approx(priced.iteration_s)
        if cheaper:  # the same wire bytes on every link as the chosen codecs give, plus codec time
            by_wire = cm.evaluate(part.node_part, part.part_device, wire)
            assert len(priced.links) == len(by_wire.links)
            for link, other in zip(priced.links, by_wire.links):
                assert link.fwd_bytes == pytest.approx(other.fwd_bytes) and link.bwd_bytes == pytest.approx(other.bwd_bytes)
            assert by_wire.iteration_s < priced.iteration_s < dense.iteration_s
        else:
            assert priced.iteration_s == dense.iteration_s


def test_compile_with_a_codec_partitions_for_the_compressed_time():
    """On slow devices joined by 20 Mbit/s, cutting for dense traffic keeps the model on one device (the
    transfers cost more than the compute saved); priced with 2-bit quant, OP-Fence splits it and predicts a
    shorter iteration, encode/decode time included."""
    from fusion.compress.policy import codec_prices
    from fusion.cost.estimate import CostModel
    from fusion.cost.flops import measure_costs

    model = gpt_model(4, 128, 4, 128, 32, 4, device="meta")
    n = 2
    alpha = np.full((n, n), 1e-3) - np.eye(n) * 1e-3
    beta = (np.full((n, n), 8.0 / 20e6) - np.eye(n) * (8.0 / 20e6))
    cluster = Cluster("slow-two", [Device(f"d{i}", 1.7e10, 1e9) for i in range(n)], alpha, beta, "test")
    req = request("quant:bits=2")
    aware = compile_model(model, cluster, strategy="opfence", micro_batches=2, compress=req)
    blind = compile_model(model, cluster, strategy="opfence", micro_batches=2)  # cut for dense traffic
    assert len(blind.parts) == 1 and len(aware.parts) == 2
    cm = CostModel.build(model.graph, measure_costs(model.graph), cluster, 2)
    cm.codec_prices = codec_prices(cm, req)
    names = {nm: i for i, nm in enumerate(cm.names)}
    order = sorted(aware.parts)
    node_part = np.array([order.index(aware.assignment[nm]) for nm in cm.names])
    devs = [next(i for i, d in enumerate(cluster.devices) if d.name == aware.parts[p].device) for p in order]
    assert names and aware.predicted["iteration_s"] == pytest.approx(cm.evaluate(node_part, devs).iteration_s, rel=1e-6)
    assert aware.predicted["iteration_s"] < blind.predicted["iteration_s"] < aware.predicted["dense_iteration_s"]
    assert aware.compression  # and the plan compresses the cut it was priced with

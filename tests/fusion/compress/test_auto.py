"""``--compress auto``: per edge and direction, the candidate the cost model prices fastest among the codecs
the convergence study shows to converge (AUTO_FWD / AUTO_BWD), and only where that beats dense."""
from pathlib import Path

import numpy as np
import pytest

from fusion.options import parse
from fusion.cluster import Cluster, Device, load_cluster
from fusion.commands.compile import compile_from_args
from fusion.compile import compile_model
from fusion.compress.policy import AUTO_BWD, AUTO_FWD, codec_prices, request
from fusion.cost.estimate import CostModel, samples_per_micro_batch
from fusion.cost.flops import measure_costs
from fusion.loader import load_model
from fusion.partition.baselines import BASELINES
from fusion.partition.chain import build_chain
from tests.testing_models import gpt_model

ROOT = Path(__file__).resolve().parents[3]
TWO_SITES = ROOT / "examples" / "clusters" / "local-4-two-sites.yaml"


def _two(bandwidth_bps: float, memory: float = 1e12) -> Cluster:
    devs = [Device(f"d{i}", 1e12, memory) for i in range(2)]
    alpha = np.full((2, 2), 1e-3) - np.eye(2) * 1e-3
    beta = np.full((2, 2), 8.0 / bandwidth_bps) - np.eye(2) * (8.0 / bandwidth_bps)
    return Cluster(f"two-{bandwidth_bps:g}", devs, alpha, beta, "test")


def _model():
    return gpt_model(2, 64, 4, 128, 32, 4, device="meta")


def _codecs(plan):
    return {(c.producer, c.src, c.dst): (c.codec("fwd"), c.codec("bwd")) for c in plan.compression}


def test_auto_compresses_nothing_on_fast_links():
    plan = compile_model(_model(), _two(100e9), strategy="equal-flops", micro_batches=2,
                         compress=request("auto", samples=512))
    assert len(plan.parts) == 2 and plan.compression == []
    assert plan.predicted["iteration_s"] == plan.predicted["dense_iteration_s"]


def test_auto_on_two_sites_prices_no_slower_than_any_candidate():
    """local-4-two-sites (20 Mbit/s between sites): every slow edge gets a study-backed codec each way, and
    the priced iteration is at most that of every single candidate pair (and of dense) on the same cut."""
    model, cluster = _model(), load_cluster(TWO_SITES)
    cm = CostModel.build(model.graph, measure_costs(model.graph), cluster, 2,
                         samples_per_micro_batch=samples_per_micro_batch(model.graph))
    part = BASELINES["equal-flops"](cm, build_chain(cm))
    names = [f"part{k}" for k in range(len(part.part_device))]
    auto = request("auto", samples=512)
    t_auto = cm.evaluate(part.node_part, part.part_device, prices=codec_prices(cm, auto)).iteration_s
    t_dense = cm.evaluate(part.node_part, part.part_device).iteration_s
    assert t_auto < t_dense
    for f in AUTO_FWD:
        for b in AUTO_BWD:
            other = request(_spec(f), _spec(b), samples=512)
            t = cm.evaluate(part.node_part, part.part_device, prices=codec_prices(cm, other)).iteration_s
            assert t_auto <= t * (1 + 1e-12), (f, b)
    from fusion.compress.policy import choose

    edges, _ = choose(cm, part.node_part, part.part_device, names, auto)
    slow = {(e.src, e.dst) for e in edges if cluster.bandwidth_bps(part.part_device[int(e.src[4:])],
                                                                   part.part_device[int(e.dst[4:])]) < 1e8}
    assert slow, "the equal-flops split of four parts over two sites cuts the 20 Mbit/s link"
    for e in edges:
        assert e.codec("fwd") in AUTO_FWD and e.codec("bwd") in AUTO_BWD
    # and compile_model gives the plan the same codecs
    plan = compile_model(model, cluster, strategy="equal-flops", micro_batches=2, compress=auto)
    assert _codecs(plan) == {(e.producer, e.src, e.dst): (e.codec("fwd"), e.codec("bwd")) for e in edges}
    assert plan.predicted["eq3_iteration_s"] == pytest.approx(t_auto, rel=1e-9)


def _spec(cfg: dict) -> str:
    return cfg["algo"] + ":" + ",".join(f"{k}={v}" for k, v in cfg.items() if k != "algo")


def test_auto_takes_delta_only_with_sample_ids_and_a_data_set_size():
    """On 1 Mbit/s 2-bit deltas price fastest for the activations; auto takes them only when the data set
    is declared (--samples with a --data function), never for synthetic data, the randomly drawn built-in
    corpus or a `fusion compile` that names no data set size."""
    model = load_model(str(ROOT / "examples/models/gpt.py:tiny"))
    slow = _two(1e6)

    def fwd_algos(*argv):
        extra = ["--cluster", "unused.yaml", "-o", "unused"] if argv[0] == "compile" else []
        _, opts = parse([*argv[:1], str(ROOT / "examples/models/gpt.py:tiny"), *extra,
                         "--strategy", "equal-flops", "--compress", "auto", *argv[1:]])
        plan = compile_from_args(opts.job(), model, slow)
        assert plan.compression
        return {c.codec("fwd")["algo"] for c in plan.compression if c.codec("fwd")}

    assert fwd_algos("run", "--data", "data.py:batches", "--samples", "512") == {"delta"}
    assert "delta" not in fwd_algos("run", "--data", "synthetic")
    assert "delta" not in fwd_algos("run", "--data", "data.py:batches")  # no --samples: size unknown
    assert "delta" not in fwd_algos("run")  # the built-in corpus: random windows, rarely revisited
    assert "delta" not in fwd_algos("compile")
    assert fwd_algos("compile", "--samples", "512") == {"delta"}


def test_auto_falls_back_from_delta_where_its_buffers_do_not_fit():
    """Buffers of 10^6 samples (8 KB each per edge end) do not fit devices of 1 GB: auto gives those edges
    their best codec without buffers; an explicit delta request is refused, naming the part and buffers."""
    model = _model()
    fits = compile_model(model, _two(1e6), strategy="equal-flops", micro_batches=2,
                         compress=request("auto", samples=1000))
    assert {c.codec("fwd")["algo"] for c in fits.compression} == {"delta"}
    small = _two(1e6, memory=1e9)
    plan = compile_model(model, small, strategy="equal-flops", micro_batches=2,
                         compress=request("auto", samples=10**6))
    assert plan.compression and {c.codec("fwd")["algo"] for c in plan.compression} == {"quant"}
    assert "delta_samples" not in plan.predicted
    from fusion.compile import CompileError

    with pytest.raises(CompileError, match=r"part 0 on d0 needs .* GB > 1.000 GB \(of which .* GB are delta "
                                           r"\(AQ-SGD\) buffers.*h\d\.add\d -> part 1"):
        compile_model(model, small, strategy="equal-flops", micro_batches=2,
                      compress=request("delta:bits=2", samples=10**6))


def test_fusion_run_on_the_built_in_corpus_sizes_delta_buffers_by_its_windows():
    """`fusion run MODEL --compress delta` on the built-in text corpus needs no --samples: the buffers are
    sized by its windows (corpus length - T - 1); a different --samples is refused in one line."""
    from fusion.data.batches import corpus_samples, corpus_text
    from fusion.ir.errors import FusionError

    model = load_model(str(ROOT / "examples/models/gpt.py:tiny"))  # T = 16
    windows = len(corpus_text(seed=0)) - 16 - 1
    assert corpus_samples(model.graph, "auto") == windows == corpus_samples(model.graph, "text")
    assert corpus_samples(model.graph, "synthetic") is None and corpus_samples(model.graph, "d.py:f") is None

    def compile_run(*extra):
        _, opts = parse(["run", str(ROOT / "examples/models/gpt.py:tiny"), "--strategy",
                         "equal-flops", "--compress", "delta:bits=2", *extra])
        return compile_from_args(opts.job(), model, _two(1e6))

    plan = compile_run()
    assert plan.predicted["delta_samples"] == windows
    assert sum(p.get("delta_buffer_bytes", 0) for p in plan.predicted["parts"].values()) > 0
    with pytest.raises(FusionError, match=f"--samples 512: the built-in text corpus gives this model {windows} "):
        compile_run("--samples", "512")
    with pytest.raises(FusionError, match="give --samples N"):
        compile_run("--data", "synthetic")

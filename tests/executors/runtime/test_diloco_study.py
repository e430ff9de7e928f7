"""benchmarks/diloco_study.py (``bench_diloco.py --study convergence``): its machinery runs, and its DiLoCo,
driven through fusion's own outer step (``OuterLoop.step`` over an in-process wire), equals its synchronous DP
where DiLoCo must: H = 1, an SGD inner optimizer, outer lr 1, outer momentum 0 (test_diloco.py's identity)."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
import diloco_study as ds  # noqa: E402

from fusion.plan import DPSync  # noqa: E402

TINY = ds.StudyConfig(global_batch=8, seq=16, steps=4, diloco_factor=1.0, eval_every=1, val_windows=8)


@pytest.fixture(scope="module")
def data():
    train, val = ds.split_corpus(ds.text_corpus())
    return train, val, ds.validation_set(val, TINY)


def test_held_out_split_and_unigram_level(data):
    train, val, vset = data
    np.testing.assert_array_equal(np.concatenate([train, val]), ds.text_corpus())  # the tail is held out
    assert train.size > 8 * val.size > 0 and vset["idx"].shape == (8, 16)
    assert 2.0 < ds.unigram_loss(train, val) < math.log(96)  # below uniform, far above a model's loss


def test_h1_sgd_outer_lr1_momentum0_is_synchronous_dp(data):
    train, _, vset = data
    cfg = ds.StudyConfig(**{**TINY.__dict__, "inner": "sgd", "lr": 0.05})
    sync = ds.run_sync(cfg, 0, train, vset)
    same = ds.run_diloco(cfg, 0, DPSync("diloco", inner_steps=1, outer_lr=1.0, outer_momentum=0.0), train, vset)
    assert same.steps == sync.steps == [1, 2, 3, 4]
    np.testing.assert_allclose(same.train, sync.train, rtol=1e-5)
    np.testing.assert_allclose(same.val, sync.val, rtol=1e-5)
    assert sync.val[-1] < sync.val[0]  # it trains
    # another outer step is not synchronous DP: the comparison can fail
    other = ds.run_diloco(cfg, 0, DPSync("diloco", inner_steps=1, outer_lr=0.5, outer_momentum=0.0), train, vset)
    assert abs(other.val[-1] - sync.val[-1]) > 1e-3


def test_ring_bytes_and_codec_path(data):
    train, _, vset = data
    n = sum(p.numel() for p in ds.make_model(TINY, 0).parameters())
    exact = ds.run_diloco(TINY, 0, DPSync("diloco", inner_steps=2), train, vset)
    assert exact.steps == [2, 4]
    # a ring of 4: each replica sends 2 (G - 1) / G of its float32 pseudo-gradient per outer step
    assert exact.sent_bytes == pytest.approx(2 * 1.5 * 4 * n, abs=2 * 6 * 4)
    q8 = ds.run_diloco(TINY, 0, DPSync("diloco", inner_steps=2, codec={"algo": "quant", "bits": 8},
                                       error_feedback=True), train, vset)
    assert 0 < q8.sent_bytes < exact.sent_bytes  # 3 peers x 8 bits < 1.5 x 32 bits
    assert abs(q8.val[-1] - exact.val[-1]) < 0.05 and q8.val[-1] != exact.val[-1]


def test_study_reports_every_seed_and_misses():
    res = ds.study(TINY, [0, 1, 2], [2], quant8_h=None)
    med = res["medians"]["diloco_h2"]
    assert len(med["per_seed"]) == 3 and set(res["per_seed"]) == {"0", "1", "2"}
    for seed, row in res["per_seed"].items():
        r = row["diloco_h2"]
        assert (r["steps_to_sync_loss_ratio"] is None) == (r["gap_at_end"] is not None)
        if r["steps_to_sync_loss"] is not None:
            assert r["steps_to_sync_loss_ratio"] == r["steps_to_sync_loss"] / TINY.steps
    reached = sorted(math.inf if x is None else x for x in med["per_seed"])
    assert med["steps_to_sync_loss_ratio"] == (None if math.isinf(reached[1]) else reached[1])


def test_steps_to_is_the_first_evaluated_step():
    c = ds.Curve(steps=[10, 20, 30], val=[3.0, 2.0, 1.0])
    assert ds.steps_to(c, 2.0) == 20 and ds.steps_to(c, 0.5) is None


def test_overlapped_outer_step_variants_run_and_differ(data):
    """``--overlap eager,delayed`` (dp_sync.delay 1 through ``OuterLoop.overlapped_step`` and the study's wire):
    the three runs train alike up to the first boundary and apart after it, and each is evaluated at every
    outer step (on replica 0's weights with the round in flight applied)."""
    train, _, vset = data
    runs = {o: ds.run_diloco(TINY, 0, DPSync("diloco", inner_steps=2, delay=d, overlap=o if d else "eager"), train,
                             vset, steps=6)
            for o, d in (("none", 0), ("eager", 1), ("delayed", 1))}
    assert all(c.steps == [2, 4, 6] for c in runs.values())
    for o in ("eager", "delayed"):
        np.testing.assert_allclose(runs[o].train[:2], runs["none"].train[:2], rtol=1e-6)
    for a, b in (("eager", "none"), ("delayed", "none"), ("eager", "delayed")):
        assert max(abs(x - y) for x, y in zip(runs[a].train[2:], runs[b].train[2:])) > 1e-4, (a, b)
    assert ds.diloco_syncs(TINY, [20], None, ["eager"])["diloco_h20_eager"].overlap == "eager"


def test_sync_warmup_is_synchronous_dp_then_diloco_from_its_weights(data):
    """``sync_warmup`` N: DiLoCo's first N steps are synchronous DP's (the same losses, evaluated at N), then the
    outer rounds count from N; the replicas' own inner learning rate changes the run after the warm-up only."""
    train, _, vset = data
    cfg = ds.StudyConfig(**{**TINY.__dict__, "steps": 6})
    sync = ds.run_sync(cfg, 0, train, vset)
    warm = ds.run_diloco(cfg, 0, DPSync("diloco", inner_steps=2), train, vset, warmup=2)
    assert warm.steps == [2, 4, 6] and len(warm.train) == 6
    np.testing.assert_allclose(warm.train[:2], sync.train[:2], rtol=1e-6)
    np.testing.assert_allclose(warm.val[0], sync.val[1], rtol=1e-6)  # sync evaluates every step (eval_every 1)
    # the step after the warm-up starts from its weights: the replicas' mean loss is the global batch's
    np.testing.assert_allclose(warm.train[2], sync.train[2], rtol=1e-5)
    fast = ds.run_diloco(cfg, 0, DPSync("diloco", inner_steps=2), train, vset, warmup=2, lr=3 * cfg.lr)
    np.testing.assert_allclose(fast.train[:3], warm.train[:3], rtol=1e-6)
    assert abs(fast.train[3] - warm.train[3]) > 1e-5
    # the config's warm-up is the default, and min_rounds lengthens the run to that many rounds after it
    assert ds.diloco_steps(cfg, 2, 2) == 2 + 2 * 2
    assert ds.diloco_steps(ds.StudyConfig(**{**cfg.__dict__, "min_rounds": 5}), 2, 2) == 2 + 5 * 2


def test_study_headline_is_the_first_run_with_its_worst_seed():
    v = {"a": ds.Variant(DPSync("diloco", inner_steps=2, outer_momentum=0.0)),
         "b": ds.Variant(DPSync("diloco", inner_steps=2), warmup=2)}
    res = ds.study(TINY, [0, 1], [], None, variants=v)
    assert res["primary_run"] == "a" and set(res["medians"]) == {"a", "b"}
    for name in ("a", "b"):
        per = res["medians"][name]["per_seed"]
        worst = res["medians"][name]["steps_to_sync_loss_ratio_max"]
        assert worst == (None if None in per else max(per))
    assert res["steps_to_sync_loss_ratio_per_seed"] == dict(zip(("0", "1"), res["medians"]["a"]["per_seed"]))
    assert res["per_seed"]["0"]["b"]["sync_warmup"] == 2 and res["per_seed"]["0"]["b"]["outer_rounds"] == 1


def test_bench_variant_option():
    import bench_diloco as bd

    cfg = ds.StudyConfig(outer_lr=0.7, outer_momentum=0.5)
    name, v = bd.parse_variant("x:h=20,outer_momentum=0,nesterov=0,lr=1e-3,warmup=100", cfg)
    assert name == "x" and v.sync.inner_steps == 20 and v.sync.outer_lr == 0.7 and v.sync.outer_momentum == 0.0
    assert not v.sync.nesterov and v.lr == 1e-3 and v.warmup == 100 and v.sync.delay == 0
    assert bd.parse_variant("y:h=5,overlap=eager", cfg)[1].sync.overlap == "eager"
    for bad in ("x", "x:outer_lr=1", "x:h=5,foo=1", "x:h=5,overlap=late"):
        with pytest.raises(ValueError):
            bd.parse_variant(bad, cfg)

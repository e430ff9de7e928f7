"""DiLoCo pricing (fusion.cost.dp): pseudo-gradient bytes are the codecs' wire bytes, the outer sync is amortised
over H inner steps, overlapped by delay 1, split by fragments, and unequal replicas get shares by speed."""
import numpy as np
import pytest

from fusion.cost.dp import (PSEUDO_CODECS, allgather_time, balance_shares, diloco_estimate, diloco_layout,
                            pseudo_wire_bytes, replica_cost_model, ring_allreduce_time, stage_param_specs)
from fusion.cost.estimate import CostModel
from fusion.kernels.codec import CODECS
from fusion.partition.chain import build_chain
from tests.fusion.dp_clusters import cost_model, matrix_cluster, tiny_gpt, two_regions


@pytest.fixture(scope="module")
def tiny():
    return tiny_gpt()


def test_pseudo_gradient_bytes_are_the_codecs_wire_bytes(tiny):
    cm = cost_model(tiny, two_regions())
    ch = build_chain(cm)
    node_part = ch.node_part([ch.n_atoms // 2])
    specs = stage_param_specs(cm, node_part, 2)
    g = cm.graph
    held = [{p for n in g.nodes.values() if node_part[cm.index[n.name]] == s for p in g[n.name].param_names()
             if g.params[p].trainable} for s in range(2)]
    for s in range(2):
        assert sorted(specs[s]) == sorted((int(np.prod(g.params[p].shape)), str(g.params[p].dtype)) for p in held[s])
        dense = sum(int(np.prod(g.params[p].shape)) * 4 for p in held[s])
        assert pseudo_wire_bytes(specs[s], None) == dense
        for cfg in PSEUDO_CODECS[1:]:
            want = sum(CODECS.get(cfg["algo"]).wire_nbytes(int(np.prod(g.params[p].shape)), "float32", cfg)
                       for p in held[s])
            assert pseudo_wire_bytes(specs[s], cfg) == want, cfg
    # 4-bit codes are about an eighth of float32, Top-K 1/100 keeps 1% of the values (and their indices)
    assert 0.12 < pseudo_wire_bytes(specs[0], {"algo": "quant", "bits": 4}) / pseudo_wire_bytes(specs[0], None) < 0.2
    assert pseudo_wire_bytes(specs[0], {"algo": "topk", "ratio": 100}) < 0.03 * pseudo_wire_bytes(specs[0], None)


def _two_replicas(tiny, slow_bps=50e6, M=4):
    cm = cost_model(tiny, two_regions(slow_bps=slow_bps))
    zero = np.zeros(len(cm.names), dtype=np.int64)
    return cm, diloco_layout(cm, zero, [[0], [4]], M)  # one replica per region: the slow link averages


def test_dense_sync_is_the_ring_all_reduce_amortised_over_h(tiny):
    cm, lay = _two_replicas(tiny)
    P = float(cm.p_bytes[cm.p_trainable].sum())
    ring = ring_allreduce_time(cm.cluster, [0, 4], P)
    assert lay.micro_batches == [2, 2] and lay.global_batch == 4
    t_c = replica_cost_model(cm, 2).evaluate(lay.node_part, [0]).iteration_s
    assert lay.compute_s == pytest.approx(t_c, rel=1e-12)
    for H in (1, 10, 100):
        e = diloco_estimate(lay, H)
        assert e.sync_bytes == [P] and e.sync_s == [pytest.approx(ring, rel=1e-12)]
        assert e.iteration_s == pytest.approx(t_c + ring / H, rel=1e-12)
        assert e.samples_per_s == pytest.approx(4 / (t_c + ring / H), rel=1e-12)
        assert e.predicted()["sync_bytes_per_step"] == pytest.approx(P / H)


def test_lossy_codecs_are_all_gathered_over_the_slowest_link(tiny):
    cm, lay = _two_replicas(tiny)
    cfg = {"algo": "quant", "bits": 4}
    b = pseudo_wire_bytes(lay.specs[0], cfg)
    a, beta = cm.cluster.alpha[0, 4], cm.cluster.beta[0, 4]
    assert allgather_time(cm.cluster, [0, 4], b) == pytest.approx(a + b * beta, rel=1e-12)  # (R - 1) hops
    e = diloco_estimate(lay, 20, cfg)
    assert e.sync_s[0] == pytest.approx(a + b * beta, rel=1e-12)
    assert e.iteration_s == pytest.approx(lay.compute_s + (a + b * beta) / 20, rel=1e-12)


def test_delay_one_hides_the_sync_behind_h_inner_steps(tiny):
    cm, lay = _two_replicas(tiny, slow_bps=5e6)
    t0 = diloco_estimate(lay, 1).sync_s[0]  # delay 0: the ring all-reduce of the dense pseudo-gradient
    t = diloco_estimate(lay, 1, delay=1).sync_s[0]  # delay 1: the all-gather the runtime overlaps
    assert t == pytest.approx(allgather_time(cm.cluster, [0, 4], pseudo_wire_bytes(lay.specs[0], None)), rel=1e-12)
    assert t < t0  # two replicas: the same bytes, one link latency instead of the ring's two
    T = lay.compute_s
    H_small, H_big = max(1, int(0.2 * t / T)), int(3 * t / T) + 1
    assert H_small * T < t < H_big * T
    late = diloco_estimate(lay, H_small, delay=1)
    assert late.exposed_s == pytest.approx(t - H_small * T, rel=1e-9)  # only what exceeds H compute steps shows
    assert late.iteration_s == pytest.approx(T + (t - H_small * T) / H_small, rel=1e-9)
    hidden = diloco_estimate(lay, H_big, delay=1)
    assert hidden.exposed_s == 0 and hidden.iteration_s == T and hidden.predicted()["sync_hidden"] == 1.0
    assert diloco_estimate(lay, H_big, delay=0).iteration_s == pytest.approx(T + t0 / H_big, rel=1e-12)


def test_fragments_cut_the_peak_and_pay_a_latency_each(tiny):
    cm, lay = _two_replicas(tiny)
    cfg = {"algo": "topk", "ratio": 10}
    one, four = diloco_estimate(lay, 20, cfg), diloco_estimate(lay, 20, cfg, fragments=4)
    a = cm.cluster.alpha[0, 4]
    assert four.sync_s[0] == pytest.approx(one.sync_s[0] + 3 * a, rel=1e-9)  # 4 x (alpha + b/4 beta)
    assert four.predicted()["sync_peak_bytes"] == pytest.approx(one.predicted()["sync_peak_bytes"] / 4)
    assert four.predicted()["sync_bytes_per_outer_step"] == one.predicted()["sync_bytes_per_outer_step"]
    with pytest.raises(ValueError):
        diloco_estimate(lay, 2, fragments=3)
    with pytest.raises(ValueError):
        diloco_estimate(lay, 0)


def test_shares_follow_replica_speed():
    assert balance_shares([(0.0, 1.0), (0.0, 3.0)], 8) == [6, 2]
    assert balance_shares([(1.0, 1.0), (1.0, 1.0), (1.0, 1.0)], 9) == [3, 3, 3]
    with pytest.raises(ValueError):
        balance_shares([(0.0, 1.0)] * 3, 2)


def test_a_slow_replica_gets_a_small_share_and_does_not_set_the_pace(tiny):
    m, costs = tiny
    from dataclasses import replace

    from fusion.cluster.model import Cluster

    base = matrix_cluster([[0, 1e-3], [1e-3, 0]], [[0, 1e9], [1e9, 0]])
    devs = [replace(base.devices[0], peak_flops=3e12), replace(base.devices[1], peak_flops=1e12)]
    cl = Cluster(base.name, devs, base.alpha, base.beta, base.source)
    cm = CostModel.build(m.graph, costs, cl, 1, "1f1b", 2, 1)
    zero = np.zeros(len(cm.names), dtype=np.int64)
    by_speed = diloco_layout(cm, zero, [[0], [1]], 16)
    equal = diloco_layout(cm, zero, [[0], [1]], 16, shares=False)
    assert sum(by_speed.micro_batches) == 16 and by_speed.micro_batches[0] > 2 * by_speed.micro_batches[1]
    assert equal.micro_batches == [8, 8]
    assert by_speed.compute_s < 0.8 * equal.compute_s
    assert max(by_speed.replica_s) / min(by_speed.replica_s) < 1.3


def test_a_replica_over_its_memory_recomputes_the_parts_that_need_it(tiny):
    m, costs = tiny
    cm = cost_model(tiny, two_regions())
    ch = build_chain(cm)
    node_part = ch.node_part([ch.n_atoms // 2])
    two = replica_cost_model(cm, 4)
    plain = [p.memory_bytes for p in two.evaluate(node_part, [0, 1], recompute=np.zeros(2, dtype=bool)).parts]
    redo = [p.memory_bytes for p in two.evaluate(node_part, [0, 1], recompute=np.ones(2, dtype=bool)).parts]
    assert redo[0] < plain[0]  # stage 0 holds two micro-batches' activations under 1F1B, recomputing only one
    cap = (plain[0] + redo[0]) / 2
    assert max(plain[1], redo[0]) < cap  # so stage 0 fits only by recomputing, stage 1 as it is
    small = cost_model(tiny, two_regions(memory=cap))
    lay = diloco_layout(small, node_part, [[0, 1], [4, 5]], 8, recompute=True)
    assert lay.recompute == [[True, False], [True, False]] and not lay.violations
    assert diloco_layout(small, node_part, [[0, 1], [4, 5]], 8).violations  # without it stage 0 overflows
    assert diloco_estimate(lay, 10).recompute == lay.recompute

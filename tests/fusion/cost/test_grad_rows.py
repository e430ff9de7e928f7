"""The tied-gradient sync priced by what each owner sends (``fusion/cost/grad_rows.py``): an embedding's gradient as
the rows a step's ids can touch, in values and indices (``executors/runtime/exact_zeros.py`` sends it so), the output
layer's dense; a table smaller than a step's ids, or any other use, counts dense."""
import numpy as np
import pytest
import torch

from fusion.cost.estimate import CostModel
from fusion.cost.flops import NodeCost
from fusion.cost.grad_rows import is_embedding, node_grad_nbytes
from fusion.ir.builder import GraphBuilder
from tests.fusion.cost.test_estimate_equations import BPS, _cluster

D, MB, IDS = 8, 3, 2 * 5  # width, micro-batches, ids per micro-batch (2 x 5)


def _tied_lm(vocab: int):
    b = GraphBuilder()
    x, y = b.input("ids"), b.label("y")
    h = b.module("emb", "torch.nn.Embedding", x, num_embeddings=vocab, embedding_dim=D)
    logits = b.module("head", "torch.nn.Linear", h, in_features=D, out_features=vocab, bias=False,
                      params={"weight": "emb.weight"})
    flat = b.function("flat", "torch.flatten", logits, 0, 1)
    b.loss("loss", "torch.nn.functional.cross_entropy", flat, y)
    return b.build({"ids": torch.zeros(2, 5, dtype=torch.long), "y": torch.zeros(10, dtype=torch.long)},
                   device="meta").graph


def _cm(graph):
    costs = {n: NodeCost() for n in graph.nodes}
    return CostModel.build(graph, costs, _cluster(), micro_batches=MB, schedule="gpipe", samples_per_micro_batch=2)


def test_an_embedding_owner_is_priced_by_its_rows_and_the_output_layer_dense():
    g = _tied_lm(1000)
    assert is_embedding(g.nodes["emb"]) and not is_embedding(g.nodes["head"])
    dense = 1000 * D * 4
    rows = IDS * MB  # 30 of 1000 rows at most
    assert node_grad_nbytes(g, g.nodes["emb"], "emb.weight", MB) == rows * D * (4 + 4)  # float32 value + int32 index
    assert node_grad_nbytes(g, g.nodes["head"], "emb.weight", MB) == dense

    cm = _cm(g)
    cm.cluster.alpha[:] = 0.0
    part = np.array([0 if n in ("ids", "emb") else 1 for n in cm.names])
    q = cm.p_names.index("emb.weight")
    assert cm.tied_grad_nbytes(q, part, 0) == rows * D * 8 and cm.tied_grad_nbytes(q, part, 1) == dense
    est = cm.evaluate(part, [0, 1])
    # the head's owner sends its dense gradient to the embedding's, which sends back its rows
    assert est.sync_s == pytest.approx(dense * 8 / BPS[1, 0] + rows * D * 8 * 8 / BPS[0, 1], rel=1e-12)


def test_a_table_no_larger_than_a_steps_ids_counts_dense():
    g = _tied_lm(20)  # 30 ids a step can touch all 20 rows
    assert node_grad_nbytes(g, g.nodes["emb"], "emb.weight", MB) == 20 * D * 4


def test_a_table_a_step_touches_more_than_a_quarter_of_counts_dense_as_the_runtime_sends_it():
    g = _tied_lm(100)  # 30 of 100 rows: sparse would be smaller (30 x 8 x 8 < 100 x 8 x 4), but the runtime sends dense
    assert node_grad_nbytes(g, g.nodes["emb"], "emb.weight", MB) == 100 * D * 4

"""A tied gradient that is mostly exact zeros (an embedding's) travels as its nonzero elements, with the same bits
(``executors/runtime/exact_zeros.py``): the form itself, its refusals on the wire, and a tied GPT whose embedding owner
sends a few kB instead of the whole table, still equal to plain PyTorch."""
from __future__ import annotations

import json

import numpy as np
import pytest

from fusion.executors.runtime.exact_zeros import MAX_FRACTION, pack, unpack
from fusion.ir.errors import WireError
from fusion.ir.opdata import OpData
from fusion.ir.wire import decode, encode_opdata, opdata_from_message
from fusion.kernels.sparse import SparsePayload


def _rows(shape=(1000, 16), rows=(3, 17, 999), dtype=np.float32) -> np.ndarray:
    g = np.zeros(shape, dtype)
    rng = np.random.default_rng(0)
    for r in rows:
        g[r] = rng.standard_normal(shape[1]).astype(dtype)
    return g


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_an_embedding_gradient_goes_sparse_and_comes_back_with_the_same_bits(dtype):
    g = _rows(dtype=dtype)
    g[5, 2] = -0.0  # a negative zero is nonzero bits: kept, not rebuilt as +0.0
    g[6, 0] = np.nan
    p = pack(g, np.dtype(dtype).name)
    assert isinstance(p, SparsePayload) and p.k == 3 * 16 + 2
    assert p.nbytes < g.nbytes / 10
    assert _same_bits(unpack(p, g.shape, np.dtype(dtype).name, "w"), g)


def test_bfloat16_bits_round_trip():
    g = _rows(dtype=np.uint16)  # bfloat16 travels as its uint16 bits
    g[1, 1] = 0x8000  # bfloat16's -0.0
    p = pack(g, "bfloat16")
    assert isinstance(p, SparsePayload) and p.dtype == "bfloat16"
    assert _same_bits(unpack(p, g.shape, "bfloat16", "w"), g)


def test_a_dense_gradient_and_anything_else_stay_as_they_are():
    g = np.random.default_rng(1).standard_normal((100, 8)).astype(np.float32)
    assert pack(g, "float32") is g
    half = _rows(shape=(8, 4), rows=(0, 1, 2))  # 3 of 8 rows: above MAX_FRACTION
    assert 3 / 8 > MAX_FRACTION and pack(half, "float32") is half
    assert pack(None, "float32") is None
    empty = np.zeros((0, 4), np.float32)
    assert pack(empty, "float32") is empty
    assert unpack(g, g.shape, "float32", "w") is g


def test_a_sparse_payload_of_another_shape_or_dtype_is_refused_naming_the_parameter():
    g = _rows()
    p = pack(g, "float32")
    with pytest.raises(WireError, match="gradient of 'w'.*float32\\[1000, 16\\].*float32\\[1000, 8\\]"):
        unpack(p, (1000, 8), "float32", "gradient of 'w'")
    with pytest.raises(WireError, match="float64"):
        unpack(p, g.shape, "float64", "gradient of 'w'")
    cast = SparsePayload(p.values.astype(np.float16), p.indices, p.shape, "float32", "float16")
    with pytest.raises(WireError, match="float16 values"):
        unpack(cast, g.shape, "float32", "gradient of 'w'")


def test_the_sparse_form_crosses_the_wire_and_the_inbox_rebuilds_it():
    from fusion.executors.runtime.inbox import Inbox
    from fusion.executors.runtime.part import Routes
    from fusion.ir.graph import OpGraph, ParamSpec

    g = _rows()
    graph = OpGraph()
    graph.params["w"] = ParamSpec("w", (1000, 16), "float32")
    od = OpData(name="w", index=None, op_users=(), actual_user=(), is_grad=True, local_iter=0, micro_batch=-1,
                src="p1", dst="p0", payload=pack(g, "float32"))
    frames = encode_opdata(od, kind="pgrad")
    assert sum(len(memoryview(f).cast("B")) if not isinstance(f, bytes) else len(f) for f in frames) < g.nbytes / 10
    got = opdata_from_message(decode(frames))
    assert isinstance(got.payload, SparsePayload)
    inbox = Inbox(graph, "p0", Routes(), 1, {"w": ["p0", "p1"]})
    inbox.open = True
    inbox.accept("p1", got, param_grad=True)
    assert _same_bits(inbox.param_grads(0)["w"]["p1"], g)


def test_a_tied_gpt_sends_its_embedding_gradient_sparse_and_still_equals_plain_pytorch(tmp_path):
    """A GPT whose vocabulary (1024) is much larger than the tokens of a step: the embedding's owner sends the rows
    the step touched, the output layer's owner its dense gradient; 3 steps equal plain PyTorch (losses rtol 1e-5)."""
    from fusion.cluster import load_cluster
    from fusion.compile import compile_model
    from fusion.data.batches import make_batches
    from fusion.ir.trace import trace
    from fusion.plan import save_plan
    from tests.executors.dist_models import assert_matches_plain, run_distributed
    from tests.executors.runtime.test_distributed_gpt import MICRO, OPT, _gpt_module, plain_sgd

    gpt = _gpt_module()
    cfg = gpt.GPTConfig(vocab=1024)
    module, example = gpt.gpt_model(cfg, batch=2, seed=0)
    model = trace(module, example)
    plan = compile_model(model, load_cluster("local-4-two-sites"), strategy="equal-count", micro_batches=MICRO,
                         optimizer=OPT)
    name = "transformer.wte.weight"
    owners = sorted({plan.assignment[n] for n in model.graph.param_users()[name]}, key=list(plan.parts).index)
    assert len(owners) == 2
    batch_fn = make_batches(plan, "text", seed=0)
    batches = [batch_fn(s) for s in range(3)]
    reports, state = run_distributed(save_plan(plan, tmp_path / "plan", params=model.params), tmp_path / "run", batches)
    module.train()
    assert_matches_plain(reports, state, plain_sgd(dict(module.named_parameters()), module, batches, MICRO))
    for r in reports:  # the owners' wait for each other's gradient is in the step line; the other parts have none
        line = r.metrics_line()["parts"]
        assert all(line[p]["tied_sync_s"] > 0 for p in owners)
        assert all("tied_sync_s" not in v for p, v in line.items() if p not in owners)

    dense = 1024 * cfg.d_model * 4
    sent = {}
    for part in owners:
        events = json.loads((tmp_path / "run" / "trace" / f"{part}.json").read_text())["traceEvents"]
        sent[part] = [e["args"]["bytes"] for e in events if e.get("cat") == "send" and e["name"] == f"grad {name}"]
    assert len(sent[owners[0]]) == len(sent[owners[1]]) == 3
    assert all(b < dense / 4 for b in sent[owners[0]]), sent  # the embedding's rows: sparse
    assert all(b >= dense for b in sent[owners[1]]), sent  # the output layer's gradient: dense

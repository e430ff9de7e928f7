"""Feeds checked against the plan (issue 28): a step's fields are checked by the coordinator before anything is sent
and again by the executor on receipt (dimensions, dtype kind, finite values, index ranges the graph knows), the
error naming the field and the node. They used to be checked by name only: token ids past the vocabulary reached the
engine as ``IndexError: index out of range in self``."""
import re

import numpy as np
import pytest

from tests.executors.dist_models import CNN_SPLITS, GPT_SPLITS, branching_cnn, cnn_batch, gpt_batch, tied_transformer
from fusion.executors.runtime.compnode import CompNode, ExecutorConfig
from fusion.executors.runtime.control import Setup, Step
from fusion.executors.runtime.coordinator import Coordinator, CoordinatorConfig
from fusion.executors.runtime.feeds import feed_problem, feed_specs
from fusion.executors.runtime.launcher import hand_plan
from fusion.ir.errors import FusionError, WireError
from fusion.ir.wire import decode
from fusion.plan import load_plan, save_plan

VOCAB = 17  # tests.executors.dist_models' tied transformer


def test_the_plan_knows_each_feed_s_range_dtype_and_shape():
    gpt = hand_plan(tied_transformer(mb=2), GPT_SPLITS[2], micro_batches=2)
    specs = feed_specs(gpt, ["idx", "targets"])
    assert (specs["idx"].bound.high, specs["idx"].bound.node, specs["idx"].bound.ignore) == (VOCAB, "emb", None)
    assert (specs["targets"].bound.high, specs["targets"].bound.node, specs["targets"].bound.ignore) == (VOCAB, "loss", -100)
    ok = gpt_batch(0, 2)
    assert feed_problem(specs["idx"], ok["idx"]) is None
    assert feed_problem(specs["idx"], ok["idx"][:1]) is None  # fewer rows than the example: allowed
    padded = ok["targets"].copy()
    padded[0, :3] = -100  # cross_entropy's ignore_index
    assert feed_problem(specs["targets"], padded) is None
    bad = ok["idx"].copy()
    bad[1, 2] = VOCAB
    assert feed_problem(specs["idx"], bad) == (f"holds {VOCAB} at flat position {bad.shape[1] + 2}, outside "
                                               f"0..{VOCAB - 1} (the {VOCAB} rows of the embedding 'emb')")
    assert "outside 0..16 or -100" in feed_problem(specs["targets"], -ok["targets"] - 1)
    assert "has dtype float32, the plan expects int64" in feed_problem(specs["idx"], ok["idx"].astype(np.float32))
    assert "has shape [2, 3], the plan expects [rows, " in feed_problem(specs["idx"], ok["idx"][:, :3])
    cnn = hand_plan(branching_cnn(mb=2), CNN_SPLITS[2], micro_batches=2)
    x = cnn_batch(0, 2)["x"].copy()
    x[0, 0, 0, 1] = np.nan
    assert feed_problem(feed_specs(cnn, ["x"])["x"], x) == "holds a non-finite value (nan) at flat position 1"


def test_the_coordinator_refuses_a_bad_field_before_sending_anything():
    plan = hand_plan(tied_transformer(mb=2), GPT_SPLITS[2], micro_batches=2)
    coord = Coordinator(plan, CoordinatorConfig())
    try:
        batch = gpt_batch(0, 4)
        batch["idx"][3, 0] = VOCAB + 7  # micro-batch 1 (rows 2 and 3), its second row: flat position T = 6
        with pytest.raises(FusionError, match=re.escape(f"step 0: batch field 'idx' (micro-batch 1) holds {VOCAB + 7} "
                                                        f"at flat position 6, outside 0..{VOCAB - 1} (the {VOCAB} rows "
                                                        f"of the embedding 'emb')")):
            coord._send_step(batch, False, False)
    finally:
        coord.close()


def test_an_executor_refuses_a_bad_feed_on_receipt_and_stops_naming_it(tmp_path):
    model = tied_transformer(mb=2)
    plan_dir = save_plan(hand_plan(model, GPT_SPLITS[2], micro_batches=1), tmp_path / "plan", params=model.params)
    node = CompNode(load_plan(plan_dir), plan_dir, ExecutorConfig("p0", "tcp://127.0.0.1:9"))
    node._setup(Setup(peers={"p1": "tcp://127.0.0.1:9"}, emulate_links=False, resume_step=None, checkpoint_dir=None))
    try:
        idx = gpt_batch(0, 2)["idx"]
        idx[0, 0] = -1
        with pytest.raises(WireError, match=re.escape("step 0: feed 'idx' (micro-batch 0) holds -1 at flat position 0, "
                                                      f"outside 0..{VOCAB - 1} (the {VOCAB} rows of the embedding 'emb')")):
            node._on_message("coordinator", decode(Step(arrays={"0/idx": idx}, it=0, want_grads=False, checkpoint=False).frames()))
        assert node._aborted.startswith("step 0: feed 'idx'")  # the part stops (naming it), it does not wait on
    finally:
        node.transport.close(timeout_s=1, linger_s=0)

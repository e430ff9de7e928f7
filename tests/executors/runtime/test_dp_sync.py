"""The data-parallel sync interface (executors/runtime/dp/): one registry maps every mode a plan may name to its
GradSync, a stage of one replica has none, and a received message goes to the inbox its header's type names
(a type the method does not take is refused by name). The end-to-end runs that check each method against plain
PyTorch are test_dp.py, test_dp_tree.py and test_diloco.py."""
from __future__ import annotations

import numpy as np
import pytest

from fusion.executors.runtime.dp.diloco import DiLoCo
from fusion.executors.runtime.dp.every_step import EveryStep
from fusion.executors.runtime.dp.header import DelayedHeader, PseudoHeader
from fusion.executors.runtime.dp.registry import SYNC_METHODS, make_sync
from fusion.ir.boundary import partition
from fusion.ir.errors import WireError
from fusion.ir.wire import decode, encode_payload
from fusion.plan import DPSync, load_plan
from tests.executors.dist_models import MODELS
from tests.executors.runtime.test_dp import MB, MICRO, save_dp_plan


def test_every_mode_a_plan_may_name_has_one_sync_method():
    assert sorted(SYNC_METHODS) == sorted(DPSync.MODES)
    assert all(cls.mode == mode for mode, cls in SYNC_METHODS.items())


def _trainable(plan, part):
    """What the CompNode of ``part`` hands make_sync: its trainable parameters, name -> (shape, dtype)."""
    g = plan.graph
    sub = partition(g, plan.replica_assignment(plan.parts[part].replica))[part]
    names = {p for n in sub.nodes for p in g[n].param_names()}
    return {p: (tuple(g.params[p].shape), g.params[p].dtype) for p in names if g.params[p].trainable}


def _received(header, data):
    meta, arrays = encode_payload(data)
    return decode([memoryview(f) for f in header.frames(meta, arrays)])


def test_the_plans_mode_picks_the_sync_and_the_header_type_its_inbox(tmp_path):
    build, splits, _, _ = MODELS["cnn"]
    model = build(mb=MB)
    plan = load_plan(save_dp_plan(tmp_path, model, splits[2], 2, micro_batches=MICRO))
    trainable = _trainable(plan, "p0")
    every = make_sync(plan, "p0", trainable)
    assert type(every) is EveryStep and every.group == ["p0", "r1.p0"] and every.neighbours == {"r1.p0"}
    n = every.buckets[0].total
    with pytest.raises(WireError, match="PseudoHeader from 'r1.p0': p0's 'every' data-parallel sync takes none"):
        every.accept("r1.p0", _received(PseudoHeader(0, 0, 0, 0, "r1.p0", "p0", ("p0", "r1.p0")),
                                        np.zeros(n, np.float32)))
    plan.dp_sync = DPSync("diloco", inner_steps=2, delay=1)
    diloco = make_sync(plan, "p0", trainable)
    assert type(diloco) is DiLoCo and diloco.delayed is not None
    diloco.accept("r1.p0", _received(DelayedHeader(2, 0, "r1.p0", "p0"), np.ones(n, np.float32)))
    np.testing.assert_array_equal(diloco.delayed.take(2, 0, "r1.p0"), np.ones(n, np.float32))
    assert diloco.state() is None  # no outer state before start() saw the engine's weights
    diloco.set_group(["p0"], 0)  # the other replica dropped: no group, nothing accepted
    assert diloco.ring is None
    with pytest.raises(WireError, match="has no data-parallel group"):
        diloco.accept("r1.p0", _received(DelayedHeader(4, 0, "r1.p0", "p0"), np.ones(n, np.float32)))


def test_a_stage_of_one_replica_has_no_sync(tmp_path):
    build, splits, _, _ = MODELS["cnn"]
    model = build(mb=MB)
    plan = load_plan(save_dp_plan(tmp_path, model, splits[2], 1, micro_batches=MICRO))
    assert make_sync(plan, "p0", _trainable(plan, "p0")) is None

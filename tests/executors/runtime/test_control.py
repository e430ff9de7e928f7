"""Typed control messages (executors/runtime/control.py): each op's dataclass gives the very bytes the
header dicts of before gave, reads back equal, and rejects a malformed header naming the op and field."""
import numpy as np
import pytest

from fusion.executors.runtime.control import (MESSAGES, TO_COORDINATOR, TO_EXECUTOR, Abort, Admit, Admitted, Clip, Commit,
                                              Done, Error, Eval, Evaluated, Fetch, GradNorm, Hb, Hello, Ready, Reduced,
                                              Regroup, Regrouped, Setup, State, Step, Stop, decode_ctrl)
from fusion.ir.errors import WireError
from fusion.ir.wire import decode, encode

X = {"0/x": np.arange(6, dtype=np.float32).reshape(2, 3), "0/y": np.array([1, 0], np.int64)}
W = {"w": np.ones(3, np.float32)}

#: (typed message, the header the untyped encoder sent for it: {"op", "names", *fields in the senders' order}, tensors)
CASES = [
    (Hello(part="p0", address="tcp://127.0.0.1:9", pid=7, engine="torch", digest="ab"),
     {"op": "hello", "names": [], "part": "p0", "address": "tcp://127.0.0.1:9", "pid": 7, "engine": "torch", "digest": "ab"}, {}),
    # the coordinator's setup: every field
    (Setup(peers={"p0": "tcp://a:1", "p1": "tcp://b:2"}, emulate_links=True, resume_step=3, checkpoint_dir="/c",
           failover=False, digest="d", resume_from="r1.p0"),
     {"op": "setup", "names": [], "peers": {"p0": "tcp://a:1", "p1": "tcp://b:2"}, "emulate_links": True,
      "resume_step": 3, "checkpoint_dir": "/c", "failover": False, "digest": "d", "resume_from": "r1.p0"}, {}),
    # without the optional fields (benchmarks/fuzz_wire.py's corpus)
    (Setup(peers={"p0": "tcp://a:1"}, emulate_links=False, resume_step=None, checkpoint_dir=None, digest=""),
     {"op": "setup", "names": [], "peers": {"p0": "tcp://a:1"}, "emulate_links": False, "resume_step": None,
      "checkpoint_dir": None, "digest": ""}, {}),
    (Ready(part="p1"), {"op": "ready", "names": [], "part": "p1"}, {}),
    (Step(arrays=X, it=4, want_grads=True, checkpoint=True, save_step=3),
     {"op": "step", "names": list(X), "it": 4, "want_grads": True, "checkpoint": True, "save_step": 3}, X),
    (Step(arrays=X, it=0, want_grads=False, checkpoint=False),
     {"op": "step", "names": list(X), "it": 0, "want_grads": False, "checkpoint": False}, X),
    (Done(arrays=W, it=2, losses=[[0, 1.5], [1, 2.0]], stats={"idle_s": 0.25, "sent": {"p1": {"bytes": 3}}}),
     {"op": "done", "names": ["w"], "it": 2, "losses": [[0, 1.5], [1, 2.0]], "stats": {"idle_s": 0.25, "sent": {"p1": {"bytes": 3}}}}, W),
    (Fetch(), {"op": "fetch", "names": []}, {}),
    (State(arrays=W), {"op": "state", "names": ["w"]}, W),
    (Stop(), {"op": "stop", "names": []}, {}),
    (Abort(reason="replica 1 dropped"), {"op": "abort", "names": [], "reason": "replica 1 dropped"}, {}),
    (Hb(), {"op": "hb", "names": []}, {}),
    (Error(reason="ValueError: x"), {"op": "error", "names": [], "reason": "ValueError: x"}, {}),
    (Reduced(it=5), {"op": "reduced", "names": [], "it": 5}, {}),
    (Commit(it=5), {"op": "commit", "names": [], "it": 5}, {}),
    (Regroup(it=5, drop=["r1.p0", "r1.p1"], micro_batches=4),
     {"op": "regroup", "names": [], "it": 5, "drop": ["r1.p0", "r1.p1"], "micro_batches": 4}, {}),
    (Regrouped(it=6), {"op": "regrouped", "names": [], "it": 6}, {}),
    # a replica joins (join.py): the live parts take it in, the joiner's setup carries the outer state
    (Admit(it=4, add=["r2.p0"], peers={"r2.p0": "tcp://c:3"}, micro_batches=2),
     {"op": "admit", "names": [], "it": 4, "add": ["r2.p0"], "peers": {"r2.p0": "tcp://c:3"}, "micro_batches": 2}, {}),
    (Admitted(it=4), {"op": "admitted", "names": [], "it": 4}, {}),
    (Fetch(outer=True), {"op": "fetch", "names": [], "outer": True}, {}),
    (Setup(arrays=W, peers={"p0": "tcp://a:1"}, emulate_links=False, resume_step=None, checkpoint_dir=None, digest="d",
           members=["p0", "r2.p0"], micro_batches=2, start_it=4, join_from="p0"),
     {"op": "setup", "names": ["w"], "peers": {"p0": "tcp://a:1"}, "emulate_links": False, "resume_step": None,
      "checkpoint_dir": None, "digest": "d", "members": ["p0", "r2.p0"], "micro_batches": 2, "start_it": 4,
      "join_from": "p0"}, W),
    (GradNorm(it=3, sq=0.25), {"op": "gradnorm", "names": [], "it": 3, "sq": 0.25}, {}),
    (Clip(it=3, norm=1.5), {"op": "clip", "names": [], "it": 3, "norm": 1.5}, {}),
    (Eval(arrays=X, it=4), {"op": "eval", "names": list(X), "it": 4}, X),
    (Evaluated(it=4, losses=[[0, 1.5]]), {"op": "evaluated", "names": [], "it": 4, "losses": [[0, 1.5]]}, {}),
]


def test_every_op_has_a_case_and_a_receiver():
    assert {m.op for m, _, _ in CASES} == set(MESSAGES)
    assert TO_EXECUTOR | TO_COORDINATOR == set(MESSAGES)


@pytest.mark.parametrize("msg,header,arrays", CASES, ids=[f"{m.op}{i}" for i, (m, _, _) in enumerate(CASES)])
def test_a_typed_message_has_the_bytes_of_its_header_dict_and_reads_back_equal(msg, header, arrays):
    frames = msg.frames()
    want = encode("ctrl", header, list(arrays.values()))
    assert [bytes(f) for f in frames] == [bytes(f) for f in want]
    back = decode_ctrl(decode([bytes(f) for f in frames]))
    assert type(back) is type(msg) and back.op == header["op"]
    assert back == msg and vars(back).keys() == vars(msg).keys()  # every field (equality leaves the tensors out)
    assert {k: v for k, v in vars(back).items() if k != "arrays"} == {k: v for k, v in vars(msg).items() if k != "arrays"}
    assert list(back.arrays) == list(arrays)
    for k, a in arrays.items():
        np.testing.assert_array_equal(back.arrays[k], a)
        assert back.arrays[k].dtype == a.dtype


def _bad(header):
    return decode(encode("ctrl", {"names": [], **header}))


@pytest.mark.parametrize("msg,header,arrays", CASES, ids=[f"{m.op}{i}" for i, (m, _, _) in enumerate(CASES)])
def test_a_missing_or_mistyped_field_is_a_wire_error_naming_the_op_and_field(msg, header, arrays):
    fields = [k for k in header if k not in ("op", "names")]
    optional = {"setup": {"failover", "resume_from", "members", "micro_batches", "start_it", "join_from"},
                "step": {"save_step"}, "fetch": {"outer"}}.get(msg.op, set())
    for f in fields:
        h = {k: v for k, v in header.items() if k not in ("names", f)}
        if f in optional:
            decode_ctrl(_bad(h))  # may be left off
        else:
            with pytest.raises(WireError, match=rf"control message '{msg.op}' lacks fields \['{f}'\]"):
                decode_ctrl(_bad(h))
        # no field takes a list of lists of floats, and none but the gradient norms a float
        for wrong in (("1.5", [[1.5]]) if f in ("sq", "norm") else (2.5, [[1.5]])):
            h = {**{k: v for k, v in header.items() if k != "names"}, f: wrong}
            with pytest.raises(WireError, match=rf"control message '{msg.op}': field '{f}' has a bad value"):
                decode_ctrl(_bad(h))


def test_unknown_ops_tensor_names_and_the_other_sides_ops_are_rejected():
    with pytest.raises(WireError, match="unknown control op 'exec'"):
        decode_ctrl(_bad({"op": "exec"}))
    with pytest.raises(WireError, match="unknown control op None"):
        decode_ctrl(_bad({}))
    with pytest.raises(WireError, match="is not a control message"):
        decode_ctrl(decode(encode("opdata", {"op": "hb"})))
    with pytest.raises(WireError, match="'hello' is not one this process receives"):
        decode_ctrl(decode(Hello(part="p", address="a", pid=1, engine="torch", digest="").frames()), TO_EXECUTOR)
    with pytest.raises(WireError, match="names 2 tensors but carries 1"):
        decode_ctrl(decode(encode("ctrl", {"op": "state", "names": ["a", "b"]}, [np.zeros(1)])))
    with pytest.raises(WireError, match="'names' must be a list of distinct strings"):
        decode_ctrl(decode(encode("ctrl", {"op": "state", "names": ["a", "a"]}, [np.zeros(1), np.zeros(1)])))


def test_a_step_names_its_checkpoint_by_a_step_count_up_to_its_iteration_plus_one():
    base = {"op": "step", "it": 2, "want_grads": False, "checkpoint": True}
    for save in (1, 3):
        assert decode_ctrl(_bad({**base, "save_step": save})).save_step == save
    for save in (0, 4):
        with pytest.raises(WireError, match=rf"step 2: save_step {save} is not a step count in 1..3"):
            decode_ctrl(_bad({**base, "save_step": save}))
    with pytest.raises(WireError, match="field 'save_step' has a bad value True"):
        decode_ctrl(_bad({**base, "save_step": True}))


def test_messages_are_frozen():
    import dataclasses

    with pytest.raises(dataclasses.FrozenInstanceError):
        Commit(it=1).it = 2

"""Fuzzing the wire decoder (issue 15): whatever the bytes, decoding raises WireError or returns a checked message.

The mutations are the ones of ``benchmarks/fuzz_wire.py`` (which also sends them to a live run); here hypothesis
drives them, plus arbitrary msgpack trees in every field, with a bounded number of examples.
"""
import importlib.util
from pathlib import Path

import msgpack
import numpy as np
from hypothesis import HealthCheck, given, settings, strategies as st

from fusion.ir.errors import WireError
from fusion.ir.opdata import OpData
from fusion.ir.wire import decode, encode, encode_opbatch, encode_opdata, opbatch_from_message, opdata_from_message
from fusion.kernels.sparse import SparsePayload

_spec = importlib.util.spec_from_file_location("fuzz_wire", Path(__file__).resolve().parents[2] / "benchmarks" / "fuzz_wire.py")
fuzz_wire = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fuzz_wire)


def _seeds() -> list[list[bytes]]:
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    sp = SparsePayload(np.ones(2, np.float32), np.array([1, 5], np.int32), (3, 4), "float32")
    msgs = [
        encode_opdata(OpData("a", 0, ("b",), ("b",), False, 0, 0, "p0", "p1", x, requires_grad=True)),
        encode_opdata(OpData("a", None, ("b",), ("b",), True, 3, 1, "p1", "p0", sp, compress_cfg={"algo": "topk", "ratio": 6})),
        encode_opdata(OpData("w", None, (), (), True, 0, -1, "p0", "p1", (1, 2.5)), kind="pgrad"),
        encode_opbatch([OpData("c", None, ("r",), ("r",), False, 0, 0, "p0", "p1", x, requires_grad=True),
                        OpData("idx", None, ("e",), ("e",), False, 0, 0, "p0", "p1", np.arange(4, dtype=np.int64)),
                        OpData("a", None, ("b",), ("b",), False, 0, 0, "p0", "p1", sp, compress_cfg={"algo": "topk"})]),
        encode("ctrl", {"op": "step", "names": ["0/x"], "it": 0, "want_grads": True, "checkpoint": False}, [x]),
        encode("ctrl", {"op": "done", "names": [], "it": 0, "losses": [[0, 1.5]], "stats": {}}),
    ]
    return [[f if isinstance(f, bytes) else np.ascontiguousarray(f).tobytes() for f in m] for m in msgs]


SEEDS = _seeds()


def _decode_all(frames) -> None:
    """decode, then the OP-Data field checks (and the payload codecs); only WireError may come out."""
    try:
        msg = decode(frames, max_bytes=1 << 20)
        if msg.kind in ("opdata", "pgrad"):
            opdata_from_message(msg)
        elif msg.kind == "opbatch":
            opbatch_from_message(msg)
    except WireError:
        pass


def test_the_seeds_are_valid():
    for frames in SEEDS:
        decode(frames)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.randoms(use_true_random=False), st.sampled_from(range(len(SEEDS))))
def test_mutated_messages_raise_only_wire_errors(rng, i):
    _decode_all(fuzz_wire.mutate(rng, SEEDS[i]))


_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(), st.text(max_size=8),
                  st.binary(max_size=8))
_tree = st.recursive(_leaf, lambda c: st.one_of(st.lists(c, max_size=4), st.dictionaries(st.text(max_size=4), c, max_size=4)),
                     max_leaves=12)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(range(len(SEEDS))), st.data())
def test_any_value_in_any_field_raises_only_wire_errors(i, data):
    frames = list(SEEDS[i])
    head = msgpack.unpackb(frames[0], raw=False)
    path = data.draw(st.sampled_from(fuzz_wire._paths(head)))
    head = fuzz_wire._set(head, path, data.draw(_tree))
    frames[0] = msgpack.packb(head, use_bin_type=True)
    if data.draw(st.booleans()):
        frames = frames[:1] + [data.draw(st.binary(max_size=64)) for _ in range(data.draw(st.integers(0, 3)))]
    _decode_all(frames)

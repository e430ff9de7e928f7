"""``delta`` (AQ-SGD): buffers stay identical at both ends, NumPy == torch bytes, wire, state, errors."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fusion.ir.errors import FusionError, WireError
from fusion.kernels import CODECS, DeltaBuffer, DeltaConfig, DeltaPayload, QuantPayload, TorchDeltaBuffer
from fusion.kernels import quant as Q
from fusion.kernels.delta import delta_buffer_nbytes, delta_wire_nbytes
from tests.kernels.codec_helpers import TORCH_DTYPES, opdata_round_trip, payload_bytes, to_numpy, widen

ROW = (3, 11)


def same_state(*bufs) -> None:
    states = [b.state_dict() for b in bufs]
    assert all(s.keys() == states[0].keys() for s in states)
    for k in states[0]:
        ref = states[0][k]
        for s in states[1:]:
            assert s[k].dtype == ref.dtype and s[k].shape == ref.shape and s[k].tobytes() == ref.tobytes(), k


def run_steps(cfg, dtype, steps=6, seed=0):
    """Sender/receiver pairs, NumPy and torch, fed the same micro-batches with repeated sample ids."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((12, *ROW))
    sn, rn, st, rt = DeltaBuffer(cfg), DeltaBuffer(cfg), TorchDeltaBuffer(cfg), TorchDeltaBuffer(cfg)
    outs = []
    for step in range(steps):
        ids = rng.choice(12, 5, replace=False)
        x = torch.from_numpy(base[ids] + 0.05 * step * rng.standard_normal((5, *ROW))).to(TORCH_DTYPES[dtype])
        pn = sn.encode(to_numpy(x), ids, dtype=dtype, seed=step)
        pt = st.encode(x, torch.from_numpy(ids), seed=step)
        assert payload_bytes(pn) == payload_bytes(pt), step
        yn = rn.decode(opdata_round_trip(pn, {"algo": "delta", **cfg}))
        yt = rt.decode(pt)
        assert yn.tobytes() == to_numpy(yt).tobytes()
        assert yn.shape == (5, *ROW) and yt.dtype == x.dtype
        outs.append((ids, x, pn, yn))
        same_state(sn, rn, st, rt)
    return (sn, rn, st, rt), outs


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
@pytest.mark.parametrize("first_visit", ["quant8", "dense"])
def test_sender_and_receiver_buffers_stay_identical(dtype, first_visit):
    cfg = {"bits": 2, "block": 16, "rounding": "stochastic", "first_visit": first_visit}
    (sn, rn, st, rt), outs = run_steps(cfg, dtype)
    assert any(p.first.any() for _, _, p, _ in outs[1:]) and any((~p.first).any() for _, _, p, _ in outs)
    assert len(sn) == len({int(i) for ids, *_ in outs for i in ids})
    # what the receiver returned is the sender's buffer for those ids
    ids, _, _, y = outs[-1]
    state = sn.state_dict()
    for j, i in enumerate(ids.tolist()):
        assert state[i].tobytes() == y[j].tobytes()


def test_first_visit_dense_is_exact_and_deltas_are_within_half_a_step():
    cfg = {"bits": 4, "block": 16, "first_visit": "dense"}
    s, r = DeltaBuffer(cfg), DeltaBuffer(cfg)
    x0 = np.random.default_rng(1).standard_normal((4, *ROW)).astype(np.float32)
    ids = [10, 20, 30, 40]
    p0 = s.encode(x0, ids)
    assert p0.first.all() and isinstance(p0.fresh, np.ndarray)
    np.testing.assert_array_equal(r.decode(p0), x0)
    x1 = x0 + 0.01 * np.random.default_rng(2).standard_normal(x0.shape).astype(np.float32)
    p1 = s.encode(x1, ids)
    assert not p1.first.any() and p1.delta.dtype == "float64" and p1.delta.bits == 4
    y1 = r.decode(p1)
    step = Q.step_sizes(p1.delta).reshape(x1.shape)
    # error = delta quantisation (<= step/2) + the float32 cast of buffer + delta
    err = np.abs(y1.astype(np.float64) - x1.astype(np.float64))
    assert np.all(err <= step / 2 * (1 + 1e-9) + np.spacing(np.abs(x1)))


def test_error_shrinks_when_a_sample_repeats():
    """AQ-SGD's point: the same activation sent again is corrected by the next delta."""
    cfg = {"bits": 2, "block": 32}
    s, r = DeltaBuffer(cfg), DeltaBuffer(cfg)
    x = np.random.default_rng(3).standard_normal((2, 64)).astype(np.float32)
    errs = [float(np.abs(r.decode(s.encode(x, [7, 8])) - x).max()) for _ in range(6)]
    assert errs[-1] < 0.05 * errs[0], errs
    assert all(b <= a for a, b in zip(errs, errs[1:])), errs


def test_unknown_sample_id_is_a_wire_error_naming_it():
    s = DeltaBuffer({"bits": 4})
    x = np.ones((2, 5), np.float32)
    s.encode(x, [1, 2])
    p = s.encode(x * 2, [2, 1])  # deltas for both
    fresh = DeltaBuffer({"bits": 4})
    with pytest.raises(WireError, match="sample id 2 is sent as a delta but this end has no buffer"):
        fresh.decode(p)
    half = DeltaBuffer({"bits": 4})
    half.decode(DeltaBuffer({"bits": 4}).encode(x[:1], [1]))  # a buffer for id 1 only
    with pytest.raises(WireError, match="sample id 2 "):
        half.decode(p)
    assert 2 not in half and 1 in half  # a refused payload changes nothing


def test_state_dict_round_trip_continues_identically():
    cfg = {"bits": 4, "block": 8}
    (sn, rn, st, rt), _ = run_steps(cfg, "bfloat16", steps=4, seed=5)
    state = sn.state_dict()
    assert all(a.dtype == np.uint16 and a.shape == ROW for a in state.values())
    # restore the sender into a fresh torch buffer and the receiver into a fresh NumPy one
    st2, rn2 = TorchDeltaBuffer(cfg), DeltaBuffer(cfg)
    st2.load_state_dict(state)
    rn2.load_state_dict(rn.state_dict())
    same_state(sn, st2, rn2)
    assert st2.dtype == "bfloat16" and st2.row_shape == ROW and st2.nbytes == sn.nbytes
    ids = np.array(sorted(state)[:3])
    x = torch.randn(3, *ROW).to(torch.bfloat16)
    a, b = sn.encode(to_numpy(x), ids, dtype="bfloat16"), st2.encode(x, ids)
    assert payload_bytes(a) == payload_bytes(b) and not a.first.any()
    assert rn2.decode(b).tobytes() == rn.decode(a).tobytes()
    same_state(sn, st2, rn, rn2)
    state[ids[0]] = state[ids[0]].astype(np.float32)
    with pytest.raises(FusionError, match="delta state"):
        DeltaBuffer(cfg).load_state_dict(state)


def test_memory_report():
    cfg = {"bits": 8}
    s = DeltaBuffer(cfg)
    assert s.nbytes == 0
    s.encode(np.zeros((4, *ROW), np.float16), [0, 1, 2, 3])
    s.encode(np.zeros((2, *ROW), np.float16), [3, 9])
    assert len(s) == 5 and s.nbytes == delta_buffer_nbytes(5, math.prod(ROW), "float16") == 5 * 33 * 2
    assert delta_buffer_nbytes(50_000, 512 * 1024, "bfloat16") == 50_000 * 512 * 1024 * 2
    s.drop([0, 1])
    assert len(s) == 3 and 0 not in s


def test_wire_nbytes_matches_payloads():
    cfg = DeltaConfig.from_cfg({"bits": 2, "block": 16})
    s = DeltaBuffer(cfg)
    x = np.random.default_rng(0).standard_normal((6, *ROW)).astype(np.float32)
    p0 = s.encode(x, range(6))
    assert p0.nbytes == delta_wire_nbytes(6, 33, "float32", cfg, first_rows=6)
    p1 = s.encode(x, [0, 1, 2, 3, 4, 10])
    assert p1.nbytes == delta_wire_nbytes(6, 33, "float32", cfg, first_rows=1)
    codec = CODECS.get("delta")
    assert codec.wire_nbytes(33, "float32", {"bits": 2, "block": 16}) == \
        delta_wire_nbytes(1, 33, "float32", cfg) + 2 * Q.HEADER_NBYTES


def test_codec_is_a_factory_and_validates_cfg():
    codec = CODECS.get("delta")
    assert isinstance(codec.buffer({"bits": 2}, backend="numpy"), DeltaBuffer)
    assert isinstance(codec.buffer({"bits": 2}), TorchDeltaBuffer)
    with pytest.raises(FusionError, match="delta is stateful"):
        codec.encode(torch.zeros(3), {})
    with pytest.raises(FusionError, match="delta is stateful"):
        codec.decode(None)
    with pytest.raises(FusionError, match="delta cfg: bits must be one of 2, 4, 8, got 5"):
        codec.wire_nbytes(10, "float32", {"bits": 5})
    with pytest.raises(FusionError, match="delta cfg: first_visit must be 'quant8' or 'dense', got 'fp16'"):
        codec.buffer({"first_visit": "fp16"})
    with pytest.raises(FusionError, match=r"delta cfg: unknown key\(s\) \['ratio'\]"):
        DeltaConfig.from_cfg({"ratio": 3})


def test_encode_errors():
    s = DeltaBuffer({})
    with pytest.raises(FusionError, match="duplicate sample ids"):
        s.encode(np.zeros((2, 3), np.float32), [4, 4])
    with pytest.raises(FusionError, match="3 sample ids for a tensor of shape"):
        s.encode(np.zeros((2, 3), np.float32), [1, 2, 3])
    s.encode(np.zeros((2, 3), np.float32), [1, 2])
    with pytest.raises(FusionError, match="on an edge whose buffers hold"):
        s.encode(np.zeros((2, 4), np.float32), [1, 2])
    with pytest.raises(FusionError, match="NaN or inf"):
        s.encode(np.full((1, 3), np.nan, np.float32), [1])


# ---------------------------------------------------------------- malformed payloads

def _good() -> DeltaPayload:
    s = DeltaBuffer({"bits": 2, "block": 8})
    x = np.random.default_rng(0).standard_normal((3, *ROW)).astype(np.float32)
    s.encode(x, [1, 2, 3])
    return s.encode(x, [3, 4, 1])  # rows: delta, first, delta


def test_good_payload_round_trips_through_the_wire():
    p = _good()
    back = opdata_round_trip(p, {"algo": "delta"})
    assert payload_bytes(back) == payload_bytes(p)
    assert back.first.tolist() == [False, True, False] and back.ids.tolist() == [3, 4, 1]


def _msg_cases():
    head, frames = _good().to_msg()
    ids = np.frombuffer(frames[0], np.int64)
    return {
        "duplicate id": (head, [np.array([3, 3, 1]).tobytes(), *frames[1:]], "sample id 3 appears more than once"),
        "flag 2": (head, [frames[0], bytes([0, 2, 0]), *frames[2:]], "first flags must be 0 or 1"),
        "ids short": (head, [ids[:2].tobytes(), *frames[1:]], "ids/first frames have 16/3 bytes"),
        "frame count": (head, frames[:-1], "needs 8 frames, got 7"),
        "rows": ({**head, "rows": -1}, frames, "bad rows"),
        "dtype": ({**head, "dtype": "int32"}, frames, "unknown dtype"),
        "no header": ({k: v for k, v in head.items() if k != "delta"}, frames, "malformed header"),
        "delta rows": (head, [frames[0], bytes([1, 1, 0]), *frames[2:]], "delta part has shape"),
        "delta bits": ({**head, "delta": {**head["delta"], "bits": 3}}, frames, "bits must be one of"),
        "fresh codes": (head, [*frames[:7], frames[7][:-1]], "codes frame has"),
        "fresh dense size": ({**head, "fresh": {"dense": True}}, [*frames[:5], b"\x00" * 7],
                             "dense first-visit frame has 7 bytes"),
        "delta scales nan": (head, [*frames[:2], np.full(len(frames[2]) // 2, np.nan, np.float16).tobytes(),
                                    *frames[3:]], "non-finite scale"),
    }


@pytest.mark.parametrize("case", list(_msg_cases()))
def test_malformed_payloads_raise_wire_error(case):
    head, frames, msg = _msg_cases()[case]
    with pytest.raises(WireError, match=msg):
        DeltaPayload.from_msg(head, frames)


def test_malformed_dataclass_fields_raise_wire_error():
    p = _good()
    fields = {f: getattr(p, f) for f in DeltaPayload.__dataclass_fields__}
    cases = [
        (dict(ids=p.ids.astype(np.int32)), "ids must be a 1-D int64 array"),
        (dict(first=p.first[:2]), "first must be a bool array"),
        (dict(fresh=p.delta), "first-visit part is a float64"),
        (dict(fresh=np.zeros((1, *ROW), np.float64)), "first-visit part is a float64"),
        (dict(row_shape=(3, -1)), "bad row_shape"),
    ]
    for kw, msg in cases:
        with pytest.raises(WireError, match=msg):
            DeltaPayload(**{**fields, **kw}).validate()
    assert isinstance(p.delta, QuantPayload)

"""The ``sparseloco`` pseudo-gradient codec (SparseLoCo, arXiv 2508.15706): chunk Top-k + 2-bit values, its bytes on
the wire, round trips, malformed payloads refused, and what the registry and the DiLoCo planner read of it."""
import numpy as np
import pytest

from fusion.executors.runtime.dp.outer import decode_pseudo, encode_pseudo, payload_nbytes, pseudo_feedback_decay
from fusion.ir.errors import FusionError, WireError
from fusion.kernels.codecs import CODECS, CodecPayload, Role
from fusion.kernels.codecs.sparseloco import SparseLoCoCodec, pack2, unpack2

UNIT = CODECS.unit("sparseloco")
X = np.array([0.1, -3, 2, 0.5, 0, 0, 1, -1, 5, 4, -0.1, 0.2, 7], np.float32)


def test_chunk_topk_and_two_bit_levels_on_a_fixed_input():
    """Chunks of 8 (the last of 5), 2 kept each: chunk 0 keeps -3 and 2 (levels 2, 3), chunk 1 keeps 7 and 5
    (levels 5, 7); the 2-bit codes are sign | upper << 1; the bytes are 2 per index, 1 per 4 codes, 8 per chunk."""
    cfg = {"algo": "sparseloco", "chunk": 8, "k": 2}
    p = UNIT.encode_host(X, "float32", cfg, None)
    assert isinstance(p, CodecPayload) and UNIT.owns(p)
    f = p.fields
    assert np.frombuffer(f["idx"], "<u2").tolist() == [1, 2, 0, 4]
    assert unpack2(f["codes"], 4).tolist() == [0b11, 0b00, 0b00, 0b10]
    assert np.frombuffer(f["levels"], "<f4").tolist() == [2.0, 3.0, 5.0, 7.0]
    assert f["codes"] == bytes([0b10_00_00_11])
    got = UNIT.decode_host(p)
    assert got.dtype == np.float32
    assert got.tolist() == [0, -3, 2, 0, 0, 0, 0, 0, 5, 0, 0, 0, 7]
    assert UNIT.wire_nbytes(13, "float32", cfg) == 8 + 1 + 16 == len(f["idx"]) + len(f["codes"]) + len(f["levels"])


def test_middle_magnitudes_go_to_their_level_mean_and_ties_to_the_lower_index():
    cfg = {"algo": "sparseloco", "chunk": 6, "k": 4}
    x = np.array([1.0, -1.0, 2.0, 9.0, -10.0, 0.0], np.float64)
    got = UNIT.decode_host(UNIT.encode_host(x, "float64", cfg, None))
    # kept: 9, -10, 2 and the first of the tied 1 / -1; levels: mean(1, 2) = 1.5, mean(9, 10) = 9.5
    np.testing.assert_array_equal(got, [1.5, 0, 1.5, 9.5, -9.5, 0])


@pytest.mark.parametrize("n,chunk,k", [(1, 4096, 64), (4096, 4096, 64), (10_000, 4096, 64), (300, 64, 64),
                                       (257, 16, 3), (0, 8, 2)])
def test_round_trip_bytes_and_what_survives(n, chunk, k):
    """Through the runtime's encode/decode (the wire's payload frames): the payload is ``wire_nbytes``, at most
    k values per chunk survive, each the sign of its input, and the kept ones are the chunk's largest."""
    rng = np.random.default_rng(n)
    x = rng.standard_normal(n).astype(np.float32)
    cfg = {"algo": "sparseloco", "chunk": chunk, "k": k}
    meta, frames = encode_pseudo(x, cfg)
    assert payload_nbytes(frames) == UNIT.wire_nbytes(n, "float32", cfg)
    got = decode_pseudo(meta, frames, cfg)
    assert got.shape == (n,) and got.dtype == np.float32
    for lo in range(0, n, chunk):
        c, g = x[lo:lo + chunk], got[lo:lo + chunk]
        nz = np.flatnonzero(g)
        assert len(nz) == min(k, len(c))
        assert set(nz) == set(np.argsort(-np.abs(c), kind="stable")[:len(nz)])
        assert (np.sign(g[nz]) == np.sign(c[nz])).all()
        assert np.abs(g[nz]).min() >= np.abs(c[nz]).min() - 1e-6 and np.abs(g[nz]).max() <= np.abs(c[nz]).max() + 1e-6
    if n >= 4096:
        assert payload_nbytes(frames) < 4 * n / 30  # 1.6 % density, 2 B + 2 bit each: about 50x fewer bytes


def test_pack2_round_trips():
    codes = np.array([3, 0, 1, 2, 2, 1, 0], np.uint8)
    assert unpack2(pack2(codes), 7).tolist() == codes.tolist()


def test_bad_cfgs_and_dtypes_name_the_key():
    for cfg, says in [({"k": 0}, "k 0 must be an integer 1..chunk"), ({"chunk": 8, "k": 9}, "k 9 must be"),
                      ({"chunk": 1 << 17}, "chunk 131072 must be"), ({"beta": 1.5}, "beta 1.5 must be"),
                      ({"ratio": 10}, "unknown key 'ratio'")]:
        with pytest.raises(FusionError, match=says):
            CODECS.check_role({"algo": "sparseloco", **cfg}, Role.PSEUDO_GRADIENT, "--pseudo-codec")
    with pytest.raises(FusionError, match="sparseloco cannot compress activations"):
        CODECS.check_role({"algo": "sparseloco"}, Role.ACTIVATION, "--compress")
    with pytest.raises(FusionError, match="cannot compress bfloat16"):
        UNIT.encode_host(np.zeros(4, np.uint16), "bfloat16", {"algo": "sparseloco"}, None)


def test_malformed_payloads_are_refused():
    cfg = {"algo": "sparseloco", "chunk": 8, "k": 2}
    good = UNIT.encode_host(X, "float32", cfg, None).fields

    def bad(**kw):
        with pytest.raises(WireError):
            UNIT.decode_host(CodecPayload("sparseloco", {**good, **kw}))

    bad(n=9)  # a last chunk of 1 keeps 1: 3 indices, not 4
    bad(k=0)
    bad(chunk=1 << 17)
    bad(dtype="int8")
    bad(idx=good["idx"][:-2])
    bad(levels=good["levels"] + b"\0" * 8)
    bad(idx=np.array([1, 2, 0, 5], "<u2").tobytes())  # index 5 of a 5-element last chunk
    bad(n=True)


def test_registry_answers_what_diloco_needs():
    """Pseudo-gradients only; error feedback always, decay beta; no outer momentum; ``auto``'s candidates after
    quant's and topk's, priced by ``wire_nbytes`` in the DiLoCo planner's list."""
    from fusion.cost.dp import PSEUDO_CODECS, pseudo_wire_bytes

    assert "sparseloco" in CODECS.serving(Role.PSEUDO_GRADIENT)
    assert "sparseloco" not in CODECS.serving(Role.DP_GRADIENT) + CODECS.serving(Role.ACTIVATION)
    assert UNIT.error_feedback and UNIT.pseudo_feedback and UNIT.outer_momentum == 0.0
    assert pseudo_feedback_decay({"algo": "sparseloco", "beta": 0.9}) == 0.9
    assert pseudo_feedback_decay({"algo": "sparseloco"}) == 0.95
    assert pseudo_feedback_decay({"algo": "topk", "ratio": 10}) == 1.0 == pseudo_feedback_decay(None)
    auto = CODECS.auto(Role.PSEUDO_GRADIENT)
    mine = [c for c in auto if c["algo"] == "sparseloco"]
    assert mine and list(auto[-len(mine):]) == mine and all(c in PSEUDO_CODECS for c in mine)
    specs = [(4096 * 3, "float32"), (100, "float32")]
    assert pseudo_wire_bytes(specs, mine[0]) == sum(UNIT.wire_nbytes(n, d, mine[0]) for n, d in specs)
    assert isinstance(UNIT, SparseLoCoCodec)

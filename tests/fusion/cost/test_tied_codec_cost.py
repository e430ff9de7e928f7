"""The tied-parameter gradient sync priced with a codec (``Plan.tied_codec``): the link term of each tied
parameter shrinks by the codec's byte ratio ``Codec.wire_nbytes / dense bytes``, plus its encode + decode time."""
import numpy as np
import pytest

from fusion.cost.estimate import tied_prices
from fusion.kernels.codec import CODECS
from tests.fusion.cost.test_estimate_equations import BPS, _cm, _graph, _node_part

Q8 = {"algo": "quant", "bits": 8, "block": 64}


def test_the_tied_sync_term_shrinks_by_the_codecs_byte_ratio():
    cm = _cm(_graph(tied=True))
    cm.cluster.alpha[:] = 0.0  # no latency: the link term is bytes over bandwidth, so it scales with the bytes
    dense = cm.evaluate(_node_part(cm), [0, 1, 2])
    w = 8 * 8 * 4  # l2.weight, held by p1 and p2
    assert dense.sync_s == pytest.approx(w * 8 / BPS[2, 1] + w * 8 / BPS[1, 2], rel=1e-12)
    wire = CODECS.get("quant").wire_nbytes(64, "float32", Q8)
    assert wire < w
    cm.tied_wire, cm.tied_codec_s = tied_prices(cm, Q8, rate_bytes_s=1e9)
    q = cm.p_names.index("l2.weight")
    assert cm.tied_wire[q] == wire and cm.tied_codec_s[q] == pytest.approx(w / 1e9)
    coded = cm.evaluate(_node_part(cm), [0, 1, 2])
    assert coded.sync_s - cm.tied_codec_s[q] == pytest.approx(dense.sync_s * wire / w, rel=1e-12)
    assert coded.pipeline_s == dense.pipeline_s  # only the sync term changes
    assert coded.iteration_s == pytest.approx(coded.pipeline_s + coded.sync_s, rel=1e-12)
    # a tiny tensor costs more quantised than dense (the frame header): priced as it is sent
    assert cm.tied_wire[cm.p_names.index("l1.bias")] > cm.p_bytes[cm.p_names.index("l1.bias")]


def test_no_tied_codec_prices_nothing():
    cm = _cm(_graph(tied=True))
    assert tied_prices(cm, None, 1e9) == (None, None)

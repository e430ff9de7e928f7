"""Which cut edges get a codec, and which one: compress only where the cost model says it pays.

``--compress`` takes ``none``, ``auto`` or a codec spec ``CODEC[:KEY=VALUE,...]``
(``quant:bits=4,block=64``, ``hadamard-quant:bits=4``, ``topk:ratio=100``,
``delta:bits=4``); ``--compress-bwd`` overrides the gradients' codec (``none``
sends them dense). ``delta`` (AQ-SGD activation deltas) is for activations
only: with it the gradients default to 8-bit ``quant`` (:data:`DELTA_BWD`), and
``--compress-bwd delta`` is refused.

The rule for one cut edge (tensor t from part a to part b), priced with the
alpha-beta model of FusionLLM Eq. (2) and the codec's exact wire bytes
(``Codec.wire_nbytes``): the edge is compressed in a direction when

    alpha_ab + beta_ab * wire(t) + M_t / codec_rate  <  alpha_ab + beta_ab * M_t

i.e. when the bytes saved on the link take longer to send than encoding and
decoding them take. :func:`codec_prices` gives the estimator the same prices
for every tensor, so OP-Fence scores each candidate cut with its codec
(compression-aware partitioning) and :func:`choose` then compresses exactly
the edges the partitioner priced as compressed. ``codec_rate`` (dense bytes per second through encode +
decode, :data:`CODEC_RATE`) comes from ``benchmarks/bench_codecs.py`` on one
CPU thread. Unlike Eq. (7), which is relative (the slowest edge always gets
the largest ratio, even when every link is 10 Gbit/s), this compresses nothing
on fast links.

``auto`` gives each slow edge 8-bit block quantisation in both directions:
SWARM reports 8-bit activations and gradients with no loss in perplexity, and
Top-K does not converge here (``docs/compression.md``); lower bit widths are
left to an explicit spec until the convergence study shows where they pay.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fusion.cost.estimate import CostModel
from fusion.ir.errors import FusionError
from fusion.ir.node import TensorMeta
from fusion.plan import EdgeCompression

#: dense bytes per second through one encode + decode on one CPU thread (bench_codecs.py, 1M float32:
#: quant ~10 ms, hadamard-quant ~60 ms, Top-K ~2 ms; rounded down)
CODEC_RATE = {"quant": 300e6, "hadamard-quant": 60e6, "topk": 400e6, "delta": 150e6}

#: what ``auto`` chooses on an edge where compression pays
AUTO = {"algo": "quant", "bits": 8, "block": 64}

#: the gradients' codec when ``--compress delta:...`` is given without ``--compress-bwd`` (AQ-SGD sends
#: gradients directly quantised; 8 bits as SWARM)
DELTA_BWD = {"algo": "quant", "bits": 8, "block": 64}


class CompressSpecError(FusionError):
    """A ``--compress`` value that names no codec or has bad arguments; the message says which."""


@dataclass(frozen=True)
class CompressRequest:
    """What the user asked for: ``fwd``/``bwd`` codec cfgs (None: dense) or ``auto`` for both."""

    fwd: dict | None
    bwd: dict | None
    auto: bool = False


def parse_spec(spec: str, flag: str = "--compress") -> dict | None | str:
    """``"quant:bits=4,block=64"`` -> ``{"algo": "quant", "bits": 4, "block": 64}``; ``none`` -> None;
    ``auto`` -> ``"auto"``. Values are ints, floats or strings; the codec checks its own keys."""
    from fusion.kernels.codec import CODECS

    text = spec.strip()
    if text == "none":
        return None
    if text == "auto":
        return "auto"
    algo, _, rest = text.partition(":")
    if algo not in CODECS:
        raise CompressSpecError(f"{flag} {spec!r}: unknown codec {algo!r}; known: none, auto, {', '.join(CODECS.names())}")
    if algo == "delta" and flag == "--compress-bwd":
        raise CompressSpecError(f"{flag} {spec!r}: delta (AQ-SGD) compresses activations only; give the gradients "
                                "another codec (e.g. quant:bits=8) or none")
    cfg: dict[str, Any] = {"algo": algo}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise CompressSpecError(f"{flag} {spec!r}: expected KEY=VALUE, got {item!r}")
        cfg[key.strip()] = _value(value.strip())
    try:
        CODECS.get(algo).wire_nbytes(1024, "float32", cfg)  # the codec validates its keys
    except FusionError as e:
        raise CompressSpecError(f"{flag} {spec!r}: {e}") from None
    return cfg


def _value(v: str) -> Any:
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return v


def request(fwd_spec: str | None, bwd_spec: str | None = None) -> CompressRequest | None:
    """The request of ``--compress`` and ``--compress-bwd`` (None: nothing compressed)."""
    if fwd_spec is None and bwd_spec is None:
        return None
    fwd = parse_spec(fwd_spec) if fwd_spec is not None else None
    if fwd == "auto":
        bwd = parse_spec(bwd_spec, "--compress-bwd") if bwd_spec is not None else "auto"
        if bwd == "auto":
            return CompressRequest(dict(AUTO), dict(AUTO), auto=True)
        return CompressRequest(dict(AUTO), bwd, auto=True)
    if bwd_spec is not None:
        bwd = parse_spec(bwd_spec, "--compress-bwd")
    elif isinstance(fwd, dict) and fwd["algo"] == "delta":
        bwd = dict(DELTA_BWD)  # per-sample deltas of gradients make no sense: AQ-SGD quantises them directly
    else:
        bwd = fwd
    if bwd == "auto":
        bwd = dict(AUTO)
    if fwd is None and bwd is None:
        return None
    return CompressRequest(fwd, bwd)


def _meta(cm: CostModel, t: int) -> TensorMeta | None:
    producer, index = cm.t_key[t]
    node = cm.graph[producer]
    outs = node.meta.outputs
    o = outs[0] if index is None and len(outs) == 1 and not node.meta.multi else \
        (outs[index] if index is not None and index < len(outs) else None)
    if not isinstance(o, TensorMeta) or not o.dtype.startswith(("float", "bfloat")) or o.numel == 0:
        return None
    return o


def codec_prices(cm: CostModel, req: CompressRequest) -> "CodecPrices":
    """Each tensor's wire bytes and encode + decode seconds under the requested codecs, for
    :attr:`CostModel.codec_prices` (so that partitioning prices every candidate cut with its codec)."""
    import numpy as np

    from fusion.cost.estimate import CodecPrices
    from fusion.kernels.codec import CODECS

    n = len(cm.t_key)
    out = {k: np.full(n, np.inf) for k in ("fwd_wire", "fwd_s", "bwd_wire", "bwd_s")}
    for t in range(n):
        meta = _meta(cm, t)
        if meta is None:
            continue
        for d, cfg in (("fwd", req.fwd), ("bwd", req.bwd)):
            if cfg is None:
                continue
            out[f"{d}_wire"][t] = float(CODECS.get(cfg["algo"]).wire_nbytes(meta.numel, meta.dtype, cfg))
            out[f"{d}_s"][t] = float(meta.nbytes) / CODEC_RATE.get(cfg["algo"], CODEC_RATE["quant"])
    return CodecPrices(**out)


def pays(cm: CostModel, src_dev: int, dst_dev: int, meta: TensorMeta, cfg: dict) -> tuple[bool, float]:
    """(whether ``cfg`` shortens this edge's transfer, the compressed wire bytes)."""
    from fusion.kernels.codec import CODECS

    dense = float(meta.nbytes)
    wire = float(CODECS.get(cfg["algo"]).wire_nbytes(meta.numel, meta.dtype, cfg))
    t_dense = cm.cluster.comm_time(src_dev, dst_dev, dense)
    t_codec = cm.cluster.comm_time(src_dev, dst_dev, wire) + dense / CODEC_RATE.get(cfg["algo"], CODEC_RATE["quant"])
    return t_codec < t_dense, wire


def choose(cm: CostModel, node_part, part_device, part_names: list[str], req: CompressRequest
           ) -> tuple[list[EdgeCompression], dict[tuple[int, int, int], tuple[float, float]]]:
    """Codecs for the cut edges of an assignment where they pay; returns the plan's list and the wire
    bytes per (tensor, src part, dst part) (forward, backward) for :meth:`CostModel.evaluate`."""
    import numpy as np

    node_part = np.asarray(node_part)
    dev = np.asarray(part_device)
    src = node_part[cm.t_prod[cm.e_t]]
    dst = node_part[cm.e_cons]
    edges = sorted({(int(t), int(a), int(b)) for t, a, b in zip(cm.e_t, src, dst) if a != b})
    out: list[EdgeCompression] = []
    wire: dict[tuple[int, int, int], tuple[float, float]] = {}
    for e in edges:
        meta = _meta(cm, e[0])
        if meta is None:
            continue
        a, b = int(dev[e[1]]), int(dev[e[2]])
        dense = float(meta.nbytes)  # an edge compressed one way only sends the other way dense
        fwd = bwd = None
        fwd_bytes = bwd_bytes = dense
        if req.fwd is not None:
            ok, nb = pays(cm, a, b, meta, req.fwd)
            if ok:
                fwd, fwd_bytes = dict(req.fwd), nb
        if req.bwd is not None and cm.t_rg[e[0]]:
            ok, nb = pays(cm, b, a, meta, req.bwd)
            if ok:
                bwd, bwd_bytes = dict(req.bwd), nb
        if fwd is None and bwd is None:
            continue
        producer, index = cm.t_key[e[0]]
        out.append(EdgeCompression(producer, index, part_names[e[1]], part_names[e[2]], 1.0, (), False, fwd, bwd))
        wire[e] = (fwd_bytes, bwd_bytes)
    return out, wire

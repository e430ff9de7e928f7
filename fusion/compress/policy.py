"""Which cut edges get a codec, and which one: compress only where the cost model says it pays.

``--compress`` takes ``none``, ``auto`` or a codec spec ``CODEC[:KEY=VALUE,...]``
(``quant:bits=4,block=64``, ``hadamard-quant:bits=4``, ``topk:ratio=100``,
``delta:bits=4``); ``--compress-bwd`` overrides the gradients' codec (``none``
sends them dense, ``auto`` chooses). ``delta`` (AQ-SGD activation deltas) is for
activations only: with it the gradients default to 8-bit ``quant``
(``DeltaCodec.gradient_codec``), and ``--compress-bwd delta`` is refused. ``delta`` keeps
one decoded activation per training sample at both ends of an edge, so it needs
the data set's size (``--samples N``, or the built-in text corpus's window
count when ``fusion run`` trains on it): its buffers are in the memory model.

The rule for one direction of one cut edge (tensor t from part a to part b),
priced with the alpha-beta model of FusionLLM Eq. (2), each candidate codec's
exact wire bytes (``Codec.wire_nbytes``) and its encode + decode time:

    price(c) = alpha_ab + beta_ab * wire_c(t) + M_t / rate_c

the edge takes the candidate with the lowest price, and only where that is
below the dense ``alpha_ab + beta_ab * M_t`` (compress only where it pays;
unlike Eq. (7), which is relative and gives the slowest edge the largest ratio
even when every link is 10 Gbit/s, this compresses nothing on fast links). An
explicit ``--compress CODEC`` has one candidate; ``auto`` has the table
:data:`AUTO_FWD` / :data:`AUTO_BWD` of codecs the convergence study shows to
converge (``docs/compression.md``, "How auto chooses"). The estimator prices
every candidate cut of the partitioner the same way (:func:`codec_prices`,
``CostModel.evaluate``: compression-aware partitioning), and :func:`choose`
reads the codecs of the final cut from that same evaluation, so the plan
compresses exactly what was priced.
"""
from __future__ import annotations

import dataclasses

import logging
from dataclasses import dataclass
from typing import Any

from fusion.cost.estimate import CostModel
from fusion.ir.errors import FusionError
from fusion.ir.node import TensorMeta
from fusion.kernels.codecs import CODECS, Role
from fusion.plan import EdgeCompression

log = logging.getLogger(__name__)

#: ``auto``'s candidates for activations and for gradients, best first: each codec declares its own (its
#: ``auto``, with the convergence study's numbers beside it, ``fusion/kernels/codecs/``); ``delta`` rows count
#: only where the data gives sample ids and the data set's size is declared (:attr:`CompressRequest.auto_delta`).
AUTO_FWD = CODECS.auto(Role.ACTIVATION)
AUTO_BWD = CODECS.auto(Role.GRADIENT)

class CompressSpecError(FusionError):
    """A ``--compress`` value that names no codec or has bad arguments; the message says which."""


@dataclass(frozen=True)
class CompressRequest:
    """What the user asked for, per direction: a codec cfg, None (dense) or ``"auto"`` (the table).

    samples:    training samples in the data set (distinct sample ids the data gives): sizes the
                ``delta`` buffers in the memory model; None: unknown, and ``delta`` is refused.
    auto_delta: ``auto`` may choose ``delta`` (the data is a fixed set of ``samples`` samples visited
                again every epoch, as in the study); False for data drawn at random (the built-in
                corpus), where a sample rarely comes back and nearly every message would be a first visit.
    """

    fwd: dict | str | None
    bwd: dict | str | None
    samples: int | None = None
    auto_delta: bool = False

    @property
    def auto(self) -> bool:
        return "auto" in (self.fwd, self.bwd)

    def candidates(self, direction: str) -> list[dict]:
        """The codec cfgs this direction chooses among (empty: dense)."""
        want = self.fwd if direction == "fwd" else self.bwd
        if want is None:
            return []
        if want != "auto":
            return [dict(want)]
        table = AUTO_FWD if direction == "fwd" else AUTO_BWD
        return [dict(c) for c in table if not _per_sample(c) or (self.auto_delta and self.samples)]


def parse_spec(spec: str, flag: str = "--compress") -> dict | None | str:
    """``"quant:bits=4,block=64"`` -> ``{"algo": "quant", "bits": 4, "block": 64}``; ``none`` -> None;
    ``auto`` -> ``"auto"``. Values are ints, floats or strings; the codec checks its own keys."""
    text = spec.strip()
    if text == "none":
        return None
    if text == "auto":
        return "auto"
    algo, _, rest = text.partition(":")
    if algo not in CODECS:
        raise CompressSpecError(f"{flag} {spec!r}: unknown codec {algo!r}; known: none, auto, {', '.join(CODECS.names())}")
    if flag == "--compress-bwd" and Role.GRADIENT not in CODECS.unit(algo).roles:
        raise CompressSpecError(f"{flag} {spec!r}: {algo} compresses activations only; give the gradients "
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


def request(fwd_spec: str | None, bwd_spec: str | None = None, samples: int | None = None,
            auto_delta: bool | None = None) -> CompressRequest | None:
    """The request of ``--compress`` and ``--compress-bwd`` (None: nothing compressed).

    samples: the data set's size (``--samples``); auto_delta: whether ``auto`` may choose ``delta``
    (default: when ``samples`` is given). An explicit ``delta`` without ``samples`` is refused."""
    if fwd_spec is None and bwd_spec is None:
        return None
    fwd = parse_spec(fwd_spec) if fwd_spec is not None else None
    if bwd_spec is not None:
        bwd = parse_spec(bwd_spec, "--compress-bwd")
    elif isinstance(fwd, dict):
        bwd = CODECS.gradients_for(fwd)  # delta: per-sample deltas of gradients make no sense (AQ-SGD quantises them)
    else:
        bwd = fwd
    if fwd is None and bwd is None:
        return None
    if isinstance(fwd, dict) and _per_sample(fwd) and not samples:
        raise CompressSpecError(f"--compress {fwd_spec}: delta (AQ-SGD) keeps one activation per training sample "
                                "at both ends of every delta edge, and the compiler sizes those buffers by the data "
                                "set: give --samples N (the number of distinct sample ids your data gives)")
    if samples is not None and samples < 1:
        raise CompressSpecError(f"--samples {samples}: the data set's size must be a positive integer")
    return CompressRequest(fwd, bwd, samples, bool(samples) if auto_delta is None else bool(auto_delta and samples))


def _meta(cm: CostModel, t: int) -> TensorMeta | None:
    producer, index = cm.t_key[t]
    node = cm.graph[producer]
    outs = node.meta.outputs
    o = outs[0] if index is None and len(outs) == 1 and not node.meta.multi else \
        (outs[index] if index is not None and index < len(outs) else None)
    if not isinstance(o, TensorMeta) or not o.dtype.startswith(("float", "bfloat")) or o.numel == 0:
        return None
    if producer in cm.bf16 and o.dtype == "float32":  # autocast sends it as bfloat16 (--precision bf16)
        return dataclasses.replace(o, dtype="bfloat16")
    return o


def _per_sample(cfg: dict) -> bool:
    """Whether the codec keeps per-sample state at both ends (``delta``): it needs sample ids and buffers."""
    return CODECS.unit(cfg["algo"]).stateful


def _rate(algo: str) -> float:
    """Dense bytes per second through encode + decode (the codec's ``rate``); a codec whose CPU cost was
    never measured (a user-registered one) is priced at no time, and said so."""
    rate = CODECS.unit(algo).rate
    if rate is None:
        log.warning("codec %r: its encode/decode time was never measured here; pricing its wire bytes only", algo)
        return float("inf")
    return rate


def codec_prices(cm: CostModel, req: CompressRequest) -> "CodecPrices":
    """Every candidate codec's wire bytes, encode + decode seconds and buffer bytes per tensor, for
    :attr:`CostModel.codec_prices` (so that partitioning prices every candidate cut with its codecs).

    ``delta`` applies to a float tensor whose leading dimension is a multiple of the micro-batch's
    samples (the runtime buffers it per sample; others go dense, ``executors/runtime/delta_edges.py``);
    it is priced at its steady state (every row a delta; first visits go at 8 bits), and each end of
    its edge keeps ``req.samples * M_t / samples_per_micro_batch`` bytes of buffers, in the
    activation's dtype as the runtime keeps them (``kernels/delta.py``: ``delta_buffer_nbytes``).

    Seconds: the host's measured encode + decode of a message of the tensor's size
    (``Device.codec_costs``, from ``fusion profile``; the slowest device that measured the codec) where the
    cluster has them, else the dense bytes over the codec's built-in ``rate``.
    """
    import numpy as np

    from fusion.cost.estimate import CodecPrices

    from fusion.cost.codec_costs import codec_seconds

    devices = cm.cluster.devices
    n = len(cm.t_key)
    spmb = max(1, int(cm.samples_per_micro_batch))
    metas = [_meta(cm, t) for t in range(n)]
    out: dict[str, Any] = {}
    for d in ("fwd", "bwd"):
        cands = req.candidates(d) or [None]  # one all-inf row: that direction stays dense
        wire, secs, mem = (np.full((len(cands), n), np.inf) for _ in range(3))
        mem[:] = 0.0
        for k, cfg in enumerate(cands):
            if cfg is None:
                continue
            codec = CODECS.unit(cfg["algo"])
            measured = [codec_seconds(devices, cfg, float(m.nbytes)) if m is not None else None for m in metas]
            rate = _rate(cfg["algo"]) if any(m is not None and s is None for m, s in zip(metas, measured)) else None
            for t, meta in enumerate(metas):
                if meta is None:
                    continue
                if codec.stateful:
                    if not meta.shape or meta.shape[0] % spmb or not req.samples:
                        continue  # no sample rows: the runtime sends it dense
                    mem[k, t] = float(req.samples * (meta.nbytes // spmb))
                wire[k, t] = float(codec.wire_nbytes(meta.numel, meta.dtype, cfg))
                secs[k, t] = measured[t] if measured[t] is not None else float(meta.nbytes) / rate
        out[f"{d}_wire"], out[f"{d}_s"], out[f"{d}_cfgs"] = wire, secs, [c for c in cands if c is not None]
        if d == "fwd":
            out["fwd_mem"] = mem
    return CodecPrices(**out, fallback=req.fwd == "auto")


def choose(cm: CostModel, node_part, part_device, part_names: list[str], req: CompressRequest,
           recompute=None) -> tuple[list[EdgeCompression], dict[tuple[int, int, int], tuple[float, float]]]:
    """Codecs for the cut edges of an assignment where they pay (the candidate :meth:`CostModel.evaluate`
    prices fastest per direction); returns the plan's list and the wire bytes per (tensor, src part,
    dst part) (forward, backward) for :meth:`CostModel.evaluate`."""
    cp = codec_prices(cm, req)
    est = cm.evaluate(node_part, part_device, recompute=recompute, prices=cp)
    out: list[EdgeCompression] = []
    wire: dict[tuple[int, int, int], tuple[float, float]] = {}
    for (t, a, b), (f, g) in sorted(est.codecs.items()):
        dense = float(cm.t_bytes[t])  # a direction left dense sends the tensor's bytes
        fwd = dict(cp.fwd_cfgs[f]) if f >= 0 else None
        bwd = dict(cp.bwd_cfgs[g]) if g >= 0 and cm.t_rg[t] else None
        if fwd is None and bwd is None:
            continue
        producer, index = cm.t_key[t]
        out.append(EdgeCompression(producer, index, part_names[a], part_names[b], 1.0, (), False, fwd, bwd))
        wire[(t, a, b)] = (float(cp.fwd_wire[f, t]) if fwd else dense, float(cp.bwd_wire[g, t]) if bwd else dense)
    return out, wire

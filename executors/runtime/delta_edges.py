"""AQ-SGD activation deltas at run time: the per-sample buffers of one part's ``delta`` edges.

AQ-SGD (Wang et al., NeurIPS 2022, Alg. 1) sends for a training sample seen
before only the quantised change of its activation since its previous visit,
``q(a_xi - m(xi))``, and both ends set ``m(xi) += dequant(q)``; a first visit
is sent with a higher-precision codec. :mod:`fusion.kernels.delta` implements
one edge's buffers (``DeltaBuffer``, NumPy, so NumPy CompNodes stay
torch-free); this module keeps one per (role, tensor, peer) of a part:

* ``("send", key, dst)``: activations this part sends over a delta edge;
* ``("recv", key, src)``: activations it receives over one.

Sample identity: every micro-batch's sample ids reach every part with the
coordinator's ``step`` message (feed ``<mb>/#sample_ids``,
:data:`fusion.ir.opdata.SAMPLE_IDS`; the in-process reference executor passes
them in the feeds too), and every delta payload carries its rows' ids
(``DeltaPayload.ids``), so the receiver decodes with the ids the sender used.

Rows: a delta buffer is per sample, so the tensor's leading dimension must be
the micro-batch's samples, or a multiple of them in sample-major order (a
``[mb*T, d]`` activation is buffered as ``[mb, T, d]``). A tensor whose leading
dimension is not is sent dense (logged once per edge); both ends agree because
the receiver decodes whatever payload arrives.

Received payloads are checked when they arrive (:meth:`DeltaEdges.check`,
called by the CompNode's inbox): a delta row whose sample has no buffer at
this end (a cache miss: the ends are out of step) is a :class:`WireError`, so
the transport logs and drops the message and the executor keeps serving.

Checkpoints: :meth:`state_arrays` / :meth:`load_state_arrays` give every
buffer as two arrays (ids, stacked rows) keyed by the edge, which the CompNode
saves beside its parameters, so ``--resume`` continues bit for bit.
"""
from __future__ import annotations

import json
import logging
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fusion.ir.errors import FusionError, WireError
from fusion.kernels.delta import DeltaBuffer, DeltaConfig, DeltaPayload

log = logging.getLogger(__name__)

Key = tuple[str, "int | None"]
EdgeId = tuple[str, Key, str]  # (role "send"/"recv", tensor key, peer part)


def _rows_view(x: np.ndarray, n: int) -> np.ndarray | None:
    """``x`` with ``n`` sample rows leading (``[B, ...]`` -> ``[n, B // n, ...]``), or None when it cannot be."""
    if x.ndim == 0 or n == 0 or x.shape[0] % n:
        return None
    return x if x.shape[0] == n else x.reshape(n, x.shape[0] // n, *x.shape[1:])


@dataclass
class DeltaEdges:
    """The AQ-SGD buffers of one part.

    part:    this part's name (messages in log lines and stochastic-rounding seeds).
    buffers: (role, tensor key, peer) -> that edge's :class:`DeltaBuffer`, made on first use.
    """

    part: str
    buffers: dict[EdgeId, DeltaBuffer] = field(default_factory=dict)
    _dense_warned: set = field(default_factory=set, repr=False)

    def buffer(self, role: str, key: Key, peer: str, cfg: dict) -> DeltaBuffer:
        eid = (role, key, peer)
        b = self.buffers.get(eid)
        if b is None:
            b = self.buffers[eid] = DeltaBuffer(DeltaConfig.from_cfg(cfg))
        return b

    # -- sending ------------------------------------------------------------------------
    def encode(self, x: np.ndarray, dtype: str, key: Key, peer: str, cfg: dict, ids: Any, it: int | None,
               mb: int) -> DeltaPayload | None:
        """The delta payload of activation ``x`` (micro-batch ``mb`` of samples ``ids``) to ``peer``,
        or None when ``x`` has no sample rows (sent dense). FusionError when the data carries no ids."""
        if ids is None:
            raise FusionError(f"{self.part}: edge {key[0]}[{key[1]}] -> {peer} is compressed with delta (AQ-SGD), "
                              "which needs each micro-batch's sample ids; the batches carry none (the built-in "
                              "text corpus gives them; a --data function returns them under '#sample_ids')")
        ids = np.asarray(ids).reshape(-1)
        rows = _rows_view(x, ids.size)
        if rows is None:
            if (key, peer) not in self._dense_warned:
                self._dense_warned.add((key, peer))
                log.warning("%s: %s[%s] -> %s has shape %s, whose leading dimension is not a multiple of the "
                            "%d samples of a micro-batch: sent dense, not as deltas", self.part, key[0], key[1], peer,
                            list(x.shape), ids.size)
            return None
        dc = DeltaConfig.from_cfg(cfg)
        seed = None
        if dc.rounding == "stochastic":  # fresh noise per message, a function of (edge, step, micro-batch) only:
            # a resumed run draws what the uninterrupted one drew
            seed = zlib.crc32(repr((self.part, key, peer, it, mb)).encode())
        return self.buffer("send", key, peer, cfg).encode(rows, ids, dtype=dtype, seed=seed)

    # -- receiving ----------------------------------------------------------------------
    def check(self, p: DeltaPayload, key: Key, src: str, mb: int) -> None:
        """Raise WireError unless every delta row of ``p`` has a buffer here (no cache miss)."""
        b = self.buffers.get(("recv", key, src))
        for i, first in zip(p.ids.tolist(), p.first.tolist()):
            if not first and (b is None or i not in b):
                raise WireError(f"delta payload of {key[0]}[{key[1]}] from {src}, micro-batch {mb}: sample id {i} is "
                                f"sent as a delta but {self.part} has no buffer for it (cache miss: the two ends "
                                "are out of step)")

    def decode(self, p: DeltaPayload, key: Key, src: str, cfg: dict, shape: tuple[int, ...] | None) -> np.ndarray:
        """The activation ``p`` carries (reshaped to the graph's ``shape``); updates this end's buffers."""
        self.check(p, key, src, -1)
        out = self.buffer("recv", key, src, cfg).decode(p)
        return out.reshape(shape) if shape is not None else out

    # -- checkpoints --------------------------------------------------------------------
    def state_arrays(self) -> dict[str, np.ndarray]:
        """Every buffer as ``<edge>#ids`` (int64) and ``<edge>#rows`` (stacked rows; bfloat16 as uint16);
        ``<edge>`` is the JSON list ``[role, producer, index, peer]``."""
        out: dict[str, np.ndarray] = {}
        for (role, key, peer), b in sorted(self.buffers.items(), key=lambda kv: repr(kv[0])):
            if b.dtype is None:
                continue
            name = json.dumps([role, key[0], key[1], peer])
            state = b.state_dict()
            ids = np.array(sorted(state), dtype=np.int64)
            out[f"{name}#ids"] = ids
            out[f"{name}#rows"] = np.stack([state[i] for i in ids.tolist()]) if ids.size else np.zeros((0,))
        return out

    def load_state_arrays(self, arrays: dict[str, np.ndarray], cfgs: dict[EdgeId, dict]) -> None:
        """Replace the buffers by :meth:`state_arrays` output; ``cfgs`` gives each edge's codec cfg.
        FusionError naming the key for an edge this part does not have or a malformed entry."""
        self.buffers = {}
        for k in sorted(arrays):
            if not k.endswith("#ids"):
                continue
            name = k[:-4]
            try:
                role, producer, index, peer = json.loads(name)
            except (ValueError, TypeError):
                raise FusionError(f"delta checkpoint: malformed key {k!r}") from None
            eid = (role, (producer, index), peer)
            if eid not in cfgs:
                raise FusionError(f"delta checkpoint: buffers of {name}, an edge part {self.part} does not have "
                                  "with delta in this plan")
            ids, rows = arrays[k], arrays.get(f"{name}#rows")
            if rows is None or ids.ndim != 1 or rows.shape[:1] != ids.shape:
                raise FusionError(f"delta checkpoint: {name}: {ids.shape} ids for rows of shape "
                                  f"{None if rows is None else rows.shape}")
            b = self.buffer(role, eid[1], peer, cfgs[eid])
            b.load_state_dict({int(i): rows[j] for j, i in enumerate(ids.tolist())})

    def rows_held(self) -> int:
        """Buffered sample rows over all edges (for logs and tests)."""
        return sum(len(b) for b in self.buffers.values())


# -- the CompNode's hooks ----------------------------------------------------------------------

def attach(runtime: Any, inbox: Any, checkpoint_dir: str | None, resume_step: int | None) -> None:
    """Wire a CompNode's delta edges: the inbox refuses delta payloads this end cannot decode, and on
    resume the buffers saved with the checkpoint are loaded (both ends saved theirs at the same step)."""
    table = runtime.compression
    if table is None or not (table.delta_cfgs() or table.user_in):
        return
    inbox.check = table.check_incoming  # also decodes (and so checks) user codecs' payloads on arrival
    if resume_step is None or not table.delta_cfgs():
        return
    from fusion.executors.runtime import checkpoint

    arrays = checkpoint.load_delta(checkpoint_dir, int(resume_step), runtime.name)
    if arrays is None:
        log.warning("%s: the checkpoint of step %s has no delta buffers; every sample's next visit is a first "
                    "visit at both ends", runtime.name, resume_step)
        return
    table.delta.load_state_arrays(arrays, table.delta_cfgs())
    log.info("%s: %d delta buffer rows restored from step %s", runtime.name, table.delta.rows_held(), resume_step)


def checkpoint_arrays(runtime: Any) -> dict[str, np.ndarray] | None:
    """The delta buffers a CompNode saves with its checkpoint (None: it has no delta edge)."""
    table = runtime.compression
    if table is None or not table.delta_cfgs():
        return None
    return table.delta.state_arrays()


def uses_delta(plan: Any) -> list[str]:
    """The plan's delta edges as ``producer[index] src->dst`` (empty: none)."""
    out = []
    for e in plan.compression or ():
        cfg = e.codec("fwd")
        if cfg is not None and cfg.get("algo") == "delta":
            out.append(f"{e.producer}[{e.index}] {e.src}->{e.dst}")
    return out


def batch_sample_ids(plan: Any, batch: Any) -> np.ndarray | None:
    """The batch's sample ids (int64, unique) when the plan has delta edges, else None.

    FusionError when a delta plan's batch has none, or ids that are not unique integers: each row of an
    iteration must be a different sample, or two micro-batches would update one buffer in an order the
    receiver could not check."""
    edges = uses_delta(plan)
    if not edges:
        return None
    from fusion.ir.opdata import SAMPLE_IDS

    if SAMPLE_IDS not in batch:
        raise FusionError(f"the plan compresses {edges[0]} with delta (AQ-SGD), which needs each row's sample id; "
                          f"the batch has no field {SAMPLE_IDS!r} (the built-in text corpus gives it; synthetic data "
                          "has no samples to revisit; a --data function returns it beside the placeholders)")
    ids = np.asarray(batch[SAMPLE_IDS])
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise FusionError(f"batch field {SAMPLE_IDS!r}: expected a 1-D integer array, got {ids.dtype}{list(ids.shape)}")
    if np.unique(ids).size != ids.size:
        raise FusionError(f"batch field {SAMPLE_IDS!r}: a sample appears twice in one batch")
    return ids.astype(np.int64)

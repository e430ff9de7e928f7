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
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fusion.ir.errors import FusionError, WireError
from fusion.kernels.codecs import CODECS
from fusion.kernels.delta import DeltaBuffer, DeltaPayload
from fusion.executors.runtime.sample_ids import batch_ids, per_sample_edges

log = logging.getLogger(__name__)

Key = tuple[str, "int | None"]
EdgeId = tuple[str, Key, str]  # (role "send"/"recv", tensor key, peer part)


@dataclass
class DeltaEdges:
    """The AQ-SGD buffers of one part.

    part:    this part's name (messages in log lines).
    buffers: (role, tensor key, peer) -> that edge's buffers, made on first use by the edge's codec
             (``Codec.new_state``: ``DeltaBuffer`` in NumPy, ``TorchDeltaBuffer`` on ``device``).
    device:  where the buffers live (None: NumPy; a torch device when the part encodes there).
    """

    part: str
    buffers: dict[EdgeId, DeltaBuffer] = field(default_factory=dict)
    device: Any = None

    def buffer(self, role: str, key: Key, peer: str, cfg: dict) -> DeltaBuffer:
        """This end's buffers of one edge (``role`` ``"send"``/``"recv"``), made on first use."""
        eid = (role, key, peer)
        b = self.buffers.get(eid)
        if b is None:
            b = self.buffers[eid] = CODECS.unit(cfg["algo"]).new_state(cfg, self.device)
        return b

    # -- receiving ----------------------------------------------------------------------
    def check(self, p: DeltaPayload, key: Key, src: str, mb: int) -> None:
        """Raise WireError unless every delta row of ``p`` has a buffer here (no cache miss)."""
        b = self.buffers.get(("recv", key, src))
        for i, first in zip(p.ids.tolist(), p.first.tolist()):
            if not first and (b is None or i not in b):
                raise WireError(f"delta payload of {key[0]}[{key[1]}] from {src}, micro-batch {mb}: sample id {i} is "
                                f"sent as a delta but {self.part} has no buffer for it (cache miss: the two ends "
                                "are out of step)")

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


def stateful_edges(plan: Any) -> list[str]:
    """The plan's edges whose codec keeps per-sample state at both ends (``Codec.stateful``, the registry's
    ``needs_sample_ids``: ``delta``) as ``producer[index] src->dst`` (empty: none)."""
    return per_sample_edges(plan.compression)


def batch_sample_ids(plan: Any, batch: Any) -> np.ndarray | None:
    """:func:`~.sample_ids.batch_ids` of ``batch`` for ``plan``'s per-sample edges (None: the plan has none)."""
    return batch_ids(batch, per_sample_edges(plan.compression))

"""OpData: the message between OP nodes on different CompNodes (FusionLLM §3.4).

The payload is framework-neutral: a NumPy array (dense), a sparse triple from
the Top-K codec, or a small JSON-able value for non-tensor outputs (an int
shape, say). Engines convert to and from their own tensors; the wire codec
(``fusion.ir.wire``) turns an OpData into a msgpack header plus raw frames.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: the batch field (and, per micro-batch, the feed ``<mb>/#sample_ids`` of every part) holding the int64
#: sample id of each row: stable per training sample, so ``delta`` (AQ-SGD) edges can keep per-sample buffers.
#: ``#`` keeps it apart from any placeholder (node names are identifiers).
SAMPLE_IDS = "#sample_ids"


@dataclass
class OpData:
    """One activation or gradient crossing a sub-DAG boundary.

    name:          producer node of the tensor (FusionLLM "Name").
    index:         output index of a multi-output producer (None: whole output).
    op_users:      every user of the producer (FusionLLM "OP users").
    actual_user:   the consumer nodes this message is for (FP) or comes from (BP)
                   (FusionLLM "Actual OP user"); gradients are summed per actual user.
    is_grad:       False for a forward activation, True for a backward gradient.
    is_loss:       the payload is a loss value (never compressed).
    requires_grad: the receiver must send a gradient back for this activation.
    local_iter:    training iteration this message belongs to.
    micro_batch:   micro-batch index within the iteration.
    src, dst:      sending and receiving CompNode (part) names.
    compress_cfg:  how the payload is compressed (None: dense), e.g.
                   ``{"algo": "topk", "ratio": 100}``.
    payload:       NumPy array, sparse payload, or a JSON-able value.
    """

    name: str
    index: int | None
    op_users: tuple[str, ...]
    actual_user: tuple[str, ...]
    is_grad: bool
    local_iter: int
    micro_batch: int
    src: str
    dst: str
    payload: Any
    is_loss: bool = False
    requires_grad: bool = False
    compress_cfg: dict | None = field(default=None)

    @property
    def key(self) -> tuple[str, int | None]:
        """The tensor carried: ``(producer, index)``."""
        return (self.name, self.index)

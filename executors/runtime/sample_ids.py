"""Sample identity: which edges of a plan need each micro-batch's sample ids, and a batch's ids.

A codec with per-sample state (``delta``, AQ-SGD: ``Codec.stateful``) keys both ends' buffers by the
training samples a micro-batch holds, so every micro-batch's sample ids reach every part with the
coordinator's ``step`` message (feed ``<mb>/#sample_ids``, :data:`fusion.ir.opdata.SAMPLE_IDS`). The
coordinator asks :func:`per_sample_edges` once, when it starts, and checks each batch with :func:`batch_ids`.
"""
from __future__ import annotations

from typing import Any, Iterable

import numpy as np

from fusion.ir.errors import FusionError
from fusion.ir.opdata import SAMPLE_IDS
from fusion.kernels.codecs import CODECS


def per_sample_edges(compression: Iterable[Any] | None) -> list[str]:
    """The edges (a plan's ``EdgeCompression`` list) whose activation codec keeps per-sample state, as
    ``producer[index] src->dst`` (empty: none)."""
    return [f"{e.producer}[{e.index}] {e.src}->{e.dst}" for e in compression or ()
            if CODECS.needs_sample_ids(e.codec("fwd"))]


def batch_ids(batch: Any, edges: list[str]) -> np.ndarray | None:
    """The batch's sample ids (int64, unique) when ``edges`` (:func:`per_sample_edges`) is not empty, else None.

    FusionError when such a plan's batch has none, or ids that are not unique integers: each row of an
    iteration must be a different sample, or two micro-batches would update one buffer in an order the
    receiver could not check."""
    if not edges:
        return None
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

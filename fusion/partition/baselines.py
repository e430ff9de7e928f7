"""The paper's two scheduling baselines (FusionLLM §7.2).

Both cut the atom chain (:mod:`fusion.partition.chain`: one atom per operator node,
placeholders with their first user) into contiguous ranges and give range k
to the k-th device of the cluster file, using ``min(#devices, #atoms)``
devices; neither looks at bandwidth, device speed or memory:

- ``equal-count``: "equally assigns the same number of user-defined modules
  on computing nodes": every range has the same number of operator nodes (+-1).
- ``equal-flops``: "partitions user-defined modules with load balance":
  ranges of (nearly) equal forward + backward FLOPs.

The result is priced by the same exact estimator as OP-Fence.
"""
from __future__ import annotations

import numpy as np

from fusion.partition.chain import Chain, build_chain
from fusion.cost.estimate import CostModel
from fusion.partition.fence import Partition, layout_partition


def equal_count(cm: CostModel, ch: Chain | None = None) -> Partition:
    ch = ch or build_chain(cm)
    m = min(len(cm.cluster), ch.n_atoms)
    cuts = [int(round(k * ch.n_atoms / m)) for k in range(1, m)]
    return layout_partition(cm, ch, cuts, list(range(m)), {"devices_used": m})


def equal_flops(cm: CostModel, ch: Chain | None = None) -> Partition:
    ch = ch or build_chain(cm)
    A = ch.n_atoms
    m = min(len(cm.cluster), A)
    total = ch.flops[-1]
    cuts: list[int] = []
    prev = 0
    for k in range(1, m):
        # first position whose prefix reaches k/m of the FLOPs, keeping every range non-empty
        p = int(np.searchsorted(ch.flops, total * k / m, side="left")) if total > 0 else round(k * A / m)
        p = min(max(p, prev + 1), A - (m - k))
        cuts.append(p)
        prev = p
    return layout_partition(cm, ch, cuts, list(range(m)), {"devices_used": m})


BASELINES = {"equal-count": equal_count, "equal-flops": equal_flops}

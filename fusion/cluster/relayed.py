"""Devices behind NAT, priced as the two hops their traffic takes through the relay (issue 39).

A CompNode behind NAT only dials out (``fusion executor --dial-out``): every message *into* it goes through
``fusion relay`` on a reachable host, while what it sends goes directly where the receiver is reachable
(``executors/runtime/relay.py``). A cluster file says so with a top-level ``relay`` entry::

    relay: {via: lab-0, behind_nat: [home-a, home-b]}   # device or group names

``via`` is the reachable device whose host runs the relay. Each link ``i -> j`` into a device ``j`` behind NAT,
from any device but ``via``, becomes the relay's two hops, forwarded message by message (the relay receives a
sealed message whole before it sends it on): latency ``alpha(i, via) + alpha(via, j)`` and time per byte
``beta(i, via) + beta(via, j)``, i.e. bandwidth ``1 / (1/b(i, via) + 1/b(via, j))`` (FusionLLM Eq. 2's
``alpha + beta M`` per hop). The link from ``via`` itself (the relay's connection into the home, which the
home dialled) and every link out of a device behind NAT stay as the link table gives them. The compiler then
prices a cut into a home, the tied exchange and the DP all-reduce over these links like any other.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from fusion.cluster.model import ClusterError, Device


def relay_links(spec: Any, devices: list[Device], alpha: np.ndarray, bandwidth: np.ndarray,
                where: str) -> tuple[np.ndarray, np.ndarray]:
    """(alpha, bandwidth) with every link into a device behind NAT priced through the relay; ``spec`` is the
    file's ``relay`` entry (None: the matrices unchanged). ClusterError naming ``where`` and the field."""
    if spec is None:
        return alpha, bandwidth
    if not isinstance(spec, dict):
        raise ClusterError(f"{where}: expected a mapping {{via: DEVICE, behind_nat: [DEVICE or GROUP, ...]}}")
    unknown = sorted(set(spec) - {"via", "behind_nat"})
    if unknown:
        raise ClusterError(f"{where}: unknown field {unknown[0]!r} (known: ['behind_nat', 'via'])")
    index = {d.name: i for i, d in enumerate(devices)}
    groups: dict[str, list[int]] = {}
    for i, d in enumerate(devices):
        if d.group:
            groups.setdefault(d.group, []).append(i)
    via = spec.get("via")
    if via not in index:
        raise ClusterError(f"{where}.via: {via!r} is not a device of this cluster (the reachable device whose host "
                           f"runs `fusion relay`; devices: {sorted(index)})")
    names = spec.get("behind_nat")
    if not isinstance(names, list) or not names:
        raise ClusterError(f"{where}.behind_nat: must list the devices (or groups) behind NAT")
    homes: set[int] = set()
    for k, n in enumerate(names):
        if n in index:
            homes.add(index[n])
        elif n in groups:
            homes.update(groups[n])
        else:
            raise ClusterError(f"{where}.behind_nat[{k}]: {n!r} is neither a device nor a group of this cluster")
    v = index[via]
    if v in homes:
        raise ClusterError(f"{where}.via: {via!r} is listed behind NAT too; the relay must run on a reachable host")
    relayed_alpha, relayed_bw = alpha.copy(), bandwidth.copy()  # written here; read from the link table as given
    for j in sorted(homes):
        for i in range(len(devices)):
            if i in (j, v):
                continue
            relayed_alpha[i, j] = alpha[i, v] + alpha[v, j]
            relayed_bw[i, j] = 1.0 / (1.0 / bandwidth[i, v] + 1.0 / bandwidth[v, j])
    return relayed_alpha, relayed_bw

"""The readable YAML cluster format (``examples/clusters/*.yaml``).

::

    name: local-4-two-sites
    devices:
      - {name: cpu, count: 2, group: site-a, peak_flops: 50 GFLOPS, memory: 4 GB}
      - {name: cpu-2, group: site-b, peak_flops: 50 GFLOPS, memory: 4 GB, lambda: 0.8,
         address: "tcp://127.0.0.1:6002", memory_bandwidth: 20 GB/s}
    links:
      default:      {latency: 30 ms, bandwidth: 20 Mbit/s}   # any pair not matched below
      within_group: {latency: 1 ms, bandwidth: 1 Gbit/s}     # two devices of the same group
      groups:       {site-b: {latency: 2 ms, bandwidth: 500 Mbit/s}}   # inside one named group
      between:      [{groups: [site-a, site-b], latency: 30 ms, bandwidth: 20 Mbit/s}]
      pairs:        [{src: cpu-0, dst: cpu-2, latency: 25 ms, bandwidth: 40 Mbit/s, symmetric: true}]

A top-level ``relay: {via: DEVICE, behind_nat: [DEVICE or GROUP, ...]}`` prices every link into a device behind
NAT as the two hops through the relay on ``via``'s host (:mod:`fusion.cluster.relayed`).

``count: k`` expands one entry into devices ``name-0 .. name-(k-1)`` (group
defaults to ``name``). Later rules override earlier ones in the order
default < within_group < groups < between < pairs; ``between`` and ``pairs``
apply both ways unless ``symmetric: false``. Every ordered pair of devices
must end up with a link. Quantities take units (see :mod:`fusion.cluster.units`).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from fusion.cluster.model import Cluster, ClusterError, Device, check_unique, overheads_from_dict, require_fields
from fusion.cluster.relayed import relay_links
from fusion.cluster.units import UnitError, forgotten_unit, parse_quantity

_DEVICE_KEYS = {"name", "count", "group", "peak_flops", "memory", "memory_bytes", "lambda", "memory_bandwidth", "address",
                "node_overhead_s", "message_overhead_s", "step_overhead_s", "feed_overhead_s", "feed_byte_s",
                "optimizer_byte_s", "codec_costs"}
_LINK_KEYS = {"latency", "bandwidth"}


def cluster_from_yaml(data: Any, source: str) -> Cluster:
    if not isinstance(data, dict):
        raise ClusterError(f"{source}: expected a mapping with fields 'devices' and 'links'")
    require_fields(data, ("devices", "links"), source)
    raw = data["devices"]
    if not isinstance(raw, list) or not raw:
        raise ClusterError(f"{source}: field 'devices' must be a non-empty list")
    devices: list[Device] = []
    for i, e in enumerate(raw):
        devices.extend(_devices(e, f"{source}: devices[{i}]"))
    check_unique(devices, source)
    alpha, bandwidth = _links(data["links"], devices, f"{source}: links")
    alpha, bandwidth = relay_links(data.get("relay"), devices, alpha, bandwidth, f"{source}: relay")
    return Cluster.from_bandwidth(str(data.get("name", "cluster")), devices, alpha, bandwidth, source)


def _q(e: dict, key: str, kind: str, where: str, required: bool = True) -> float | None:
    if key not in e or e[key] is None:
        if required:
            raise ClusterError(f"{where}: missing field {key!r}")
        return None
    try:
        v = parse_quantity(e[key], kind)
    except UnitError as err:
        raise ClusterError(f"{where}.{key}: {err}") from None
    why = forgotten_unit(e[key], kind)
    if why is not None and v > 0:
        raise ClusterError(f"{where}.{key}: {why}")
    if kind == "seconds":
        if v < 0:
            raise ClusterError(f"{where}.{key}: must be >= 0, got {e[key]!r}")
    elif v <= 0:
        raise ClusterError(f"{where}.{key}: must be > 0, got {e[key]!r}")
    return v


def _devices(e: Any, where: str) -> list[Device]:
    if not isinstance(e, dict):
        raise ClusterError(f"{where}: expected a mapping, got {type(e).__name__}")
    unknown = sorted(set(e) - _DEVICE_KEYS)
    if unknown:
        raise ClusterError(f"{where}: unknown field {unknown[0]!r} (known: {sorted(_DEVICE_KEYS)})")
    require_fields(e, ("name",), where)
    name = e["name"]
    if not isinstance(name, str) or not name:
        raise ClusterError(f"{where}.name: must be a non-empty string, got {name!r}")
    where = f"{where} ({name})"
    peak = _q(e, "peak_flops", "flops", where)
    mem_key = "memory" if "memory" in e else "memory_bytes"
    mem = _q(e, mem_key, "bytes", where)
    lam = 1.0
    if "lambda" in e:
        lam = e["lambda"]
        if not isinstance(lam, (int, float)) or isinstance(lam, bool) or not lam > 0:
            raise ClusterError(f"{where}.lambda: must be a positive number, got {lam!r}")
    mbw = _q(e, "memory_bandwidth", "byte_rate", where, required=False)
    count = e.get("count", None)
    if count is not None and (not isinstance(count, int) or isinstance(count, bool) or count < 1):
        raise ClusterError(f"{where}.count: must be a positive integer, got {count!r}")
    group = str(e.get("group", name if count is not None else "") or "")
    address = str(e.get("address", "") or "")
    over = overheads_from_dict(e, where.rsplit(" (", 1)[0], name)
    if count is None:
        return [Device(name, peak, mem, float(lam), mbw, address, group, **over)]
    if address:
        raise ClusterError(f"{where}.address: give addresses per device, not on an entry with 'count'")
    return [Device(f"{name}-{k}", peak, mem, float(lam), mbw, "", group, **over) for k in range(count)]


def _spec(e: Any, where: str) -> tuple[float, float]:
    """(alpha seconds, bandwidth bit/s as given) of one link rule."""
    if not isinstance(e, dict):
        raise ClusterError(f"{where}: expected a mapping with 'latency' and 'bandwidth'")
    lat = _q(e, "latency", "seconds", where)
    bw = _q(e, "bandwidth", "bandwidth", where)
    return lat, bw


def _links(links: Any, devices: list[Device], where: str) -> tuple[np.ndarray, np.ndarray]:
    """(alpha seconds, bandwidth bit/s) for every ordered pair of devices (diagonal 0)."""
    if not isinstance(links, dict):
        raise ClusterError(f"{where}: expected a mapping (default, within_group, groups, between, pairs)")
    known = {"default", "within_group", "groups", "between", "pairs"}
    unknown = sorted(set(links) - known)
    if unknown:
        raise ClusterError(f"{where}: unknown field {unknown[0]!r} (known: {sorted(known)})")
    n = len(devices)
    alpha = np.full((n, n), np.nan)
    bandwidth = np.full((n, n), np.nan)
    index = {d.name: i for i, d in enumerate(devices)}
    groups: dict[str, list[int]] = {}
    for i, d in enumerate(devices):
        groups.setdefault(d.group, []).append(i)

    def put(rows, cols, spec):
        a, b = spec
        r, c = np.ix_(rows, cols)
        alpha[r, c] = a
        bandwidth[r, c] = b

    def group_members(g: Any, w: str) -> list[int]:
        if g not in groups or g == "":
            raise ClusterError(f"{w}: unknown group {g!r} (groups: {sorted(k for k in groups if k)})")
        return groups[g]

    if "default" in links:
        put(range(n), range(n), _spec(links["default"], f"{where}.default"))
    if "within_group" in links:
        spec = _spec(links["within_group"], f"{where}.within_group")
        for g, members in groups.items():
            if g:
                put(members, members, spec)
    gs = links.get("groups") or {}
    if not isinstance(gs, dict):
        raise ClusterError(f"{where}.groups: expected a mapping group -> {{latency, bandwidth}}")
    for g, e in gs.items():
        members = group_members(g, f"{where}.groups")
        put(members, members, _spec(e, f"{where}.groups.{g}"))
    for i, e in enumerate(_list(links.get("between"), f"{where}.between")):
        w = f"{where}.between[{i}]"
        pair = e.get("groups") if isinstance(e, dict) else None
        if not isinstance(pair, list) or len(pair) != 2:
            raise ClusterError(f"{w}.groups: must list two group names")
        a, b = (group_members(g, f"{w}.groups") for g in pair)
        spec = _spec(e, w)
        put(a, b, spec)
        if e.get("symmetric", True):
            put(b, a, spec)
    for i, e in enumerate(_list(links.get("pairs"), f"{where}.pairs")):
        w = f"{where}.pairs[{i}]"
        if not isinstance(e, dict):
            raise ClusterError(f"{w}: expected a mapping with src, dst, latency, bandwidth")
        ends = []
        for key in ("src", "dst"):
            if key not in e:
                raise ClusterError(f"{w}: missing field {key!r}")
            if e[key] not in index:
                raise ClusterError(f"{w}.{key}: unknown device {e[key]!r}")
            ends.append(index[e[key]])
        s, t = ends
        if s == t:
            raise ClusterError(f"{w}: src and dst are the same device {e['src']!r}")
        spec = _spec(e, w)
        put([s], [t], spec)
        if e.get("symmetric", True):
            put([t], [s], spec)
    np.fill_diagonal(alpha, 0.0)
    np.fill_diagonal(bandwidth, 0.0)
    missing = np.argwhere(np.isnan(bandwidth))
    if len(missing):
        i, j = map(int, missing[0])
        raise ClusterError(f"{where}: no link from {devices[i].name} to {devices[j].name} "
                           f"(give links.default, a links.between rule or a links.pairs entry)")
    return alpha, bandwidth


def _list(v: Any, where: str) -> list:
    if v is None:
        return []
    if not isinstance(v, list):
        raise ClusterError(f"{where}: expected a list")
    return v

"""The cluster model: devices and directed links (FusionLLM §3.5).

A device p has a peak speed S*(p) (FLOP/s), a fitted factor lambda_p (the
actual speed is S(p) = lambda_p * S*(p)), a memory D^p, a memory bandwidth
for memory-bound operators, and an address. A directed link i -> j follows
the alpha-beta model ``T_comm^{ij}(M) = alpha_ij + beta_ij * M`` with alpha in
seconds and beta in seconds per byte.

Two file formats load into a :class:`Cluster` (see ``docs/compiler.md``;
:func:`fusion.cluster.load.load_cluster` tells them apart):

- the readable YAML format of ``examples/clusters/*.yaml`` (devices with
  units, links given by default / group / pair rules), read by
  :mod:`fusion.cluster.yaml_format`;
- the scenario JSON format of the shipped scenarios (``fusion/cluster/data``) (``devices``,
  ``delay_s[i][j]``, ``bandwidth_bps[i][j]``), read by :meth:`Cluster.from_dict` here, which
  is also what :meth:`Cluster.to_dict` writes into a plan.

Every error is a :class:`ClusterError` whose message names the file and field.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fusion.ir.errors import FusionError

#: FLOP per byte assumed when a device gives no ``memory_bandwidth``: the
#: roofline ridge point of current GPUs (V100 ~139, A100 fp16 ~150, RTX 4090
#: ~165). Only memory-bound operators (norms, element-wise, embeddings) use it.
DEFAULT_FLOPS_PER_BYTE = 100.0


class ClusterError(FusionError):
    """A malformed cluster description; the message names the file and field."""


@dataclass(frozen=True)
class Device:
    """One CompNode's hardware.

    name:             unique device name.
    peak_flops:       S*(p), peak FLOP/s.
    memory_bytes:     D^p, memory usable by the part placed here.
    lam:              lambda_p of §3.5, fitted by ``fusion profile`` (1.0 = peak).
    memory_bandwidth: bytes/s for memory-bound operators; None means
                      ``peak_flops / DEFAULT_FLOPS_PER_BYTE``.
    address:          where its executor listens (``tcp://host:port``), may be empty.
    group:            a label from the file (machine, region); informational only,
                      OP-Fence finds its own clusters with Louvain.
    node_overhead_s:  seconds of fixed cost per executed op node per micro-batch, forward +
                      backward (Python and dispatch work FLOPs do not capture), fitted by
                      ``fusion profile``; 0 when the file gives none (profiles written before it).
    message_overhead_s: seconds of CPU per activation or gradient message a part sends or
                      receives (serialisation, copies, the socket), fitted by ``fusion profile``;
                      0 when absent.
    step_overhead_s:  seconds of one iteration's control round trip between the coordinator and a
                      part placed here (the ``step`` message out, ``done`` back, no data), fitted by
                      ``fusion profile``; 0 when absent.
    feed_overhead_s:  seconds per fed array (one micro-batch of one input or label placeholder) in the
                      ``step`` message, beside its bytes; 0 when absent.
    feed_byte_s:      seconds per byte of fed data (split, encode, loopback socket, decode); 0 when absent.
    optimizer_byte_s: seconds per trainable parameter byte of one optimizer step, one entry per
                      optimizer kind (:data:`OPTIMIZER_KINDS`: SGD, SGD with momentum, AdamW), timed on
                      torch's optimizers by ``fusion profile``; 0 when absent.
    codec_costs:      encode + decode of one message on this host's host path, per codec cfg key
                      (``fusion.cost.codec_costs.cost_key``: ``quant-4``, ``hadamard-quant-4``, ``topk``, ...):
                      ``(key, seconds per message, seconds per dense byte)``, timed by ``fusion profile``; the
                      compiler prices a codec by these where given, else by the codec's built-in ``rate``.
    """

    name: str
    peak_flops: float
    memory_bytes: float
    lam: float = 1.0
    memory_bandwidth: float | None = None
    address: str = ""
    group: str = ""
    node_overhead_s: float = 0.0
    message_overhead_s: float = 0.0
    step_overhead_s: float = 0.0
    feed_overhead_s: float = 0.0
    feed_byte_s: float = 0.0
    optimizer_byte_s: tuple[float, float, float] = (0.0, 0.0, 0.0)
    codec_costs: tuple[tuple[str, float, float], ...] = ()

    def codec_seconds(self, key: str, nbytes: float) -> float | None:
        """Measured encode + decode seconds of one ``nbytes`` message with codec ``key``; None: not measured."""
        for k, message_s, byte_s in self.codec_costs:
            if k == key:
                return message_s + nbytes * byte_s
        return None

    @property
    def speed(self) -> float:
        """S(p) = lambda_p * S*(p), FLOP/s."""
        return self.lam * self.peak_flops

    @property
    def memory_speed(self) -> float:
        """Effective bytes/s for memory-bound work, scaled by lambda_p like FLOPs."""
        bw = self.memory_bandwidth if self.memory_bandwidth else self.peak_flops / DEFAULT_FLOPS_PER_BYTE
        return self.lam * bw


@dataclass
class Cluster:
    """Devices plus a dense directed link matrix.

    alpha[i, j]: latency of link i -> j in seconds (alpha_ij).
    beta[i, j]:  seconds per byte of link i -> j (beta_ij = 8 / bandwidth in bit/s).
    The diagonal is unused (a device does not talk to itself) and kept at 0.
    source:      the file the cluster came from, for error messages.
    """

    name: str
    devices: list[Device]
    alpha: np.ndarray
    beta: np.ndarray
    source: str = "cluster"
    bandwidth: np.ndarray | None = None

    def __post_init__(self) -> None:
        self._index = {d.name: i for i, d in enumerate(self.devices)}
        if self.bandwidth is None:
            # given beta only: derive the bandwidth once (callers that have the user's numbers pass them)
            off = ~np.eye(len(self.devices), dtype=bool)
            self.bandwidth = np.zeros_like(self.beta, dtype=float)
            self.bandwidth[off] = 8.0 / self.beta[off]

    @classmethod
    def from_bandwidth(cls, name: str, devices: list[Device], alpha: np.ndarray, bandwidth_bps: np.ndarray,
                       source: str = "cluster") -> "Cluster":
        """A cluster from the bandwidths the user gave (bit/s); beta = 8 / bandwidth is derived, and the
        bandwidths are kept as given, so writing the cluster back gives the same numbers (1 Gbit/s stays 1e9)."""
        n = len(devices)
        off = ~np.eye(n, dtype=bool)
        bw = np.array(bandwidth_bps, dtype=float)
        bw[~off] = 0.0
        beta = np.zeros((n, n))
        beta[off] = 8.0 / bw[off]
        return cls(name, devices, alpha, beta, source, bw)

    def __len__(self) -> int:
        return len(self.devices)

    def index(self, name: str) -> int:
        try:
            return self._index[name]
        except KeyError:
            raise ClusterError(f"{self.source}: unknown device {name!r}") from None

    def comm_time(self, i: int, j: int, nbytes: float) -> float:
        """T_comm^{ij}(M) = alpha_ij + beta_ij * M (0 on the same device)."""
        if i == j:
            return 0.0
        return float(self.alpha[i, j] + self.beta[i, j] * nbytes)

    def bandwidth_bps(self, i: int, j: int) -> float:
        return float(self.bandwidth[i, j]) if i != j else math.inf

    def subset(self, names: list[str]) -> "Cluster":
        idx = [self.index(n) for n in names]
        ix = np.ix_(idx, idx)
        return Cluster(self.name, [self.devices[i] for i in idx], self.alpha[ix].copy(), self.beta[ix].copy(),
                       self.source, self.bandwidth[ix].copy())

    # -- plain data (the scenario JSON format plus per-device extras) -------------
    def to_dict(self) -> dict[str, Any]:
        bw = self.bandwidth.copy()
        np.fill_diagonal(bw, 0.0)
        devs = []
        for d in self.devices:
            e: dict[str, Any] = {"name": d.name, "group": d.group, "peak_flops": d.peak_flops, "memory_bytes": d.memory_bytes}
            if d.lam != 1.0:
                e["lambda"] = d.lam
            if d.memory_bandwidth:
                e["memory_bandwidth"] = d.memory_bandwidth
            if d.address:
                e["address"] = d.address
            for key in OVERHEAD_KEYS:
                if getattr(d, key):
                    e[key] = getattr(d, key)
            if any(d.optimizer_byte_s):
                e["optimizer_byte_s"] = dict(zip(OPTIMIZER_KINDS, d.optimizer_byte_s))
            if d.codec_costs:
                e["codec_costs"] = codec_costs_dict(d.codec_costs)
            devs.append(e)
        alpha = self.alpha.copy()
        np.fill_diagonal(alpha, 0.0)
        return {"name": self.name, "devices": devs, "delay_s": alpha.tolist(), "bandwidth_bps": bw.tolist()}

    @classmethod
    def from_dict(cls, d: Any, source: str = "cluster") -> "Cluster":
        """Read the scenario format; every problem names ``source`` and the field."""
        if not isinstance(d, dict):
            raise ClusterError(f"{source}: expected a mapping with fields 'devices', 'delay_s', 'bandwidth_bps'")
        require_fields(d, ("devices", "delay_s", "bandwidth_bps"), source)
        raw = d["devices"]
        if not isinstance(raw, list) or not raw:
            raise ClusterError(f"{source}: field 'devices' must be a non-empty list")
        devices = [device_from_dict(e, f"{source}: devices[{i}]") for i, e in enumerate(raw)]
        check_unique(devices, source)
        n = len(devices)
        delay = _matrix(d["delay_s"], n, f"{source}: delay_s")
        bw = _matrix(d["bandwidth_bps"], n, f"{source}: bandwidth_bps")
        off = ~np.eye(n, dtype=bool)
        for i, j in zip(*np.nonzero(off & ~(bw > 0))):
            raise ClusterError(f"{source}: bandwidth_bps[{i}][{j}] ({devices[i].name} -> {devices[j].name}) "
                               f"must be > 0, got {bw[i, j]!r}")
        for i, j in zip(*np.nonzero(off & ~(delay >= 0))):
            raise ClusterError(f"{source}: delay_s[{i}][{j}] ({devices[i].name} -> {devices[j].name}) "
                               f"must be >= 0, got {delay[i, j]!r}")
        alpha = np.where(off, delay, 0.0)
        return cls.from_bandwidth(str(d.get("name", Path(source).stem)), devices, alpha, bw, source)


def require_fields(d: dict, keys: tuple[str, ...], where: str) -> None:
    """Raise ClusterError naming ``where`` and the first of ``keys`` missing from ``d``."""
    for key in keys:
        if key not in d:
            raise ClusterError(f"{where}: missing field {key!r}")


def device_from_dict(e: Any, where: str) -> Device:
    """One device of the scenario format (numbers in base units)."""
    if not isinstance(e, dict):
        raise ClusterError(f"{where}: expected a mapping, got {type(e).__name__}")
    require_fields(e, ("name", "peak_flops", "memory_bytes"), where)
    name = e["name"]
    if not isinstance(name, str) or not name:
        raise ClusterError(f"{where}.name: must be a non-empty string, got {name!r}")
    vals = {}
    for key in ("peak_flops", "memory_bytes", "lambda", "memory_bandwidth"):
        if key in e and e[key] is not None:
            v = e[key]
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
                raise ClusterError(f"{where}.{key} ({name}): must be a positive number, got {v!r}")
            vals[key] = float(v)
    return Device(name, vals["peak_flops"], vals["memory_bytes"], vals.get("lambda", 1.0),
                  vals.get("memory_bandwidth"), str(e.get("address", "") or ""), str(e.get("group", "") or ""),
                  **overheads_from_dict(e, where, name))


#: per-device fixed costs fitted by ``fusion profile`` (seconds; absent = 0)
OVERHEAD_KEYS = ("node_overhead_s", "message_overhead_s", "step_overhead_s", "feed_overhead_s", "feed_byte_s")
#: the optimizers ``optimizer_byte_s`` prices, in the order of their state slots per parameter
#: (:func:`fusion.cost.estimate.optimizer_slots`: SGD 0, SGD with momentum 1, AdamW 2)
OPTIMIZER_KINDS = ("sgd", "sgd_momentum", "adamw")


def _seconds(v: Any, where: str) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
        raise ClusterError(f"{where}: must be a number >= 0 (seconds), got {v!r}")
    return float(v)


def overheads_from_dict(e: dict, where: str, name: str) -> dict[str, Any]:
    """The fitted fixed costs of a device entry (:data:`OVERHEAD_KEYS`: finite numbers >= 0;
    ``optimizer_byte_s``: a mapping from :data:`OPTIMIZER_KINDS` to such numbers); absent = 0."""
    out: dict[str, Any] = {}
    for key in OVERHEAD_KEYS:
        v = e.get(key)
        if v is not None:
            out[key] = _seconds(v, f"{where}.{key} ({name})")
    opt = e.get("optimizer_byte_s")
    if opt is not None:
        if not isinstance(opt, dict):
            raise ClusterError(f"{where}.optimizer_byte_s ({name}): must be a mapping of "
                               f"{', '.join(OPTIMIZER_KINDS)} to seconds per parameter byte, got {opt!r}")
        unknown = sorted(set(map(str, opt)) - set(OPTIMIZER_KINDS))
        if unknown:
            raise ClusterError(f"{where}.optimizer_byte_s.{unknown[0]} ({name}): unknown optimizer "
                               f"(known: {', '.join(OPTIMIZER_KINDS)})")
        out["optimizer_byte_s"] = tuple(_seconds(opt.get(k, 0.0), f"{where}.optimizer_byte_s.{k} ({name})")
                                        for k in OPTIMIZER_KINDS)
    costs = e.get("codec_costs")
    if costs is not None:
        if not isinstance(costs, dict):
            raise ClusterError(f"{where}.codec_costs ({name}): must be a mapping of codec keys (quant-4, ...) to "
                               f"{{message_s: ..., byte_s: ...}}, got {costs!r}"[:300])
        rows = []
        for key, v in costs.items():
            w = f"{where}.codec_costs.{key} ({name})"
            if not isinstance(v, dict) or set(v) - {"message_s", "byte_s"}:
                raise ClusterError(f"{w}: must be {{message_s: seconds, byte_s: seconds per dense byte}}, got {v!r}")
            rows.append((str(key), _seconds(v.get("message_s", 0.0), f"{w}.message_s"),
                         _seconds(v.get("byte_s", 0.0), f"{w}.byte_s")))
        out["codec_costs"] = tuple(rows)
    return out


def codec_costs_dict(costs: tuple[tuple[str, float, float], ...], digits: int | None = None) -> dict:
    """``Device.codec_costs`` as a cluster file writes it (``digits``: significant digits kept)."""
    r = (lambda v: float(f"{v:.{digits}g}")) if digits else float  # noqa: E731
    return {k: {"message_s": r(m), "byte_s": r(b)} for k, m, b in costs}


def check_unique(devices: list[Device], source: str) -> None:
    seen: set[str] = set()
    for i, dv in enumerate(devices):
        if dv.name in seen:
            raise ClusterError(f"{source}: devices[{i}].name: duplicate device name {dv.name!r}")
        seen.add(dv.name)


def _matrix(v: Any, n: int, where: str) -> np.ndarray:
    if not isinstance(v, list) or len(v) != n or not all(isinstance(r, list) and len(r) == n for r in v):
        raise ClusterError(f"{where}: must be a {n} x {n} list of lists (one row and column per device)")
    try:
        m = np.array(v, dtype=float)
    except (TypeError, ValueError):
        raise ClusterError(f"{where}: entries must be numbers") from None
    if not np.all(np.isfinite(m)):
        i, j = map(int, np.argwhere(~np.isfinite(m))[0])
        raise ClusterError(f"{where}[{i}][{j}]: must be a finite number, got {m[i, j]!r}")
    return m

"""Per-link emulation of the alpha-beta model, so a plan can be rehearsed on one host.

A message of ``M`` bytes on link ``i -> j`` takes ``T_comm = alpha_ij + beta_ij * M``
(FusionLLM §3.5). The sender emulates it with two pieces:

* a token bucket filled at ``1 / beta`` bytes per second: the message leaves the
  sender's queue when the bucket holds ``M`` tokens (so messages on one link
  are serialised and the link's bandwidth is shared between them);
* a delay line: the message is handed to the socket ``alpha`` seconds after its
  last byte left the bucket (latency overlaps the next message's transmission).

The link parameters come from the plan's cluster dict in the scenario format
(``devices[*].name``, ``delay_s[i][j]`` seconds, ``bandwidth_bps[i][j]`` bits per
second, ``beta = 8 / bandwidth_bps``); a zero or missing bandwidth means
unlimited, as on the diagonal.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from fusion.ir.errors import FusionError


@dataclass(frozen=True)
class LinkModel:
    """alpha_s: one-way latency in seconds; beta_s_per_byte: seconds per byte (0 = unlimited)."""

    alpha_s: float
    beta_s_per_byte: float

    def time(self, nbytes: int) -> float:
        """T_comm = alpha + beta * M."""
        return self.alpha_s + self.beta_s_per_byte * nbytes

    @property
    def bandwidth_Bps(self) -> float:
        return 1.0 / self.beta_s_per_byte if self.beta_s_per_byte > 0 else float("inf")


def link_model(cluster: Mapping[str, Any], src_device: str, dst_device: str) -> LinkModel:
    """The alpha-beta parameters of ordered device pair ``src -> dst`` in a cluster dict."""
    devices = cluster.get("devices")
    if not isinstance(devices, list):
        raise FusionError("cluster: field 'devices' must be a list of {name: ...}")
    names = [d.get("name") if isinstance(d, dict) else d for d in devices]
    try:
        i, j = names.index(src_device), names.index(dst_device)
    except ValueError:
        missing = src_device if src_device not in names else dst_device
        raise FusionError(f"cluster: no device named {missing!r} (devices: {names})") from None
    if i == j:
        return LinkModel(0.0, 0.0)
    try:
        alpha = float(cluster.get("delay_s", [[0.0]])[i][j]) if "delay_s" in cluster else 0.0
        bw = float(cluster["bandwidth_bps"][i][j]) if "bandwidth_bps" in cluster else 0.0
    except (IndexError, TypeError, ValueError) as e:
        raise FusionError(f"cluster: delay_s/bandwidth_bps[{i}][{j}] for {src_device}->{dst_device} is malformed ({e})") from None
    if alpha < 0 or bw < 0:
        raise FusionError(f"cluster: negative delay or bandwidth for {src_device}->{dst_device}")
    return LinkModel(alpha, 8.0 / bw if bw > 0 else 0.0)


class TokenBucket:
    """Tokens (bytes) accrue at ``rate`` per second up to ``burst``; sending M bytes takes M tokens.

    :meth:`reserve` is given the time a message is ready and returns when its
    last byte has been paid for. Reservations are serialised: a message waits
    for the ones before it. With ``burst = 0`` the link sends at exactly
    ``rate`` with no credit for idle time, which is what the alpha-beta model
    prices.
    """

    def __init__(self, rate_Bps: float, burst_bytes: float = 0.0):
        if rate_Bps <= 0:
            raise ValueError("rate must be > 0")
        self.rate, self.burst = float(rate_Bps), float(burst_bytes)
        self._tokens = self.burst
        self._t = 0.0  # time at which self._tokens was valid (all earlier reservations paid)

    def reserve(self, nbytes: int, now: float) -> tuple[float, float]:
        """``(start, end)`` of sending ``nbytes`` that are ready at ``now``."""
        start = max(now, self._t)
        tokens = min(self.burst, self._tokens + (start - self._t) * self.rate)
        need = nbytes - tokens
        end = start + max(0.0, need) / self.rate
        self._tokens = max(0.0, tokens - nbytes)
        self._t = end
        return start, end


class EmulatedLink:
    """Token bucket plus delay line for one ordered link."""

    def __init__(self, model: LinkModel, burst_bytes: float = 0.0):
        self.model = model
        self.bucket = TokenBucket(model.bandwidth_Bps, burst_bytes) if model.beta_s_per_byte > 0 else None

    def schedule(self, nbytes: int, now: float) -> tuple[float, float, float]:
        """``(tx_start, tx_end, deliver_at)`` for a message of ``nbytes`` ready at ``now``."""
        if self.bucket is None:
            start = end = now
        else:
            start, end = self.bucket.reserve(nbytes, now)
        return start, end, end + self.model.alpha_s

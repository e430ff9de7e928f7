"""Quantities with units in cluster files: ``"20 Mbit/s"``, ``"30 ms"``, ``"24 GB"``, ``"165 TFLOPS"``.

A bare number is read in the base unit of its kind: bit/s for bandwidth,
seconds for latency, bytes for memory, FLOP/s for compute, bytes/s for memory
bandwidth. Prefixes are decimal (k, M, G, T = 1e3 ... 1e12) except the binary
ones (KiB, MiB, GiB, TiB). Parsing never evaluates anything.
"""
from __future__ import annotations

import math
import re

_DEC = {"": 1.0, "k": 1e3, "K": 1e3, "m": 1e-3, "u": 1e-6, "µ": 1e-6, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15}
_BIN = {"Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40}

#: kind -> {unit suffix (after the prefix) -> factor to the base unit}
_UNITS = {
    "bandwidth": {"bps": 1.0, "bit/s": 1.0, "b/s": 1.0, "B/s": 8.0, "Bps": 8.0},  # base: bit/s
    "seconds": {"s": 1.0, "sec": 1.0},
    "bytes": {"B": 1.0, "bytes": 1.0},
    "flops": {"FLOPS": 1.0, "FLOP/s": 1.0, "flops": 1.0},
    "byte_rate": {"B/s": 1.0, "Bps": 1.0},  # base: bytes/s
}

_NUM = re.compile(r"^\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*([^\s\d].*?)?\s*$")


class UnitError(ValueError):
    """A quantity that cannot be read; the message says what was expected."""


def parse_quantity(value: object, kind: str) -> float:
    """``value`` (number or string with unit) in the base unit of ``kind``.

    kind: ``bandwidth`` (bit/s), ``seconds``, ``bytes``, ``flops`` (FLOP/s),
    ``byte_rate`` (bytes/s). Raises :class:`UnitError` on anything else.
    """
    if isinstance(value, bool):
        raise UnitError(f"expected a {kind} quantity, got {value!r}")
    if isinstance(value, (int, float)):
        out = float(value)
    elif isinstance(value, str):
        m = _NUM.match(value)
        if not m:
            raise UnitError(f"cannot read {value!r} as a {kind} quantity (e.g. {_example(kind)})")
        num, unit = float(m.group(1)), (m.group(2) or "").strip()
        out = num * _unit_factor(unit, kind, value)
    else:
        raise UnitError(f"expected a {kind} quantity, got {type(value).__name__} {value!r}")
    if not math.isfinite(out):
        raise UnitError(f"{value!r} is not a finite {kind} quantity")
    return out


def _unit_factor(unit: str, kind: str, raw: str) -> float:
    if not unit:
        return 1.0
    table = _UNITS[kind]
    for suffix, f in sorted(table.items(), key=lambda kv: -len(kv[0])):
        if unit == suffix:
            return f
        if unit.endswith(suffix):
            prefix = unit[: -len(suffix)]
            if prefix in _BIN:
                return _BIN[prefix] * f
            if prefix in _DEC and not (kind != "seconds" and prefix in ("m", "u", "µ")):
                return _DEC[prefix] * f
    raise UnitError(f"unknown unit {unit!r} in {raw!r} for a {kind} quantity (e.g. {_example(kind)})")


def _example(kind: str) -> str:
    return {"bandwidth": "'1 Gbps', '20 Mbit/s', '125 MB/s'", "seconds": "'30 ms', '0.5 s'",
            "bytes": "'24 GB', '16 GiB'", "flops": "'165 TFLOPS', '5e13'", "byte_rate": "'900 GB/s'"}[kind]


#: below these a number written without a unit is a forgotten unit, not a device: 4 (bytes of memory), 50 (FLOP/s),
#: 20 (bit/s). Plain numbers in base units stay valid above them (the JSON cluster format writes 4e9).
_BARE_FLOOR = {"bytes": 2.0 ** 20, "flops": 1e6, "byte_rate": 1e6, "bandwidth": 1e3}


def forgotten_unit(value: object, kind: str) -> str | None:
    """Why ``value``, a number written without a unit, cannot be meant (``memory: 4`` reads as 4 bytes), or None."""
    floor = _BARE_FLOOR.get(kind)
    bare = isinstance(value, (int, float)) and not isinstance(value, bool) or \
        isinstance(value, str) and (m := _NUM.match(value)) is not None and not (m.group(2) or "").strip()
    if floor is None or not bare:
        return None
    v = float(value)
    if v >= floor:
        return None
    base = {"bytes": "bytes", "flops": "FLOP/s", "byte_rate": "bytes/s", "bandwidth": "bit/s"}[kind]
    return f"{value!r} has no unit, so it reads as {v:g} {base}; write the unit (e.g. {_example(kind)})"


def format_bandwidth(bps: float) -> str:
    """``1 Gbit/s``, ``20 Mbit/s``, ``2.5 kbit/s``: the largest unit that keeps the number >= 1 (4 digits)."""
    if not math.isfinite(bps):
        return "unlimited" if bps > 0 else str(bps)
    for unit, f in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= f * (1 - 1e-9):
            return f"{bps / f:.4g} {unit}"
    return f"{bps:.4g} bit/s"

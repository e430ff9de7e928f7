"""``delta``: activation compression by quantised differences to the last message (AQ-SGD).

AQ-SGD (Wang et al., "Fine-tuning Language Models over Slow Networks using
Activation Compression with Guarantees", NeurIPS 2022) sends, for a sample
seen before, the *change* of its activation since the last time it crossed
the edge, quantised: ``q(x - buffer[id])``. Both ends keep ``buffer[id]``, the
last *decoded* activation of sample ``id`` on that edge, and both update it
with what the receiver reconstructs (``buffer[id] += dequant(q)``), so the
two buffers stay identical bit for bit and the quantisation error does not
accumulate. As training converges, activations of a sample change little
between epochs, so the deltas are small and a few bits suffice.

One :class:`DeltaBuffer` holds the buffers of *one edge* (one cut tensor in
one direction): the runtime keeps one per edge at each end, the way it keeps
error-feedback streams. Rows of the leading (batch) dimension are samples,
named by caller-given int64 sample ids (the data loader's sample index).

* First visit of an id (no buffer at the sender): the row is sent with the
  first-visit codec, 8-bit ``quant`` (``first_visit: "quant8"``, default) or
  dense (``"dense"``), and the decoded row becomes the buffer.
* Later visits: ``x - buffer[id]`` is computed in float64, quantised with
  ``quant`` at ``bits`` (payload dtype float64), and the receiver returns
  ``cast(buffer[id] + dequant(delta))`` (float64 sum, clipped to the dtype's
  finite range, cast as ``quant`` casts), which is the new buffer.
* The sender runs the receiver's decode on its own payload to update its
  buffer, so "sender and receiver buffers are identical" holds by construction
  (tested after several steps with repeated ids, NumPy and torch).

Memory: one row per sample id ever sent, in the tensor's dtype:
:func:`delta_buffer_nbytes` ``(samples, row_numel, dtype)`` is what the
compiler should budget (e.g. 50 000 samples x 512 x 1024 float16 = 52 GB: AQ-SGD
buffers are large; :meth:`DeltaBuffer.drop` frees ids the caller will not revisit).

Wire (payload type ``"delta"``): header ``{dtype, row_shape, rows, delta:
<quant header>, fresh: <quant header> | {"dense": true}}``; frames ``[ids
(int64, rows), first (uint8 0/1, rows), delta scales, delta offsets, delta
codes, fresh frames (3 for quant, 1 dense array)]``. The delta payload
covers the ``first == 0`` rows in order, stacked as ``(n, *row_shape)``; the
fresh payload the ``first == 1`` rows. Decoding a non-first row whose id has
no buffer raises :class:`WireError` naming the id.

This module is torch-free; :mod:`fusion.kernels.delta_torch` is the torch twin
(buffers kept as tensors on the activation's device), with byte-identical payloads.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from fusion.ir.errors import FusionError, WireError
from fusion.ir.wire import PayloadCodec, register_payload_codec

from fusion.kernels import quant as Q, quant_host
from fusion.kernels.dtypes import VALUE_DTYPES, dtype_size
from fusion.kernels.quant import QuantConfig, QuantPayload

#: First-visit codecs.
FIRST_VISIT = ("quant8", "dense")
_CFG_KEYS = {"algo", "bits", "block", "rounding", "seed", "first_visit"}


@dataclass(frozen=True)
class DeltaConfig:
    """A validated ``delta`` cfg.

    bits, block, rounding, seed: the ``quant`` settings of the deltas
                 (defaults 4, 64, ``"nearest"``, 0).
    first_visit: ``"quant8"`` (default: 8-bit ``quant``, same block/rounding/seed)
                 or ``"dense"`` (the row as is) for samples not yet buffered.
    """

    bits: int = 4
    block: int = Q.DEFAULT_BLOCK
    rounding: str = "nearest"
    seed: int = 0
    first_visit: str = "quant8"

    @classmethod
    def from_cfg(cls, cfg: Mapping[str, Any]) -> "DeltaConfig":
        """Validate a cfg dict; FusionError naming the bad key and value."""
        if not isinstance(cfg, Mapping):
            raise FusionError(f"delta cfg must be a map, got {type(cfg).__name__}")
        unknown = sorted(set(cfg) - _CFG_KEYS)
        if unknown:
            raise FusionError(f"delta cfg: unknown key(s) {unknown}; known: {sorted(_CFG_KEYS)}")
        first = cfg.get("first_visit", "quant8")
        if first not in FIRST_VISIT:
            raise FusionError(f"delta cfg: first_visit must be 'quant8' or 'dense', got {first!r}")
        q = {k: v for k, v in cfg.items() if k in ("bits", "block", "rounding", "seed")}
        q.setdefault("bits", 4)
        try:
            qc = QuantConfig.from_cfg(q)
        except FusionError as e:
            raise FusionError(str(e).replace("quant cfg", "delta cfg", 1)) from None
        return cls(qc.bits, qc.block, qc.rounding, qc.seed, first)

    def delta_quant(self, seed: int | None = None) -> QuantConfig:
        """The ``quant`` config of the deltas."""
        return QuantConfig(self.bits, self.block, self.rounding, self.seed if seed is None else seed)

    def first_quant(self, seed: int | None = None) -> QuantConfig:
        """The ``quant`` config of first-visit rows (8 bits)."""
        return QuantConfig(8, self.block, self.rounding, self.seed if seed is None else seed)


def delta_buffer_nbytes(samples: int, row_numel: int, dtype: str) -> int:
    """Bytes the buffers of one edge hold for ``samples`` sample ids of ``row_numel`` elements of ``dtype``."""
    return samples * row_numel * dtype_size(dtype)


def delta_wire_nbytes(rows: int, row_numel: int, dtype: str, cfg: DeltaConfig, first_rows: int = 0) -> int:
    """Exact frame bytes of a ``rows``-row payload with ``first_rows`` first visits (headers excluded)."""
    n_delta = rows - first_rows
    fresh = (Q.quant_nbytes(first_rows * row_numel, cfg.first_quant()) if cfg.first_visit == "quant8"
             else first_rows * row_numel * dtype_size(dtype))
    return 9 * rows + Q.quant_nbytes(n_delta * row_numel, cfg.delta_quant()) + fresh


@dataclass(frozen=True)
class DeltaPayload:
    """One micro-batch of an AQ-SGD edge.

    ids:       int64 sample id of each row (unique within the payload).
    first:     bool per row: first visit (row carried by ``fresh``) or delta (by ``delta``).
    row_shape: shape of one row (the tensor's shape without its leading dimension).
    dtype:     dtype name of the activation (and of the buffers).
    delta:     :class:`QuantPayload` (dtype float64) of ``x - buffer`` for the
               ``first == False`` rows, in row order, shape ``(n_delta, *row_shape)``.
    fresh:     the ``first == True`` rows, shape ``(n_first, *row_shape)``: an 8-bit
               :class:`QuantPayload` of dtype ``dtype``, or the dense array
               (bfloat16 as uint16 bits).
    """

    ids: np.ndarray
    first: np.ndarray
    row_shape: tuple[int, ...]
    dtype: str
    delta: QuantPayload
    fresh: QuantPayload | np.ndarray

    def __post_init__(self):
        object.__setattr__(self, "row_shape", tuple(self.row_shape))

    @property
    def rows(self) -> int:
        return int(np.size(self.ids))

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the decoded tensor, ``(rows, *row_shape)``."""
        return (self.rows, *self.row_shape)

    @property
    def nbytes(self) -> int:
        fresh = self.fresh.nbytes if isinstance(self.fresh, QuantPayload) else int(self.fresh.nbytes)
        return int(self.ids.nbytes + self.first.size + self.delta.nbytes + fresh)

    def validate(self) -> "DeltaPayload":
        """Check the payload is well formed; return it, or raise :class:`WireError`."""
        if self.dtype not in VALUE_DTYPES:
            raise WireError(f"delta payload: unknown dtype {self.dtype!r}; known: {sorted(VALUE_DTYPES)}")
        if not all(Q._is_int(s) and s >= 0 for s in self.row_shape) or len(self.row_shape) > 31:
            raise WireError(f"delta payload: bad row_shape {self.row_shape!r}")
        if not isinstance(self.ids, np.ndarray) or self.ids.ndim != 1 or self.ids.dtype != np.int64:
            raise WireError("delta payload: ids must be a 1-D int64 array")
        if not isinstance(self.first, np.ndarray) or self.first.shape != self.ids.shape or self.first.dtype != bool:
            raise WireError(f"delta payload: first must be a bool array of {self.rows} flags")
        if np.unique(self.ids).size != self.rows:
            uniq, counts = np.unique(self.ids, return_counts=True)
            raise WireError(f"delta payload: sample id {int(uniq[counts > 1][0])} appears more than once")
        n_first = int(self.first.sum())
        if not isinstance(self.delta, QuantPayload):
            raise WireError(f"delta payload: delta must be a QuantPayload, got {type(self.delta).__name__}")
        want = (self.rows - n_first, *self.row_shape)
        if self.delta.shape != want or self.delta.hadamard:
            raise WireError(f"delta payload: delta part has shape {self.delta.shape}, {want} expected")
        self.delta.validate()
        want = (n_first, *self.row_shape)
        if isinstance(self.fresh, QuantPayload):
            if self.fresh.shape != want or self.fresh.dtype != self.dtype or self.fresh.hadamard:
                raise WireError(f"delta payload: first-visit part is a {self.fresh.dtype} {self.fresh.shape} "
                                f"quant payload, {self.dtype} {want} expected")
            self.fresh.validate()
        elif isinstance(self.fresh, np.ndarray):
            np_dt = VALUE_DTYPES[self.dtype].numpy
            if self.fresh.shape != want or self.fresh.dtype != np_dt:
                raise WireError(f"delta payload: first-visit part is a {self.fresh.dtype} {self.fresh.shape} "
                                f"array, {np_dt} {want} expected")
        else:
            raise WireError(f"delta payload: bad first-visit part {type(self.fresh).__name__}")
        return self

    def header(self) -> dict[str, Any]:
        fresh = self.fresh.header() if isinstance(self.fresh, QuantPayload) else {"dense": True}
        return {"dtype": self.dtype, "row_shape": [int(s) for s in self.row_shape], "rows": self.rows,
                "delta": self.delta.header(), "fresh": fresh}

    def arrays(self) -> list[np.ndarray]:
        fresh = self.fresh.arrays() if isinstance(self.fresh, QuantPayload) else [np.ascontiguousarray(self.fresh)]
        return [np.ascontiguousarray(self.ids), self.first.astype(np.uint8), *self.delta.arrays(), *fresh]

    def to_msg(self) -> tuple[dict[str, Any], list[bytes]]:
        """A msgpack-able header and raw frames (see the module docstring)."""
        return self.header(), [a.tobytes() for a in self.arrays()]

    @classmethod
    def from_msg(cls, header: Mapping[str, Any], frames: list) -> "DeltaPayload":
        """Rebuild from :meth:`to_msg` output (bytes-like frames); validates, raises :class:`WireError`."""
        try:
            dtype, row_shape, rows = header["dtype"], tuple(header["row_shape"]), header["rows"]
            dhead, fhead = header["delta"], header["fresh"]
            if not isinstance(fhead, Mapping):
                raise TypeError("fresh header is not a map")
            dense = fhead.get("dense") is True
            frames = list(frames)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise WireError(f"delta payload: malformed header or frames: {e!r}") from None
        if dtype not in VALUE_DTYPES:
            raise WireError(f"delta payload: unknown dtype {dtype!r}")
        if not Q._is_int(rows) or rows < 0:
            raise WireError(f"delta payload: bad rows {rows!r}")
        want = 6 if dense else 8
        if len(frames) != want:
            raise WireError(f"delta payload needs {want} frames, got {len(frames)}")
        bufs = [Q.as_bytes(f) for f in frames]
        if bufs[0].size != 8 * rows or bufs[1].size != rows:
            raise WireError(f"delta payload: ids/first frames have {bufs[0].size}/{bufs[1].size} bytes, "
                            f"{8 * rows}/{rows} expected for {rows} rows")
        ids = bufs[0].view("<i8").astype(np.int64, copy=False)
        flags = bufs[1]
        if flags.size and int(flags.max()) > 1:
            raise WireError("delta payload: first flags must be 0 or 1")
        delta = QuantPayload.from_msg(dhead, bufs[2:5])
        if dense:
            if not all(Q._is_int(s) and s >= 0 for s in row_shape):
                raise WireError(f"delta payload: bad row_shape {row_shape!r}")
            np_dt = VALUE_DTYPES[dtype].numpy
            n_first = int(flags.sum())
            want_bytes = n_first * math.prod(row_shape) * np_dt.itemsize
            if bufs[5].size != want_bytes:
                raise WireError(f"delta payload: dense first-visit frame has {bufs[5].size} bytes, "
                                f"{want_bytes} expected")
            fresh = bufs[5].view(np_dt.newbyteorder("<")).astype(np_dt, copy=False)
            fresh = fresh.reshape((n_first, *row_shape))
        else:
            fresh = QuantPayload.from_msg(fhead, bufs[5:8])
        return cls(ids, flags.astype(bool), row_shape, dtype, delta, fresh).validate()


def _wire_encode(p: DeltaPayload) -> tuple[dict, list[np.ndarray]]:
    return p.header(), p.arrays()


def _wire_decode(meta: dict, arrays: list[np.ndarray]) -> DeltaPayload:
    return DeltaPayload.from_msg(meta, [Q.as_bytes(a) for a in arrays])


#: Registered with the wire at import (payload type ``"delta"``).
WIRE_CODEC = register_payload_codec(
    PayloadCodec("delta", lambda p: isinstance(p, DeltaPayload), _wire_encode, _wire_decode))


class DeltaBufferBase:
    """The AQ-SGD buffers of one edge and the encode/decode that keeps them in step.

    Subclasses supply the array backend (:class:`DeltaBuffer`: NumPy;
    ``delta_torch.TorchDeltaBuffer``: torch). Buffers: ``{sample id: row}``,
    each row in the activation's dtype (shape ``row_shape``). ``row_shape`` and
    ``dtype`` are fixed by the first message (or :meth:`load_state_dict`).
    """

    def __init__(self, cfg: DeltaConfig | Mapping[str, Any] = DeltaConfig()):
        self.cfg = cfg if isinstance(cfg, DeltaConfig) else DeltaConfig.from_cfg(cfg)
        self._rows: dict[int, Any] = {}
        self.row_shape: tuple[int, ...] | None = None
        self.dtype: str | None = None

    # -- backend hooks ------------------------------------------------------------------
    def _prepare(self, x, dtype: str | None):  # -> (array, dtype name)
        raise NotImplementedError

    def _widen_rows(self, rows: list, n: int):  # -> float64 (n, row_numel) of buffer rows
        raise NotImplementedError

    def _widen_x(self, x, sel):  # -> float64 (k, row_numel) of x's rows sel
        raise NotImplementedError

    def _quantize(self, x, cfg: QuantConfig, dtype: str) -> QuantPayload:
        raise NotImplementedError

    def _dequantize_f64(self, p: QuantPayload):
        raise NotImplementedError

    def _cast(self, y64, dtype: str):
        raise NotImplementedError

    def _dense_rows(self, x, sel) -> np.ndarray:
        raise NotImplementedError

    def _from_dense(self, a: np.ndarray):
        raise NotImplementedError

    def _assemble(self, n_rows: int, row_numel: int, parts: list):  # -> (rows, row_numel) in dtype
        raise NotImplementedError

    def _to_numpy(self, row) -> np.ndarray:
        raise NotImplementedError

    def _from_numpy(self, a: np.ndarray):
        raise NotImplementedError

    # -- API ------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, sample_id: object) -> bool:
        return sample_id in self._rows

    @property
    def nbytes(self) -> int:
        """Bytes the buffers hold now."""
        if self.dtype is None:
            return 0
        return delta_buffer_nbytes(len(self._rows), math.prod(self.row_shape), self.dtype)

    def drop(self, ids) -> None:
        """Forget the buffers of ``ids`` (their next visit is a first visit again at both ends)."""
        for i in np.asarray(ids, dtype=np.int64).reshape(-1).tolist():
            self._rows.pop(i, None)

    def _check_layout(self, row_shape: tuple, dtype: str, err: type) -> None:
        if self.dtype is None:
            self.row_shape, self.dtype = row_shape, dtype
        elif (row_shape, dtype) != (self.row_shape, self.dtype):
            raise err(f"delta: rows of {dtype} {row_shape} on an edge whose buffers hold "
                      f"{self.dtype} {self.row_shape}")

    def encode(self, x, ids, dtype: str | None = None, seed: int | None = None) -> DeltaPayload:
        """Sender: compress a micro-batch ``x`` whose rows are samples ``ids``; update the buffers.

        ``seed`` overrides the cfg's seed for this message (stochastic rounding).
        ``dtype="bfloat16"`` for a NumPy array of bfloat16 bits. Raises FusionError on
        NaN/inf in a delta or first-visit-quant row, duplicate ids, or a layout change.
        """
        x, name = self._prepare(x, dtype)
        ids = np.asarray(ids if not hasattr(ids, "cpu") else ids.cpu().numpy()).reshape(-1)
        if ids.dtype.kind not in "iu":
            raise FusionError(f"delta: sample ids must be integers, got {ids.dtype}")
        ids = ids.astype(np.int64)
        if len(x.shape) < 1 or x.shape[0] != ids.size:
            raise FusionError(f"delta: {ids.size} sample ids for a tensor of shape {tuple(x.shape)}")
        if np.unique(ids).size != ids.size:
            raise FusionError(f"delta: duplicate sample ids in one micro-batch: {ids.tolist()}")
        row_shape = tuple(x.shape[1:])
        self._check_layout(row_shape, name, FusionError)
        first = np.array([i not in self._rows for i in ids.tolist()], dtype=bool)
        dsel = np.flatnonzero(~first)
        fsel = np.flatnonzero(first)
        row_numel = math.prod(row_shape)
        prev = self._widen_rows([self._rows[i] for i in ids[dsel].tolist()], dsel.size)
        d64 = self._widen_x(x, dsel) - prev
        delta = self._quantize(d64.reshape((dsel.size, *row_shape)), self.cfg.delta_quant(seed), "float64")
        if self.cfg.first_visit == "quant8":
            fresh = self._quantize(self._select(x, fsel, row_numel).reshape((fsel.size, *row_shape)),
                                   self.cfg.first_quant(seed), name)
        else:
            fresh = self._dense_rows(x, fsel).reshape((fsel.size, *row_shape))
        p = DeltaPayload(ids, first, row_shape, name, delta, fresh)
        self._apply(p)
        return p

    def decode(self, p: DeltaPayload):
        """Receiver: the decoded micro-batch ``(rows, *row_shape)``; updates the buffers.

        Raises :class:`WireError` for a malformed payload, a delta row whose
        sample id has no buffer, or a layout different from the edge's.
        """
        return self._apply(p)

    def _apply(self, p: DeltaPayload):
        if not isinstance(p, DeltaPayload):
            raise WireError(f"delta: expected a DeltaPayload, got {type(p).__name__}")
        p.validate()
        ids = p.ids.tolist()
        for i, f in zip(ids, p.first.tolist()):
            if not f and i not in self._rows:
                raise WireError(f"delta payload: sample id {i} is sent as a delta but this end has no "
                                f"buffer for it (not a first visit)")
        self._check_layout(p.row_shape, p.dtype, WireError)
        row_numel = math.prod(p.row_shape)
        dsel = np.flatnonzero(~p.first)
        fsel = np.flatnonzero(p.first)
        prev = self._widen_rows([self._rows[ids[j]] for j in dsel.tolist()], dsel.size)
        new = self._cast(prev + self._dequantize_f64(p.delta).reshape(dsel.size, row_numel), p.dtype)
        if isinstance(p.fresh, QuantPayload):
            fresh = self._cast(self._dequantize_f64(p.fresh).reshape(fsel.size, row_numel), p.dtype)
        else:
            fresh = self._from_dense(p.fresh.reshape(fsel.size, row_numel))
        out = self._assemble(p.rows, row_numel, [(dsel, new), (fsel, fresh)])
        for j, i in enumerate(ids):
            self._rows[i] = out[j].reshape(p.row_shape).clone() if hasattr(out, "clone") else \
                out[j].reshape(p.row_shape).copy()
        return out.reshape(p.shape)

    def _select(self, x, sel, row_numel):
        return x.reshape(x.shape[0], row_numel)[sel]

    def state_dict(self) -> dict[int, np.ndarray]:
        """``{sample id: row}`` as NumPy arrays (copies; bfloat16 rows as uint16 bits), for checkpoints."""
        return {i: self._to_numpy(r) for i, r in self._rows.items()}

    def load_state_dict(self, state: Mapping[int, np.ndarray]) -> None:
        """Replace the buffers by a :meth:`state_dict` (uint16 arrays are read as bfloat16 bits).

        All rows must share one shape and dtype; FusionError otherwise.
        """
        rows: dict[int, Any] = {}
        layout = None
        for k, a in state.items():
            a = np.asarray(a)
            name = "bfloat16" if a.dtype == np.uint16 else a.dtype.name
            if name not in VALUE_DTYPES:
                raise FusionError(f"delta state: row of sample {k} has dtype {a.dtype}")
            if layout is None:
                layout = (tuple(a.shape), name)
            elif layout != (tuple(a.shape), name):
                raise FusionError(f"delta state: sample {k} has {name} {a.shape}, others {layout[1]} {layout[0]}")
            rows[int(k)] = self._from_numpy(np.array(a, copy=True))
        self._rows = rows
        self.row_shape, self.dtype = layout if layout is not None else (None, None)


class DeltaBuffer(DeltaBufferBase):
    """NumPy (torch-free) AQ-SGD buffers of one edge; see :class:`DeltaBufferBase`."""

    def _prepare(self, x, dtype):
        a = np.ascontiguousarray(x)
        name = dtype or a.dtype.name
        if name not in VALUE_DTYPES or (name == "bfloat16") != (a.dtype == np.uint16):
            raise FusionError(f"delta: cannot compress a {a.dtype} array as {name!r}")
        return a, name

    def _widen_rows(self, rows, n):
        if not rows:
            return np.zeros((0, math.prod(self.row_shape)), dtype=np.float64)
        return Q.NumpyOps.widen(np.stack(rows), self.dtype).reshape(n, math.prod(self.row_shape))

    def _widen_x(self, x, sel):
        row_numel = math.prod(x.shape[1:])
        return Q.NumpyOps.widen(self._select(x, sel, row_numel), self.dtype).reshape(sel.size, row_numel)

    def _quantize(self, x, cfg, dtype):
        return quant_host.quantize(x, cfg, dtype=dtype)

    def _dequantize_f64(self, p):
        return quant_host.dequantize_f64(p)

    def _cast(self, y64, dtype):
        return Q.clip_cast(Q.NumpyOps, y64, dtype)

    def _dense_rows(self, x, sel):
        return np.ascontiguousarray(self._select(x, sel, math.prod(x.shape[1:])))

    def _from_dense(self, a):
        return a

    def _assemble(self, n_rows, row_numel, parts):
        out = np.empty((n_rows, row_numel), dtype=VALUE_DTYPES[self.dtype].numpy)
        for sel, vals in parts:
            out[sel] = vals
        return out

    def _to_numpy(self, row):
        return np.array(row, copy=True)

    def _from_numpy(self, a):
        return a


__all__ = ["DeltaConfig", "DeltaPayload", "DeltaBuffer", "DeltaBufferBase", "delta_buffer_nbytes",
           "delta_wire_nbytes", "FIRST_VISIT"]

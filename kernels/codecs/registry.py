"""The codec registry: every codec by name, the built-ins found in this package, user codecs adapted.

Built-in codecs are the ``BUILTINS`` of each module of ``fusion.kernels.codecs`` (one file per algorithm;
a new file is found without editing anything else). A user codec written against the plain protocol
(``name``, ``encode(tensor, cfg)``, ``decode(payload, like)``, ``wire_nbytes``, optionally
``encode_numpy``/``decode_numpy``; see ``fusion.kernels.codec``) is registered as given and run through
:class:`PluginCodec`, which gives it the unit's interface: plain payloads on the wire as
:class:`~.plain.CodecPayload`, its NumPy path where it has one, every role but error feedback.

Everything the rest of fusion asks about codecs is read from here: which codec may serve a role
(:meth:`CodecRegistry.serving`), its rate (:meth:`CodecRegistry.rate`), ``auto``'s candidates
(:meth:`CodecRegistry.auto`), which codec made a received payload (:meth:`CodecRegistry.for_payload`). Each
codec's declarations are checked when it is registered (:func:`check_unit`), the built-ins at import.
"""
from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from fusion.ir.errors import FusionError, WireError
from fusion.kernels.codecs.base import ALL_ROLES, ROLE_WORDS, Codec, CodecContext, Role, as_torch, to_numpy
from fusion.kernels.codecs.plain import MAX_PLAIN_KEY, CodecPayload, check_plain


@runtime_checkable
class CodecProtocol(Protocol):
    """A user codec's plain protocol (see ``fusion.kernels.codec.Codec``'s docs for the rules)."""

    name: str

    def encode(self, tensor: Any, cfg: Mapping[str, Any]) -> Any: ...

    def decode(self, payload: Any, like: Any = None) -> Any: ...

    def wire_nbytes(self, numel: int, dtype: str, cfg: Mapping[str, Any]) -> int: ...


def numpy_path(codec: Any) -> bool:
    """Whether ``codec`` runs without torch: a unit (its host path is NumPy), or a user codec declaring
    ``encode_numpy`` and ``decode_numpy``."""
    if is_unit(codec):
        return getattr(codec, "numpy_path", True)
    return callable(getattr(codec, "encode_numpy", None)) and callable(getattr(codec, "decode_numpy", None))


def is_unit(codec: Any) -> bool:
    """Whether ``codec`` implements the unit's interface itself (a :class:`Codec` with a host path)."""
    return isinstance(codec, Codec) and type(codec).encode_host is not Codec.encode_host


class PluginCodec(Codec):
    """A user codec of the plain protocol, as a unit: host path only (its NumPy path, else its torch path on
    a CPU copy), plain payloads, every role, no error feedback, no state."""

    roles = ALL_ROLES
    order = 1000
    payload_types = (CodecPayload,)

    def __init__(self, user: Any):
        self.user = user
        self.name = user.name  # type: ignore[misc]
        self.rate = getattr(user, "rate", None)  # type: ignore[misc]
        self.numpy_path = numpy_path(user)

    def owns(self, payload: Any) -> bool:
        return isinstance(payload, CodecPayload) and payload.algo == self.name

    def wire_nbytes(self, numel: int, dtype: str, cfg: Mapping[str, Any]) -> int:
        return self.user.wire_nbytes(numel, dtype, cfg)

    def encode_host(self, arr: np.ndarray, dtype: str, cfg: Mapping[str, Any], ctx: CodecContext) -> CodecPayload:
        """The plain payload of a NumPy message (bfloat16 as uint16 bits). FusionError when it is not plain."""
        if self.numpy_path:
            out = self.user.encode_numpy(np.ascontiguousarray(arr), cfg)
        else:
            out = self.user.encode(as_torch(arr, dtype), cfg)
        return CodecPayload(self.name, dict(check_plain(out, self.name)))

    def decode_host(self, payload: CodecPayload, ctx: CodecContext | None = None) -> np.ndarray:
        """The NumPy array of a payload; WireError for one the codec refuses (its checks, or its bugs)."""
        try:
            if self.numpy_path:
                return np.asarray(self.user.decode_numpy(dict(payload.fields)))
            return to_numpy(self.user.decode(dict(payload.fields), None))
        except Exception as e:  # the codec's own checks (lengths, counts) or its bugs: a rejected message
            raise WireError(f"{self.name} payload refused by its codec: {type(e).__name__}: {str(e)[:200]}") from None


def check_unit(codec: Codec) -> None:
    """FusionError unless a unit's declarations hold together: a valid name, roles that are :class:`Role` s,
    a positive rate or None, ``auto`` candidates of its own name, for roles it serves, that its checks pass."""
    name = codec.name
    if not isinstance(name, str) or not 0 < len(name) <= MAX_PLAIN_KEY or name in ("none", "auto") \
            or any(c in name for c in ":,= "):
        raise FusionError(f"codec name {name!r}: 1..{MAX_PLAIN_KEY} characters without ':', ',', '=' or spaces, "
                          "not 'none' or 'auto'")
    if not codec.roles <= ALL_ROLES:
        raise FusionError(f"codec {name!r}: roles must be fusion.kernels.codecs.Role members")
    if codec.rate is not None and not (isinstance(codec.rate, (int, float)) and codec.rate > 0):
        raise FusionError(f"codec {name!r}: rate must be a positive number of bytes per second, got {codec.rate!r}")
    for role, cfgs in codec.auto.items():
        for cfg in cfgs:
            if cfg.get("algo") != name:
                raise FusionError(f"codec {name!r}: auto candidate {cfg} names another codec")
            codec.check(cfg, role)


class CodecRegistry:
    """Codecs by name. Build your own or start from :meth:`with_defaults`;
    registries are plain objects, never shared mutable module state.
    """

    def __init__(self, codecs: Iterable[Any] = ()):
        self._codecs: dict[str, Any] = {}
        for c in codecs:
            self.register(c)

    @classmethod
    def with_defaults(cls) -> "CodecRegistry":
        """A new registry holding the built-in codecs (``topk``, ``quant``, ``hadamard-quant``, ``delta``)."""
        return cls(builtin_codecs())

    def register(self, codec: Any) -> Any:
        """Add ``codec`` under ``codec.name``; a name may be registered once (the same class imported
        again, e.g. a model file loaded twice in one process, replaces its earlier instance)."""
        if not is_unit(codec) and not isinstance(codec, CodecProtocol):
            raise FusionError(f"codec {codec!r} does not implement name/encode/decode/wire_nbytes")
        check_unit(codec if is_unit(codec) else PluginCodec(codec))
        name = codec.name
        old = self._codecs.get(name)
        if old is not None and (name in BUILTIN or _origin(old) != _origin(codec)):
            raise FusionError(f"codec {name!r} is already registered")
        self._codecs[name] = codec
        return codec

    def user_module(self, name: str) -> str | None:
        """The module that defines a user codec's class (None for a built-in codec)."""
        return None if name in BUILTIN else type(self.get(name)).__module__

    def get(self, name: str) -> Any:
        """The codec called ``name`` as registered; FusionError naming the known ones otherwise."""
        try:
            return self._codecs[name]
        except KeyError:
            raise FusionError(f"unknown compression algo {name!r}; known: {sorted(self._codecs)}") from None

    def unit(self, name: str) -> Codec:
        """The codec called ``name`` with the unit's interface (a user codec adapted by :class:`PluginCodec`)."""
        c = self.get(name)
        return c if is_unit(c) else PluginCodec(c)

    def for_cfg(self, cfg: Mapping[str, Any]) -> Any:
        """The codec a ``compress_cfg`` names in its ``algo`` key."""
        if "algo" not in cfg:
            raise FusionError(f"compress_cfg has no 'algo': {dict(cfg)}")
        return self.get(cfg["algo"])

    def units(self) -> list[Codec]:
        """Every codec as a unit, built-ins first in their order, then user codecs by name."""
        return sorted((self.unit(n) for n in self._codecs), key=lambda c: (c.order, c.name))

    def for_payload(self, payload: Any) -> Codec | None:
        """The codec that made a received payload (None: a dense array or value)."""
        if isinstance(payload, CodecPayload):
            return self.unit(payload.algo) if payload.algo in self._codecs else None
        for c in self.units():
            if c.owns(payload):
                return c
        return None

    def serving(self, role: Role) -> list[str]:
        """Names of the codecs that may serve ``role``, in :meth:`units` order."""
        return [c.name for c in self.units() if role in c.roles]

    def rate(self, name: str, default: str = "quant") -> float:
        """Dense bytes per second through one encode + decode of codec ``name`` (the estimator's price); a codec
        without a measured rate is priced as ``default``."""
        r = self.unit(name).rate if name in self._codecs else None
        return r if r is not None else self.unit(default).rate

    def auto(self, role: Role) -> tuple[dict, ...]:
        """``auto``'s candidate cfgs for ``role``, best codec first (each codec's ``auto_order`` for the role,
        else its ``order``): ``--compress auto``'s for activations and gradients, ``--tied-codec auto``'s for
        tied gradients, the DiLoCo planner's for pseudo-gradients."""
        units = sorted(self.units(), key=lambda c: (c.auto_order.get(role, c.order), c.name))
        return tuple(dict(cfg) for c in units for cfg in c.auto.get(role, ()))

    def gradients_for(self, cfg: Mapping[str, Any]) -> dict:
        """The gradients' cfg when ``cfg`` is asked for activations alone: ``cfg`` itself where its codec carries
        gradients, else the codec's ``gradient_codec``, else the best gradient ``auto`` candidate."""
        unit = self.unit(cfg["algo"])
        if Role.GRADIENT in unit.roles:
            return dict(cfg)
        return dict(unit.gradient_codec) if unit.gradient_codec is not None else self.auto(Role.GRADIENT)[0]

    def stateful(self, cfg: Mapping[str, Any] | None) -> bool:
        """Whether a cfg names a codec that keeps per-edge state at both ends (``Codec.stateful``)."""
        return cfg is not None and cfg.get("algo") in self._codecs and self.unit(cfg["algo"]).stateful

    def error_feedback(self, cfg: Mapping[str, Any] | None) -> bool:
        """Whether a cfg names a codec whose unsent residual may be fed back into the next message."""
        return cfg is not None and cfg.get("algo") in self._codecs and self.unit(cfg["algo"]).error_feedback

    def needs_sample_ids(self, cfg: Mapping[str, Any] | None) -> bool:
        """Whether a cfg names a codec with per-sample state (``delta``): its edges need every micro-batch's
        sample ids, and both ends keep buffers."""
        return self.stateful(cfg)

    def check_role(self, cfg: Any, role: Role, where: str) -> Codec:
        """The codec a cfg names, checked for ``role``; FusionError (one line naming ``where``) for a cfg that is
        not one, a codec this registry lacks, one that cannot serve ``role``, or a bad cfg."""
        if not isinstance(cfg, Mapping) or not isinstance(cfg.get("algo"), str):
            raise FusionError(f"{where}: expected a codec cfg with an 'algo' name, got {cfg!r}"[:300])
        algo = cfg["algo"]
        if algo not in self._codecs:
            raise FusionError(f"{where}: unknown codec {algo!r} (known: {', '.join(self.names())}); a user codec is "
                              "registered by a plugin file the plan lists, imported with --trust-plugins")
        unit = self.unit(algo)
        if role not in unit.roles:
            serving = [n for n in self.serving(role) if is_unit(self.get(n))]
            raise FusionError(f"{where}: {algo} cannot compress {ROLE_WORDS[role]} (use one of {', '.join(serving)} "
                              "or a user codec)")
        try:
            unit.check(cfg, role)
        except FusionError as err:
            raise FusionError(f"{where}: {err}") from None
        return unit

    def names(self) -> list[str]:
        """Registered codec names, sorted."""
        return sorted(self._codecs)

    def __contains__(self, name: object) -> bool:
        return name in self._codecs


def _origin(codec: Any) -> tuple[str, str]:
    return type(codec).__module__, type(codec).__qualname__


_NOT_CODECS = frozenset({"base", "registry", "plain"})


def builtin_codecs() -> list[Codec]:
    """The ``BUILTINS`` of every codec module in this module's folder (the codecs package), in their declared
    order. The folder is read from this file's own place: the registry needs the package's files, not its
    ``__init__`` (which imports the registry)."""
    out: list[Codec] = []
    for m in pkgutil.iter_modules([str(Path(__file__).parent)]):
        if m.name not in _NOT_CODECS:
            out.extend(importlib.import_module(f"{__package__}.{m.name}").BUILTINS)
    return sorted(out, key=lambda c: c.order)


#: names of the built-in codecs
BUILTIN = frozenset(c.name for c in builtin_codecs())

#: The process-wide registry: the built-in codecs plus those user plugin files register with
#: :func:`register_codec` (as user ops go into ``fusion.ir.registry.REGISTRY``). Compiling, the
#: estimator and every CompNode look codecs up here; a plan that names a user codec lists the file
#: that registers it as a plugin, which executors import under ``--trust-plugins``.
CODECS = CodecRegistry.with_defaults()


def register_codec(codec: Any) -> Any:
    """Register a user codec in :data:`CODECS` (call it at the top level of a model file)::

        from fusion.kernels.codec import register_codec
        register_codec(Int8Codec())        # fusion compile model.py:model ... --compress int8

    ``codec`` implements the plain protocol (``fusion.kernels.codec.Codec``'s docs; and, for NumPy parts,
    ``encode_numpy``/``decode_numpy``), or is a :class:`~.base.Codec` unit with its own host path. Returns it."""
    return CODECS.register(codec)


class FlatCodec:
    """One codec cfg bound to a role, for flat host arrays that are summed after decoding: all-reduce chunks
    (``Role.DP_GRADIENT``) and DiLoCo pseudo-gradients (``Role.PSEUDO_GRADIENT``).

    cfg: the plan's codec cfg (``{"algo": "quant", "bits": 8}``), or None for dense arrays (sent as a copy);
    role: what the arrays are, which sets the codec's context (its stochastic-rounding stream).
    """

    def __init__(self, cfg: Mapping[str, Any] | None, role: Role, registry: "CodecRegistry | None" = None):
        self.cfg, self.role = (dict(cfg) if cfg else None), role
        self.unit = (registry or CODECS).unit(cfg["algo"]) if cfg else None
        self.ctx = CodecContext(role)

    def encode(self, flat: np.ndarray) -> Any:
        """The payload of ``flat`` (a copy of it when dense)."""
        if self.unit is None:
            return flat.copy()
        return self.unit.encode_host(flat, flat.dtype.name, self.cfg, self.ctx)

    def owns(self, payload: Any) -> bool:
        """Whether ``payload`` is what this codec makes (a dense array when the cfg is None)."""
        return isinstance(payload, np.ndarray) if self.unit is None else self.unit.owns(payload)

    def decode(self, payload: Any, what: str) -> np.ndarray:
        """``payload`` as a dense array; WireError naming ``what`` for a payload another codec made (a dense array
        where the cfg names a codec, or the reverse) or one the codec refuses."""
        dense = isinstance(payload, np.ndarray)
        if self.unit is None or dense:
            if self.unit is None and dense:
                return payload
            made = "dense array" if dense else type(payload).__name__
            raise WireError(f"{what}: a {made}, not what {self.cfg['algo'] if self.cfg else 'a dense group'} makes")
        if not self.unit.owns(payload):
            raise WireError(f"{what}: a {type(payload).__name__}, not what {self.cfg['algo']} makes")
        try:
            return np.asarray(self.unit.decode_host(payload))
        except (WireError, FusionError) as e:
            raise WireError(f"{what}: {e}") from None


def decode_checked(unit: Codec, payload: Any, shape: tuple[int, ...] | None, dtype: "str | tuple[str, ...] | None",
                   what: str) -> Any:
    """A user codec's payload decoded and checked against the tensor's graph ``shape``/``dtype`` (None:
    unchecked; a tuple: any of those, e.g. float32 or the bfloat16 autocast gave it); WireError naming ``what`` for a payload the codec refuses or a tensor that does not fit."""
    try:
        out = unit.decode_host(payload)
    except WireError as e:
        raise WireError(f"{what}: {e}") from None
    if shape is not None:
        dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
        want = {np.dtype(np.uint16 if d == "bfloat16" else d) for d in dtypes}
        if tuple(out.shape) != tuple(shape) or out.dtype not in want:
            raise WireError(f"{what}: {unit.name} payload decodes to {out.dtype}{list(out.shape)}, the graph says "
                            f"{' or '.join(dtypes)}{list(shape)}")
    return out

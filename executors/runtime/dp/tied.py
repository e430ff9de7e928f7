"""Tied-parameter gradients through a codec (``Plan.tied_codec``): every owner of a parameter held by several
parts encodes its gradient once; every owner sums the *decoded* gradients of all owners (its own included)
in plan part order, so all owners apply the same bits. The codec is any of the registry that serves
``Role.TIED_GRADIENT``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fusion.ir.errors import FusionError, WireError
from fusion.kernels.codecs import CODECS, FLOAT_DTYPES, Codec, CodecContext, CodecPayload, Role
from fusion.kernels.codecs.registry import decode_checked, numpy_path

COMPRESSIBLE = FLOAT_DTYPES


@dataclass(frozen=True)
class TiedCodec:
    """How the owners of a tied parameter exchange its gradient (``Plan.tied_codec``).

    cfg: the codec cfg (``{"algo": "quant", "bits": 8}``; any codec of the registry that may serve
         tied-parameter gradients: quant, hadamard-quant, topk or a user codec).

    Semantics (deterministic, the same on every owner): each owner encodes its own accumulated gradient
    once (:meth:`encode`), sends that payload to the other owners, and every owner sums the *decoded*
    gradients of all owners, its own included (:meth:`decode`, same NumPy code on every end), in plan
    part order (:func:`sum_in_order`). So every owner applies the same bits and the weights stay identical;
    the reference executor does the same in one process. A gradient whose dtype is not a float travels
    dense (and counts dense on every owner).
    """

    cfg: dict
    unit: Codec = field(compare=False, repr=False)

    @classmethod
    def from_cfg(cls, cfg: Any, where: str = "plan.tied_codec") -> "TiedCodec | None":
        """None for no codec; FusionError (one line) for one the registry lacks or the exchange cannot use."""
        if cfg is None:
            return None
        return cls(dict(cfg), CODECS.check_role(cfg, Role.TIED_GRADIENT, where))

    @property
    def algo(self) -> str:
        return self.cfg["algo"]

    def check_engine(self, part: str, engine: str) -> None:
        """FusionError when a NumPy part would have to run a torch-only user codec."""
        if engine == "numpy" and not numpy_path(self.unit):
            raise FusionError(f"plan.tied_codec: codec {self.algo!r} has only a torch path, and part {part} (an owner "
                              "of a tied parameter) runs the numpy engine")

    def encode(self, grad: np.ndarray, dtype: str, name: str, owner: str, it: int) -> Any:
        """The payload of ``owner``'s gradient of parameter ``name`` at iteration ``it`` (``dtype``: the graph's;
        bfloat16 as uint16 bits). Stochastic rounding is seeded by (name, owner, it): the same on every run."""
        if dtype not in COMPRESSIBLE:
            return grad
        ctx = CodecContext(Role.TIED_GRADIENT, owner, (name, None), iteration=it)
        return self.unit.encode_host(grad, dtype, self.cfg, ctx)

    def decode(self, payload: Any, shape: tuple[int, ...], dtype: str, what: str) -> np.ndarray:
        """The dense gradient of a payload :meth:`encode` made; WireError naming ``what`` when it is not one
        (another codec, or a tensor of another shape or dtype)."""
        if isinstance(payload, np.ndarray) and dtype not in COMPRESSIBLE:
            return payload
        if not self.unit.owns(payload):
            raise WireError(f"{what}: expected a {self.algo} payload (plan.tied_codec), got {type(payload).__name__}")
        if isinstance(payload, CodecPayload):
            return decode_checked(self.unit, payload, shape, dtype, what)
        if tuple(payload.shape) != tuple(shape) or payload.dtype != dtype:
            raise WireError(f"{what}: {self.algo} payload of {payload.dtype}{list(payload.shape)}, the parameter is "
                            f"{dtype}{list(shape)}")
        return np.asarray(self.unit.decode_host(payload))


def sum_in_order(grads: list[np.ndarray]) -> np.ndarray:
    """The sum of ``grads`` left to right (the one order every owner and the reference executor use), in a new
    array that aliases none of them. One allocation: the first sum is made into a fresh array and the later ones
    are added into it in place (the same bits as ``((g0 + g1) + g2) ...``; a tied gradient of GPT-2 small's
    embedding is 154 MB, and a copy of ``g0`` before the first sum cost a third pass and a second 154 MB
    allocation on every owner every step, docs/testing.md "Real size")."""
    if len(grads) == 1:
        return np.array(grads[0], copy=True)
    total = np.add(grads[0], grads[1])
    for g in grads[2:]:
        if np.result_type(total, g) == total.dtype:
            np.add(total, g, out=total)
        else:  # a wider dtype: promoted, as ``total + g`` does
            total = total + g
    return total

"""The codec as the unit: what one compression algorithm is, and the context every call gets.

One :class:`Codec` object per algorithm owns everything about it (hivemind's
``compression/base.py`` is the model): its host encode/decode (NumPy,
torch-free, so NumPy CompNodes never import torch), its optional device path
(torch, or CuPy through the torch kernels' dispatch), ``wire_nbytes`` for the
compiler, its encode + decode rate for the estimator, its ``auto`` candidates,
its capabilities (the :class:`Role` s it may serve, error feedback, per-edge
state) and its config checks. Built-in codecs live one file each in this
package and are registered once (:mod:`.registry`); a user codec registers
itself from its own plugin file with ``register_codec``.

Every encode gets one :class:`CodecContext` (tensor, peer, role, micro-batch,
sample ids, iteration, the stream's message counter, ...) instead of seven
arguments, and the stochastic-rounding seed is derived from it in one place
(:meth:`CodecContext.rounding_seed`).
"""
from __future__ import annotations

import enum
import sys
import zlib
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

import numpy as np

from fusion.ir.errors import FusionError
from fusion.kernels.dtypes import VALUE_DTYPES

Key = tuple[str, "int | None"]

#: tensor dtypes a codec may compress (bfloat16 travels as uint16 bits; the graph's dtype tells it apart)
FLOAT_DTYPES = frozenset(VALUE_DTYPES)


class Role(enum.Enum):
    """What a compressed tensor is, which decides the codecs that may carry it.

    ACTIVATION:      an activation sent forward over a cut edge (FusionLLM §3.4).
    GRADIENT:        the gradient of such an activation sent back (straight-through, ``docs/compression.md``).
    TIED_GRADIENT:   a tied parameter's gradient exchanged by its owners (``Plan.tied_codec``).
    DP_GRADIENT:     a chunk of the data-parallel all-reduce (``Plan.dp_codec``).
    PSEUDO_GRADIENT: a DiLoCo pseudo-gradient (outer step, ``DPSync.codec``).
    """

    ACTIVATION = "activation"
    GRADIENT = "gradient"
    TIED_GRADIENT = "tied-gradient"
    DP_GRADIENT = "dp-gradient"
    PSEUDO_GRADIENT = "pseudo-gradient"


ALL_ROLES = frozenset(Role)


class Counter:
    """A stream's message counter: each stochastically rounded message of a table takes the next number."""

    def __init__(self) -> None:
        self.n = 0

    def next(self) -> int:
        self.n += 1
        return self.n


@dataclass
class CodecContext:
    """Where one message is encoded (every field optional but ``role``).

    role:        what the tensor is (:class:`Role`).
    part:        the sending part (for a tied gradient: the owner that encodes it).
    key:         the tensor: ``(producer, output index)``; for a tied gradient ``(parameter name, None)``.
    peer:        the part the message goes to (activations, gradients).
    micro_batch: the micro-batch the message belongs to.
    sample_ids:  the micro-batch's sample ids (per-sample codecs: ``delta``).
    iteration:   the training step.
    counter:     the sending table's message counter (fresh stochastic-rounding noise per message).
    feedback:    the error-feedback residual store when the edge has error feedback on, else None.
    state:       the edge's state for a stateful codec (``delta``'s buffers at this end), else None.
    """

    role: Role
    part: str = ""
    key: Key | None = None
    peer: str | None = None
    micro_batch: int = 0
    sample_ids: Any = None
    iteration: int | None = None
    counter: Counter | None = field(default=None, repr=False)
    feedback: Any = field(default=None, repr=False)
    state: Any = field(default=None, repr=False)

    @property
    def is_grad(self) -> bool:
        return self.role is not Role.ACTIVATION

    @property
    def stream(self) -> tuple:
        """The error-feedback stream of an edge message: (tensor, peer, direction, micro-batch)."""
        return (self.key, self.peer, "bwd" if self.is_grad else "fwd", self.micro_batch)

    def rounding_seed(self, per_sample: bool = False) -> int | None:
        """The stochastic-rounding seed of this message, the same on every run of the plan; None: the cfg's own.

        The one place seeds are made:

        * tied gradients: (``"tied"``, parameter, owner, iteration), so every owner's bits are reproducible;
        * per-sample codecs (``per_sample``: delta): (part, tensor, peer, iteration, micro-batch), a function of
          the step only, so a resumed run draws what the uninterrupted one drew;
        * other edge messages: (part, tensor, peer, is-gradient, micro-batch, the table's message counter);
        * anything else (data-parallel chunks, a codec called outside a table): None.
        """
        if self.role is Role.TIED_GRADIENT:
            return zlib.crc32(repr(("tied", self.key[0], self.part, self.iteration)).encode())
        if self.role not in (Role.ACTIVATION, Role.GRADIENT) or self.key is None:
            return None
        if per_sample:
            return zlib.crc32(repr((self.part, self.key, self.peer, self.iteration, self.micro_batch)).encode())
        if self.counter is None:
            return None
        return zlib.crc32(repr((self.part, self.key, self.peer, self.is_grad, self.micro_batch,
                                self.counter.next())).encode())


class Codec:
    """One compression algorithm (subclass it; one object per algorithm, registered once).

    Class attributes say what it can do:

    name:          the ``algo`` value of a ``compress_cfg``.
    roles:         the :class:`Role` s it may serve.
    error_feedback: whether an edge may add its unsent residual to the next message (Top-K).
    stateful:      keeps per-edge state at both ends (:meth:`new_state`; ``delta``).
    rate:          dense bytes per second through encode + decode on one CPU thread (the estimator's price);
                   None: unmeasured (the compiler then assumes quant's).
    auto:          role -> the cfgs ``--compress auto`` may choose for that role, best first (for
                   ``Role.TIED_GRADIENT``: ``--tied-codec auto``'s; for ``Role.PSEUDO_GRADIENT``: the DiLoCo
                   planner's, most faithful first).
    auto_order:    role -> where this codec's ``auto`` cfgs sort among other codecs' for that role (default:
                   ``order``).
    gradient_codec: for a codec that cannot carry gradients, the gradients' cfg when only it is asked for
                   (``--compress`` without ``--compress-bwd``); None: the best gradient ``auto`` candidate.
    host_on_cpu:   on a CPU tensor the host (NumPy) path is the fast one, so a CPU part runs it unless asked
                   for the torch codecs (``encode="torch"``); False: the device path runs on CPU tensors too.
    payload_types: the payload classes it makes (what the receiver dispatches on).
    order:         where it sorts among built-ins (``auto`` candidate order).

    Methods (``ctx`` is a :class:`CodecContext`; ``dtype`` the graph's dtype, bfloat16 as uint16 bits on the host):

    check(cfg, role, error_feedback):   FusionError (the reason, without where) for a cfg it cannot run.
    encode_host(arr, dtype, cfg, ctx):  payload of a NumPy array; None: send the tensor dense.
    decode_host(payload, ctx):          NumPy array of a payload.
    encode_device(t, dtype, cfg, ctx):  payload of a torch tensor on its device (None: dense); only with
                                        ``has_device``.
    decode_device(payload, device, ctx): a torch tensor on ``device``.
    wire_nbytes(numel, dtype, cfg):     bytes on the wire (what the compiler prices).
    message_cfg(cfg, payload):          the ``OpData.compress_cfg`` of a message.
    """

    name: ClassVar[str] = ""
    roles: ClassVar[frozenset] = frozenset()
    error_feedback: ClassVar[bool] = False
    stateful: ClassVar[bool] = False
    rate: ClassVar[float | None] = None
    auto: ClassVar[Mapping[Role, tuple]] = {}
    auto_order: ClassVar[Mapping[Role, int]] = {}
    gradient_codec: ClassVar[Mapping[str, Any] | None] = None
    host_on_cpu: ClassVar[bool] = True
    payload_types: ClassVar[tuple] = ()
    payload_word: ClassVar[str] = ""  # how log lines name its payloads ("sparse", "quantised"); default: its name
    title: ClassVar[str] = ""  # how log lines name the codec ("delta (AQ-SGD)"); default: its name
    order: ClassVar[int] = 100
    has_device: ClassVar[bool] = False
    #: pseudo-gradients: the outer momentum the codec's algorithm runs with (SparseLoCo: 0, its error feedback
    #: replaces it); None: DiLoCo's (the plan's)
    outer_momentum: ClassVar[float | None] = None
    #: pseudo-gradients: its algorithm always feeds the unsent residual back (SparseLoCo), so choosing the codec
    #: turns ``dp_sync.error_feedback`` on
    pseudo_feedback: ClassVar[bool] = False

    # -- capabilities and checks ------------------------------------------------------------
    def check_cfg(self, cfg: Mapping[str, Any]) -> None:
        """FusionError naming the bad key for a cfg this codec refuses (default: every cfg is fine)."""

    def check(self, cfg: Mapping[str, Any], role: Role, error_feedback: bool = False) -> None:
        """FusionError for a cfg, role or error-feedback setting this codec cannot run."""
        if role not in self.roles:
            raise FusionError(f"{self.name} cannot compress {ROLE_WORDS[role]}")
        if error_feedback and not self.error_feedback:
            raise FusionError("error feedback is for Top-K only")
        self.check_cfg(cfg)

    def feedback_decay(self, cfg: Mapping[str, Any]) -> float:
        """The weight of the unsent residual in the next message under error feedback (1: the whole residual;
        SparseLoCo's beta)."""
        return 1.0

    def owns(self, payload: Any) -> bool:
        """Whether ``payload`` is one this codec made."""
        return isinstance(payload, self.payload_types)

    def runs_on_device(self, device_type: str, torch_on_cpu: bool) -> bool:
        """Whether a tensor on a ``device_type`` device is encoded by the device path."""
        return self.has_device and (device_type != "cpu" or torch_on_cpu or not self.host_on_cpu)

    def check_payload(self, payload: Any, shape: tuple, dtype: str) -> str | None:
        """Why a received payload cannot be the graph's tensor ``dtype[shape]`` (None: it can). Default: the
        payload says its ``shape`` and ``dtype``, which must be the graph's."""
        if tuple(payload.shape) != tuple(shape) or payload.dtype != dtype:
            return (f"{self.payload_word or self.name} payload of {payload.dtype}{list(payload.shape)} does not "
                    f"match the graph's {dtype}{list(shape)}")
        return None

    def message_cfg(self, cfg: Mapping[str, Any], payload: Any) -> dict:
        return dict(cfg)

    def new_state(self, cfg: Mapping[str, Any], device: Any = None) -> Any:
        raise FusionError(f"{self.name} keeps no per-edge state")

    # -- the work -----------------------------------------------------------------------------
    def encode_host(self, arr: np.ndarray, dtype: str, cfg: Mapping[str, Any], ctx: CodecContext) -> Any:
        raise NotImplementedError

    def decode_host(self, payload: Any, ctx: CodecContext | None = None) -> np.ndarray:
        raise NotImplementedError

    def encode_device(self, t: Any, dtype: str, cfg: Mapping[str, Any], ctx: CodecContext) -> Any:
        raise FusionError(f"{self.name} has no device path")

    def decode_device(self, payload: Any, device: Any, ctx: CodecContext | None = None) -> Any:
        raise FusionError(f"{self.name} has no device path")

    def wire_nbytes(self, numel: int, dtype: str, cfg: Mapping[str, Any]) -> int:
        raise NotImplementedError


ROLE_WORDS = {Role.ACTIVATION: "activations", Role.GRADIENT: "gradients",
               Role.TIED_GRADIENT: "tied-parameter gradients", Role.DP_GRADIENT: "data-parallel gradients",
               Role.PSEUDO_GRADIENT: "pseudo-gradients"}


def check_dtype(algo: str, dtype: str) -> None:
    if dtype not in VALUE_DTYPES:
        raise FusionError(f"{algo}: cannot compress dtype {dtype!r}; floating dtypes only: {sorted(VALUE_DTYPES)}")


# -- tensors and arrays, without importing torch in a NumPy process ------------------------------

def is_torch(t: Any) -> bool:
    """Whether ``t`` is a torch tensor, without importing torch (a NumPy process never has one)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(t, torch.Tensor)


def numel_of(t: Any) -> int:
    return t.numel() if is_torch(t) else int(np.size(t))


def to_numpy(t: Any) -> np.ndarray:
    """A host NumPy view (CPU) or copy of a tensor, detached; bfloat16 as uint16 bits. Arrays pass through."""
    if not is_torch(t):
        return np.asarray(t)
    import torch

    t = t.detach()
    if not t.is_cpu:
        t = t.cpu()
    if t.dtype is torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def as_torch(a: np.ndarray, dtype: str):
    """A CPU tensor viewing a NumPy array (bfloat16 bits viewed back)."""
    import torch

    t = torch.from_numpy(np.ascontiguousarray(a))
    return t.view(torch.int16).view(torch.bfloat16) if dtype == "bfloat16" else t


def to_tensor(a: Any, dtype: str | None, device: Any):
    """A received array as a tensor of the graph's ``dtype`` on ``device`` (bfloat16 bits viewed back)."""
    import torch

    if is_torch(a):
        return a
    arr = np.asarray(a)
    if not arr.flags.writeable:
        arr = arr.copy()
    t = torch.from_numpy(arr).to(device)
    if dtype == "bfloat16" and t.dtype in (torch.uint16, torch.int16):
        return t.view(torch.bfloat16)
    return t


def dtype_of(payload: Any, bfloat16: bool = False) -> str | None:
    """The graph dtype name of a NumPy array or torch tensor (``bfloat16``: a uint16 array holds bfloat16 bits);
    None for anything else."""
    if isinstance(payload, np.ndarray):
        return "bfloat16" if payload.dtype == np.uint16 and bfloat16 else payload.dtype.name
    if is_torch(payload):
        from fusion.kernels.dtypes import dtype_name

        return dtype_name(payload.dtype)
    return None

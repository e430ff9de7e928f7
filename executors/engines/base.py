"""The engine protocol: what an ML framework must provide to run a CompNode.

FusionLLM's CompNodes need not share a framework or its version: every part
talks to the rest of the system only through dense NumPy-compatible arrays
(OpData payloads), so one part can run torch and the next NumPy. An engine
is registered by name in ``fusion.executors.engines.ENGINES`` and provides:

1. **Build a node** — ``Part(graph, subgraph, params, device)`` turns the
   sub-DAG's OpNodes into runnable ops (``TorchPart`` builds modules on the
   meta device and binds the part's tensors; ``NumpyPart`` looks targets up in
   its op table). ``params`` maps graph parameter names to initial values
   (arrays); trainable ones receive gradients, the others are buffers. Ops
   the engine lacks are rejected at compile time by
   ``engines.check_engines`` (node and op named) and again at build time.
2. **Forward** — ``forward(mb_key, inputs, feeds) -> (sent, loss)``:
   ``inputs`` are activations from other parts keyed ``(producer, index)``,
   ``feeds`` the part's placeholders; ``sent`` holds the activations other
   parts need, as arrays; ``loss`` is this part's summed loss (a float) or
   None. The part keeps what its backward needs under ``mb_key`` (one entry
   per in-flight micro-batch).
3. **Vector-Jacobian product** — ``backward(mb_key, grads, loss_scale) ->
   input_grads``: ``grads`` are the gradients of the activations it sent,
   already summed over actual users; the loss is seeded with ``loss_scale``
   (1 / micro-batches). Returns gradients of the received activations that
   require grad, and accumulates parameter gradients across micro-batches
   (FusionLLM §3.3 remote autodiff).
4. **Parameter update** — ``trainable()`` (name -> parameter), ``grads()``,
   ``set_grad(name, grad, owned=False)`` (tied parameters get the sum over owners before
   the step), ``state()`` (name -> array copy), and an optimizer:
   ``engines.make_optimizer(engine, part, cfg)`` builds the engine's registered
   :class:`~fusion.executors.engines.LocalOptimizer` (``step()``,
   ``zero_grad()``, and ``state()``/``load_state()`` for checkpoints). Every engine
   implements SGD (momentum, weight decay) and AdamW with torch's formulas,
   so a mixed-engine run is one synchronous training run.
5. **Dense tensors in and out** — everything crossing the part boundary is a
   NumPy array (or anything ``np.asarray`` accepts) plus dtype and shape, so
   the wire codec never needs the framework and never pickles.

6. **Optional abilities**, declared on :class:`EnginePart` with defaults that are right for an engine
   without them, so the runtime calls them without probing: ``backward_input``/``backward_weight`` (a
   split backward for zero-bubble schedules; default: all of backward in the first, nothing in the
   second), ``forget`` (drop what forward kept for backward; default: nothing kept),
   ``codec_device`` / ``keep_tensors`` (encode compressed edges where the tensors are; default: on the
   host, in NumPy) and ``RECORDS_OUTPUTS`` (``forward`` takes ``record=``; default False).

Every engine part subclasses :class:`EnginePart` (``make_engine_part`` checks it). This module
imports neither torch nor NumPy engines.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, Mapping

import numpy as np

Key = tuple[str, "int | None"]


class EnginePart(ABC):
    """What an engine provides for one sub-DAG (arrays in, arrays out), and its optional abilities."""

    #: the engine's registered name (``"torch"``, ``"numpy"``); picks the runtime's host codecs
    engine: ClassVar[str]
    #: the option names ``make_engine_part(..., options=)`` accepts for this engine
    OPTIONS: ClassVar[tuple[str, ...]] = ()
    #: whether ``forward`` takes ``record=callable(node name, value)`` to report every node's output
    #: (the reference executor's ``forward_outputs``)
    RECORDS_OUTPUTS: ClassVar[bool] = False

    # -- what every engine implements ------------------------------------------------------
    @abstractmethod
    def forward(self, mb_key: Any, inputs: Mapping[Key, Any], feeds: Mapping[str, Any]) -> tuple[dict[Key, Any], float | None]:
        """(activations other parts need, this part's summed loss or None); keeps what backward needs under ``mb_key``."""

    @abstractmethod
    def backward(self, mb_key: Any, grads: Mapping[Key, Any], loss_scale: float = 1.0) -> dict[Key, Any]:
        """Gradients of the received activations; accumulates the parameter gradients (FusionLLM §3.3)."""

    @abstractmethod
    def trainable(self) -> Mapping[str, Any]:
        """Name -> trainable parameter (the engine's own object, which its optimizer steps)."""

    @abstractmethod
    def state(self) -> dict[str, np.ndarray]:
        """Name -> a copy of every parameter and buffer of the part."""

    @abstractmethod
    def grads(self) -> dict[str, np.ndarray | None]:
        """Name -> accumulated gradient of each trainable parameter (None: it got none)."""

    @abstractmethod
    def set_grad(self, name: str, grad: Any, owned: bool = False) -> None:
        """Replace a parameter's gradient (tied parameters: the sum over owners; data parallelism: the average).
        ``owned``: ``grad`` is a fresh array the caller drops, so the engine may keep its memory instead of a copy
        (False: it copies, since the caller may reuse ``grad`` or ``grad`` may view a received frame)."""

    # -- optional abilities, with the defaults of an engine that lacks them -----------------------
    def backward_input(self, mb_key: Any, grads: Mapping[Key, Any], loss_scale: float = 1.0) -> dict[Key, Any]:
        """The ``B`` half of a split backward: the gradients of the received activations. Default: the whole
        backward (parameter gradients included), so :meth:`backward_weight` has nothing left to do."""
        return self.backward(mb_key, grads, loss_scale)

    def backward_weight(self, mb_key: Any) -> None:
        """The ``W`` half of a split backward: accumulate micro-batch ``mb_key``'s parameter gradients.
        Default: nothing (:meth:`backward_input` did all of backward)."""

    def evaluate(self, inputs: Mapping[Key, Any], feeds: Mapping[str, Any]) -> tuple[dict[Key, Any], float | None]:
        """Forward for evaluation (``--eval-every``): as :meth:`forward`, with no autograd graph kept, nothing kept
        for a backward, every output an array, and ``model.eval()`` semantics where the engine has training modes.
        Default: :meth:`forward` under a key of its own, then :meth:`forget` of that key."""
        key = ("eval", None)
        try:
            return self.forward(key, inputs, feeds)
        finally:
            self.forget(key)

    def forget(self, mb_key: Any = None) -> None:
        """Drop what forward kept for backward: of micro-batch ``mb_key``, or of every micro-batch (None; an
        abandoned attempt after a replica was dropped). Default: nothing is kept."""

    @property
    def codec_device(self) -> Any:
        """Where this part's compressed edges are encoded: ``(device, torch codecs on a CPU device too)`` for an
        engine whose tensors live on a device (torch), else None. Default: None, every output leaves as an array
        and is encoded by the codecs' host (NumPy) paths."""
        return None

    def keep_tensors(self, sent: frozenset, grads: frozenset) -> None:
        """Return the activations ``sent`` and input gradients ``grads`` as device tensors from now on (their
        edges are encoded on :attr:`codec_device`). Default: nothing to keep (no device)."""


#: an engine part that can be trained by the executors (every one: ``trainable`` is part of :class:`EnginePart`)
TrainablePart = EnginePart

__all__ = ["EnginePart", "TrainablePart", "Key"]

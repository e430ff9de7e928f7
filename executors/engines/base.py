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
   ``set_grad(name, grad)`` (tied parameters get the sum over owners before
   the step), ``state()`` (name -> array copy), and an optimizer:
   ``engines.make_optimizer(engine, part, cfg)`` builds the engine's registered
   :class:`~fusion.executors.engines.LocalOptimizer` (``step()``,
   ``zero_grad()``, and ``state()``/``load_state()`` for checkpoints). Every engine
   implements SGD (momentum, weight decay) and AdamW with torch's formulas,
   so a mixed-engine run is one synchronous training run.
5. **Dense tensors in and out** — everything crossing the part boundary is a
   NumPy array (or anything ``np.asarray`` accepts) plus dtype and shape, so
   the wire codec never needs the framework and never pickles.

This module is documentation plus the two typing protocols; it imports
neither torch nor NumPy engines.
"""
from __future__ import annotations

from typing import Any, Mapping, Protocol

from fusion.executors.runtime.part import EnginePart

Key = tuple[str, "int | None"]


class TrainablePart(EnginePart, Protocol):
    """An ``EnginePart`` that can also be trained by the executors."""

    def trainable(self) -> Mapping[str, Any]: ...


__all__ = ["EnginePart", "TrainablePart", "Key"]

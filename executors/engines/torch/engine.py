"""The torch engine: runs one sub-DAG with torch autograd.

An engine part takes framework-neutral inputs (NumPy arrays keyed by
``(producer, index)``) and returns framework-neutral outputs, so parts on
different engines can feed each other. Inside a part, torch autograd does the
local backward; across parts, gradients arrive as arrays and are pushed into
the part's autograd graph with ``torch.autograd.backward`` (remote autodiff).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np
import torch
from torch import nn

from fusion.ir.boundary import SubGraph
from fusion.ir.errors import FusionError, GraphError
from fusion.ir.graph import OpGraph
from fusion.ir.node import NodeKind, OpNode, ParamRef, Ref, TensorMeta
from fusion.ir.torch_ops import TORCH_DTYPES, build_module, dtype_name, make_call, node_callable, on_device, set_module_tensor
from fusion.ir.walk import GraphWalk, Key
from fusion.executors.engines.base import EnginePart

log = logging.getLogger(__name__)

def to_array(t: torch.Tensor) -> np.ndarray:
    """A NumPy view (CPU) or copy (other devices) of a tensor, detached.

    Called for every parameter gradient of every step (:meth:`TorchPart.grads`), so it
    does only the work a tensor needs: ``.detach()`` only when it requires grad, ``is_cpu``
    rather than building a ``torch.device``.
    """
    if t.requires_grad:
        t = t.detach()
    if not t.is_cpu:
        t = t.cpu()
    if t.dtype is torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)  # raw bits; wire records the dtype
    return t.numpy()


def from_array(a: Any, device: torch.device | str = "cpu") -> torch.Tensor:
    if isinstance(a, torch.Tensor):
        return a.to(device)
    arr = np.asarray(a)
    if not arr.flags.writeable:
        arr = arr.copy()
    return torch.from_numpy(arr).to(device)


def from_wire(a: Any, dtype: str | None, device: torch.device | str = "cpu") -> torch.Tensor:
    """An array from the wire, a checkpoint or a feed as a tensor of the graph's ``dtype``.

    NumPy has no bfloat16, so bfloat16 tensors travel as their raw bits in uint16
    (or int16) arrays: those are viewed back, bit for bit. A float array fed to a
    placeholder of another float dtype (float32 data for a bfloat16 model) is cast
    with torch's rounding, as ``x.to(dtype)`` would.
    """
    t = from_array(a, device)
    if dtype is None or dtype_name(t.dtype) == dtype:
        return t
    want = TORCH_DTYPES.get(dtype)
    if want is torch.bfloat16 and t.dtype in (torch.uint16, torch.int16):
        return t.view(torch.bfloat16)
    if want is not None and want.is_floating_point and t.is_floating_point():
        return t.to(want)
    return t


@dataclass
class _Stash:
    """Autograd state of one in-flight micro-batch.

    With recomputation the forward ran without autograd: only the part's inputs
    (``leaves``, ``feeds``) and the RNG state are kept, and backward runs the
    forward again before it pushes gradients. ``weight`` holds what a split
    backward's weight-gradient action (``W``) still has to do.
    """

    leaves: dict[Key, torch.Tensor] = field(default_factory=dict)
    sent: dict[Key, torch.Tensor] = field(default_factory=dict)
    loss: torch.Tensor | None = None
    feeds: dict[str, Any] | None = None
    rng: tuple | None = None
    weight: Any = None


class TorchPart(EnginePart):
    """One sub-DAG on the torch engine.

    params: graph parameter name -> initial value for every parameter this
            part's nodes read. Trainable ones become ``nn.Parameter``.
    compiled: run the forward as one generated function (a ``torch.fx.GraphModule``
            of the part's nodes, :mod:`.compiled`) instead of walking the nodes in a
            Python loop; bit-identical, faster. Falls back to the loop (logged) if the
            part cannot be written as an fx graph.
    compile: additionally pass that module through ``torch.compile`` (fused kernels,
            not bit-identical; compiles on the first micro-batch).
    recompute: activation recomputation: forward without autograd keeping only the
            part's inputs, and run the forward again in backward.
    encode: where the part's compressed edges are encoded (the payload bytes are the same either way):
            ``"device"`` (default): on the part's device (:attr:`codec_device`; each codec's device path,
            ``fusion.kernels.codecs``), only payloads leave it; on a CPU device each codec's faster CPU path.
            ``"torch"``: the torch codecs even on a CPU device (the CUDA code path, run without a GPU).
            ``"host"``: the engine hands every output to the runtime as a NumPy array, which encodes it
            in NumPy (a GPU part copies every dense tensor off the device first).
    precision: ``"fp32"`` or ``"bf16"`` (``Plan.precision``): run forward (and so backward) under
            ``torch.autocast(device type, dtype=torch.bfloat16)``; parameters stay in their dtype. A sent
            activation leaves in the dtype autocast gave it (bfloat16 as bits), and a received one whose
            graph dtype is float32 but arrives as bfloat16 bits is viewed back as bfloat16, as one process
            under autocast would have it.
    """

    engine = "torch"
    #: the option names ``make_engine_part(..., options=)`` accepts for this engine
    OPTIONS = ("compiled", "compile", "recompute", "encode", "precision")
    PRECISIONS = ("fp32", "bf16")
    ENCODE = ("device", "torch", "host")
    RECORDS_OUTPUTS = True  # forward(..., record=)

    def forget(self, mb_key: Any = None) -> None:
        """Drop the stash of micro-batch ``mb_key`` (None: of every one)."""
        if mb_key is None:
            self.stash.clear()
        else:
            self.stash.pop(mb_key, None)

    def __init__(self, graph: OpGraph, sub: SubGraph, params: Mapping[str, Any], device: str | torch.device = "cpu",
                 compiled: bool = True, compile: bool = False, recompute: bool = False, encode: str = "device",
                 precision: str = "fp32"):
        self.graph = graph
        if precision not in self.PRECISIONS:
            raise FusionError(f"torch engine option precision={precision!r}: one of {', '.join(self.PRECISIONS)}")
        #: autocast to bfloat16 around every forward (``precision="bf16"``)
        self.autocast = precision == "bf16"
        self.sub = sub
        self.device = torch.device(device)
        if encode not in self.ENCODE:
            raise FusionError(f"torch engine option encode={encode!r}: one of {', '.join(self.ENCODE)}")
        self.encode = encode
        #: sent activations / input gradients returned as device tensors (their edges are encoded on the device)
        self.tensor_out: frozenset = frozenset()
        self.tensor_grads: frozenset = frozenset()
        self.params: dict[str, torch.Tensor] = {}
        for node_name in sub.nodes:
            for pname in graph[node_name].param_names():
                if pname in self.params:
                    continue
                spec = graph.params[pname]
                if pname not in params and self.device.type != "meta":
                    raise GraphError(f"no initial value for parameter {pname!r}", node_name)
                t = from_wire(params[pname], spec.dtype, self.device).clone() if self.device.type != "meta" else \
                    torch.empty(spec.shape, dtype=TORCH_DTYPES[spec.dtype], device="meta")
                if tuple(t.shape) != tuple(spec.shape):
                    raise GraphError(f"parameter {pname!r} has shape {tuple(t.shape)}, graph says {spec.shape}", node_name)
                self.params[pname] = nn.Parameter(t) if spec.trainable else t
        #: (name, parameter) of the trainable ones, built once: grads() and trainable() run every step
        self._trainable: tuple[tuple[str, nn.Parameter], ...] = tuple(
            (n, p) for n, p in self.params.items() if isinstance(p, nn.Parameter))
        self.modules: dict[str, nn.Module] = {}
        #: the part's nodes ready to run (the graph walk of :mod:`fusion.ir.walk`; builds ``modules``)
        self.walk = _TorchWalk(self)
        self.recv_keys: dict[Key, bool] = self.walk.recv_keys
        self.send_keys: list[Key] = self.walk.send_keys
        #: the graph's dtype of every received activation and fed placeholder (bfloat16 arrives as bits)
        self.dtypes: dict[Any, str | None] = self.walk.dtypes
        self.stash: dict[Any, _Stash] = {}
        self.recompute = bool(recompute)
        #: running statistics (BatchNorm) a recomputed forward must not update a second time
        self._stat_buffers = [b for m in self.modules.values() for sm in m.modules()
                              if isinstance(sm, nn.modules.batchnorm._NormBase) for b in sm.buffers()]
        self._fn: Callable[..., Any] | None = None
        self._n_sent, self._has_loss = 0, False
        if compiled or compile:
            self._build_compiled(bool(compile))

    def _build_compiled(self, use_torch_compile: bool) -> None:
        from fusion.executors.engines.torch.compiled import build_part_module

        try:
            gm, self._n_sent, self._has_loss = build_part_module(self)
        except Exception as e:  # an op fx cannot write out: the loop runs it, as before
            log.warning("torch engine: part of %d nodes runs interpreted (no fx module: %s: %s)",
                        len(self.sub.nodes), type(e).__name__, e)
            return
        self.module = gm
        # gm.forward, not gm(...): no nn.Module call wrapper (a part module has no hooks)
        self._fn = torch.compile(gm, dynamic=False) if use_torch_compile else gm.forward

    @property
    def compiled(self) -> bool:
        """Whether forwards run as one generated function."""
        return self._fn is not None

    @property
    def codec_device(self) -> tuple[torch.device, bool] | None:
        """Where this part's compressed edges are encoded: ``(device, torch codecs on a CPU device too)``, or
        None with ``encode="host"`` (every output leaves as a NumPy array, encoded in NumPy)."""
        if self.encode == "host" or self.device.type == "meta":
            return None
        return self.device, self.encode == "torch"

    def keep_tensors(self, sent: frozenset, grads: frozenset) -> None:
        """From now on return the activations ``sent`` and the input gradients ``grads`` as device tensors
        (their edges are encoded on the device: only payloads leave it), every other output as an array."""
        self.tensor_out, self.tensor_grads = frozenset(sent), frozenset(grads)
        log.info("torch engine: compressed edges encoded on %s with the %s codecs (%d activations, %d gradients); "
                 "only payloads leave the device", self.device,
                 "torch" if self.device.type != "cpu" or self.encode == "torch" else "CPU",
                 len(self.tensor_out), len(self.tensor_grads))

    def _out(self, key: Key, v: Any, keep: frozenset) -> Any:
        """What leaves the engine for tensor ``key``: the detached tensor when its edge is encoded on the
        device, else a NumPy array (non-tensor values unchanged)."""
        if not isinstance(v, torch.Tensor):
            return v
        return v.detach() if key in keep else to_array(v)

    # -- forward -----------------------------------------------------------------
    def forward(self, mb_key: Any, inputs: Mapping[Key, Any], feeds: Mapping[str, Any],
                record: Callable[[str, Any], None] | None = None) -> tuple[dict[Key, Any], float | None]:
        """Run the sub-DAG for one micro-batch.

        inputs: activations from other parts, keyed by ``(producer, index)``.
        feeds:  values of this part's input/label placeholders.
        record: called with every node's output (runs the interpreted loop).
        Returns the activations to send (arrays or values) and this part's
        loss (None when the part has no loss node).
        """
        st = _Stash()
        st.leaves = self.walk.receive(inputs)
        fed = self.walk.feed(feeds)
        if self.recompute and record is None:
            st.feeds, st.rng = fed, self._rng_state()
            with torch.no_grad():
                sent, loss = self._run(st.leaves, fed, None)
        else:
            sent, loss = st.sent, st.loss = self._run(st.leaves, fed, record)
        self.stash[mb_key] = st
        arrays = {k: self._out(k, v, self.tensor_out) for k, v in sent.items()}
        return arrays, (float(loss.detach()) if loss is not None and self.device.type != "meta" else None)

    def evaluate(self, inputs: Mapping[Key, Any], feeds: Mapping[str, Any]) -> tuple[dict[Key, Any], float | None]:
        """Forward for evaluation: under ``torch.no_grad``, every module of the part in eval mode (dropout off,
        BatchNorm on its running statistics: ``model.eval()``), nothing stashed; outputs as arrays."""
        leaves = self.walk.receive(inputs)
        fed = self.walk.feed(feeds)
        mods = [m for top in self.modules.values() for m in top.modules()]
        if getattr(self, "module", None) is not None:
            mods += list(self.module.modules())
        modes = [(m, m.training) for m in mods]
        with torch.no_grad():
            for m, _ in modes:
                m.training = False
            try:
                sent, loss = self._run(leaves, fed, None)
            finally:
                for m, t in modes:
                    m.training = t
        arrays = {k: to_array(v).copy() if isinstance(v, torch.Tensor) else v for k, v in sent.items()}
        return arrays, (float(loss) if loss is not None and self.device.type != "meta" else None)

    def _run(self, leaves: Mapping[Key, Any], fed: Mapping[str, Any],
             record: Callable[[str, Any], None] | None) -> tuple[dict[Key, Any], torch.Tensor | None]:
        """The part's forward: sent values by key and the summed loss (or None), under autocast with bf16."""
        if self.autocast and self.device.type != "meta":
            with torch.autocast(self.device.type, dtype=torch.bfloat16):
                return self._run_plain(leaves, fed, record)
        return self._run_plain(leaves, fed, record)

    def _run_plain(self, leaves: Mapping[Key, Any], fed: Mapping[str, Any],
                   record: Callable[[str, Any], None] | None) -> tuple[dict[Key, Any], torch.Tensor | None]:
        if self._fn is not None and record is None:
            outs = self._fn(*(leaves[k] for k in self.recv_keys), *fed.values())
            sent = dict(zip(self.send_keys, outs[:self._n_sent]))
            return sent, (outs[self._n_sent] if self._has_loss else None)
        sent, losses = self.walk.run(leaves, fed, record)
        return sent, (sum(losses[1:], losses[0]) if losses else None)

    def _rng_state(self) -> tuple:
        cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        return torch.get_rng_state(), cuda

    def _recompute(self, st: _Stash) -> None:
        """Run the forward of a recomputed micro-batch again, with autograd, under its RNG state."""
        saved = [b.clone() for b in self._stat_buffers]
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.set_rng_state(st.rng[0])
            if st.rng[1] is not None:
                torch.cuda.set_rng_state(st.rng[1], self.device)
            st.sent, st.loss = self._run(st.leaves, st.feeds, None)
        with torch.no_grad():
            for b, v in zip(self._stat_buffers, saved):
                b.data.copy_(v)  # .data: a running statistic is no input of the backward (no version bump)
        st.feeds = st.rng = None

    # -- backward ----------------------------------------------------------------
    def backward(self, mb_key: Any, grads: Mapping[Key, Any], loss_scale: float = 1.0) -> dict[Key, np.ndarray]:
        """Backward for one micro-batch.

        grads: gradients of this part's sent activations, already summed over
               the actual users in other parts.
        loss_scale: d(total loss)/d(this part's loss), e.g. 1/n_micro_batches.
        Returns gradients of the received activations that require grad.
        Parameter gradients accumulate in ``.grad`` across micro-batches.
        """
        st = self._pop(mb_key)
        roots, seeds = self._roots(st, grads, loss_scale)
        if roots:
            torch.autograd.backward(roots, seeds)
        return self._input_grads(st)

    def backward_input(self, mb_key: Any, grads: Mapping[Key, Any], loss_scale: float = 1.0) -> dict[Key, np.ndarray]:
        """The first half of a split backward (zero-bubble schedules' ``B``): gradients of the
        received activations only. Parameter gradients wait for :meth:`backward_weight`."""
        from fusion.executors.engines.torch.split_backward import input_grads

        st = self.stash.get(mb_key)
        if st is None or st.weight is not None:
            raise RuntimeError(f"backward of micro-batch {mb_key} before its forward (or twice); the schedule is wrong")
        roots, seeds = self._roots(st, grads, loss_scale)
        leaves = [st.leaves[k] for k, need in self.recv_keys.items()
                  if need and isinstance(st.leaves[k], torch.Tensor) and st.leaves[k].requires_grad]
        st.weight = input_grads(roots, seeds, leaves, list(self.trainable().values()))
        st.sent, st.loss = {}, None
        return self._input_grads(st)

    def backward_weight(self, mb_key: Any) -> None:
        """The second half (``W``): accumulate the parameter gradients of micro-batch ``mb_key``."""
        st = self.stash.get(mb_key)
        if st is None or st.weight is None:
            raise RuntimeError(f"weight gradient of micro-batch {mb_key} before its input gradient; the schedule is wrong")
        del self.stash[mb_key]
        st.weight()

    def _pop(self, mb_key: Any) -> _Stash:
        st = self.stash.pop(mb_key, None)
        if st is None:
            raise RuntimeError(f"backward of micro-batch {mb_key} before its forward (or twice); the schedule is wrong")
        return st

    def _roots(self, st: _Stash, grads: Mapping[Key, Any], loss_scale: float) -> tuple[list, list]:
        """The tensors backward starts from (loss, sent activations) and their seeds."""
        if st.feeds is not None:
            self._recompute(st)
        roots, seeds = [], []
        if st.loss is not None and st.loss.requires_grad:
            roots.append(st.loss)
            seeds.append(torch.full_like(st.loss, loss_scale))
        for key, g in grads.items():
            t = st.sent.get(key)
            if t is None:
                raise GraphError(f"gradient for {key} which this part did not send", key[0])
            if isinstance(t, torch.Tensor) and t.requires_grad:
                gt = from_wire(g, dtype_name(t.dtype), self.device)
                if tuple(gt.shape) != tuple(t.shape):
                    raise GraphError(f"gradient shape {tuple(gt.shape)} != activation shape {tuple(t.shape)}", key[0])
                roots.append(t)
                seeds.append(gt.to(t.dtype))
        return roots, seeds

    def _input_grads(self, st: _Stash) -> dict[Key, np.ndarray]:
        out: dict[Key, np.ndarray] = {}
        for key, needs_grad in self.recv_keys.items():
            leaf = st.leaves[key]
            if not needs_grad or not isinstance(leaf, torch.Tensor) or not leaf.requires_grad:
                continue
            g = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            out[key] = self._out(key, g, self.tensor_grads)
        return out

    # -- parameters ----------------------------------------------------------------
    def trainable(self) -> dict[str, nn.Parameter]:
        """Trainable parameters by graph name (``params`` is fixed once the part is built)."""
        return dict(self._trainable)

    def state(self) -> dict[str, np.ndarray]:
        return {n: to_array(p).copy() for n, p in self.params.items()}

    def grads(self) -> dict[str, np.ndarray | None]:
        out: dict[str, np.ndarray | None] = {}
        for n, p in self._trainable:
            g = p.grad
            out[n] = None if g is None else to_array(g)
        return out

    def set_grad(self, name: str, grad: Any, owned: bool = False) -> None:
        p = self.params[name]
        t = from_wire(grad, dtype_name(p.dtype), self.device).to(p.dtype)
        p.grad = t if owned else t.clone()  # owned: the caller's fresh array becomes the gradient, no copy


class _TorchWalk(GraphWalk):
    """The graph walk (:class:`fusion.ir.walk.GraphWalk`) of a torch part: a node calls its torch op, or
    the part's own ``nn.Module`` built here from the node (with the part's parameters, on its device);
    parameters, fed values and received activations are the part's tensors on its device."""

    def __init__(self, part: TorchPart):
        self.part, self.device = part, part.device
        super().__init__(part.graph, part.sub)
        g = part.graph
        #: the graph's dtype of every received activation and fed placeholder (bfloat16 arrives as bits)
        self.dtypes: dict[Any, str | None] = {k: getattr(g.output_meta(*k), "dtype", None) for k in self.recv_keys}
        self.dtypes.update({n: getattr(g.output_meta(n, None), "dtype", None) for n in self.placeholders})

    def call(self, node: OpNode) -> Callable[..., Any] | None:
        part = self.part
        call, obj = node_callable(node)
        if call == "module":
            mod = build_module(node, obj)
            for path, pname in node.params.items():
                set_module_tensor(mod, path, part.params[pname], part.graph.params[pname].trainable)
            leftovers = [n for n, t in list(mod.named_parameters()) + list(mod.named_buffers()) if t.device.type == "meta"]
            if leftovers and part.device.type != "meta":
                raise GraphError(f"module tensors {leftovers} have no graph parameter (node.params is incomplete)", node.name)
            mod.to(part.device) if part.device.type != "meta" else None
            part.modules[node.name] = mod
            return make_call(call, obj, mod)
        if call == "method" and self._tensor_arg(node):
            return getattr(torch.Tensor, obj)  # the receiver is a tensor: call the unbound method, no wrapper
        if call in ("function", "method"):
            return make_call(call, obj, None)
        return None  # the output marker: its argument passes through

    def _tensor_arg(self, node: OpNode) -> bool:
        """Whether shape inference says the node's first argument is a tensor."""
        a = node.args[0] if node.args else None
        if isinstance(a, ParamRef):
            return True
        if not isinstance(a, Ref) or a.node not in self.graph.nodes:
            return False
        outs = self.graph[a.node].meta.outputs
        i = a.index or 0
        return i < len(outs) and isinstance(outs[i], TensorMeta) and (a.index is not None or len(outs) == 1)

    def param(self, name: str) -> torch.Tensor:
        return self.part.params[name]

    def literals(self, node: OpNode) -> tuple[tuple, dict]:
        return on_device(node.args, self.part.device), on_device(dict(node.kwargs), self.part.device)

    def fetch_placeholder(self, name: str, value: Any) -> torch.Tensor:
        return from_wire(value, self.dtypes[name], self.device)

    def fetch_received(self, key: Key, value: Any, needs_grad: bool) -> Any:
        if isinstance(value, (np.ndarray, torch.Tensor)):
            dtype = self.dtypes[key]
            bits = value.dtype == np.uint16 if isinstance(value, np.ndarray) else value.dtype in (torch.uint16, torch.bfloat16)
            if self.part.autocast and bits and dtype in ("float32", "float64"):
                dtype = "bfloat16"  # autocast made it bfloat16 in the producer: it stays so, as in one process
            value = from_wire(value, dtype, self.device)
            if needs_grad and value.is_floating_point():
                value = value.detach().requires_grad_(True)
        return value

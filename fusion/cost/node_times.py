"""Measured per-node seconds (forward and backward) on a real device: what FLOPs / lambda cannot see.

FLOPs divided by one fitted speed price every operator at the speed of the profiler's forward Linear layers,
but a backward's weight-gradient GEMM whose inner dimension is a micro-batch of 16 rows runs far below it
(issue 17). :func:`measure_node_times` times each distinct node signature (same target, attributes,
argument shapes and literals cost the same, as in :mod:`fusion.cost.flops`) on real tensors of the graph's
recorded micro-batch shapes, on a torch device with a given number of threads:

- forward: the node's call on fresh inputs (float inputs random normal; integer and bool inputs 0, a
  valid index and label for any table or class count), its parameters random normal (std 0.02) on
  the device;
- backward: ``torch.autograd.backward`` from the node's outputs with random output gradients, in training
  conditions: the parameters' ``.grad`` already allocated (the warm-up made them), so they accumulate as
  they do from a pipeline's second micro-batch on; the inputs are fresh leaves every time, as a part's
  received activations are;
- cold weights, warm activations, when the model's parameters and their gradients together exceed half of
  ``flush_bytes`` (default 64 MiB, twice this host's 32 MiB L3; ``cold=True``/``False`` forces it): before
  each timed forward and each timed backward a buffer of ``flush_bytes`` is read, then the call's inputs
  (forward) or output gradients (backward) are read back, so the node's parameters and gradients come from
  memory as they do in a part whose other nodes evict them between one use and the next, while what the
  previous node just produced is in cache (timed on the 2-core EPYC host, one 1024 x 1024 Linear on 16
  rows: backward 1.6 ms with its weights in cache, 2.2 ms cold, ~2.1 ms inside a 2-block MLP). A smaller
  model stays in cache in a part too, and is timed warm;
- after ``warmup`` calls the node runs ``repeats`` times (warm caches: ``repeats`` x k times, k calls lasting
  ``min_round_s``), each call timed on its own with Python's garbage collector off; a node's forward and
  backward times are the medians over those calls (other work on a shared host preempts some calls and
  only adds time).

Each node's backward is its own ``torch.autograd.backward`` call, which costs a fixed ~15 us (engine start,
timed on the 2-core host) that a part pays once for all its nodes: :func:`backward_call_s` fits it from
chains of 1 and 16 tiny multiplications (``t = c + k u``) and it is taken off every node's backward
(``NodeTimes.backward_call_s`` records it).
A measured time contains the node's fixed cost (Python, dispatch, autograd bookkeeping), so the estimator
adds no ``node_overhead_s`` for a timed node (:meth:`fusion.cost.estimate.CostModel.use_node_times`).
A node that cannot run on the device is left out (logged) and keeps its FLOP price.

:class:`NodeTimes` is the table ``fusion profile --model`` writes and ``fusion compile --node-times``
reads: JSON, validated on load, tied to the model by a digest of its node names and signatures.
"""
from __future__ import annotations

import gc
import hashlib
import json
import logging
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from fusion.cost.flops import _TORCH_DTYPES, _is_param, _meta_key, _signature, node_inputs
from fusion.ir.errors import FusionError
from fusion.ir.graph import OpGraph
from fusion.ir.node import IDLE_KINDS, OpNode, ValueMeta

log = logging.getLogger(__name__)

#: the ``format`` field of a node-times file
FORMAT = "fusion.node_times/1"


@dataclass(frozen=True)
class NodeTime:
    """Seconds of one node for one micro-batch: ``fwd_s`` its forward, ``bwd_s`` its backward (0 when no
    gradient flows through it)."""

    fwd_s: float
    bwd_s: float


@dataclass
class NodeTimes:
    """A measured per-node time table.

    digest:      :func:`graph_digest` of the model it was measured on (node names and signatures, so the
                 micro-batch shapes too); a table is refused for any other graph.
    device:      torch device timed (``cpu``, ``cuda:0``, ...).
    threads:     torch CPU threads while timing (None: left as torch had it).
    backward_call_s: the fixed seconds of one ``torch.autograd.backward`` call, taken off each node's
                 backward (:func:`backward_call_s`; informative).
    speed_flops: S = lambda * S* of the profiling host in FLOP/s: the estimator scales a node's time to a
                 device of speed S_d by ``speed_flops / S_d`` (the same speed: factor 1).
    nodes:       node name -> :class:`NodeTime`, every op node that ran (placeholders and outputs run
                 nothing and are absent; a node that failed to run is absent and priced by FLOPs).
    """

    digest: str
    device: str
    threads: int | None
    speed_flops: float
    nodes: dict[str, NodeTime] = field(default_factory=dict)
    backward_call_s: float = 0.0
    source: str = field(default="node times", compare=False)  # the file it was read from, for error messages

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "digest": self.digest, "device": self.device, "threads": self.threads,
                "speed_flops": self.speed_flops, "backward_call_s": self.backward_call_s,
                "nodes": {n: {"fwd_s": t.fwd_s, "bwd_s": t.bwd_s} for n, t in self.nodes.items()}}

    @classmethod
    def from_dict(cls, d: Any, source: str = "node times") -> "NodeTimes":
        """Validate and build; FusionError naming ``source`` and the bad field otherwise."""

        def bad(fld: str, why: str) -> FusionError:
            return FusionError(f"{source}: field {fld}: {why}")

        if not isinstance(d, dict):
            raise bad("(top level)", f"expected a JSON object, got {type(d).__name__}")
        if d.get("format") != FORMAT:
            raise bad("format", f"expected {FORMAT!r}, got {d.get('format')!r} (write it with `fusion profile --model`)")
        for k in ("digest", "device"):
            if not isinstance(d.get(k), str) or not d[k]:
                raise bad(k, f"expected a non-empty string, got {d.get(k)!r}")
        threads = d.get("threads")
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise bad("threads", f"expected an integer >= 1 or null, got {threads!r}")
        speed = d.get("speed_flops")
        if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not math.isfinite(speed) or speed <= 0:
            raise bad("speed_flops", f"expected a FLOP/s figure > 0, got {speed!r}")
        call = d.get("backward_call_s", 0.0)
        if isinstance(call, bool) or not isinstance(call, (int, float)) or not math.isfinite(call) or call < 0:
            raise bad("backward_call_s", f"expected seconds >= 0, got {call!r}")
        raw = d.get("nodes")
        if not isinstance(raw, dict):
            raise bad("nodes", f"expected an object of node name -> {{fwd_s, bwd_s}}, got {type(raw).__name__}")
        nodes = {}
        for name, t in raw.items():
            if not isinstance(t, dict):
                raise bad(f"nodes.{name}", f"expected {{fwd_s, bwd_s}}, got {t!r}")
            vals = []
            for k in ("fwd_s", "bwd_s"):
                v = t.get(k)
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                    raise bad(f"nodes.{name}.{k}", f"expected seconds >= 0, got {v!r}")
                vals.append(float(v))
            nodes[name] = NodeTime(*vals)
        return cls(d["digest"], d["device"], threads, float(speed), nodes, float(call), source)

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.to_dict(), indent=1))
        return p

    @classmethod
    def load(cls, path: str | Path) -> "NodeTimes":
        """Read a table; FusionError naming the file (and field) when it is missing or malformed."""
        p = Path(path)
        try:
            text = p.read_text()
        except OSError as e:
            raise FusionError(f"{p}: cannot read the node-times file ({e.strerror or e})") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise FusionError(f"{p}: not JSON (line {e.lineno}: {e.msg}); write it with `fusion profile --model`") from None
        return cls.from_dict(data, str(p))

    def check(self, graph: OpGraph, source: str = "node times") -> None:
        """Refuse a table measured on another model (or other micro-batch shapes)."""
        mine = graph_digest(graph)
        if self.digest != mine:
            raise FusionError(f"{source}: field digest: the table was measured on another model or other micro-batch "
                              f"shapes ({self.digest[:12]}) than the one being compiled ({mine[:12]}); measure this one "
                              "with `fusion profile --model MODEL -o FILE`")
        unknown = [n for n in self.nodes if n not in graph.nodes]
        if unknown:  # a digest collision is not expected; a hand-edited file is
            raise FusionError(f"{source}: field nodes.{unknown[0]}: the model has no such node")

    def apply(self, cm, source: str | None = None) -> int:
        """Check the table against ``cm.graph`` and make ``cm`` (a :class:`fusion.cost.estimate.CostModel`)
        price the timed nodes by it. Returns the number of nodes priced by time."""
        self.check(cm.graph, source or self.source)
        fwd, bwd, timed = self.arrays(cm.names)
        cm.use_node_times(fwd, bwd, timed, self.speed_flops)
        return int(sum(timed))

    def summary(self) -> dict[str, Any]:
        """What a plan records of the table it was priced with (``plan.predicted["node_times"]``)."""
        return {"digest": self.digest, "device": self.device, "threads": self.threads, "speed_flops": self.speed_flops,
                "timed_nodes": len(self.nodes), "fwd_s": sum(t.fwd_s for t in self.nodes.values()),
                "bwd_s": sum(t.bwd_s for t in self.nodes.values())}

    def arrays(self, names: list[str]) -> tuple[list[float], list[float], list[bool]]:
        """(fwd_s, bwd_s, timed) per name in ``names`` (0, 0, False where the table has no time)."""
        got = [self.nodes.get(n) for n in names]
        return ([t.fwd_s if t else 0.0 for t in got], [t.bwd_s if t else 0.0 for t in got], [t is not None for t in got])


def graph_digest(graph: OpGraph) -> str:
    """sha256 of every node's name, cost signature (:func:`fusion.cost.flops._signature`) and output shapes."""
    h = hashlib.sha256()
    for node in graph.nodes.values():
        outs = tuple(_meta_key(o) for o in node.meta.outputs)
        h.update(repr((node.name, _signature(graph, node), outs)).encode())
    return h.hexdigest()


def measure_node_times(graph: OpGraph, device: str = "cpu", threads: int | None = None, *, speed_flops: float,
                       warmup: int = 3, repeats: int = 9, min_round_s: float = 2e-3,
                       flush_bytes: int = 64 * 2**20, cold: bool | None = None,
                       progress: bool = True) -> NodeTimes:
    """Time every op node of ``graph`` (one run per distinct signature) on ``device``; see the module doc.

    speed_flops: the profiling host's fitted speed S (FLOP/s) recorded with the table.
    Raises FusionError for a device torch does not have or a graph without shape metadata.
    """
    from tqdm import tqdm

    try:
        dev = torch.device(device)
        torch.empty(1, device=dev)
    except (RuntimeError, AssertionError) as e:
        raise FusionError(f"--device {device}: torch cannot use it ({e})") from None
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    state = 2 * sum(p.nbytes for p in graph.params.values() if p.trainable)
    if cold is None:
        cold = state > flush_bytes / 2
    log.info("timing with %s caches (parameters + gradients %.1f MB)", "cold" if cold else "warm", state / 1e6)
    flush = torch.ones(max(int(flush_bytes) // 4, 0) if cold else 0, dtype=torch.float32, device=dev)
    cache: dict[str, NodeTime | None] = {}
    nodes: dict[str, NodeTime] = {}
    call_s = 0.0
    todo = [n for n in graph.nodes.values() if n.kind not in IDLE_KINDS]
    try:
        gen = torch.Generator().manual_seed(0)
        call_s = backward_call_s(dev)
        for node in tqdm(todo, desc="node times", unit="node", disable=None if progress else True, leave=False):
            key = _signature(graph, node)
            if key not in cache:
                try:
                    t = _time_node(graph, node, dev, gen, warmup, repeats, min_round_s, flush)
                    cache[key] = NodeTime(t.fwd_s, max(t.bwd_s - call_s, 0.0) if t.bwd_s > 0 else 0.0)
                except Exception as e:  # an op that cannot run on this device: priced by FLOPs instead
                    log.warning("node %r (%s): cannot time it on %s (%s: %s); the estimator prices it by FLOPs",
                                node.name, node.target, device, type(e).__name__, e)
                    cache[key] = None
            if cache[key] is not None:
                nodes[node.name] = cache[key]
    finally:
        torch.set_num_threads(before)
    log.info("timed %d of %d op nodes (%d distinct signatures) on %s", len(nodes), len(todo), len(cache), device)
    return NodeTimes(graph_digest(graph), str(dev), threads, float(speed_flops), nodes, call_s)


def backward_call_s(dev: torch.device, reps: int = 300) -> float:
    """Fixed seconds of one ``torch.autograd.backward`` call on ``dev``: medians of backward through chains of
    1 and 16 multiplications of a 1-element tensor, ``c = t_1 - (t_16 - t_1) / 15`` (0 if noise makes it
    negative)."""
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    x, g = torch.ones(1, device=dev), torch.ones(1, device=dev)

    def timed(k: int) -> float:
        ts = []
        for _ in range(reps):
            y = x.detach().requires_grad_(True)
            for _ in range(k):
                y = y * 1.0
            sync()
            t0 = time.perf_counter()
            torch.autograd.backward([y], [g])
            sync()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    gc_was = gc.isenabled()
    gc.disable()
    try:
        timed(1)
        t1, t16 = timed(1), timed(16)
    finally:
        if gc_was:
            gc.enable()
    return max(t1 - (t16 - t1) / 15, 0.0)


def _real(meta: Any, dev: torch.device, gen: torch.Generator) -> Any:
    """A tensor of ``meta``'s shape and dtype on ``dev``: random normal floats, zeros otherwise."""
    if isinstance(meta, ValueMeta):
        return meta.value
    dt = _TORCH_DTYPES[meta.dtype]
    if dt.is_floating_point or dt.is_complex:
        return torch.randn(meta.shape, generator=gen, dtype=dt).to(dev)
    return torch.zeros(meta.shape, dtype=dt, device=dev)


def _init(t: torch.Tensor, gen: torch.Generator, buffer: bool) -> None:
    with torch.no_grad():
        if not t.is_floating_point():
            t.zero_()
        elif buffer:
            t.fill_(1.0)  # a running variance must stay positive
        else:
            t.copy_(torch.randn(t.shape, generator=gen, dtype=t.dtype) * 0.02)


def _time_node(graph: OpGraph, node: OpNode, dev: torch.device, gen: torch.Generator, warmup: int, repeats: int,
               min_round_s: float, flush: torch.Tensor) -> NodeTime:
    from fusion.ir.torch_ops import build_module, make_call, node_callable, on_device

    call, obj = node_callable(node)
    module = None
    params: dict[str, torch.Tensor] = {}
    if call == "module":
        module = build_module(node, obj).to_empty(device=dev)
        for path, gname in node.params.items():
            is_p = _is_param(module, path)
            t = module.get_parameter(path) if is_p else module.get_buffer(path)
            _init(t, gen, buffer=not is_p)
            t.requires_grad_(graph.params[gname].trainable and t.is_floating_point())
            params[gname] = t
    fn = make_call(call, obj, module)

    needs: set[int] = set()  # ids of the input tensors a gradient flows back to (fresh leaves every call)

    def real(meta):
        t = _real(meta, dev, gen)
        if isinstance(t, torch.Tensor) and meta.requires_grad and t.is_floating_point():
            needs.add(id(t))
        return t

    def param(spec):
        t = _real(spec, dev, gen)
        return torch.nn.Parameter(t * 0.02, requires_grad=spec.trainable) if t.is_floating_point() else t

    args, kwargs = on_device(node_inputs(graph, node, params, real, param), dev)
    flat_in, spec_in = tree_flatten((args, kwargs))
    grad_in = [id(x) in needs for x in flat_in]
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    out_grads: list[torch.Tensor] | None = None

    def evict(hot: list) -> None:
        """Caches cold, then the tensors ``hot`` read back in (what the previous node just produced)."""
        if flush.numel():
            flush.sum()  # reads only: no dirty lines left to write back during the timed call
            for t in hot:
                if isinstance(t, torch.Tensor) and t.numel():
                    t.detach().sum()
        sync()

    def once() -> tuple[float, float]:
        nonlocal out_grads
        leaves = [x.detach().requires_grad_(True) if g else x for x, g in zip(flat_in, grad_in)]
        a, k = spec_in.unflatten(leaves)
        evict(leaves)
        t0 = time.perf_counter()
        out = fn(*a, **k)
        sync()
        t1 = time.perf_counter()
        roots = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if not roots:
            return t1 - t0, 0.0
        if out_grads is None:
            out_grads = [torch.ones_like(t) if t.dim() == 0 else torch.randn(t.shape, generator=gen, dtype=t.dtype).to(dev)
                         for t in roots]
        evict(out_grads)
        t2 = time.perf_counter()
        torch.autograd.backward(roots, out_grads)
        sync()
        return t1 - t0, time.perf_counter() - t2

    gc_was = gc.isenabled()
    gc.disable()  # a collection inside a timed call is not the node's cost (timeit does the same)
    try:
        for _ in range(max(warmup, 1)):  # the first backward allocates the parameters' .grad
            once()
        one = sum(once())
        k = 1 if flush.numel() else max(1, min(1000, math.ceil(min_round_s / max(one, 1e-7))))
        fwd, bwd = [], []
        for _ in range(max(repeats, 1) * k):
            df, db = once()
            fwd.append(df)
            bwd.append(db)
    finally:
        if gc_was:
            gc.enable()
    return NodeTime(statistics.median(fwd), statistics.median(bwd))


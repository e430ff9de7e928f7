"""Fit lambda_p for this host from a short warm-up (FusionLLM §3.5).

The actual speed of a device is ``S(p) = lambda_p * S*(p)``. We time a set of
forward + backward steps of Linear layers of growing size (FLOPs counted by
``FlopCounterMode``, so the workload is priced exactly as the estimator prices
a model), then fit by least squares ``t = t0 + FLOPs / S`` and report
``lambda = S / S*``. ``t0`` absorbs the per-call overhead; R^2 says how well a
single speed explains the timings.

FLOPs do not price the fixed work around each op (Python, dispatch, autograd
bookkeeping), which dominates a part of many small ops. Two more fits price
it for the estimator (:mod:`fusion.cost.estimate`):

- ``node_overhead_s``: chains of ``k`` tiny ops (LayerNorm, Linear, GELU,
  residual add on a 4 x 8 tensor, so their FLOPs are negligible) run forward
  and backward as the torch engine runs a part, one generated
  ``torch.fx.GraphModule`` call (compiled parts, the default) or a Python
  loop over the nodes (``--interpreted-parts``); least squares
  ``t = c0 + k * node_overhead_s`` over several k.
- ``message_overhead_s``: CPU seconds to move one small activation message
  as the runtime does (msgpack header + raw array frame over a ZeroMQ
  loopback socket, decoded back into an array), sender and receiver
  together, from the slope of time against the number of messages.

Three more price the iteration's work outside the pipeline (``T_step`` of
:mod:`fusion.cost.estimate`):

- ``step_overhead_s``, ``feed_overhead_s``, ``feed_byte_s``: the coordinator's
  round trip as the runtime makes it (micro-batches sliced from the batch, a
  ``step`` control message with one frame per fed array encoded and decoded
  by the wire format the runtime uses, :mod:`fusion.ir.wire`, over a ZeroMQ
  loopback socket, a ``done`` message with the executor's stats back),
  least squares ``t = o_step + k o_feed + B o_byte`` over
  messages of k arrays and B bytes in all.
- ``optimizer_byte_s``: torch's SGD, SGD with momentum and AdamW stepping
  parameters of several total sizes (``zero_grad`` included: gradients set to
  None, as the runtime does), the slope of time against parameter bytes, one
  per optimizer.

And what the codecs cost here: ``codec_costs``, encode + decode per message and
per byte through each codec's host path (:mod:`fusion.cost.codec_costs`).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)


@dataclass
class Profile:
    """Fitted speed of this host.

    device:         torch device the warm-up ran on.
    peak_flops:     S*(p) the fit is relative to.
    fitted_flops:   S(p) = 1 / slope of time against FLOPs.
    lam:            lambda_p = S(p) / S*(p).
    overhead_s:     t0, the intercept.
    r2:             coefficient of determination of the fit.
    samples:        (FLOPs, seconds) per timed workload.
    node_overhead_s: seconds per op node per micro-batch (forward + backward) of a compiled part
                    (0 when not measured).
    node_overhead_interpreted_s: the same for a part run by the interpreted loop.
    message_overhead_s: CPU seconds per message sent or received (0 when not measured).
    step_overhead_s: seconds of one empty coordinator round trip (step out, done back).
    feed_overhead_s: seconds per fed array in the step message.
    feed_byte_s:    seconds per fed byte.
    optimizer_byte_s: seconds per trainable parameter byte of one optimizer step, per
                    :data:`fusion.cluster.model.OPTIMIZER_KINDS` (SGD, SGD with momentum, AdamW).
    codec_costs:    ``(codec key, seconds per message, seconds per dense byte)`` of encode + decode through
                    each codec's host path (:mod:`fusion.cost.codec_costs`).
    """

    device: str
    peak_flops: float
    fitted_flops: float
    lam: float
    overhead_s: float
    r2: float
    samples: list[tuple[float, float]]
    node_overhead_s: float = 0.0
    node_overhead_interpreted_s: float = 0.0
    message_overhead_s: float = 0.0
    step_overhead_s: float = 0.0
    feed_overhead_s: float = 0.0
    feed_byte_s: float = 0.0
    optimizer_byte_s: tuple[float, float, float] = (0.0, 0.0, 0.0)
    codec_costs: tuple[tuple[str, float, float], ...] = ()

    def to_dict(self) -> dict:
        return {"device": self.device, "peak_flops": self.peak_flops, "fitted_flops": self.fitted_flops,
                "lambda": self.lam, "overhead_s": self.overhead_s, "r2": self.r2,
                "node_overhead_s": self.node_overhead_s,
                "node_overhead_interpreted_s": self.node_overhead_interpreted_s,
                "message_overhead_s": self.message_overhead_s,
                "step_overhead_s": self.step_overhead_s, "feed_overhead_s": self.feed_overhead_s,
                "feed_byte_s": self.feed_byte_s,
                "optimizer_byte_s": dict(zip(("sgd", "sgd_momentum", "adamw"), self.optimizer_byte_s)),
                "codec_costs": {k: {"message_s": m, "byte_s": b} for k, m, b in self.codec_costs},
                "samples": [[f, t] for f, t in self.samples]}


def fit_speed(samples: list[tuple[float, float]]) -> tuple[float, float, float]:
    """Least squares ``t = t0 + F / S``: returns (S, t0, R^2)."""
    f = np.array([s[0] for s in samples], dtype=float)
    t = np.array([s[1] for s in samples], dtype=float)
    if len(f) < 2 or np.ptp(f) == 0:
        raise ValueError("need at least two workloads of different FLOPs to fit a speed")
    slope, t0 = np.polyfit(f, t, 1)
    if slope <= 0:
        raise ValueError("timings do not grow with FLOPs; the host is too noisy to fit lambda")
    pred = t0 + slope * f
    ss_res = float(np.sum((t - pred) ** 2))
    ss_tot = float(np.sum((t - t.mean()) ** 2))
    return 1.0 / slope, float(t0), 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0


def fit_per_unit(samples: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares ``t = c0 + k * c`` over (k, seconds): returns (c, c0); ``c`` is clipped at 0
    (a host too noisy to see the per-unit cost prices it at nothing rather than negatively)."""
    k = np.array([s[0] for s in samples], dtype=float)
    t = np.array([s[1] for s in samples], dtype=float)
    if len(k) < 2 or np.ptp(k) == 0:
        raise ValueError("need timings at two or more different counts to fit a per-unit overhead")
    slope, c0 = np.polyfit(k, t, 1)
    return max(float(slope), 0.0), float(c0)


def _best_times(steps: list, repeats: int, min_time: float, sync=None) -> list[float]:
    """Fastest run of each step, round-robin, at least ``repeats`` rounds and ``min_time`` seconds."""
    best = [float("inf")] * len(steps)
    spent, rounds = 0.0, 0
    while rounds < repeats or spent < min_time:
        for i, step in enumerate(steps):
            if sync:
                sync()
            t = time.perf_counter()
            step()
            if sync:
                sync()
            el = time.perf_counter() - t
            best[i] = min(best[i], el)
            spent += el
        rounds += 1
    return best


def chain_ops(k: int, width: int = 8, device: str = "cpu"):
    """``k`` tiny op nodes cycling LayerNorm, Linear, GELU, residual add: (modules, program) where
    program[i] = (callable, argument indices into the values so far; value 0 is the input)."""
    import torch
    from torch import nn

    mods, prog = nn.ModuleList(), []
    for i in range(k):
        kind = i % 4
        if kind == 0:
            m = nn.LayerNorm(width, device=device)
            mods.append(m)
            prog.append((m, (i,)))
        elif kind == 1:
            m = nn.Linear(width, width, device=device)
            mods.append(m)
            prog.append((m, (i,)))
        elif kind == 2:
            prog.append((torch.nn.functional.gelu, (i,)))
        else:
            prog.append((torch.add, (i, max(i - 3, 0))))
    return mods, prog


def _chain_module(k: int, width: int, device: str):
    """A ``torch.fx.GraphModule`` of a k-node chain, written node by node as the engine writes a part."""
    import torch
    from torch import fx

    mods, prog = chain_ops(k, width, device)
    root = torch.nn.Module()
    g = fx.Graph()
    vals = [g.placeholder("x")]
    j = 0
    for fn, args in prog:
        if isinstance(fn, torch.nn.Module):
            name = f"m{j}"
            root.add_module(name, fn)
            j += 1
            vals.append(g.call_module(name, tuple(vals[a] for a in args)))
        else:
            vals.append(g.call_function(fn, tuple(vals[a] for a in args)))
    g.output(vals[-1])
    return fx.GraphModule(root, g)


def _chain_loop(k: int, width: int, device: str):
    """The same chain run by a Python loop that resolves each node's arguments (the interpreted path)."""
    _, prog = chain_ops(k, width, device)

    def run(x):
        env = [x]
        for fn, args in prog:
            env.append(fn(*[env[a] for a in args]))
        return env[-1]
    return run


def profile_node_overhead(device: str = "cpu", lengths: tuple[int, ...] = (8, 32, 64, 128), width: int = 8,
                          rows: int = 4, repeats: int = 5, min_time: float = 0.3, compiled: bool = True) -> float:
    """Seconds per op node per micro-batch, forward + backward (see the module docstring)."""
    import torch

    dev = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else None
    steps = []
    for k in lengths:
        fn = _chain_module(k, width, device).forward if compiled else _chain_loop(k, width, device)
        x = torch.randn(rows, width, device=dev, requires_grad=True)
        steps.append(lambda fn=fn, x=x: fn(x).sum().backward())
    best = _best_times(steps, repeats, min_time, sync)
    for k, t in zip(lengths, best):
        log.info("profile %s chain of %d nodes: %.3g s", "compiled" if compiled else "interpreted", k, t)
    return fit_per_unit(list(zip(lengths, best)))[0]


def profile_message_overhead(counts: tuple[int, ...] = (20, 80, 160), nbytes: int = 256, repeats: int = 3,
                             min_time: float = 0.2) -> float:
    """CPU seconds per small message, sender and receiver together (see the module docstring)."""
    import msgpack
    import zmq

    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    try:
        for s in (pull, push):
            s.setsockopt(zmq.LINGER, 0)
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        push.connect(f"tcp://127.0.0.1:{port}")
        arr = np.zeros(nbytes // 4, dtype=np.float32)
        if not pull.poll(0):  # make sure the connection is up before timing
            push.send_multipart([msgpack.packb({"warm": 1}), b""])
            if not pull.poll(5000):
                raise ValueError("message overhead: the loopback socket did not connect in 5 s")
            pull.recv_multipart()

        def burst(n: int) -> None:
            for m in range(n):
                head = msgpack.packb({"name": "h", "index": 0, "mb": m, "dtype": "float32", "shape": list(arr.shape)})
                push.send_multipart([head, memoryview(arr)], copy=False)
            for _ in range(n):
                h, body = pull.recv_multipart(copy=False)
                meta = msgpack.unpackb(h.bytes)
                np.frombuffer(body.buffer, dtype=meta["dtype"]).reshape(meta["shape"]).copy()

        steps = [lambda n=n: burst(n) for n in counts]
        best = _best_times(steps, repeats, min_time)
    finally:
        push.close()
        pull.close()
        ctx.term()
    return fit_per_unit(list(zip(counts, best)))[0]


def fit_step(samples: list[tuple[int, int, float]]) -> tuple[float, float, float]:
    """Least squares ``t = o_step + k o_feed + B o_byte`` over (k arrays, B bytes, seconds): returns
    (o_step, o_feed, o_byte), each clipped at 0 (noise priced at nothing rather than negatively)."""
    a = np.array([[1.0, k, b] for k, b, _ in samples], dtype=float)
    t = np.array([s[2] for s in samples], dtype=float)
    if len(samples) < 3 or np.linalg.matrix_rank(a) < 3:
        raise ValueError("need round trips of at least three independent (arrays, bytes) shapes to fit the step cost")
    coef = np.linalg.lstsq(a, t, rcond=None)[0]
    return tuple(max(float(c), 0.0) for c in coef)  # type: ignore[return-value]


#: (arrays, bytes per array) of the timed step round trips: 1-64 micro-batches, 1 KiB-256 KiB each
STEP_SHAPES = ((1, 1024), (1, 262144), (16, 1024), (16, 65536), (64, 1024), (64, 16384))


def profile_step_overhead(shapes: tuple[tuple[int, int], ...] = STEP_SHAPES, repeats: int = 3,
                          min_time: float = 0.3) -> tuple[float, float, float]:
    """(step_overhead_s, feed_overhead_s, feed_byte_s): see the module docstring."""
    import msgpack
    import zmq

    from fusion.ir.wire import decode, encode

    ctx = zmq.Context()
    socks = {k: ctx.socket(t) for k, t in (("out", zmq.PUSH), ("in", zmq.PULL), ("back", zmq.PUSH), ("home", zmq.PULL))}
    try:
        for sk in socks.values():
            sk.setsockopt(zmq.LINGER, 0)
        port = socks["in"].bind_to_random_port("tcp://127.0.0.1")
        socks["out"].connect(f"tcp://127.0.0.1:{port}")
        port = socks["home"].bind_to_random_port("tcp://127.0.0.1")
        socks["back"].connect(f"tcp://127.0.0.1:{port}")
        for a, b in (("out", "in"), ("back", "home")):  # the connections are up before timing
            socks[a].send_multipart([msgpack.packb({"warm": 1})])
            if not socks[b].poll(5000):
                raise ValueError("step overhead: the loopback socket did not connect in 5 s")
            socks[b].recv_multipart()

        def round_trip(batch: np.ndarray, k: int) -> None:
            mbs = np.split(batch, k)  # the coordinator's split into micro-batches, then its step message
            arrays = {f"{m}/x": a for m, a in enumerate(mbs)}
            socks["out"].send_multipart(encode("ctrl", {"op": "step", "names": list(arrays), "it": 0, "want_grads": False,
                                                        "checkpoint": False, "save_step": 1}, list(arrays.values())),
                                        copy=False)
            msg = decode(socks["in"].recv_multipart(copy=False))  # the part decodes it and keeps its feeds
            feeds = [{} for _ in range(k)]
            for name, arr in zip(msg.header["names"], msg.arrays):
                mb, _, ph = name.partition("/")
                feeds[int(mb)][ph] = arr
            stats = {"forward_s": [0.0] * k, "backward_s": [0.0] * k, "idle_s": 0.0, "sync_s": 0.0,
                     "optimizer_s": 0.0, "t_start": 0.0, "t_end": 0.0, "sent": {}}
            socks["back"].send_multipart(encode("ctrl", {"op": "done", "names": [], "it": 0,
                                                         "losses": [[m, 0.0] for m in range(k)], "stats": stats}),
                                         copy=False)
            decode(socks["home"].recv_multipart(copy=False))

        steps = []
        for k, nbytes in shapes:
            batch = np.zeros((k, max(nbytes // 4, 1)), dtype=np.float32)
            steps.append(lambda batch=batch, k=k: round_trip(batch, k))
        best = _best_times(steps, repeats, min_time)
    finally:
        for sk in socks.values():
            sk.close()
        ctx.term()
    for (k, nbytes), t in zip(shapes, best):
        log.info("profile step round trip, %d arrays of %d bytes: %.3g s", k, nbytes, t)
    return fit_step([(k, k * nbytes, t) for (k, nbytes), t in zip(shapes, best)])


def profile_optimizer(device: str = "cpu", sizes_mb: tuple[int, ...] = (2, 8, 16), repeats: int = 3,
                      min_time: float = 0.2) -> tuple[float, float, float]:
    """Seconds per trainable parameter byte of one step of torch's SGD, SGD with momentum and AdamW
    (the order of :data:`fusion.cluster.model.OPTIMIZER_KINDS`), each the slope over ``sizes_mb`` MB
    of float32 parameters in 1 MiB tensors."""
    import torch

    dev = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else None
    out = []
    for make in (lambda ps: torch.optim.SGD(ps, lr=1e-3), lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9),
                 lambda ps: torch.optim.AdamW(ps, lr=1e-3)):
        steps, nbytes = [], []
        for mb in sizes_mb:
            params = [torch.zeros(1 << 18, device=dev, requires_grad=True) for _ in range(mb)]
            grads = [torch.randn(1 << 18, device=dev) for _ in params]
            opt = make(params)

            def step(opt=opt, params=params, grads=grads) -> None:
                for p, g in zip(params, grads):  # the backward's gradients, then the runtime's step + zero_grad
                    p.grad = g
                opt.step()
                opt.zero_grad(set_to_none=True)
            step()  # optimizer state allocated outside the timing
            steps.append(step)
            nbytes.append(mb * (1 << 20))
        best = _best_times(steps, repeats, min_time, sync)
        out.append(fit_per_unit(list(zip(nbytes, best)))[0])
    log.info("profile optimizer step: %s s per parameter byte (sgd, sgd with momentum, adamw)",
             ", ".join(f"{v:.3g}" for v in out))
    return tuple(out)  # type: ignore[return-value]


def profile_host(peak_flops: float, device: str = "cpu", sizes: tuple[int, ...] = (256, 512, 768, 1024),
                 batch: int = 64, repeats: int = 5, dtype: str = "float32", min_time: float = 0.5,
                 threads: int | None = None, overheads: bool = True) -> Profile:
    """Time fwd+bwd of ``Linear(n, n)`` on a (batch, n) input for each n; fit lambda against ``peak_flops``.

    The workloads run round-robin, at least ``repeats`` rounds and at least
    ``min_time`` seconds in all; each keeps its fastest run (on a shared host
    the minimum is the least disturbed measurement, and round-robin spreads a
    disturbed moment over all sizes). ``threads`` sets torch's CPU threads
    for the measurement (None: leave as is). ``overheads``: also fit the
    per-node (compiled and interpreted) and per-message overheads.
    """
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    if not peak_flops > 0:
        raise ValueError(f"peak_flops must be > 0, got {peak_flops}")
    dt = getattr(torch, dtype)
    dev = torch.device(device)
    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        steps, flops = [], []
        for n in sizes:
            layer = torch.nn.Linear(n, n, device=dev, dtype=dt)
            x = torch.randn(batch, n, device=dev, dtype=dt, requires_grad=True)
            step = (lambda layer=layer, x=x: layer(x).sum().backward())
            with FlopCounterMode(display=False) as fc:
                step()
            steps.append(step)
            flops.append(float(fc.get_total_flops()))
        best = _best_times(steps, repeats, min_time, (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else None)
        node = node_i = msg = 0.0
        step: tuple[float, float, float] = (0.0, 0.0, 0.0)
        opt: tuple[float, float, float] = (0.0, 0.0, 0.0)
        codecs: tuple = ()
        if overheads:
            node = profile_node_overhead(device, compiled=True)
            node_i = profile_node_overhead(device, compiled=False)
            msg = profile_message_overhead()
            step = profile_step_overhead()
            opt = profile_optimizer(device)
            from fusion.cost.codec_costs import profile_codecs

            codecs = profile_codecs()
    finally:
        torch.set_num_threads(old_threads)
    samples = list(zip(flops, best))
    for n, (f, t) in zip(sizes, samples):
        log.info("profile n=%d: %.3g FLOP in %.3g s", n, f, t)
    speed, t0, r2 = fit_speed(samples)
    log.info("profile overheads: %.3g s per node compiled, %.3g s interpreted, %.3g s per message", node, node_i, msg)
    log.info("profile step: %.3g s per round trip, %.3g s per fed array, %.3g s per fed byte", *step)
    return Profile(str(dev), float(peak_flops), speed, speed / peak_flops, t0, r2, samples, node, node_i, msg,
                   *step, opt, codecs)

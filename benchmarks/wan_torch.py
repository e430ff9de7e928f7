"""The PyTorch baseline of the WAN comparison (issue 29): what a PyTorch user runs instead of fusion.

``torch.distributed.pipelining`` over gloo: the GPT of :mod:`wan_model` (the convergence study's, same init, same
batches, same AdamW as fusion gets from ``wan_model.gpt_setup``) cut into ``--world`` equal stages, one process
per stage, no compression. One rank per process::

    python benchmarks/wan_torch.py --rank R --world W --master ADDR:PORT --steps N --seed S --micro-batches M \\
        --batch B --eval-every E --eval-batches K --model small|tiny --out FILE.json [--lr LR] [--schedule auto] \\
        [--precision fp32|bf16] [--replicas R]

Rank 0 (the first stage) listens at ``ADDR:PORT`` (``init_method tcp://``); gloo binds every rank to the interface
whose address routes to ``ADDR`` (``GLOO_SOCKET_IFNAME``, unless set), so it runs from network namespaces.

The split: the GPT's 2 x n_layer residual sub-blocks (attention, MLP) in ``W`` equal contiguous groups (``W`` must
divide 2 x n_layer); the first stage also holds the embeddings, the last the final LayerNorm, the head and the loss.
The head's weight is tied to the token embedding: the first and the last stage each hold a copy and, after every
backward, add their gradients (an all-reduce between the two, Megatron's way), so both copies take the same AdamW
step and the run trains what the single-process GPT trains. Every micro-batch's loss is its mean cross-entropy and
the schedule divides the gradients by the micro-batches (``scale_grads``): the gradient of the whole batch's mean.
``PipelineStage`` gets the stages' input and output shapes (static metadata: no pickled shape exchange).

``--replicas R`` (DP x PP, issue 36's row): the ``--world`` ranks are R pipelines of ``W = world / R`` stages,
rank ``r`` is stage ``r % W`` of replica ``r // W`` (a replica's ranks are consecutive, so started site after
site each pipeline stays inside its site). Each step's ``B`` rows are split into R equal shares (replica k takes
the k-th, as fusion's ``--replicas`` does) of ``M / R`` micro-batches each, and after the backward each stage's
replicas average their gradients (one flat all-reduce over the stage's data-parallel group: what DDP does with a
single bucket, and this model's gradients fit DDP's first 25 MB bucket, which it reduces once the backward is
over), so every step trains on the whole batch's mean gradient, as one process would. ``--dp-wire bf16`` does
what DDP's ``bf16_compress_hook`` does instead: divide by R, all-reduce in bfloat16 (half the bytes), back to
float32. Losses and validation losses are the mean over the replicas (each evaluates its share of every held-out
batch).

Schedule: ``--schedule auto`` (default) times ``ScheduleGPipe``, ``Schedule1F1B`` and ``ScheduleInterleaved1F1B``
(two stages per rank, the model cut into 2 x W stages, stage s on rank s mod W), each where torch and the split
allow it (1F1B: at least as many micro-batches as stages; interleaved: 2 x W dividing the sub-blocks), on step 0's
batch (two rounds, each schedule's faster one; no optimizer step) and keeps the fastest (rank 0 decides). The probe
is not in ``wall_s`` (its seconds are ``probe_s``); every schedule's step-0 loss and squared gradient norm are in
``probe`` (they must agree).

Rank 0 writes ``--out`` (JSON)::

    {"samples_per_s": B x steps / train_s, "wall_s": seconds from the first step to the end of the last evaluation,
     "train_s": wall_s less the evaluations, "eval_s": the evaluations,
     "val": [[step, wall_s, loss], ...], "losses": [training loss per step], "schedule": "gpipe"|"1f1b"|"interleaved1f1b",
     "stages": W, "model": ..., "seed": S, "batch": B, "micro_batches": M, "lr": ..., "precision": ..., "probe_s": ...,
     "probe": {schedule: {"s": seconds, "loss": step 0's loss, "grad_sq": its squared gradient norm}}}

``wall_s`` excludes process start-up (imports, the process group, building the stages, the schedule probe) and
counts the evaluations; ``samples_per_s`` counts training steps only. A validation loss is the mean of ``K``
held-out batches (``wan_model.WanSetup.val_batch``), forward only through the pipeline (``schedule.eval``), after
every ``E``-th step and after the last (``E`` = 0: only after the last); its ``wall_s`` is when the last stage's
loss reached rank 0.
"""
from __future__ import annotations

import argparse
import fcntl
import json
import logging
import os
import socket
import struct
import sys
import time
from datetime import timedelta
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_pipeline import TORCH_SCHEDULES, torch_pipeline_step  # noqa: E402

log = logging.getLogger("wan_torch")
#: the schedules ``--schedule auto`` chooses between; name -> stages per rank (bench_pipeline.TORCH_SCHEDULES)
CANDIDATES = {"gpipe": 1, "1f1b": 1, "interleaved1f1b": 2}


class UsageError(Exception):
    """Bad input: one line, exit status 2."""


# -- the stages -------------------------------------------------------------------------------------------

def units(gpt) -> list:
    """The GPT's residual sub-blocks in order: attention and MLP of every block (``x + f(ln(x))``)."""
    from torch import nn

    class Residual(nn.Module):
        def __init__(self, ln, f):
            super().__init__()
            self.ln, self.f = ln, f

        def forward(self, x):
            return x + self.f(self.ln(x))

    out = []
    for block in gpt.transformer.h:
        out += [Residual(block.ln_1, block.attn), Residual(block.ln_2, block.mlp)]
    return out


def build_stage(gpt, subs: list, stage: int, stages: int, head_weight=None, bf16: bool = False):
    """Stage ``stage`` of ``stages`` as an ``nn.Module`` over the modules of ``gpt`` (``subs``: its
    :func:`units`): embeddings (first), its share of the sub-blocks, final LayerNorm and head (last; its weight
    ``head_weight``, the copy of the tied embedding the last rank holds, when the first stage is on another rank).

    ``bf16`` (``--precision bf16``, torch's best wire): the stage runs under ``torch.autocast`` (bfloat16) and
    sends bfloat16: its output is cast to bfloat16 before it leaves (half the bytes, and the gradient coming back
    is bfloat16 too), the next stage casts it back to float32 for its residual stream; the last stage's logits
    leave as float32 for the loss. Parameters and AdamW's state stay float32, as under fusion's
    ``--precision bf16``. (What a PyTorch user does to halve the pipeline's wire; fusion's cuts carry whatever
    dtype autocast gave the tensor, float32 for a residual sum, and its codecs do the rest.)"""
    import contextlib

    import torch
    from torch import nn

    per = len(subs) // stages
    first, last = stage == 0, stage == stages - 1
    cfg = gpt.cfg

    class Stage(nn.Module):
        def __init__(self):
            super().__init__()
            if first:
                self.wte, self.wpe = gpt.transformer.wte, gpt.transformer.wpe
            self.blocks = nn.ModuleList(subs[stage * per:(stage + 1) * per])
            if last:
                self.ln_f = gpt.transformer.ln_f
                self.lm_head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
                self.lm_head.weight = gpt.lm_head.weight if first else head_weight

        def forward(self, x):
            cast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
            with cast:
                if first:
                    x = self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device))
                elif bf16:
                    x = x.float()
                for b in self.blocks:
                    x = b(x)
                if last:
                    return self.lm_head(self.ln_f(x)).float()
            return x.to(torch.bfloat16) if bf16 else x

    return Stage()


def loss_fn(logits, targets):
    """A micro-batch's mean cross-entropy (the GPT's own loss)."""
    import torch.nn.functional as F

    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def stage_shapes(setup, stage: int, stages: int, bf16: bool = False):
    """(input, output) example tensors of one micro-batch of ``stage``: static metadata for ``PipelineStage``
    (``bf16``: the activations between stages are bfloat16, :func:`build_stage`)."""
    import torch

    mb, t, c = setup.micro_batch, setup.config.seq_len, setup.config
    wire = torch.bfloat16 if bf16 else torch.float32
    x = (torch.zeros(mb, t, dtype=torch.int64) if stage == 0
         else torch.zeros(mb, t, c.d_model, dtype=wire, requires_grad=True))
    last = stage == stages - 1
    y = torch.zeros(mb, t, c.vocab if last else c.d_model, dtype=torch.float32 if last else wire, requires_grad=True)
    return x, y  # requires_grad: the activations between stages carry gradients back


# -- gloo's interface ----------------------------------------------------------------------------------------

def interface_for(addr: str) -> str | None:
    """The name of the local interface whose address routes to ``addr`` (None when none is found)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((addr, 9))  # UDP: no packet is sent, the kernel only picks the route
        local = s.getsockname()[0]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                req = struct.pack("256s", name.encode()[:15])
                got = fcntl.ioctl(s.fileno(), 0x8915, req)  # SIOCGIFADDR
            except OSError:
                continue
            if socket.inet_ntoa(got[20:24]) == local:
                return name
    return None


def parse_master(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"--master {text!r}: expected ADDR:PORT with a port 1-65535")
    try:
        return socket.gethostbyname(host), int(port)
    except OSError:
        raise UsageError(f"--master {text!r}: cannot resolve {host!r}") from None


# -- the run -------------------------------------------------------------------------------------------------

class Pipeline:
    """This rank's stage, its schedule(s), the optimizer and the tied-weight group."""

    def __init__(self, args, setup):
        import torch
        from torch.distributed import pipelining as tp

        self.args, self.setup = args, setup
        r, R = args.rank, args.replicas
        w = args.world // R  # stages of one replica
        self.stage, self.replica, self.stages = r % w, r // w, w
        self.first, self.last = self.stage == 0, self.stage == w - 1
        groups = process_groups(args.world, R)
        self.pipe_group = groups["pipe"][self.replica]
        self.tied_group = groups["tied"][self.replica]  # the tied weight's two copies: first and last stage
        self.dp_group = groups["dp"][self.stage]  # this stage's replicas (None: one replica)
        micro = setup.micro_batches // R
        gpt = setup.module()
        subs = units(gpt)
        # the tied embedding: rank 0 holds the GPT's own, the last rank a copy (the same values) for the head
        self.tied = gpt.transformer.wte.weight if self.first else (
            torch.nn.Parameter(gpt.lm_head.weight.detach().clone()) if self.last else None)
        self.schedules, self.modules = {}, {}
        for name in candidates(args.schedule, micro, w, len(subs)):
            total = w * CANDIDATES[name]  # stage s on rank s % W, as torch places interleaved stages
            bf16 = args.precision == "bf16"
            own = range(self.stage, total, w)
            mods = [build_stage(gpt, subs, s, total, self.tied, bf16) for s in own]
            stages = [tp.PipelineStage(m, s, total, torch.device("cpu"), group=self.pipe_group,
                                       **dict(zip(("input_args", "output_args"), stage_shapes(setup, s, total, bf16))))
                      for m, s in zip(mods, own)]
            cls = getattr(tp, TORCH_SCHEDULES[name][0])
            self.schedules[name] = cls(stages if len(stages) > 1 else stages[0], micro, loss_fn=loss_fn)
            self.modules[name] = mods  # every schedule's stages hold the same parameters (gpt's, and the copy)
        self.opt = None  # AdamW over the chosen schedule's parameters (use())

    def params(self, schedule: str) -> list:
        """This rank's parameters under ``schedule`` (interleaved stages put other sub-blocks on a rank)."""
        return list({id(p): p for m in self.modules[schedule] for p in m.parameters()}.values())

    def use(self, schedule: str) -> None:
        """Train with ``schedule`` from now on: AdamW over its parameters on this rank."""
        import torch

        s = self.setup
        self.opt = torch.optim.AdamW(self.params(schedule), lr=s.lr, betas=s.betas, eps=s.eps,
                                     weight_decay=s.weight_decay)

    def _run(self, schedule: str, batch: dict, train: bool) -> float | None:
        """One forward (+ backward) of ``batch`` through the pipeline; the mean micro-batch loss on the last rank."""
        import torch

        rows = len(batch["idx"]) // self.args.replicas  # this replica's share of the rows
        share = slice(self.replica * rows, (self.replica + 1) * rows)
        return torch_pipeline_step(self.schedules[schedule], self.stage, self.stages,
                                   torch.from_numpy(batch["idx"][share]), torch.from_numpy(batch["targets"][share]),
                                   train)

    def replica_mean(self, value: float | None) -> float:
        """The mean over the replicas of a loss their last stages hold (None elsewhere); every rank gets it."""
        import torch
        import torch.distributed as dist

        t = torch.tensor([value if self.last else 0.0], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t[0]) / self.args.replicas

    def train_step(self, schedule: str, batch: dict, update: bool = True) -> float | None:
        """Forward and backward of ``batch``, the tied gradients added, the replicas' gradients averaged, then
        (``update``) AdamW's step."""
        import torch
        import torch.distributed as dist

        for p in self.params(schedule):
            p.grad = None
        loss = self._run(schedule, batch, train=True)
        if self.tied is not None:
            dist.all_reduce(self.tied.grad, group=self.tied_group)
        if self.dp_group is not None:  # DDP's arithmetic: the replicas' mean gradient, one flat buffer
            from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

            grads = [p.grad for p in self.params(schedule)]
            flat = _flatten_dense_tensors(grads)
            if self.args.dp_wire == "bf16":  # DDP's bf16_compress_hook: divide, all-reduce in bfloat16, back
                wire = flat.div_(self.args.replicas).to(torch.bfloat16)
                dist.all_reduce(wire, group=self.dp_group)
                flat.copy_(wire)
            else:
                dist.all_reduce(flat, group=self.dp_group)
                flat /= self.args.replicas
            for g, v in zip(grads, _unflatten_dense_tensors(flat, grads)):
                g.copy_(v)
        if update:
            self.opt.step()
        return loss

    def grad_sq(self, schedule: str) -> float:
        """Sum of squared gradients over one replica's parameters (the tied weight on both of its ranks; after
        the data-parallel average every replica holds the same gradients)."""
        import torch
        import torch.distributed as dist

        t = torch.tensor([sum(float((p.grad.double() ** 2).sum()) for p in self.params(schedule))],
                         dtype=torch.float64)
        dist.all_reduce(t)
        return float(t[0]) / self.args.replicas

    def evaluate(self, schedule: str) -> float:
        """Mean held-out loss over ``--eval-batches`` batches, forward only; every rank gets it (from the last)."""
        import torch
        import torch.distributed as dist

        with torch.no_grad():
            vals = [self._run(schedule, self.setup.val_batch(k), train=False) for k in range(self.args.eval_batches)]
        return self.replica_mean(sum(vals) / len(vals) if self.last else None)


def process_groups(world: int, replicas: int) -> dict:
    """Every rank's groups, made in the same order on every rank (``new_group`` is collective): ``pipe`` per
    replica (its stages; None with one replica: the world), ``tied`` per replica (its first and last stage, which
    add the tied weight's gradients; None where that is the world) and ``dp`` per stage (its replicas; None with
    one replica)."""
    import torch.distributed as dist

    w = world // replicas
    reps = [list(range(k * w, (k + 1) * w)) for k in range(replicas)]
    solo = replicas == 1
    return {"pipe": [None if solo else dist.new_group(r) for r in reps],
            "tied": [None if solo and w == 2 else dist.new_group([r[0], r[-1]]) for r in reps],
            "dp": [None if solo else dist.new_group(list(range(s, world, w))) for s in range(w)]}


def choose_schedule(pipe: Pipeline) -> tuple[str, dict, float]:
    """(schedule, probe, probe seconds): each candidate's faster of two steps on step 0's batch, timed on rank 0
    (whose backward ends last) and decided there; no optimizer step. ``probe``: name -> {"s": seconds, "loss":
    step 0's loss, "grad_sq": :meth:`Pipeline.grad_sq`} (every schedule must compute the same)."""
    import torch
    import torch.distributed as dist

    names = list(pipe.schedules)
    t0 = time.perf_counter()
    probe: dict = {}
    if len(names) > 1:
        batch = pipe.setup.train_batch(0)
        for _ in range(2):
            for n in names:
                dist.barrier()
                t = time.perf_counter()
                loss = pipe.train_step(n, batch, update=False)
                dt = time.perf_counter() - t
                probe[n] = {"s": min(dt, probe.get(n, {}).get("s", dt)), "loss": pipe.replica_mean(loss),
                            "grad_sq": pipe.grad_sq(n)}
                for p in pipe.params(n):
                    p.grad = None
    best = torch.tensor([min(range(len(names)), key=lambda i: probe.get(names[i], {}).get("s", 0.0))],
                        dtype=torch.int64)
    dist.broadcast(best, src=0)  # rank 0's choice for every rank
    return names[int(best[0])], probe, time.perf_counter() - t0


def refusal(schedule: str, micro_batches: int, world: int, subs: int) -> str | None:
    """Why ``schedule`` cannot run ``subs`` sub-blocks on ``world`` ranks with ``micro_batches`` (None: it can)."""
    total = world * CANDIDATES[schedule]
    if subs % total:
        return (f"the GPT's {subs} sub-blocks (attention and MLP of {subs // 2} layers) do not split into {total} "
                f"equal stages ({CANDIDATES[schedule]} per rank)")
    if schedule == "1f1b" and micro_batches < world:
        return f"torch's 1F1B needs at least as many micro-batches as stages ({micro_batches} < {world})"
    if schedule == "interleaved1f1b" and micro_batches % max(1, micro_batches // world):
        return f"torch's interleaved 1F1B needs micro-batches in equal rounds of {world}"
    return None


def candidates(schedule: str, micro_batches: int, world: int, subs: int) -> tuple[str, ...]:
    """The schedules to build: ``schedule``, or with ``auto`` those of :data:`CANDIDATES` that this split allows
    (GPipe always: ``--world`` must divide the sub-blocks)."""
    if subs % world:
        raise UsageError(f"--world {world}: the GPT's {subs} sub-blocks (attention and MLP of {subs // 2} layers) "
                         f"do not split into {world} equal stages")
    if schedule != "auto":
        why = refusal(schedule, micro_batches, world, subs)
        if why:
            raise UsageError(f"--schedule {schedule}: {why}")
        return (schedule,)
    return tuple(n for n in CANDIDATES if refusal(n, micro_batches, world, subs) is None)


def run(args) -> dict | None:
    import torch
    import torch.distributed as dist

    from wan_model import gpt_setup

    torch.manual_seed(args.seed)
    try:
        setup = gpt_setup(args.model, args.seed, args.batch, args.micro_batches, args.lr)
    except ValueError as e:
        raise UsageError(f"wan_torch.py: {e}") from None
    # a split or schedule that cannot run: said before the group forms (2 residual sub-blocks per layer, units())
    candidates(args.schedule, args.micro_batches // args.replicas, args.world // args.replicas,
               2 * setup.config.n_layer)
    addr, port = parse_master(args.master)
    if "GLOO_SOCKET_IFNAME" not in os.environ:
        iface = interface_for(addr)
        if iface:
            os.environ["GLOO_SOCKET_IFNAME"] = iface  # this process's own gloo device; read by init below
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=args.rank, world_size=args.world,
                            timeout=timedelta(seconds=args.timeout))
    try:
        pipe = Pipeline(args, setup)
        schedule, probe, probe_s = choose_schedule(pipe)
        pipe.use(schedule)
        log.info("rank %d: schedule %s (probe %s)", args.rank, schedule, probe)
        losses, val = [], []
        eval_s = 0.0
        dist.barrier()
        t0 = time.perf_counter()
        for step in range(args.steps):
            loss = pipe.train_step(schedule, setup.train_batch(step))
            losses.append(loss)
            if (args.eval_every and (step + 1) % args.eval_every == 0) or step + 1 == args.steps:
                te = time.perf_counter()
                v = pipe.evaluate(schedule)
                now = time.perf_counter()
                eval_s += now - te
                val.append([step + 1, now - t0, v])
        wall = time.perf_counter() - t0
        # the training losses live on the last rank
        lt = torch.tensor([x if x is not None else 0.0 for x in losses], dtype=torch.float64)
        dist.all_reduce(lt)  # only the replicas' last stages hold losses: their sum
        lt /= args.replicas
        dist.barrier()  # no rank tears down (rank 0 holds the TCP store) while another still uses the group
    finally:
        dist.destroy_process_group()
    if args.rank != 0:
        return None
    train_s = wall - eval_s
    return {"samples_per_s": args.batch * args.steps / train_s, "wall_s": wall, "train_s": train_s, "eval_s": eval_s,
            "val": val, "losses": lt.tolist(), "schedule": schedule, "stages": args.world // args.replicas,
            "replicas": args.replicas, "dp_wire": args.dp_wire, "model": args.model,
            "seed": args.seed, "batch": args.batch, "micro_batches": args.micro_batches, "lr": setup.lr, "precision": args.precision,
            "probe_s": probe_s, "probe": probe,
            "notes": "wall_s: first step to the end of the last evaluation (evaluations counted, start-up and "
                     "schedule probe not); samples_per_s: training steps only"}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, required=True, help="this process's rank = its stage (0: the first)")
    ap.add_argument("--world", type=int, required=True, help="processes = stages x replicas")
    ap.add_argument("--replicas", type=int, default=1,
                    help="data-parallel pipelines (DP x PP): the ranks' R pipelines of world/R stages each, gradients "
                         "averaged across them every step (default 1)")
    ap.add_argument("--dp-wire", choices=("fp32", "bf16"), default="fp32",
                    help="with --replicas: the gradient all-reduce's dtype; bf16 is DDP's bf16_compress_hook (half "
                         "the bytes, lossy; default fp32, exact)")
    ap.add_argument("--master", required=True, metavar="ADDR:PORT", help="rank 0's address for the process group")
    ap.add_argument("--steps", type=int, required=True, help="training steps")
    ap.add_argument("--seed", type=int, default=0, help="initialisation and data seed (wan_model.gpt_setup)")
    ap.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step")
    ap.add_argument("--batch", type=int, default=32, help="rows per step (all micro-batches)")
    ap.add_argument("--eval-every", type=int, default=0, help="validation loss every E steps (0: at the end only)")
    ap.add_argument("--eval-batches", type=int, default=4, help="held-out batches per validation loss")
    ap.add_argument("--model", default="small", help="small (the convergence study's GPT) or tiny (tests)")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                    help="bf16: every stage under torch.autocast (bfloat16), bfloat16 activations between stages "
                         "(torch's best wire); parameters and AdamW state stay float32")
    ap.add_argument("--lr", type=float, default=None, help="AdamW learning rate (default: the convergence study's)")
    ap.add_argument("--schedule", default="auto", choices=["auto", *CANDIDATES],
                    help="auto: time GPipe, 1F1B and interleaved 1F1B (where they apply) on step 0's batch and "
                         "keep the fastest")
    ap.add_argument("--timeout", type=float, default=300.0, help="give up on a silent peer after this long (s)")
    ap.add_argument("--out", required=True, help="JSON written by rank 0")
    return ap


def check(args) -> None:
    if args.replicas < 1 or args.world % args.replicas:
        raise UsageError(f"--replicas {args.replicas}: expected a divisor of --world {args.world}")
    if args.world // args.replicas < 2:
        raise UsageError(f"--world {args.world}: a pipeline needs at least 2 stages"
                         + (f" per replica ({args.replicas} replicas)" if args.replicas > 1 else ""))
    if args.micro_batches % args.replicas:
        raise UsageError(f"--micro-batches {args.micro_batches}: does not split over {args.replicas} replicas")
    if not 0 <= args.rank < args.world:
        raise UsageError(f"--rank {args.rank}: expected 0..{args.world - 1} (--world {args.world})")
    for name in ("steps", "eval_batches", "micro_batches", "batch"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be at least 1")
    if args.eval_every < 0:
        raise UsageError(f"--eval-every {args.eval_every}: must be 0 or more")
    if not args.timeout > 0:
        raise UsageError(f"--timeout {args.timeout}: must be positive")


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parser().parse_args(argv)
    try:
        check(args)
        import torch

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        out = run(args)
    except UsageError as e:
        print(f"wan_torch.py: {e}" if not str(e).startswith("wan_torch.py") else str(e), file=sys.stderr)
        return 2
    if out is not None:
        Path(args.out).write_text(json.dumps(out) + "\n")
        log.info("wrote %s: %.1f samples/s, %s, final validation loss %.4f", args.out, out["samples_per_s"],
                 out["schedule"], out["val"][-1][2])
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # past here only interpreter teardown runs; c10d/gloo threads still joinable at that point abort the process
    # ("terminate called without an active exception", SIGABRT after the result was written: seen once in CI)
    os._exit(code)

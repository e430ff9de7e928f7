"""The options tree of every ``fusion`` command: one dataclass per command whose fields are its own options
(positional arguments first) and its sections (:func:`section`), and :data:`COMMANDS`, the registry the parser
and ``fusion/cli.py`` read. ``check()`` of a command runs its sections' checks and those that span sections,
once, before the command does any work."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fusion.options.compile import CompileJob, CompileOptions
from fusion.options.field import Section, option
from fusion.options.joins import check_join_options
from fusion.options.launch import Listen, LocalLaunch, Security
from fusion.options.train import DataOptions, TrainOptions
from fusion.options.types import non_negative_seconds
from fusion.options.types import positive_float, zmq_address


def section(cls: type[Section]) -> Any:
    """A field of a command that is a whole section of options."""
    return dataclasses.field(default_factory=cls, metadata={"section": cls})


@dataclass
class Graph:
    model: str = option(help="file.py:function")
    output: str | None = option("-o", "--output", help="also save the graph as JSON here")

    def check(self) -> None:
        pass


@dataclass
class Compile:
    model: str = option(help="file.py:function")
    cluster: str = option("--cluster", required=True, help="cluster file (.yaml or scenario .json)")
    output: str = option("-o", "--output", "--out", required=True, metavar="PLAN", help="plan folder to write (a new or empty folder, or with --force a plan to replace)")
    force: bool = option("--force", kind="flag", help="replace the plan already in -o PLAN")
    compile: CompileOptions = section(CompileOptions)

    def check(self) -> None:
        self.compile.check()  # bad --lr, --compress-ratio or --engine: one line before anything is traced

    def job(self) -> CompileJob:
        return CompileJob(self.model, self.cluster, self.compile)


@dataclass
class Inspect:
    plan: str = option(help="plan directory (or its plan.json)")
    png: str | None = option("--png", help="where to write the picture (default: PLAN/plan.png)")
    no_png: bool = option("--no-png", kind="flag", help="only print the table")

    def check(self) -> None:
        pass


@dataclass
class Profile:
    model: str | None = option("--model", metavar="MODEL", help="file.py:function (as `fusion compile` takes it): measure its per-node forward and backward seconds and write them to -o (the host speed S recorded with them is --cluster/--name's device speed lambda x peak_flops when given, else fitted here with --batch)")
    peak_flops: str | None = option("--peak-flops", help="S*, the peak FLOP/s to compare against (e.g. '50 GFLOPS'); default: the --name device's peak_flops")
    device: str = option("--device", default="cpu", help="torch device to time")
    sizes: str = option("--sizes", default="256,512,768,1024", help="Linear widths to time (comma-separated)")
    batch: int = option("--batch", default=64, type=int, help="rows per timed Linear step")
    repeats: int = option("--repeats", default=5, type=int, help="at least this many timed rounds")
    threads: int | None = option("--threads", type=int, help="torch CPU threads while timing (default: unchanged)")
    interpreted_parts: bool = option("--interpreted-parts", kind="flag", help="store the per-node overhead of parts run node by node (for plans run with 'fusion executor --interpreted-parts'); default: compiled parts")
    no_overheads: bool = option("--no-overheads", kind="flag", help="fit lambda only; -o leaves the fitted fixed costs (node_overhead_s, ...) as they are")
    cluster: str | None = option("--cluster", help="cluster file whose device gets the fitted lambda")
    name: str | None = option("--name", help="device name in --cluster")
    output: str | None = option("-o", "--output", help="where to write the updated cluster (.yaml or .json), or with --model the node-times table (.json)")

    def check(self) -> None:
        pass


def _check_restarts(max_restarts: int, checkpoint_every: int) -> None:
    """--max-restarts resumes from checkpoints: one line when there are none."""
    from fusion.ir.errors import FusionError

    if max_restarts and not checkpoint_every:
        raise FusionError(f"--max-restarts {max_restarts} needs --checkpoint-every N: a restarted run resumes "
                          "from its latest complete checkpoint")


def _check_resume(train: TrainOptions, out: str | None) -> None:
    from fusion.ir.errors import FusionError

    if train.resume and not out:
        raise FusionError("--resume continues the run in --out RUN: name it")


@dataclass
class Run:
    target: str = option(metavar="MODEL|PLAN", help="file.py:function or a plan directory")
    cluster: str | None = option("--cluster", essential=True, help="cluster file (needed to compile a MODEL)")
    out: str | None = option("--out", essential=True, metavar="RUN", help="run folder (default: runs/<model or plan>-<time>)")
    config: str | None = option("--config", essential=True, metavar="FILE.yaml", help="options from a YAML file (option: value, MODEL|PLAN as target:); the command line overrides them (fusion.options.config; see docs/training.md)")
    launch: LocalLaunch = section(LocalLaunch)
    train: TrainOptions = section(TrainOptions)
    data: DataOptions = section(DataOptions)
    compile: CompileOptions = section(CompileOptions)

    @property
    def is_plan(self) -> bool:
        """The target is a plan folder (or its plan.json), not a MODEL to compile."""
        return Path(self.target).is_dir() or Path(self.target).name == "plan.json"

    def check(self) -> None:
        """Every option check of ``fusion run``, before anything is traced, compiled or started."""
        from fusion.ir.errors import FusionError

        self.data.check()  # a missing data file is said now, not after the compile
        if not self.is_plan:
            self.compile.check()  # its option values, before torch is imported or the model traced
            check_warmup_steps(self.compile.dp_sync, self.compile.sync_warmup, self.train.steps)
        _check_restarts(self.launch.max_restarts, self.train.checkpoint_every)
        if self.launch.ray and self.train.join_at:
            raise FusionError("--join-at with --ray is not built: a late replica's executors start on this host only")
        self.launch.check()
        self.train.check()
        _check_resume(self.train, self.out)
        if self.train.join_at and not self.is_plan:  # what the options say already (the plan is checked later)
            check_join_options(self.compile.replicas, self.compile.dp_sync, [r for _, r in self.train.join_at])

    def job(self) -> CompileJob:
        """The compile of a MODEL target (the run's --steps and --data are read by the compile)."""
        return CompileJob(self.target, self.cluster, self.compile, steps=self.train.steps, data=self.data.data)


@dataclass
class Export:
    run_dir: str = option(metavar="RUN", help="a run folder (fusion run --out)")
    output: str = option("-o", "--output", required=True, metavar="OUT", help="safetensors file to write")
    model: str | None = option("--model", metavar="FILE.py:FUNCTION", help="the model the run trained (default: the MODEL of RUN's run.json; needed for a run of a plan)")
    weights: str | None = option("--weights", metavar="FILE", help="the weights to export (default: RUN/final.safetensors)")
    force: bool = option("--force", kind="flag", help="replace OUT if it exists")

    def check(self) -> None:
        pass


@dataclass
class Executor:
    plan: str = option(help="plan directory (plan.json + weights.safetensors)")
    node: str = option("--node", required=True, metavar="PART[,PART...]", help="the part (CompNode) to run: part0, part1, ...; under an interleaved schedule, all parts of one device, comma-separated (`fusion inspect PLAN` lists them), run in this one process")
    coordinator: str = option("--coordinator", required=True, type=zmq_address, metavar="ADDR", help="the coordinator's address, tcp://HOST:PORT, e.g. tcp://10.0.0.1:5600")
    bind: str | None = option("--bind", essential=True, type=zmq_address, metavar="ADDR", help="address to listen on (default: the plan's address for this part, on that address only; tcp://127.0.0.1:* picks a free loopback port, tcp://*:PORT listens on every interface)")
    advertise: str | None = option("--advertise", type=zmq_address, metavar="ADDR", help="address peers connect to (default: the plan's address, else the bound one)")
    dial_out: str | None = option("--dial-out", type=zmq_address, metavar="RELAY_ADDR", help="behind NAT: make only outbound connections; peers and the coordinator reach this CompNode through `fusion relay` at RELAY_ADDR, sealed end to end (needs --key; docs/security.md)")
    device: str = option("--device", essential=True, default="cpu", help="torch device of this CompNode's engine (cpu, cuda, cuda:0, ...)")
    threads: int | None = option("--threads", type=int, help="intra-op threads of the engine (default: OMP_NUM_THREADS where the environment sets it; else the host's cores shared among the plan's CompNode processes whose address names this part's host; torch's own default when the plan has no addresses)")
    startup_timeout: float = option("--startup-timeout", default=120.0, type=positive_float, help="give up when the coordinator has not answered after this long (s)")
    peer_timeout: float = option("--peer-timeout", default=10.0, type=positive_float, help="once in touch, give up when the coordinator is silent this long (s)")
    data_timeout: float = option("--data-timeout", default=300.0, type=positive_float, help="longest wait for one action's inputs (s)")
    max_message_bytes: int | None = option("--max-message-bytes", type=int, help="reject larger messages (default: the largest tensor the plan sends this part, x4, at least 8 MiB)")
    trace: str | None = option("--trace", metavar="FILE", help="write a Chrome trace (JSON) here at exit (several parts: one file per part, comma-separated, or one name that gets .PART before its extension)")
    compile_parts: bool = option("--compile-parts", kind="flag", help="torch engine: torch.compile the part's generated module (slow first step; off by default)")
    interpreted_parts: bool = option("--interpreted-parts", kind="flag", help="torch engine: walk the part node by node instead of one generated function")
    encode: str | None = option("--encode", choices=("device", "torch", "host"), help="torch engine: where compressed edges are encoded (same payload bytes): on the engine's device, only payloads leave it (default); 'torch': the torch codecs even on a CPU device; 'host': from a NumPy copy of every dense tensor, as before")
    heap: str = option("--heap", default="steady", choices=("steady", "default"), help="steady (default): raise glibc's mmap/trim thresholds so the tensors a step frees are reused by the next step instead of being unmapped and page-faulted in again (the process keeps its peak memory); default: leave the C allocator as it is. No effect without glibc")
    trust_plugins: bool = option("--trust-plugins", kind="flag", help="import the plugin files (Python code) the plan lists; without it such a plan is refused")
    security: Security = section(Security)
    fast_exit: bool = option("--fast-exit", kind="flag", hidden=True, help="exit with os._exit once everything is flushed (fusion run's own executors)")

    def check(self) -> None:
        pass  # --device is checked by the command after its frozen imports (fusion.commands.executor)


@dataclass
class Coordinator:
    plan: str = option(help="plan directory")
    out: str | None = option("--out", essential=True, metavar="RUN", help="run folder for metrics, checkpoints, final weights (default: runs/<plan>-<time>)")
    listen: Listen = section(Listen)
    train: TrainOptions = section(TrainOptions)
    data: DataOptions = section(DataOptions)
    security: Security = section(Security)

    def check(self) -> None:
        _check_restarts(self.listen.max_restarts, self.train.checkpoint_every)  # before the plan is read
        self.data.check()
        self.train.check()
        _check_resume(self.train, self.out)


def check_warmup_steps(mode: str, warmup: int | None, steps: int, what: str = "--sync-warmup") -> None:
    """FusionError (one line) when DiLoCo's synchronous warm-up (``what``: ``--sync-warmup``, or a plan's
    ``dp_sync.sync_warmup``) leaves it no step. None: the DP planner chooses it (capped below ``steps``)."""
    from fusion.ir.errors import FusionError

    if mode != "every" and warmup and warmup >= steps:
        fix = "" if what == "--sync-warmup" else f"; give --steps > {warmup} or recompile with --sync-warmup N"
        raise FusionError(f"{what} {warmup}: the synchronous warm-up must be shorter than the run "
                          f"(--steps {steps}), or DiLoCo never starts{fix}")


@dataclass
class Keys:
    plan: str = option(help="plan directory")
    out: str = option("--out", default="keys", metavar="DIR", help="folder for the secret key files")
    force: bool = option("--force", kind="flag", help="replace existing keys (running executors must restart)")
    relay: bool = option("--relay", kind="flag", help="also a key pair for `fusion relay` (relay.secret), for CompNodes started with --dial-out")

    def check(self) -> None:
        pass


@dataclass
class Relay:
    plan: str = option(help="plan directory")
    bind: str = option("--bind", required=True, type=zmq_address, metavar="ADDR", help="address to listen on, tcp://HOST:PORT, e.g. tcp://*:5700")
    key: str = option("--key", required=True, metavar="FILE", help="the relay's secret key file (relay.secret)")
    public_keys: str | None = option("--public-keys", metavar="FILE", help="the run's public keys (default: PLAN/public_keys.json)")
    max_message_bytes: int | None = option("--max-message-bytes", type=int, help="forward sealed messages up to this size (default: the largest any process of the plan receives, sealed; raise it for data-parallel or DiLoCo plans given --max-message-bytes)")
    stats: str | None = option("--stats", metavar="FILE", help="write what was forwarded (messages, bytes, per sender -> receiver) here as JSON, every second")
    link_timeout: float = option("--link-timeout", default=2.0, type=non_negative_seconds, metavar="SECONDS", help="ZeroMQ heartbeats on each client's connection: a CompNode behind NAT that dies, stops or is cut off loses its connection within this long, and whoever sends to it next (the coordinator's heartbeats) is told it is gone (0: off; a process that dies is still told at once)")

    def check(self) -> None:
        pass


@dataclass(frozen=True)
class Command:
    """One ``fusion`` command: its options tree and the module whose ``run(options) -> int`` does the work."""

    name: str
    options: type
    #: the module with ``run(options)``
    module: str
    #: the one line ``fusion --help`` shows
    help: str
    #: the paragraph ``fusion NAME --help`` shows
    description: str
    #: long-running commands log at info by default: they say what they wait for
    default_verbosity: int = 0


#: every command, in the order ``fusion --help`` lists them
COMMANDS = {c.name: c for c in (
    Command("graph", Graph, "fusion.commands.graph", "print the OP-DAG of a model (file.py:function)",
            "Load MODEL (file.py:function returning a fusion Model, an OpGraph, or (module, example inputs)) and print its nodes."),
    Command("compile", Compile, "fusion.commands.compile", "partition a model over a cluster (OP-Fence + AdaTopK) into a plan",
            "Load MODEL (file.py:function returning a fusion Model, an OpGraph, or (module, example inputs)) and a cluster "
            "file (YAML or scenario JSON), partition the OP-DAG and write the plan directory."),
    Command("inspect", Inspect, "fusion.commands.inspect", "print a plan's parts and cut edges, and draw it as a PNG",
            "Print a table (part -> device, nodes, FLOPs, memory, predicted compute and communication) and the cut edges "
            "(bytes, link, ratio); write a PNG of the partitioned DAG and the device clusters."),
    Command("profile", Profile, "fusion.commands.profile", "fit this host's speed factor lambda from a short warm-up",
            "Time a few Linear forward+backward steps, fit time = t0 + FLOPs / S and print S and lambda = S / S* as JSON "
            "(lambda needs S*: --peak-flops, or --cluster and --name), then time chains of tiny ops and small loopback "
            "messages for the fixed costs per op node and per message, the coordinator's step round trip and feeds, and "
            "the optimizer step per parameter byte. With -o, write a copy of the cluster with that device's lambda and "
            "these fitted costs (node_overhead_s, message_overhead_s, step_overhead_s, feed_overhead_s, feed_byte_s, "
            "optimizer_byte_s) set, in the format -o names (.yaml: your YAML file with the lambda added; .json: the "
            "scenario format). With --model MODEL: time each node of the model forward and backward at its micro-batch "
            "shapes instead and write that table (JSON) to -o, for `fusion compile --node-times FILE`."),
    Command("run", Run, "fusion.commands.run", "train a model or plan locally, one process per CompNode",
            "Compile MODEL (file.py:function) for --cluster, or load PLAN (a plan directory), then train it with one "
            "executor process per CompNode on loopback."),
    Command("export", Export, "fusion.commands.export", "write a run's trained weights as a state_dict of your own module",
            "Write RUN's final weights (safetensors) under your module's own state_dict keys, so that "
            "module.load_state_dict(safetensors.torch.load_file(OUT), strict=True) loads them."),
    Command("executor", Executor, "fusion.commands.executor", "run one CompNode of a plan (one per host)",
            "Load PLAN, check it and its weights, run the part named by --node (part0, part1, ...: see `fusion inspect "
            "PLAN`) and serve the coordinator at --coordinator ADDR until it says stop. Logs what it waits for. Exit "
            "status 0 after stop, 1 after a failure, an abort or a timeout, 2 for a bad plan, part name or address.",
            default_verbosity=1),
    Command("coordinator", Coordinator, "fusion.commands.coordinator",
            "coordinate executors started with `fusion executor` (multi-host runs)",
            "Listen at --bind ADDR, wait for one `fusion executor` per part of PLAN (parts are named part0, part1, ...; "
            "see `fusion inspect PLAN`), and train.", default_verbosity=1),
    Command("keys", Keys, "fusion.commands.keys", "make CURVE key pairs for a plan's CompNodes and coordinator",
            "Make one CURVE key pair per CompNode of PLAN and one for the coordinator: public keys go to "
            "PLAN/public_keys.json, each secret key to OUT/<name>.secret (mode 0600). Give each host only its own "
            "secret file."),
    Command("relay", Relay, "fusion.commands.relay", "forward the traffic of CompNodes behind NAT (`fusion executor --dial-out`)",
            "Listen at --bind ADDR (a reachable address) and forward sealed messages between the processes of PLAN's "
            "run; CompNodes started with --dial-out ADDR make only outbound connections. Needs the relay's key: "
            "`fusion keys PLAN --relay`. Runs until SIGTERM or Ctrl-C.", default_verbosity=1),
)}

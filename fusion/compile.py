"""``compile_model``: a model plus a cluster become a plan (FusionLLM §3.5-3.6, §4, §5.2).

The compiler is a list of passes over a compile state (:mod:`fusion.passes`: :data:`fusion.passes.steps.PASSES`),
each reading only what the previous ones produced::

    Model.graph --shapes, costs, node_times--> CostModel --codec_prices--> the estimator's prices
        --partition (op_fence | equal-count | equal-flops), schedule--> node -> part, part -> device
        --bottleneck, recompute, tied_codec--> --compression (AdaTopK | codecs)--> --assemble--> Plan

This module checks the arguments and runs the passes.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from fusion.cluster.model import Cluster
from fusion.ir.model import Model
from fusion.passes.assemble import assemble_plan as _assemble  # noqa: F401  (fusion.replicas)
from fusion.passes.cut import virtual_stages as check_virtual_stages
from fusion.passes.state import CompileError, CompileRequest, CompileState
from fusion.passes.steps import PASSES
from fusion.passes.steps import ensure_shapes as _ensure_shapes  # noqa: F401  (fusion.replicas, commands)
from fusion.plan import SCHEDULE_NAMES, OptimizerConfig, Plan

if TYPE_CHECKING:
    from fusion.compress.bottleneck import BottleneckRequest
    from fusion.compress.policy import CompressRequest
    from fusion.compress.subspace import SubspaceRequest
    from fusion.cost.node_times import NodeTimes
    from fusion.passes.architecture import ArchitectureRequest

log = logging.getLogger(__name__)

STRATEGIES = ("opfence", "equal-count", "equal-flops")
RECOMPUTE = ("auto", "off", "all")
#: what ``schedule=`` accepts: a schedule the executors run, or ``auto`` (the compiler prices each and picks)
SCHEDULE_CHOICES = (*SCHEDULE_NAMES, "auto")

__all__ = ["compile_model", "compare_strategies", "CompileError", "STRATEGIES", "RECOMPUTE", "SCHEDULE_CHOICES"]


def compile_model(model: Model, cluster: Cluster, *, strategy: str = "opfence", micro_batches: int = 1,
                  compress_ratio: float | None = None, schedule: str = "gpipe",
                  optimizer: OptimizerConfig = OptimizerConfig(), seed: int = 0,
                  compress: CompressRequest | None = None, recompute: str = "auto",
                  tied_codec: dict | str | None = None, virtual_stages: int | None = None,
                  node_times: "NodeTimes | None" = None, bottleneck: "BottleneckRequest | None" = None,
                  precision: str = "fp32", subspace: "SubspaceRequest | None" = None,
                  architecture: "ArchitectureRequest | None" = None) -> Plan:
    """Partition ``model`` over ``cluster`` and return the plan executors run.

    strategy:       ``opfence`` (default), ``equal-count`` or ``equal-flops``.
    micro_batches:  n_b of Eq. (3); the example in ``model`` is one micro-batch.
    compress_ratio: AdaTopK's r of Eq. (7); None or 1 compresses nothing.
    compress:       per-direction codecs, applied where they pay (:mod:`fusion.compress.policy`);
                    exclusive with ``compress_ratio``.
    schedule:       ``gpipe``, ``1f1b`` or ``zb1`` (changes the activation memory in flight and the time, see
                    :mod:`fusion.cost.schedules`), ``interleaved`` (interleaved 1F1B: the chain cut into
                    ``virtual_stages`` x D parts, part s on the (s % D)-th device, :mod:`fusion.partition.interleave`;
                    ``equal-flops`` or ``equal-count`` only), or ``auto``: partition with 1F1B's memory, price
                    gpipe, 1f1b and zb1 on that cut and devices (each with the recomputation it would need) and,
                    with ``virtual_stages`` > 1, ``interleaved`` on its own cut, and keep the shortest simulated
                    iteration among those that fit memory, ties to the smaller peak memory. Every schedule's
                    price is in ``plan.predicted["schedules"]``.
    virtual_stages: V, chunks per device of ``interleaved`` (default 2); with ``auto``, V > 1 adds interleaved
                    to what is priced. Any other schedule takes none.
    recompute:      activation recomputation per part: ``auto`` turns it on only for parts that would
                    not fit their device otherwise (and lets the partitioner count on it when nothing
                    fits without it), ``off`` never, ``all`` on every part.
    tied_codec:     codec cfg for the gradients of tied parameters (``Plan.tied_codec``), priced by the
                    estimator with its wire bytes; ``"auto"``: 8-bit quant when the cost model says the
                    iteration gets shorter with it, else none.
    node_times:     measured per-node seconds (:class:`fusion.cost.node_times.NodeTimes`, ``--node-times``):
                    the estimator prices the timed nodes by them (FusionError if measured on another graph).
    bottleneck:     learned bottlenecks at the cut (:mod:`fusion.compress.bottleneck`): after partitioning, the
                    chosen cut edges get an encoder/decoder pair (new parameters), the plan's graph is the
                    rewritten one, the estimator prices it (smaller wire bytes, extra FLOPs and memory), and
                    ``plan.bottlenecks`` says what was inserted. The returned plan's graph has new parameters:
                    their initial values are :func:`fusion.compress.bottleneck.initial_values` of
                    ``plan.bottlenecks``. Not with an interleaved schedule or ``node_times``.
    precision:      ``fp32`` or ``bf16`` (the plan then runs under autocast; ``set_precision`` sets it): bf16
                    prices the tensors autocast makes bfloat16 at 2 bytes an element (:mod:`fusion.cost.autocast`).
    subspace:       a subspace-confined residual stream (:mod:`fusion.compress.subspace`): every writer of the
                    stream confined to span(U) before partitioning, every cut edge on the stream sent as k
                    coordinates + ids after; ``plan.subspace`` says what changed, the initial weights are
                    :func:`fusion.compress.subspace.initial_params` of it and the user's weights.
    architecture:   consent to a changed model (``--compress auto --allow-architecture-change``,
                    :mod:`fusion.passes.architecture`): dense, a subspace at K = d/16 and d/6 and the bottleneck at
                    its auto rank are each compiled and priced; the shortest predicted iteration is returned (the
                    model as it is unless a change is strictly shorter), ``plan.predicted["architecture"]`` lists
                    them. Not with ``subspace`` or ``bottleneck`` (those are the user's own choice).
    Raises CompileError (naming the cluster file and field) when nothing fits.
    """
    if precision not in ("fp32", "bf16"):
        raise CompileError(f"precision must be fp32 or bf16, got {precision!r}")
    request = check_request(strategy=strategy, micro_batches=micro_batches, compress_ratio=compress_ratio,
                            schedule=schedule, optimizer=optimizer, seed=seed, compress=compress, recompute=recompute,
                            tied_codec=tied_codec, virtual_stages=virtual_stages, node_times=node_times,
                            bottleneck=bottleneck, precision=precision, subspace=subspace, architecture=architecture)
    if request.architecture is not None:
        from fusion.passes.architecture import choose

        return choose(model, cluster, request, run_passes)
    return run_passes(model, cluster, request)


def run_passes(model: Model, cluster: Cluster, request: CompileRequest) -> Plan:
    """The plan of one checked request: every pass of :data:`fusion.passes.steps.PASSES` in order."""
    state = CompileState(model, cluster, request, started=time.perf_counter())
    for run_pass in PASSES:
        state = run_pass(state)
    return state.plan


def check_request(*, strategy: str, micro_batches: int, compress_ratio: float | None, schedule: str,
                  virtual_stages: int | None, compress: "CompressRequest | None", recompute: str,
                  **rest: Any) -> CompileRequest:
    """``compile_model``'s arguments as a :class:`CompileRequest`; CompileError (one line) for a bad one."""
    if strategy not in STRATEGIES:
        raise CompileError(f"strategy must be one of {', '.join(STRATEGIES)}; got {strategy!r}")
    if not isinstance(micro_batches, int) or micro_batches < 1:
        raise CompileError(f"micro_batches must be an integer >= 1, got {micro_batches!r}")
    if schedule not in SCHEDULE_CHOICES:
        raise CompileError(f"schedule must be one of {list(SCHEDULE_CHOICES)}, got {schedule!r}")
    v_stages = check_virtual_stages(schedule, virtual_stages, strategy)
    if compress is not None and compress_ratio is not None:
        raise CompileError("give either compress_ratio (AdaTopK) or compress (codecs), not both")
    if compress_ratio is not None and not compress_ratio >= 1:
        raise CompileError(f"compress_ratio must be >= 1, got {compress_ratio!r}")
    if recompute not in RECOMPUTE:
        raise CompileError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {recompute!r}")
    if rest.get("architecture") is not None and (rest.get("subspace") is not None or rest.get("bottleneck") is not None):
        raise CompileError("architecture (--compress auto --allow-architecture-change) chooses the subspace or "
                           "bottleneck itself; give it or --subspace / --bottleneck, not both")
    return CompileRequest(strategy=strategy, micro_batches=micro_batches, compress_ratio=compress_ratio,
                          schedule=schedule, compress=compress, recompute=recompute, virtual_stages=v_stages, **rest)


def compare_strategies(model: Model, cluster: Cluster, **kw) -> dict[str, float | None]:
    """Predicted iteration time of every strategy (None where it does not fit)."""
    out: dict[str, float | None] = {}
    for s in STRATEGIES:
        try:
            out[s] = compile_model(model, cluster, strategy=s, **kw).predicted["iteration_s"]
        except CompileError as e:
            log.info("%s: %s", s, e)
            out[s] = None
    return out

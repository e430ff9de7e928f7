"""What the compiler's passes read and write: the request (checked arguments) and the compile state.

Each pass (:mod:`fusion.passes.steps`) takes a :class:`CompileState` and returns a new one
(``dataclasses.replace``); nothing is shared between passes but the state. The cost model in the state is
the plain one (the graph's costs, the cluster, the schedule, node times): the codec prices the estimator
uses are separate fields, and :meth:`CompileState.estimator` hands a pass a model with exactly the
prices it asks for, so no pass sets a field of a shared model and restores it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from fusion.ir.errors import FusionError

if TYPE_CHECKING:
    from fusion.cluster.model import Cluster
    from fusion.compress.bottleneck import BottleneckRequest
    from fusion.compress.policy import CompressRequest
    from fusion.compress.subspace import SubspaceRequest, SubspaceSpec
    from fusion.cost.estimate import CodecPrices, CostModel, Estimate
    from fusion.cost.flops import NodeCost
    from fusion.cost.node_times import NodeTimes
    from fusion.cost.schedules import SchedulePrice
    from fusion.ir.model import Model
    from fusion.partition.fence import Partition
    from fusion.plan import BottleneckSpec, EdgeCompression, OptimizerConfig, Plan


class CompileError(FusionError):
    """The model cannot be compiled for this cluster; the message says why."""


#: the subspace ranks ``--compress auto --allow-architecture-change`` prices: K = max(1, d // n) for each n (d / 16
#: and d / 6, the subspace study's two ranks; :mod:`fusion.passes.architecture`)
SUBSPACE_DIVISORS = (16, 6)


@dataclass(frozen=True)
class ArchitectureRequest:
    """What ``--compress auto --allow-architecture-change`` consents to: the compiler may change the model, by
    predicted step time (:mod:`fusion.passes.architecture`).

    bottleneck_edges: ``--bottleneck-edges``, the edges the bottleneck candidate narrows (None: every cut edge
                      of the residual width, :func:`fusion.compress.bottleneck.cut_edges`).
    subspace_divisors: n of each subspace candidate's K = d // n.
    """

    bottleneck_edges: tuple[str, ...] | None = None
    subspace_divisors: tuple[int, ...] = SUBSPACE_DIVISORS


@dataclass(frozen=True)
class CompileRequest:
    """``compile_model``'s arguments, checked (``fusion.compile.compile_model`` says what each means)."""

    #: the partitioner: ``opfence``, ``equal-count`` or ``equal-flops``
    strategy: str
    #: n_b of Eq. (3), micro-batches per iteration
    micro_batches: int
    #: AdaTopK's ratio r (None: none)
    compress_ratio: float | None
    #: the schedule asked for: one the executors run, or ``auto``
    schedule: str
    #: the plan's optimizer (its state slots are priced)
    optimizer: "OptimizerConfig"
    #: the seed of the clustering, the bottleneck's initial values and the plan
    seed: int
    #: ``--compress``'s codecs (None: none)
    compress: "CompressRequest | None"
    #: ``auto``, ``off`` or ``all``: activation recomputation per part
    recompute: str
    #: the tied codec asked for: a cfg, ``"auto"`` or None
    tied_codec: dict | str | None
    #: V of the interleaved cut to build (None: no interleaved cut), checked against schedule and strategy
    virtual_stages: int | None
    #: measured per-node seconds the estimator prices timed nodes by (None: FLOPs only)
    node_times: "NodeTimes | None"
    #: learned bottlenecks to insert at the cut (None: none)
    bottleneck: "BottleneckRequest | None"
    #: ``fp32`` or ``bf16`` (autocast): bf16 prices the tensors autocast makes bfloat16 at 2 bytes an element
    precision: str = "fp32"
    #: subspace-confined residual stream (``--subspace``, :mod:`fusion.compress.subspace`; None: none)
    subspace: "SubspaceRequest | None" = None
    #: the user's consent to a changed model chosen by predicted step time (``--compress auto
    #: --allow-architecture-change``, :mod:`fusion.passes.architecture`; None: the model is compiled as asked)
    architecture: "ArchitectureRequest | None" = None

    @property
    def auto_schedule(self) -> bool:
        """Whether the schedule is the compiler's choice (``schedule="auto"``)."""
        return self.schedule == "auto"

    @property
    def bottleneck_priced(self) -> bool:
        """Whether partitioning prices each cut with the bottleneck's wire bytes (a bottleneck without
        ``--compress`` and without an interleaved cut)."""
        return self.bottleneck is not None and self.compress is None and not self.virtual_stages


@dataclass(frozen=True)
class CompileState:
    """Everything one compile knows so far; each pass fills in some fields and leaves the others."""

    #: the model compiled (the bottleneck pass replaces it by the rewritten one)
    model: "Model"
    #: the devices and links compiled for
    cluster: "Cluster"
    #: the checked arguments
    request: CompileRequest
    #: ``time.perf_counter()`` when the compile started (``plan.predicted["compile_s"]``)
    started: float
    #: per-node FLOPs, bytes and saved activations (:func:`fusion.cost.flops.measure_costs`) of ``model``
    costs: "dict[str, NodeCost] | None" = None
    #: the plain cost model of ``model``: no codec prices set on it (see :meth:`estimator`); its ``schedule`` is
    #: the one partitioned with, then the one chosen
    cm: "CostModel | None" = None
    #: the device clusters OP-Fence starts from (:func:`fusion.cluster.topology.device_clusters`)
    clusters: list = field(default_factory=list)
    #: ``--compress``'s candidate codecs priced per edge (None: cut edges priced dense)
    codec_prices: "CodecPrices | None" = None
    #: the prices partitioning uses for the cut edges: ``codec_prices``, or the bottleneck's code (see
    #: :attr:`CompileRequest.bottleneck_priced`)
    cut_prices: "CodecPrices | None" = None
    #: the tied-gradient codec cfg (None: tied gradients dense)
    tied: dict | None = None
    #: the estimator's (``tied_wire``, ``tied_codec_s``) under ``tied`` (None: dense)
    tied_prices: "tuple[np.ndarray, np.ndarray] | None" = None
    #: node -> part and part -> device of the plan
    part: "Partition | None" = None
    #: the interleaved cut (None: none built)
    interleaved: "Partition | None" = None
    #: every priced schedule's iteration and memory (``plan.predicted["schedules"]``)
    schedule_prices: "dict[str, SchedulePrice]" = field(default_factory=dict)
    #: the plan's schedule (``auto`` resolved)
    schedule: str = ""
    #: what the bottleneck pass inserted (``plan.bottlenecks``)
    bottlenecks: "list[BottleneckSpec]" = field(default_factory=list)
    #: ``plan.predicted["bottleneck"]`` (None: no bottleneck asked for)
    bottleneck_info: dict[str, Any] | None = None
    #: what the subspace passes changed (None: no ``--subspace``)
    subspace: "SubspaceSpec | None" = None
    #: per part: whether it recomputes its activations
    recompute: np.ndarray | None = None
    #: part names, ``part0`` ...
    names: list[str] = field(default_factory=list)
    #: the estimate with every cut edge and tied gradient dense
    dense: "Estimate | None" = None
    #: the codec of each compressed cut edge (``plan.compression``)
    compression: "list[EdgeCompression]" = field(default_factory=list)
    #: the estimate of the plan as compiled (its codecs, its tied codec)
    estimate: "Estimate | None" = None
    #: the plan (the assemble pass's)
    plan: "Plan | None" = None

    def estimator(self, codecs: "CodecPrices | None | bool" = True, tied: bool = True) -> "CostModel":
        """The cost model with explicit prices: ``codecs`` True: :attr:`codec_prices`, False: none, or the
        prices given; ``tied``: :attr:`tied_prices` (False: tied gradients dense)."""
        prices = self.codec_prices if codecs is True else (None if codecs is False else codecs)
        wire, codec_s = self.tied_prices if tied and self.tied_prices is not None else (None, None)
        return self.cm.variant(codec_prices=prices, tied_wire=wire, tied_codec_s=codec_s)

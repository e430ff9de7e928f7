"""The plan of a compile: parts, links and predictions from the estimate (``plan.json``'s ``predicted``)."""
from __future__ import annotations

from typing import Any

from fusion.cluster.model import Cluster
from fusion.cost.estimate import CostModel, Estimate
from fusion.cost.schedules import simulate_estimate
from fusion.ir.model import Model
from fusion.ir.node import TensorMeta
from fusion.partition.fence import Partition
from fusion.plan import Part, Plan, boundary_tables

COST_MODEL = "fusion.estimate/2"  # 2: iteration_s is the simulated schedule, Eq. 3 in eq3_iteration_s


def assemble_plan(model: Model, cluster: Cluster, cm: CostModel, part: Partition, names: list[str], est: Estimate,
                  dense: Estimate, compression, clusters, strategy, schedule, micro_batches, optimizer, seed) -> Plan:
    """The plan of a cut priced by ``est`` (``dense``: the same cut uncompressed): parts, links, the
    predictions (the schedule simulated with the estimator's numbers) and the example's shapes."""
    graph = model.graph
    dev_names = [d.name for d in cluster.devices]
    assignment = {n: names[int(p)] for n, p in zip(cm.names, part.node_part)}
    parts = {}
    for k, pe in enumerate(est.parts):
        d = cluster.devices[part.part_device[k]]
        parts[names[k]] = Part(names[k], d.name, d.address, "torch", pe.compute_s, pe.comm_s, pe.memory_bytes)
    links = {}
    for le in est.links:
        a, b = part.part_device[le.src], part.part_device[le.dst]
        links[f"{names[le.src]}->{names[le.dst]}"] = {
            "src_device": dev_names[a], "dst_device": dev_names[b], "tensors": le.tensors,
            "fwd_bytes": le.fwd_bytes, "bwd_bytes": le.bwd_bytes, "fwd_s": le.fwd_s, "bwd_s": le.bwd_s,
            "bandwidth_bps": cluster.bandwidth_bps(a, b), "latency_s": float(cluster.alpha[a, b])}
    # the reported iteration is the schedule simulated with the estimator's numbers (fusion/cost/schedules.py):
    # Eq. 3 charges every part's C_p + R_p for the fill and drain and overlaps nothing, up to ~10 % over on a
    # link-bound cut and blind to an interleaved device's shared clock; Eq. 3 stays what the partitioners minimise
    sim = simulate_estimate(cm, est, schedule, part.node_part, part.part_device)
    dense_sim = sim if dense is est else simulate_estimate(cm, dense, schedule, part.node_part, part.part_device)
    samples = cm.micro_batches * cm.samples_per_micro_batch
    predicted: dict[str, Any] = {
        "cost_model": COST_MODEL,
        "iteration_s": sim, "pipeline_s": sim - est.sync_s - est.step_s, "sync_s": est.sync_s, "step_s": est.step_s,
        "throughput_samples_s": samples / sim if sim > 0 else float("inf"), "dense_iteration_s": dense_sim,
        "eq3_iteration_s": est.iteration_s, "eq3_pipeline_s": est.pipeline_s,
        "samples_per_micro_batch": cm.samples_per_micro_batch,
        "parts": {names[k]: {"device": pe.device, "compute_s": pe.compute_s, "comm_s": pe.comm_s,
                             "comm_fwd_s": pe.comm_fwd_s, "comm_bwd_s": pe.comm_bwd_s, "flops": pe.flops,
                             "memory_bytes": pe.memory_bytes, "param_state_bytes": pe.param_state_bytes,
                             "activation_bytes": pe.activation_bytes, "in_flight": pe.in_flight,
                             "memory_limit": pe.memory_limit,
                             **({"delta_buffer_bytes": pe.delta_buffer_bytes} if pe.delta_buffer_bytes else {}),
                             **({"optimizer_s": pe.optimizer_s} if pe.optimizer_s else {})}
                  for k, pe in enumerate(est.parts)},
        "links": links,
        "clusters": [[dev_names[i] for i in c] for c in clusters],
        "partitioner": {k: v for k, v in part.info.items()},
    }
    example = {}
    for n in graph.placeholders():
        o = n.meta.outputs[0] if n.meta.outputs else None
        if isinstance(o, TensorMeta):
            example[n.name] = {"shape": list(o.shape), "dtype": o.dtype}
    return Plan(graph, cluster.to_dict(), parts, assignment, list(compression), schedule, micro_batches,
                optimizer.to_dict(), seed, predicted, example, strategy, boundary_tables(graph, assignment))

"""What a plan does, for humans: a text table and a picture.

:func:`plan_report` prints part -> device, nodes, FLOPs, memory, predicted
compute and communication, then every cut edge (tensor, bytes, link, time,
AdaTopK ratio). :func:`draw_plan` writes a PNG with the partitioned DAG (a
layered layout, coloured by part, cut edges in red) and the devices grouped
by their Louvain clusters, with the pipeline path drawn between the devices
that hold parts and labelled with each link's bandwidth and latency.
Everything comes from the plan file alone.
"""
from __future__ import annotations

from pathlib import Path

from fusion.cluster.model import Cluster
from fusion.cost.dp import codec_label
from fusion.cost.estimate import tensor_bytes
from fusion.ir.boundary import part_order
from fusion.plan import Plan


def _fmt_bytes(b: float) -> str:
    for unit, f in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= f:
            return f"{b / f:.2f} {unit}"
    return f"{b:.0f} B"


def _fmt_bw(bps: float) -> str:
    from fusion.cluster.units import format_bandwidth

    return format_bandwidth(bps)


def cut_edges(plan: Plan) -> list[dict]:
    """One row per (tensor, src part, dst part) crossing between parts."""
    cluster = Cluster.from_dict(plan.cluster, "plan.cluster")
    ratios = {(c.producer, c.index, c.src, c.dst): c.ratio for c in plan.compression}
    codecs = {(c.producer, c.index, c.src, c.dst): (codec_label(c.codec("fwd")), codec_label(c.codec("bwd")))
              for c in plan.compression}
    rows: dict[tuple, dict] = {}
    for node in plan.graph.nodes.values():
        dst = plan.assignment[node.name]
        for ref in node.refs():
            src = plan.assignment[ref.node]
            if src == dst:
                continue
            key = (ref.node, ref.index, src, dst)
            if key in rows:
                rows[key]["users"].append(node.name)
                continue
            a, b = cluster.index(plan.parts[src].device), cluster.index(plan.parts[dst].device)
            nbytes = tensor_bytes(plan.graph, ref.node, ref.index)
            rows[key] = {"tensor": ref.node if ref.index is None else f"{ref.node}[{ref.index}]", "src": src, "dst": dst,
                         "users": [node.name], "bytes": nbytes, "src_device": cluster.devices[a].name,
                         "dst_device": cluster.devices[b].name, "bandwidth_bps": cluster.bandwidth_bps(a, b),
                         "latency_s": float(cluster.alpha[a, b]), "dense_s": cluster.comm_time(a, b, nbytes),
                         "ratio": ratios.get(key, 1.0), "fwd": codecs.get(key, ("dense", "dense"))[0],
                         "bwd": codecs.get(key, ("dense", "dense"))[1]}
    return list(rows.values())


def tied_params(plan: Plan) -> dict[str, list[str]]:
    """Trainable parameters held by several parts of replica 0 -> those parts, in pipeline order."""
    order = part_order(plan.graph, plan.assignment)
    owners: dict[str, list[str]] = {}
    for node in plan.graph.nodes.values():
        for p in node.param_names():
            if plan.graph.params[p].trainable:
                owners.setdefault(p, [])
                if plan.assignment[node.name] not in owners[p]:
                    owners[p].append(plan.assignment[node.name])
    return {p: sorted(ps, key=order.index) for p, ps in sorted(owners.items()) if len(ps) > 1}


def inner_steps_lines(plan: Plan) -> list[str]:
    """Each replica's inner steps per round under ``--inner-steps auto`` (``dp_sync.inner_steps_per_replica``) and,
    when the compiler priced them (``predicted["inner_steps_auto"]``, :mod:`fusion.inner_steps`), the predicted
    step times and a round's time and the fastest replica's wait in it, with equal H and with these H."""
    per = plan.dp_sync.inner_steps_per_replica
    if not per:
        return []
    pr = plan.predicted.get("inner_steps_auto")
    times = pr.get("step_s") if isinstance(pr, dict) else None
    out = ["  inner steps by speed (H per round): " + ", ".join(
        f"r{r} {h}" + (f" ({times[r]:.4g} s/step predicted)" if times and r < len(times) else "")
        for r, h in sorted(per.items()))]
    if isinstance(pr, dict) and "round_s" in pr:
        out.append(f"  predicted round: {pr['round_s']:.4g} s, fastest replica waits {pr['fastest_wait_s']:.4g} s "
                   f"(equal H: {pr['round_s_equal_h']:.4g} s, waits {pr['fastest_wait_s_equal_h']:.4g} s); "
                   f"{pr['micro_batches_per_s']:.4g} micro-batches/s (equal H: {pr['micro_batches_per_s_equal_h']:.4g})")
    return out


def dp_sync_lines(plan: Plan) -> list[str]:
    """How the replicas synchronise (``Plan.dp_sync``) and, when the planner priced it
    (``predicted["dp_sync"]``, :func:`fusion.cost.dp.diloco_estimate`), the sync per outer step against the
    compute it overlaps."""
    ds = plan.dp_sync
    if ds.mode == "every":
        return ["sync: every step (synchronous data parallelism, gradients averaged each step)"]
    shares = (", shares " + ", ".join(f"r{r} {v:g}" for r, v in sorted(ds.shares.items()))) if ds.shares else \
        ", equal shares"
    out = [f"sync: DiLoCo, H = {ds.inner_steps} inner steps per outer step, outer Nesterov SGD lr {ds.outer_lr:g} "
           f"momentum {ds.outer_momentum:g}{'' if ds.nesterov else ' (heavy-ball)'}, pseudo-gradient codec "
           f"{codec_label(ds.codec)}{' + error feedback' if ds.error_feedback else ''}, {ds.fragments} fragment"
           f"{'s' if ds.fragments > 1 else ''}, delay {ds.delay}{shares}"]
    out += warmup_lines(plan)
    out += inner_steps_lines(plan)
    pr = plan.predicted.get("dp_sync")
    if isinstance(pr, dict) and "sync_s_per_outer_step" in pr:
        sync, comp = pr["sync_s_per_outer_step"], pr["compute_s_per_outer_step"]
        out.append(f"  priced per outer step: sync {sync:.4g} s ({_fmt_bytes(pr['sync_bytes_per_outer_step'])} "
                   f"per replica, slowest stage group's links) vs compute {comp:.4g} s ({ds.inner_steps} inner "
                   f"steps); {'overlapped' if ds.delay else 'blocking'}: {pr['exposed_sync_s_per_outer_step']:.4g} s "
                   f"exposed ({100 * pr['sync_hidden']:.0f}% hidden), {_fmt_bytes(pr['sync_bytes_per_step'])} "
                   f"per inner step against {_fmt_bytes(pr['dense_bytes_per_step'])} for synchronous DP")
        if "diloco_over_sync_dp" in pr:
            out.append(f"  predicted {pr['samples_per_s']:.4g} samples/s, {pr['diloco_over_sync_dp']:.3g}x "
                       f"synchronous DP's best layout ({pr['sync_dp_samples_per_s']:.4g} samples/s)")
        out.append(convergence_line(pr, ds))
    return out


def convergence_line(pr: dict, ds) -> str:
    """The convergence price the DP planner chose by (:mod:`fusion.cost.convergence`), or that it had none."""
    ratio = pr.get("steps_to_sync_loss_ratio")
    if ratio is None:
        return (f"  convergence: not priced (H = {ds.inner_steps}, delay {ds.delay} not measured by the convergence "
                "study); chosen by samples/s")
    vs = pr.get("diloco_to_loss_over_sync_dp")
    tail = f"; predicted time to that loss {1 / vs:.3g}x synchronous DP's" if vs else ""
    return (f"  convergence: {ratio:g}x synchronous DP's steps to its held-out loss (H = {ds.inner_steps}, delay "
            f"{ds.delay}: the study's tuning seeds, docs/data-parallel.md){tail}")


def warmup_lines(plan: Plan) -> list[str]:
    """A DiLoCo plan's synchronous warm-up and the replicas' inner lr, with the DP planner's reasons where it chose
    them (``predicted["diloco_choice"]``, :mod:`fusion.partition.diloco_defaults`)."""
    ds = plan.dp_sync
    lr = (plan.optimizer or {}).get("lr")
    why = plan.predicted.get("diloco_choice") or {}
    warm = f"{ds.sync_warmup} synchronous steps, then DiLoCo" if ds.sync_warmup else "none"
    if ds.sync_warmup and plan.dp_codec:  # the warm-up's all-reduce travels under the plan's dp_codec
        warm += f" (its gradient all-reduce {codec_label(plan.dp_codec)})"
    inner = f"{ds.inner_lr:g}" if ds.inner_lr is not None else (f"the plan's lr {lr:g}" if lr is not None else "the plan's lr")
    # the planner's reasons begin with the value it chose
    return [f"  warm-up{' (DP planner)' if why.get('warmup_reason') else ''}: {why.get('warmup_reason') or warm}",
            f"  inner lr{' (DP planner)' if why.get('inner_lr_reason') else ''}: {why.get('inner_lr_reason') or inner}"]


def plan_report(plan: Plan) -> str:
    pr = plan.predicted
    order = part_order(plan.graph, plan.assignment)
    n_dev = len(plan.cluster.get("devices", []))
    R = plan.replicas
    reps = (f" ({len(order)} stage{'s' if len(order) > 1 else ''} x {R} data-parallel replicas, global batch "
            f"{plan.global_batch or '?'} rows)" if R > 1 else "")
    lines = [f"plan: {len(plan.graph)} nodes, strategy {plan.strategy or '?'}, {len(plan.parts)} parts{reps} on "
             f"{len({p.device for p in plan.parts.values()})} of {n_dev} devices ({plan.cluster.get('name', '')}), "
             f"schedule {plan.schedule} x {plan.micro_batches} micro-batches" + (" per replica" if R > 1 else "")]
    if pr:
        lines.append(f"predicted iteration {pr.get('iteration_s', float('nan')):.4g} s "
                     f"(pipeline {pr.get('pipeline_s', float('nan')):.4g} s + tied-gradient sync {pr.get('sync_s', 0.0):.4g} s"
                     + (f" + step {pr['step_s']:.4g} s" if pr.get("step_s") else "") + "; "
                     f"dense {pr.get('dense_iteration_s', float('nan')):.4g} s), "
                     f"throughput {pr.get('throughput_samples_s', float('nan')):.4g} samples/s")
    if pr.get("single_pipeline_parts"):  # a DP x PP plan against OP-Fence's single pipeline on the same batch
        lines.append(f"against one pipeline: {pr['dp_vs_single_pipeline']:.3g}x the samples/s of OP-Fence's best "
                     f"single pipeline on the same global batch ({pr['single_pipeline_samples_per_s']:.4g} "
                     f"samples/s on {pr['single_pipeline_parts']} devices)")
    if pr.get("schedules"):  # every schedule priced on this cut (fusion.cost.schedules), the plan's marked
        lines.append(f"schedules ({pr.get('schedule_choice', 'fixed')}, simulated): " + ", ".join(
            f"{n}{'*' if n == plan.schedule else ''} {v['iteration_s']:.4g} s {v['peak_memory_bytes'] / 1e6:.3g} MB"
            f"{'' if v['fits'] else ' (does not fit)'}" for n, v in pr["schedules"].items()))
    chunk = virtual_stages(plan)
    if chunk:
        lanes = plan.lanes()
        v = max(len(ps) for ps in lanes.values())
        lines.append(f"virtual stages (interleaved 1F1B, {v} chunks per device, one executor per device): "
                     + "; ".join(f"{dev}: {', '.join(ps)} ({_fmt_bytes(sum(plan.parts[p].memory_bytes for p in ps))})"
                                 for dev, ps in lanes.items()))
    flops: dict[str, float] = {}
    count: dict[str, int] = {}
    for n in plan.graph.nodes.values():
        p = plan.assignment[n.name]
        flops[p] = flops.get(p, 0.0) + n.meta.flops_fwd + n.meta.flops_bwd
        count[p] = count.get(p, 0) + 1
    ppred = pr.get("parts", {})
    lines.append("")
    w = max(8, max(len(p) for p in plan.parts))
    lines.append(f"{'part':<{w}} {'replica':>7} {'device':<16} " + (f"{'chunk':>6} " if chunk else "") + f"{'nodes':>5} {'GFLOP':>10} {'memory':>22} {'compute s':>10} "
                 f"{'comm s':>10}  engine")
    for r in range(R):
        m = plan.replica_parts(r)
        for stage in order:
            p = m[stage]
            part = plan.parts[p]
            lim = ppred.get(p, {}).get("memory_limit")
            mem = _fmt_bytes(part.memory_bytes) + (f" / {_fmt_bytes(lim)}" if lim else "")
            lines.append(f"{p:<{w}} {r:>7} {part.device:<16} " + (f"{chunk[p]:>6} " if chunk else "") + f"{count.get(stage, 0):>5} {flops.get(stage, 0.0) / 1e9:>10.2f} "
                         f"{mem:>22} {part.predicted_compute_s:>10.4g} {part.predicted_comm_s:>10.4g}  {part.engine}"
                         + (" (recompute)" if part.recompute else "")
                         + (f" (memory holds {_fmt_bytes(buf)} of delta buffers for {pr.get('delta_samples')} samples)"
                            if (buf := ppred.get(p, {}).get("delta_buffer_bytes")) else ""))
    if R > 1:
        lines.append("")
        lines += dp_sync_lines(plan)
        lines.append("data-parallel groups (each stage's replicas average their gradients every step; ring or tree "
                     "all-reduce):" if plan.dp_sync.mode == "every" else
                     f"data-parallel groups (each stage's replicas average their pseudo-gradients every "
                     f"{plan.dp_sync.inner_steps} inner steps):")
        for stage in order:
            group = plan.dp_group(stage)
            priced = pr.get("dp_allreduce", {}).get(stage, {})
            cost = (f" (ring {priced['ring_s']:.3g} s, tree {priced['tree_s']:.3g} s predicted)"
                    if "ring_s" in priced and "tree_s" in priced else "")
            if plan.dp_algo_of(stage) == "tree":  # binomial tree rooted at replica 0
                lines.append(f"  {stage}: tree over " + ", ".join(f"{p} ({plan.parts[p].device})" for p in group)
                             + f", rooted at {group[0]}" + cost)
            else:
                lines.append(f"  {stage}: ring " + " -> ".join(f"{p} ({plan.parts[p].device})" for p in group)
                             + f" -> {group[0]}" + cost)
    tied = tied_params(plan)
    if tied:
        lines.append("")
        lines.append(f"tied parameters ({len(tied)}; gradients exchanged between their owners each step, codec "
                     f"{codec_label(plan.tied_codec)}):")
        for name, owners in tied.items():
            lines.append(f"  {name}: {', '.join(owners)}")
    lines += bottleneck_lines(plan)
    from fusion.passes.architecture import inspect_lines as architecture_lines

    lines += architecture_lines(plan)
    if plan.subspace is not None:
        from fusion.compress.subspace import SubspaceSpec, inspect_lines

        lines += inspect_lines(SubspaceSpec.from_dict(plan.subspace))
    edges = cut_edges(plan)
    lines.append("")
    lines.append(f"cut edges ({len(edges)}; per micro-batch, forward; gradients return on the reverse link):")
    lines.append(f"{'tensor':<24} {'parts':<16} {'size':>10} {'link':<36} {'dense s':>9} {'fwd codec':<22} {'bwd codec':<22}")
    for e in sorted(edges, key=lambda e: (order.index(e["src"]), order.index(e["dst"]), e["tensor"])):
        link = f"{e['src_device']}->{e['dst_device']} {_fmt_bw(e['bandwidth_bps'])}, {e['latency_s'] * 1e3:.3g} ms"
        lines.append(f"{e['tensor'][:24]:<24} {e['src'] + '->' + e['dst']:<16} {_fmt_bytes(e['bytes']):>10} {link:<36} "
                     f"{e['dense_s']:>9.4g} {e['fwd']:<22} {e['bwd']:<22}")
    return "\n".join(lines)


def bottleneck_lines(plan: Plan) -> list[str]:
    """Every module ``fusion compile --bottleneck`` inserted (``plan.bottlenecks``): its edge, parts, D -> R and
    the parameters it added (the model changed: trainable count, and the fixed projection P)."""
    if not plan.bottlenecks:
        return []
    total = sum(b.trainable_params for b in plan.bottlenecks)
    info = plan.predicted.get("bottleneck") or {}
    lines = ["", f"bottlenecks at the cut ({len(plan.bottlenecks)}; the model is changed: {total} trainable "
                 "parameters added; encoder z = x P + x W_enc on the producing part, decoder y = z P^T + z W_dec "
                 "on each consuming part, P fixed orthonormal):"]
    lines.append(f"{'edge':<24} {'parts':<24} {'D -> R':>12} {'params':>9}  parameters")
    for b in plan.bottlenecks:
        parts = f"{b.src}->{','.join(b.dsts)}"
        lines.append(f"{b.edge[:24]:<24} {parts[:24]:<24} {f'{b.width} -> {b.rank}':>12} {b.trainable_params:>9}  "
                     f"{b.encoder}, {', '.join(b.decoders)} (+ fixed {b.projection}, {b.width * b.rank})")
    if "with_s" in info:
        lines.append(f"  estimator (Eq. 3 on this cut): {info['with_s']:.4g} s/iteration with them, "
                     f"{info['without_s']:.4g} s without (--bottleneck {info.get('request')})")
    return lines


def virtual_stages(plan: Plan) -> dict[str, str]:
    """Part -> ``"k/V"`` (its chunk k of the V its device runs) for an interleaved plan; {} otherwise."""
    if plan.schedule != "interleaved":
        return {}
    return {p: f"{k}/{len(ps)}" for ps in plan.lanes().values() for k, p in enumerate(ps)}


def part_colors(n: int) -> list:
    """``n`` clearly different colours: tab10's hues first (no two near-identical blues), then golden-ratio hues."""
    import colorsys

    import matplotlib

    base = list(matplotlib.colormaps["tab10"].colors)
    base = [base[i] for i in (0, 1, 2, 3, 4, 5, 6, 8, 9, 7)]  # grey (7) last: it reads as "unused"
    out = base[:n]
    k = 0
    while len(out) < n:
        h = (0.13 + k * 0.618034) % 1.0
        v = 0.85 if (k // 7) % 2 == 0 else 0.6
        out.append(colorsys.hsv_to_rgb(h, 0.75, v))
        k += 1
    return out


def dag_layout(graph, rows_per_column: int | None = None, cell: tuple[float, float] = (1.0, 1.0),
               aspect: float = 1.6) -> tuple[dict[str, tuple[float, float]], int, int]:
    """Layered DAG layout: layer = longest path from an input; layers run top to bottom in columns
    (wrapped after ``rows_per_column`` layers, by default chosen so that with cells of ``cell`` inches
    the picture is about ``aspect`` times as wide as tall); within a layer, nodes sit near their
    producers' mean x.

    Returns (node -> (x, y), width of the widest layer, number of columns).
    """
    import math

    layer: dict[str, int] = {}
    for name, node in graph.nodes.items():  # nodes are in topological order
        layer[name] = 1 + max((layer[p] for p in node.producers() if p in layer), default=-1)
    depth = 1 + max(layer.values(), default=0)
    layers: list[list[str]] = [[] for _ in range(depth)]
    for name in graph.nodes:
        layers[layer[name]].append(name)
    width = max(len(L) for L in layers) if layers else 1
    if rows_per_column is None:
        # width (depth / R) * (width + 1.5) * cell_w  ~  aspect * R * cell_h
        rows_per_column = math.ceil(math.sqrt(depth * (width + 1.5) * cell[0] / (aspect * cell[1])))
        rows_per_column = min(depth, max(4, rows_per_column))
    ncols = math.ceil(depth / rows_per_column)
    xpos: dict[str, float] = {}
    xy: dict[str, tuple[float, float]] = {}
    for li, names in enumerate(layers):
        col, row = divmod(li, rows_per_column)
        # barycentre of producers (in layer-local x) keeps chains straight and edges short
        def key(n, _li=li):
            ps = [xpos[p] for p in graph[n].producers() if p in xpos and layer[p] >= _li - rows_per_column]
            return sum(ps) / len(ps) if ps else 0.0
        names = sorted(names, key=key)
        want = [key(n) for n in names]
        slots = []
        for w in want:  # greedy: as close to the wanted place as the previous node allows
            x = max(w, slots[-1] + 1.0) if slots else w
            slots.append(x)
        shift = max(0.0, slots[-1] - (width - 1)) if slots else 0.0
        slots = [max(0.0, x - shift) for x in slots]
        for i in range(1, len(slots)):
            slots[i] = max(slots[i], slots[i - 1] + 1.0)
        for n, x in zip(names, slots):
            xpos[n] = x
            xy[n] = (col * (width + 1.5) + x, -row)
    return xy, width, ncols


def draw_plan(plan: Plan, path: str | Path) -> Path:
    """Write the partitioned DAG (layered, coloured by part, cut edges red) and the devices (grouped by their
    Louvain clusters, links between used devices labelled with bandwidth and latency) as a PNG."""
    import math

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fusion.cluster.units import format_bandwidth

    path = Path(path)
    g = plan.graph
    order = part_order(g, plan.assignment)
    palette = part_colors(len(order))
    color = {p: palette[i] for i, p in enumerate(order)}
    names = list(g.nodes)
    n = len(names)
    labelled = n <= 150
    # cell sizes in inches: room for a label beside each node when labelled
    cell_w, cell_h = (1.45, 0.34) if labelled else (0.12, 0.12)
    xy, width, ncols = dag_layout(g, cell=(cell_w, cell_h))
    xs = [q[0] for q in xy.values()] or [0.0]
    ys = [q[1] for q in xy.values()] or [0.0]
    span_x, span_y = max(xs) - min(xs) + 1, max(ys) - min(ys) + 1
    scale = min(1.0, 30.0 / (span_x * cell_w), 24.0 / (span_y * cell_h))  # at most 30 x 24 inches of DAG
    dag_w = max(8.0, span_x * cell_w * scale)
    dag_h = max(4.0, span_y * cell_h * scale + 1.2)
    dev_w = 6.0
    fig = plt.figure(figsize=(dag_w + dev_w, max(dag_h, 5.5)))
    ax1 = fig.add_axes((0.01, 0.08, dag_w / (dag_w + dev_w) - 0.02, 0.86))
    ax2 = fig.add_axes((dag_w / (dag_w + dev_w) + 0.01, 0.12, dev_w / (dag_w + dev_w) - 0.02, 0.78))
    # -- the DAG ------------------------------------------------------------------------------------
    lw = 0.6 if n < 300 else 0.25
    for node in g.nodes.values():
        for prod in node.producers():
            (x0, y0), (x1, y1) = xy[prod], xy[node.name]
            cut = plan.assignment[prod] != plan.assignment[node.name]
            style = dict(color="red" if cut else "0.7", lw=1.8 if cut else lw,
                         alpha=1.0 if cut else (0.8 if n < 300 else 0.35), zorder=2 if cut else 1)
            if x0 == x1 and y0 - y1 > 1 and n < 300:
                # a skip connection straight down a chain would hide under it: bend it aside
                ax1.annotate("", xy=(x1, y1), xytext=(x0, y0), zorder=style["zorder"],
                             arrowprops=dict(arrowstyle="-", color=style["color"], lw=style["lw"], alpha=style["alpha"],
                                             connectionstyle=f"arc3,rad={min(0.5, 0.12 + 0.04 * (y0 - y1))}",
                                             shrinkA=0, shrinkB=0))
            else:
                ax1.plot([x0, x1], [y0, y1], **style)
    ax1.scatter([xy[m][0] for m in names], [xy[m][1] for m in names], c=[color[plan.assignment[m]] for m in names],
                s=60 if labelled else max(2.0, 2000 / n), zorder=3, edgecolors="k", linewidths=0.4 if n < 300 else 0.0)
    if labelled:
        for m in names:
            label = m if len(m) <= 24 else m[:11] + "…" + m[-12:]
            ax1.annotate(label, xy[m], fontsize=7, xytext=(5, 2), textcoords="offset points", zorder=4,
                         bbox=dict(boxstyle="square,pad=0.05", fc="white", ec="none", alpha=0.75))
    ax1.set_xlim(min(xs) - 0.5, max(xs) + (1.3 if labelled else 0.5))
    ax1.set_ylim(min(ys) - 0.6, max(ys) + 0.6)
    ax1.axis("off")
    cuts = sum(1 for nd in g.nodes.values() for p in nd.producers() if plan.assignment[p] != plan.assignment[nd.name])
    what = f"{len(order)} stages x {plan.replicas} replicas" if plan.replicas > 1 else f"{len(order)} parts"
    ax1.set_title(f"OP-DAG: {n} nodes in {what}, {cuts} cut edges (red); layers top to bottom"
                  + (f" in {ncols} columns" if ncols > 1 else ""), fontsize=10)
    R = plan.replicas
    # the legend groups parts by replica: one row per replica (a column per stage), replica 0 first
    handles = [plt.Line2D([], [], marker="o", ls="", color=color[s], markeredgecolor="k",
                          label=(f"r{r}: " if R > 1 else "") + f"{plan.replica_parts(r)[s]} on "
                                f"{plan.parts[plan.replica_parts(r)[s]].device}")
               for r in range(R) for s in order]
    ax1.legend(handles=handles[:24], fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.01),
               ncol=min(8, len(order)) if R > 1 else min(8, len(handles)), frameon=False)
    # -- the devices by Louvain cluster -------------------------------------------------------------------
    from fusion.cluster.model import Cluster

    cl = Cluster.from_dict(plan.cluster, "plan.cluster")
    devs = [d.name for d in cl.devices]
    clusters = plan.predicted.get("clusters") or [devs]
    pos: dict[str, tuple[float, float]] = {}
    centers = []
    radii = [0.35 + 0.16 * math.sqrt(len(m)) for m in clusters]
    share = [2 * (r + 0.22) + 0.4 for r in radii]  # arc length each cluster needs on the ring
    big = max(1.2, sum(share) / (2 * math.pi))
    start = 0.0
    for c, members in enumerate(clusters):
        if len(clusters) == 1:
            cx, cy = 0.0, 0.0
        elif len(clusters) == 2:
            cx, cy = (-1.2 + 2.4 * c, 0.0)
        else:
            ang = math.pi / 2 - 2 * math.pi * (start + share[c] / 2) / sum(share)
            start += share[c]
            cx, cy = big * math.cos(ang), big * math.sin(ang)
        centers.append((cx, cy))
        r = radii[c]
        for k, d in enumerate(members):
            a = math.pi / 2 - 2 * math.pi * k / max(1, len(members))
            pos[d] = (cx + r * math.cos(a), cy + r * math.sin(a)) if len(members) > 1 else (cx, cy)
    part_of: dict[str, str] = {}  # device -> the part on it (every replica's), coloured by its stage
    for r in range(R):
        for s in order:
            p = plan.replica_parts(r)[s]
            part_of.setdefault(plan.parts[p].device, p)
    idx = {d: i for i, d in enumerate(devs)}

    def bw_label(a: str, b: str) -> str:
        i, j = idx[a], idx[b]
        return f"{format_bandwidth(cl.bandwidth_bps(i, j))}, {cl.alpha[i, j] * 1e3:.3g} ms"

    if len(clusters) <= 12:
        for c, members in enumerate(clusters):
            inside = [cl.bandwidth_bps(idx[a], idx[b]) for a in members for b in members if a != b]
            note = f"C{c}: {len(members)} device{'s' if len(members) > 1 else ''}"
            if inside:
                note += f"\n{format_bandwidth(sorted(inside)[len(inside) // 2])} inside"
            cx, cy = centers[c]
            ax2.add_patch(plt.Circle((cx, cy), radii[c] + 0.22, fc="0.96", ec="0.6", lw=0.8, zorder=0))
            if len(clusters) <= 2:
                ax2.annotate(note, (cx, cy - radii[c] - 0.3), ha="center", va="top", fontsize=7, color="0.35")
            else:  # outside the ring, away from the neighbours
                d = math.hypot(cx, cy) or 1.0
                ux, uy = cx / d, cy / d
                ax2.annotate(note, (cx + ux * (radii[c] + 0.3), cy + uy * (radii[c] + 0.3)), fontsize=7, color="0.35",
                             ha="left" if ux > 0.3 else "right" if ux < -0.3 else "center",
                             va="bottom" if uy > 0.3 else "top" if uy < -0.3 else "center")
        if 1 < len(clusters) <= 6:
            for a in range(len(clusters)):
                for b in range(a + 1, len(clusters)):
                    between = [cl.bandwidth_bps(idx[x], idx[y]) for x in clusters[a] for y in clusters[b]]
                    (xa, ya), (xb, yb) = centers[a], centers[b]
                    ax2.plot([xa, xb], [ya, yb], ls=":", color="0.6", lw=0.8, zorder=0)
                    ax2.annotate(f"{format_bandwidth(sorted(between)[len(between) // 2])} between clusters",
                                 ((xa + xb) / 2, (ya + yb) / 2 - 0.06), ha="center", va="top", fontsize=7, color="0.4")
    used = [d for d in pos if d in part_of]
    free = [d for d in pos if d not in part_of]
    small = 6 if len(pos) > 200 else 40
    ax2.scatter([pos[d][0] for d in free], [pos[d][1] for d in free], s=small, color="0.8", zorder=2)
    ax2.scatter([pos[d][0] for d in used], [pos[d][1] for d in used], s=small * 3, zorder=4,
                color=[color[plan.stage_of(part_of[d])] for d in used], edgecolors="k")
    lanes = plan.lanes() if plan.schedule == "interleaved" else {}
    for d in (used if len(pos) > 40 else list(pos)):
        label = f"{d}\n{part_of[d]}" if R > 1 and d in part_of else d
        if d in lanes:  # the device's virtual stages, in chain order
            label = f"{d}\n{', '.join(lanes[d])}"
        ax2.annotate(label, pos[d], fontsize=7, xytext=(4, 4), textcoords="offset points", zorder=5)
    links = [(lk["src_device"], lk["dst_device"]) for lk in plan.predicted.get("links", {}).values()]
    if R > 1:  # every replica's pipeline: replica 0's links moved onto its devices
        on0 = {plan.parts[p].device: p for p in order}
        links = [(plan.parts[plan.replica_parts(r)[on0[a]]].device, plan.parts[plan.replica_parts(r)[on0[b]]].device)
                 for r in range(R) for a, b in links if a in on0 and b in on0]
        for s in order:  # each data-parallel group's ring, dashed
            ring = [plan.parts[p].device for p in plan.dp_group(s)]
            for a, b in zip(ring, ring[1:] + ring[:1]):
                if a in pos and b in pos and a != b:
                    ax2.plot([pos[a][0], pos[b][0]], [pos[a][1], pos[b][1]], ls="--", lw=1.2, color=color[s], zorder=3)
    named: dict[tuple[str, str], str] = {}  # interleaved: a device pair carries several chunks' links
    for k, lk in (plan.predicted.get("links", {}).items() if lanes else ()):
        pair = (lk["src_device"], lk["dst_device"])
        named[pair] = f"{named[pair]}, {k}" if pair in named else k
    links = [(a, b) for a, b in dict.fromkeys(links) if a in pos and b in pos and a != b]
    on_arrows = len(links) <= 4 and len(pos) <= 16  # else the labels overlap: list them in a box instead
    for a, b in links:
        ax2.annotate("", xy=pos[b], xytext=pos[a], zorder=3,
                     arrowprops=dict(arrowstyle="->", color="red", lw=1.4, shrinkA=5, shrinkB=5))
        if on_arrows:
            (xa, ya), (xb, yb) = pos[a], pos[b]
            ax2.annotate(bw_label(a, b), ((xa + xb) / 2, (ya + yb) / 2), fontsize=7, color="darkred", ha="center",
                         va="bottom", zorder=6, bbox=dict(boxstyle="round,pad=0.15", fc="white", ec="none", alpha=0.85))
    if links and not on_arrows:
        rows = [f"{named.get((a, b)) or f'{part_of.get(a, a)}->{part_of.get(b, b)}'}: {bw_label(a, b)}"
                for a, b in links]
        text = "data-flow links\n" + "\n".join(rows[:12]) + (f"\n... {len(rows) - 12} more" if len(rows) > 12 else "")
        ax2.text(0.0, -0.02, text, transform=ax2.transAxes, fontsize=7, color="darkred", va="top", ha="left",
                 bbox=dict(boxstyle="round,pad=0.3", fc="white", ec="0.8"), zorder=7)
    ax2.set_title(f"{len(devs)} devices in {len(clusters)} Louvain clusters;\nused devices coloured by "
                  + ("stage, data flow red, each stage's all-reduce ring dashed" if R > 1
                     else "first chunk, its virtual stages listed (interleaved 1F1B), data flow red" if lanes
                     else "part, data flow red (bandwidth, latency)"), fontsize=10)
    pxs, pys = [q[0] for q in pos.values()] or [0.0], [q[1] for q in pos.values()] or [0.0]
    half = max(max(pxs) - min(pxs), max(pys) - min(pys), 1.0) / 2 + 0.75
    mx, my = (max(pxs) + min(pxs)) / 2, (max(pys) + min(pys)) / 2
    ax2.set_xlim(mx - half, mx + half)
    ax2.set_ylim(my - half, my + half)
    ax2.set_aspect("equal")
    ax2.axis("off")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight", pad_inches=0.2)
    plt.close(fig)
    return path

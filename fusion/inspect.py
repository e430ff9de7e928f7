"""What a plan does, for humans: a text table and a picture.

:func:`plan_report` prints part -> device, nodes, FLOPs, memory, predicted
compute and communication, then every cut edge (tensor, bytes, link, time,
AdaTopK ratio). :func:`draw_plan` writes a PNG with the partitioned DAG (nodes
in topological order, coloured by part, cut edges in red) and the devices
grouped by their Louvain clusters, with the pipeline path drawn between the
devices that hold parts. Everything comes from the plan file alone.
"""
from __future__ import annotations

from pathlib import Path

from .cluster import Cluster
from .estimate import tensor_bytes
from .ir.boundary import part_order
from .plan import Plan


def _fmt_bytes(b: float) -> str:
    for unit, f in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= f:
            return f"{b / f:.2f} {unit}"
    return f"{b:.0f} B"


def _fmt_bw(bps: float) -> str:
    for unit, f in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= f:
            return f"{bps / f:.3g} {unit}"
    return f"{bps:.3g} bit/s"


def cut_edges(plan: Plan) -> list[dict]:
    """One row per (tensor, src part, dst part) crossing between parts."""
    cluster = Cluster.from_dict(plan.cluster, "plan.cluster")
    ratios = {(c.producer, c.index, c.src, c.dst): c.ratio for c in plan.compression}
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
                         "ratio": ratios.get(key, 1.0)}
    return list(rows.values())


def plan_report(plan: Plan) -> str:
    pr = plan.predicted
    order = part_order(plan.graph, plan.assignment)
    n_dev = len(plan.cluster.get("devices", []))
    lines = [f"plan: {len(plan.graph)} nodes, strategy {plan.strategy or '?'}, {len(order)} parts on "
             f"{len({p.device for p in plan.parts.values()})} of {n_dev} devices ({plan.cluster.get('name', '')}), "
             f"schedule {plan.schedule} x {plan.micro_batches} micro-batches"]
    if pr:
        lines.append(f"predicted iteration {pr.get('iteration_s', float('nan')):.4g} s "
                     f"(pipeline {pr.get('pipeline_s', float('nan')):.4g} s + tied-gradient sync {pr.get('sync_s', 0.0):.4g} s; "
                     f"dense {pr.get('dense_iteration_s', float('nan')):.4g} s), "
                     f"throughput {pr.get('throughput_samples_s', float('nan')):.4g} samples/s")
    flops: dict[str, float] = {}
    count: dict[str, int] = {}
    for n in plan.graph.nodes.values():
        p = plan.assignment[n.name]
        flops[p] = flops.get(p, 0.0) + n.meta.flops_fwd + n.meta.flops_bwd
        count[p] = count.get(p, 0) + 1
    ppred = pr.get("parts", {})
    lines.append("")
    lines.append(f"{'part':<8} {'device':<16} {'nodes':>5} {'GFLOP':>10} {'memory':>22} {'compute s':>10} {'comm s':>10}")
    for p in order:
        part = plan.parts[p]
        lim = ppred.get(p, {}).get("memory_limit")
        mem = _fmt_bytes(part.memory_bytes) + (f" / {_fmt_bytes(lim)}" if lim else "")
        lines.append(f"{p:<8} {part.device:<16} {count.get(p, 0):>5} {flops.get(p, 0.0) / 1e9:>10.2f} {mem:>22} "
                     f"{part.predicted_compute_s:>10.4g} {part.predicted_comm_s:>10.4g}")
    edges = cut_edges(plan)
    lines.append("")
    lines.append(f"cut edges ({len(edges)}; per micro-batch, forward; gradients return on the reverse link):")
    lines.append(f"{'tensor':<24} {'parts':<16} {'size':>10} {'link':<36} {'dense s':>9} {'ratio':>7}")
    for e in sorted(edges, key=lambda e: (order.index(e["src"]), order.index(e["dst"]), e["tensor"])):
        link = f"{e['src_device']}->{e['dst_device']} {_fmt_bw(e['bandwidth_bps'])}, {e['latency_s'] * 1e3:.3g} ms"
        lines.append(f"{e['tensor'][:24]:<24} {e['src'] + '->' + e['dst']:<16} {_fmt_bytes(e['bytes']):>10} {link:<36} "
                     f"{e['dense_s']:>9.4g} {e['ratio']:>7.3g}")
    return "\n".join(lines)


def draw_plan(plan: Plan, path: str | Path) -> Path:
    """Write the partitioned DAG and the device clusters as a PNG."""
    import math

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    order = part_order(plan.graph, plan.assignment)
    cmap = plt.get_cmap("tab20")
    color = {p: cmap(i % 20) for i, p in enumerate(order)}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(18, 8), gridspec_kw={"width_ratios": [3, 2]})
    # -- the DAG, topological order in a snake of rows ---------------------------------
    names = list(plan.graph.nodes)
    per_row = max(10, math.ceil(math.sqrt(len(names) * 3)))
    xy = {}
    for i, n in enumerate(names):
        row, col = divmod(i, per_row)
        xy[n] = (col if row % 2 == 0 else per_row - 1 - col, -row)
    for node in plan.graph.nodes.values():
        for prod in node.producers():
            (x0, y0), (x1, y1) = xy[prod], xy[node.name]
            cut = plan.assignment[prod] != plan.assignment[node.name]
            ax1.plot([x0, x1], [y0, y1], color="red" if cut else "0.75", lw=1.6 if cut else 0.5, zorder=2 if cut else 1)
    ax1.scatter([xy[n][0] for n in names], [xy[n][1] for n in names], c=[color[plan.assignment[n]] for n in names],
                s=max(8, 400 / math.sqrt(len(names))), zorder=3, edgecolors="k", linewidths=0.3)
    if len(names) <= 60:
        for n in names:
            ax1.annotate(n, xy[n], fontsize=6, xytext=(2, 3), textcoords="offset points")
    handles = [plt.Line2D([], [], marker="o", ls="", color=color[p], label=f"{p} on {plan.parts[p].device}") for p in order]
    fig.legend(handles=handles[:32], fontsize=8, loc="lower center", ncol=min(8, len(handles)), frameon=False)
    ax1.set_title(f"OP-DAG, {len(names)} nodes in {len(order)} parts (cut edges red; topological order, snake rows)")
    ax1.axis("off")
    # -- the devices by Louvain cluster --------------------------------------------------
    devs = [d["name"] for d in plan.cluster.get("devices", [])]
    clusters = plan.predicted.get("clusters") or [devs]
    pos = {}
    radii = [0.3 + 0.12 * math.sqrt(len(m)) for m in clusters]
    big = max(1.0, sum(2 * r + 0.3 for r in radii) / (2 * math.pi))
    for c, members in enumerate(clusters):
        ang = 2 * math.pi * c / max(1, len(clusters))
        cx, cy = (big * math.cos(ang), big * math.sin(ang)) if len(clusters) > 1 else (0.0, 0.0)
        r = radii[c]
        for k, d in enumerate(members):
            a = 2 * math.pi * k / max(1, len(members))
            pos[d] = (cx + r * math.cos(a), cy + r * math.sin(a))
        if len(clusters) <= 40:
            ax2.annotate(f"C{c} ({len(members)})", (cx, cy), ha="center", va="center", fontsize=7, color="0.4")
    part_of = {}
    for p in order:
        part_of.setdefault(plan.parts[p].device, p)
    used = [d for d in pos if d in part_of]
    free = [d for d in pos if d not in part_of]
    small = 6 if len(pos) > 200 else 30
    ax2.scatter([pos[d][0] for d in free], [pos[d][1] for d in free], s=small, color="0.8", zorder=2)
    ax2.scatter([pos[d][0] for d in used], [pos[d][1] for d in used], s=small * 3, zorder=4,
                color=[color[part_of[d]] for d in used], edgecolors="k")
    for d in used:
        ax2.annotate(d, pos[d], fontsize=7, xytext=(3, 3), textcoords="offset points")
    for key, link in plan.predicted.get("links", {}).items():
        a, b = link["src_device"], link["dst_device"]
        if a in pos and b in pos and a != b:
            ax2.annotate("", xy=pos[b], xytext=pos[a], zorder=3,
                         arrowprops=dict(arrowstyle="->", color="red", lw=1.2, shrinkA=4, shrinkB=4))
    ax2.set_title(f"{len(devs)} devices in {len(clusters)} Louvain clusters; used devices coloured, data flow in red")
    # a square extent: collinear layouts (two clusters of two) would give a zero-height axis
    xs, ys = [q[0] for q in pos.values()] or [0.0], [q[1] for q in pos.values()] or [0.0]
    half = max(max(xs) - min(xs), max(ys) - min(ys), 1.0) / 2 + 0.5
    mx, my = (max(xs) + min(xs)) / 2, (max(ys) + min(ys)) / 2
    ax2.set_xlim(mx - half, mx + half)
    ax2.set_ylim(my - half, my + half)
    ax2.set_aspect("equal")
    ax2.axis("off")
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

"""``fusion profile``: fit lambda_p (actual / peak speed) for this host (FusionLLM §3.5), and its per-node and
per-message overheads (seconds the estimator adds to a part's compute time, :mod:`fusion.cost.profile`)."""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fusion.options.commands import Profile


def run(args: "Profile") -> int:
    """``fusion profile`` with its options (:class:`fusion.options.commands.Profile`)."""
    import json
    from dataclasses import replace
    from pathlib import Path

    from fusion.cluster import ClusterError, load_cluster
    from fusion.ir.errors import FusionError
    from fusion.cluster.units import UnitError, parse_quantity

    if args.model:
        return _node_times(args)
    cluster = dev_index = None
    if args.cluster or args.output or args.name:
        if not (args.cluster and args.name):
            raise FusionError("profile: --cluster and --name go together (and -o needs both)")
        cluster = load_cluster(args.cluster)
        dev_index = cluster.index(args.name)
    peak = None
    if args.peak_flops:
        try:
            peak = parse_quantity(args.peak_flops, "flops")
        except UnitError as e:
            raise FusionError(f"--peak-flops: {e}") from None
        if not peak > 0:
            raise FusionError(f"--peak-flops: must be > 0, got {args.peak_flops!r}")
    elif cluster is not None:
        peak = cluster.devices[dev_index].peak_flops
    prof = _profile_host(args, peak or 1.0, overheads=not args.no_overheads)
    result = prof.to_dict()
    if peak is None:
        result.update(peak_flops=None, **{"lambda": None})
    print(json.dumps(result))
    if peak is None:
        print(f"measured {prof.fitted_flops / 1e9:.4g} GFLOP/s; lambda = measured / peak needs --peak-flops "
              "(e.g. '50 GFLOPS'), or --cluster and --name", file=sys.stderr)
    if cluster is not None and args.output:
        if prof.lam <= 0:
            raise ClusterError(f"{args.cluster}: fitted lambda {prof.lam} is not positive")
        fields = _fitted_fields(args, prof)
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.suffix.lower() in (".yaml", ".yml"):
            out.write_text(_yaml_with_lambda(Path(args.cluster), cluster, args.name, fields))
        else:
            cluster.devices[dev_index] = replace(cluster.devices[dev_index], **fields)
            out.write_text(json.dumps(cluster.to_dict(), indent=1))
        extra = "" if args.no_overheads else (f", node_overhead_s = {fields['node_overhead_s']:.3g}, "
                                               f"message_overhead_s = {fields['message_overhead_s']:.3g}, "
                                               f"step_overhead_s = {fields['step_overhead_s']:.3g}, "
                                               f"feed_overhead_s = {fields['feed_overhead_s']:.3g}, "
                                               f"feed_byte_s = {fields['feed_byte_s']:.3g}, optimizer_byte_s = "
                                               + "/".join(f"{v:.3g}" for v in fields["optimizer_byte_s"]))
        print(f"wrote {args.output} with {args.name}.lambda = {prof.lam:.4g}{extra}")
    return 0


def _fitted_fields(args: "Profile", prof) -> dict:
    """The device attributes ``-o`` writes: lambda, and unless ``--no-overheads`` the fitted fixed costs and each
    codec's measured encode + decode cost."""
    fields: dict = {"lam": prof.lam}
    if not args.no_overheads:
        fields["node_overhead_s"] = prof.node_overhead_interpreted_s if args.interpreted_parts else prof.node_overhead_s
        fields.update(message_overhead_s=prof.message_overhead_s, step_overhead_s=prof.step_overhead_s,
                      feed_overhead_s=prof.feed_overhead_s, feed_byte_s=prof.feed_byte_s,
                      optimizer_byte_s=tuple(prof.optimizer_byte_s), codec_costs=tuple(prof.codec_costs))
    return fields


#: Device attribute -> the key the cluster file spells it with
_FILE_KEYS = {"lam": "lambda", "node_overhead_s": "node_overhead_s", "message_overhead_s": "message_overhead_s",
              "step_overhead_s": "step_overhead_s", "feed_overhead_s": "feed_overhead_s", "feed_byte_s": "feed_byte_s",
              "optimizer_byte_s": "optimizer_byte_s", "codec_costs": "codec_costs"}


def _file_value(key: str, v):
    """How the YAML file spells a fitted value: lambda to 6 decimals, seconds to 4 significant digits,
    ``optimizer_byte_s`` as a mapping per optimizer kind."""
    from fusion.cluster.model import OPTIMIZER_KINDS

    if key == "lam":
        return round(float(v), 6)
    if key == "optimizer_byte_s":
        return {k: float(f"{float(x):.4g}") for k, x in zip(OPTIMIZER_KINDS, v)}
    if key == "codec_costs":
        from fusion.cluster.model import codec_costs_dict

        return codec_costs_dict(v, digits=4)
    return float(f"{float(v):.4g}")


def _yaml_with_lambda(source: Path, cluster, name: str, fields: dict) -> str:
    """The cluster file as YAML with ``fields`` (Device attribute -> value: ``lam`` and the fitted
    overheads) set on device ``name``.

    A readable YAML file keeps its own structure and units (an entry with ``count`` that holds the device is
    split into one entry per device, the others unchanged); anything else is written in the scenario format.
    Comments are not kept.
    """
    import yaml
    from dataclasses import replace

    data = None
    if source.suffix.lower() in (".yaml", ".yml"):
        data = yaml.safe_load(source.read_text())
    if not (isinstance(data, dict) and isinstance(data.get("devices"), list) and "bandwidth_bps" not in data):
        i = cluster.index(name)
        cluster.devices[i] = replace(cluster.devices[i], **fields)
        return yaml.safe_dump(cluster.to_dict(), sort_keys=False)
    put = {_FILE_KEYS[k]: _file_value(k, v) for k, v in fields.items()}
    devices = []
    for e in data["devices"]:
        count = e.get("count") if isinstance(e, dict) else None
        if count is not None and name in {f"{e['name']}-{k}" for k in range(count)}:
            base = {k: v for k, v in e.items() if k not in ("name", "count")}
            base.setdefault("group", e["name"])
            for k in range(count):
                d = {"name": f"{e['name']}-{k}", **base}
                if d["name"] == name:
                    d.update(put)
                devices.append(d)
            continue
        if isinstance(e, dict) and e.get("name") == name:
            e = {**e, **put}
        devices.append(e)
    data["devices"] = devices
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=None)


def _profile_host(args: "Profile", peak: float, overheads: bool):
    """:func:`fusion.cost.profile.profile_host` with the command's ``--device``, ``--sizes``, ``--batch``,
    ``--repeats`` and ``--threads``; a bad value is one line (FusionError)."""
    from fusion.cost.profile import profile_host
    from fusion.ir.errors import FusionError

    try:
        sizes = tuple(int(s) for s in args.sizes.split(",") if s.strip())
        return profile_host(peak, args.device, sizes, args.batch, args.repeats, threads=args.threads,
                            overheads=overheads)
    except ValueError as e:
        raise FusionError(f"profile: {e}") from None


def _node_times(args: "Profile") -> int:
    """``fusion profile --model MODEL -o FILE``: the per-node time table (:mod:`fusion.cost.node_times`)."""
    from fusion.cluster import load_cluster
    from fusion.compile import _ensure_shapes
    from fusion.cost.node_times import measure_node_times
    from fusion.ir.errors import FusionError
    from fusion.loader import load_model

    if not args.output:
        raise FusionError("profile --model: give -o FILE, where the node-times table goes")
    if bool(args.cluster) != bool(args.name):
        raise FusionError("profile --model: --cluster and --name go together (the device whose speed the table records)")
    if args.threads is not None and args.threads < 1:
        raise FusionError(f"--threads: must be >= 1, got {args.threads}")
    model = load_model(args.model)
    _ensure_shapes(model)
    if args.cluster:
        cluster = load_cluster(args.cluster)
        dev = cluster.devices[cluster.index(args.name)]
        speed = dev.peak_flops * dev.lam
        how = f"{args.name}'s lambda x peak_flops in {args.cluster}"
    else:
        speed = _profile_host(args, 1.0, overheads=False).fitted_flops
        how = f"fitted here, --batch {args.batch}"
    table = measure_node_times(model.graph, args.device, args.threads, speed_flops=speed)
    out = table.save(args.output)
    fwd = sum(t.fwd_s for t in table.nodes.values())
    bwd = sum(t.bwd_s for t in table.nodes.values())
    print(f"wrote {out}: {len(table.nodes)} nodes timed on {table.device} ({args.threads or 'default'} threads), "
          f"forward {fwd * 1e3:.3f} ms + backward {bwd * 1e3:.3f} ms per micro-batch in all; host speed "
          f"{speed / 1e9:.4g} GFLOP/s ({how})")
    return 0

"""``fusion export RUN -o OUT``: the trained weights of a run as a ``state_dict`` of the user's own module.

A run's ``final.safetensors`` holds the graph's parameters: one tensor per tied weight, non-persistent buffers
(rotary ``inv_freq``) that the graph reads like any weight, and nothing of buffers folded into constants. The user's
module wants its own ``state_dict`` keys. Export builds the module the run was compiled from (``run.json``'s
MODEL, or ``--model file.py:function``: the user's own code, run again as ``fusion run`` did) and writes exactly
its ``state_dict`` keys, so ``module.load_state_dict(load_file(OUT), strict=True)`` takes it:

- a key the run trained: its final value (cast to the module's dtype);
- a tied key (``lm_head.weight`` sharing ``wte.weight``'s storage): the value of the key the graph kept;
- a buffer the graph never held (folded as a constant, so training never changed it): the module's own value;
- a graph tensor that is no ``state_dict`` key (a non-persistent buffer): left out.

A model built node by node (a fusion ``Model`` or ``OpGraph``) has no module: its weights are written as they are.

A run compiled with ``--subspace`` (:mod:`fusion.compress.subspace`) trained its stream's writers as k-wide weights
behind a fixed basis U: they are folded back (``W = U W'``, ``E = E' U^T + T``) into the module's own keys, a
plain model whose function is the trained one, and U and T (what rebuilds the subspace, to train on in it) go
beside it in ``OUT`` with ``.subspace.safetensors``, the plan's subspace description in its metadata.

A run whose plan has bottlenecks at the cut (``fusion compile --bottleneck``) trained parameters the module does not
have: they go to a second file, ``OUT`` with ``.bottlenecks.safetensors`` in place of its suffix, with a description
of where each one sits in its metadata (:func:`fusion.compress.bottleneck.export_description`);
:func:`fusion.compress.bottleneck.apply_export` puts them back into the model for inference through fusion.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from fusion.ir.errors import FusionError
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fusion.options.commands import Export


def model_spec(run_dir: Path) -> str:
    """The ``file.py:function`` the run in ``run_dir`` compiled, resolved against the directory it ran in."""
    marker = run_dir / "run.json"
    if not marker.is_file():
        raise FusionError(f"{run_dir}: not a run folder (no run.json)")
    try:
        rec = json.loads(marker.read_text())
        argv, cwd = rec["argv"], rec.get("cwd", ".")
        target = argv[argv.index("run") + 1]
    except (ValueError, KeyError, IndexError, json.JSONDecodeError) as e:
        raise FusionError(f"{marker}: cannot read the run's command line ({e}); name the model with --model") from None
    path, sep, func = target.rpartition(":")
    if not sep or not path.endswith(".py"):
        raise FusionError(f"{run_dir}: the run trained {target}, not a MODEL file.py:function; name the model the "
                          "plan was compiled from with --model FILE.py:FUNCTION")
    return f"{Path(cwd, path)}:{func}"


def state_dict_weights(module, trained: dict, spec: str) -> tuple[dict, dict[str, int]]:
    """``module``'s ``state_dict`` keys -> values from ``trained`` (graph name -> tensor), and counts of what was
    tied, kept from the module, and left out. Raises naming the first parameter the run does not hold."""
    import torch

    sd = module.state_dict(keep_vars=True)
    by_storage: dict[tuple, list[str]] = {}
    for k, v in sd.items():
        if v.numel() and v.device.type != "meta":
            by_storage.setdefault((v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape)), []).append(k)
    params = {k for k, _ in module.named_parameters(remove_duplicate=False)}
    out, used, counts = {}, set(), {"tied": 0, "module": 0, "left_out": 0}
    for k, v in sd.items():
        src = k if k in trained else None
        if src is None and v.numel() and v.device.type != "meta":
            twins = by_storage.get((v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape)), [])
            src = next((t for t in twins if t in trained), None)
            counts["tied"] += src is not None
        if src is None:
            if k in params:
                raise FusionError(f"model {spec}: parameter {k!r} is not in the run's weights; is this the model "
                                  "the run trained?")
            out[k] = v.detach().clone()  # a buffer the graph folded: training never changed it
            counts["module"] += 1
            continue
        t = torch.as_tensor(trained[src])
        if tuple(t.shape) != tuple(v.shape):
            raise FusionError(f"model {spec}: {k!r} has shape {list(v.shape)}, the run's {src!r} "
                              f"{list(t.shape)}; is this the model the run trained?")
        out[k] = t.to(v.dtype).clone()
        used.add(src)
    counts["left_out"] = len(set(trained) - used)
    return out, counts


def bottleneck_file(out: Path) -> Path:
    """Where ``fusion export -o OUT`` writes a run's bottlenecks: ``OUT`` with ``.bottlenecks.safetensors``."""
    return out.with_name(out.name.removesuffix(".safetensors") + ".bottlenecks.safetensors")


def subspace_file(out: Path) -> Path:
    """Where ``fusion export -o OUT`` writes what rebuilds a run's subspace: ``OUT`` with ``.subspace.safetensors``."""
    return out.with_name(out.name.removesuffix(".safetensors") + ".subspace.safetensors")


def _subspace(run_dir: Path, trained: dict):
    """(spec, trained weights with the constrained ones folded back into the user's keys, side tensors U and T) of a
    run compiled with ``--subspace`` (:func:`fusion.compress.subspace.fold_back`), None for another run."""
    import torch

    from fusion.compress.subspace import BASIS, SubspaceSpec, export_tensors, fold_back
    from fusion.plan import load_plan

    if not (run_dir / "plan" / "plan.json").is_file():
        return None
    plan = load_plan(run_dir / "plan")
    if plan.subspace is None:
        return None
    spec = SubspaceSpec.from_dict(plan.subspace)
    missing = [n for w in spec.writers for n in (*w.added, BASIS) if n not in trained]
    if missing:
        raise FusionError(f"{run_dir}: the plan's subspace has parameter {missing[0]!r}, the weights do not")
    folded = {k: torch.as_tensor(v) for k, v in fold_back(spec, trained).items()}
    side = {k: torch.as_tensor(v).contiguous() for k, v in export_tensors(spec, trained).items()}
    return spec, folded, side


def _bottlenecks(run_dir: Path, trained: dict):
    """(description, tensors) of the bottlenecks of the run's plan (``RUN/plan``), None without any."""
    from fusion.compress.bottleneck import export_description
    from fusion.plan import load_plan

    if not (run_dir / "plan" / "plan.json").is_file():
        return None
    plan = load_plan(run_dir / "plan")
    if not plan.bottlenecks:
        return None
    desc = export_description(plan.graph, plan.bottlenecks)
    names = [n for b in plan.bottlenecks for n in b.param_names]
    missing = [n for n in names if n not in trained]
    if missing:
        raise FusionError(f"{run_dir}: the plan has bottleneck parameter {missing[0]!r}, the weights do not")
    return desc, {n: trained[n].contiguous() for n in names}


def _write_side_files(out: Path, sub, bneck) -> None:
    """Beside ``OUT``: what rebuilds a run's subspace (``--subspace``) and its bottlenecks at the cut, if any."""
    from safetensors.torch import save_file

    from fusion.compress.bottleneck import EXPORT_KEY
    from fusion.ir.files import atomic_write

    if sub is not None:
        from fusion.compress.subspace import EXPORT_KEY as SUB_KEY

        side = subspace_file(out)
        atomic_write(side, lambda t: save_file(sub[2], str(t), metadata={SUB_KEY: json.dumps(sub[0].to_dict())}))
        print(f"wrote {side}: the subspace (width {sub[0].width}, k = {sub[0].rank}, {len(sub[0].writers)} writers "
              f"folded back into {out.name}) and what rebuilds it ({', '.join(sub[2])})")
    if bneck is not None:
        side = bottleneck_file(out)
        atomic_write(side, lambda t: save_file(bneck[1], str(t), metadata={EXPORT_KEY: json.dumps(bneck[0])}))
        print(f"wrote {side}: {len(bneck[0])} bottleneck(s) at the cut ("
              + ", ".join(f"{d['producer']} {d['width']}->{d['rank']}" for d in bneck[0])
              + "), with where they sit")


def run(args: "Export") -> int:
    """``fusion export`` with its options (:class:`fusion.options.commands.Export`)."""
    import torch
    from safetensors.torch import load_file, save_file

    from fusion.ir.graph import OpGraph
    from fusion.ir.model import Model
    from fusion.loader import load_function, user_error
    from fusion.ir.files import atomic_write

    run_dir = Path(args.run_dir)
    out = Path(args.output)
    if out.exists() and not args.force:
        raise FusionError(f"-o {out}: exists; give --force to replace it")
    weights = Path(args.weights) if args.weights else run_dir / "final.safetensors"
    if not weights.is_file():
        raise FusionError(f"{weights}: no such weights file (a run writes final.safetensors when it ends)")
    spec = args.model or model_spec(run_dir)
    try:
        trained = load_file(str(weights))
    except Exception as e:  # safetensors' own error types
        raise FusionError(f"{weights}: cannot read weights ({e})") from None
    fn = load_function(spec)
    try:
        obj = fn()
    except Exception as e:
        raise FusionError(f"model {spec!r}: {spec.rpartition(':')[2]}() raised {user_error(e, spec.rpartition(':')[0])}") from e
    module = obj[0] if isinstance(obj, tuple) and obj else obj
    sub = _subspace(run_dir, trained)
    if sub is not None:  # the constrained weights folded back into the user's keys before they are matched
        trained = sub[1]
    if isinstance(module, (Model, OpGraph)):  # built node by node: the graph's names are the model's names
        tensors, counts = dict(trained), {"tied": 0, "module": 0, "left_out": 0}
    elif isinstance(module, torch.nn.Module):
        tensors, counts = state_dict_weights(module, trained, spec)
    else:
        raise FusionError(f"model {spec!r}: returned {type(module).__name__}, not a torch module or fusion Model")
    bneck = _bottlenecks(run_dir, trained)
    if bneck is not None:  # the module's own keys in OUT; the bottlenecks beside it
        names = set(bneck[1])
        tensors = {k: v for k, v in tensors.items() if k not in names}
        counts["left_out"] -= len(names) if isinstance(module, torch.nn.Module) else 0
    if sub is not None:
        tensors = {k: v for k, v in tensors.items() if k not in sub[2]}
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    atomic_write(out, lambda t: save_file(tensors, str(t)))
    _write_side_files(out, sub, bneck)
    print(f"wrote {out}: {len(tensors)} tensors of {type(module).__name__} ({counts['tied']} tied, "
          f"{counts['module']} buffers as the module has them, {counts['left_out']} run tensors that are no "
          f"state_dict key left out)")
    return 0

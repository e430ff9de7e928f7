"""``fusion run --config run.yaml``: any option of ``fusion run`` in a YAML file; the command line overrides it.

The file is a mapping of option names (as on the command line without ``--``, dashes or underscores) to values::

    target: examples/models/gpt.py:tiny     # the MODEL|PLAN argument (a command line one wins)
    cluster: examples/clusters/local-4-two-sites.yaml
    steps: 200
    optimizer: adamw
    lr: 3.0e-4
    engine: [part0=torch, part1=numpy]      # a repeatable option takes a list
    no-progress: true                       # a flag: true sets it, false leaves it off

It becomes command-line arguments placed before the ones typed, so argparse checks every value as it would
typed, and an option given on the command line wins (a repeatable one adds to the file's list). An unknown
key is one line naming the file and the key.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from fusion.ir.errors import FusionError

#: the positional argument's key in a config file
TARGET_KEYS = ("target", "model", "plan")


def _config_path(args: list[str]) -> tuple[str | None, list[str]]:
    """(the ``--config`` file, the arguments without it)."""
    rest, path, i = [], None, 0
    while i < len(args):
        a = args[i]
        if a == "--config":
            if i + 1 >= len(args):
                raise FusionError("--config needs a file (run.yaml)")
            path, i = args[i + 1], i + 2
            continue
        if a.startswith("--config="):
            path = a.partition("=")[2]
        else:
            rest.append(a)
        i += 1
    return path, rest


def config_args(path: str, parser: argparse.ArgumentParser) -> tuple[list[str], str | None]:
    """The options of ``path`` as command-line arguments for ``parser``, and the target it names (or None)."""
    import yaml

    f = Path(path)
    try:
        data = yaml.safe_load(f.read_text()) or {}
    except OSError as e:
        raise FusionError(f"--config {path}: cannot read it ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise FusionError(f"--config {path}: not YAML ({' '.join(str(e).split())[:200]})") from None
    if not isinstance(data, dict):
        raise FusionError(f"--config {path}: expected a mapping of option: value, got {type(data).__name__}")
    flags = {s.lstrip("-"): a for a in parser._actions for s in a.option_strings if s.startswith("--")}
    out, target = [], None
    for key, value in data.items():
        name = str(key).replace("_", "-")
        if name in TARGET_KEYS:
            target = str(value)
            continue
        action = flags.get(name)
        if action is None or name in ("config", "help"):
            known = sorted(k for k in flags if k not in ("config", "help"))
            raise FusionError(f"--config {path}: unknown option {key!r} (options: target, {', '.join(known)})")
        if action.nargs == 0:  # a flag
            if not isinstance(value, bool):
                raise FusionError(f"--config {path}: {key!r} is a flag: true or false, got {value!r}")
            if value:
                out.append(f"--{name}")
            continue
        values = value if isinstance(value, list) else [value]
        if len(values) > 1 and not isinstance(action, argparse._AppendAction):
            raise FusionError(f"--config {path}: {key!r} takes one value, got a list")
        for v in values:
            out += [f"--{name}", str(v).lower() if isinstance(v, bool) else str(v)]
    return out, target


def expand(argv: list[str], parser: argparse.ArgumentParser, run_parser: argparse.ArgumentParser) -> list[str]:
    """``argv`` with ``run``'s ``--config FILE`` replaced by the file's options (before the typed ones)."""
    i = next((k for k, a in enumerate(argv) if not a.startswith("-")), None)  # the command (global options take no value)
    if i is None or argv[i] != "run":
        return argv
    path, rest = _config_path(argv[i + 1:])
    if path is None:
        return argv
    extra, target = config_args(path, run_parser)
    # a typed target wins; the file's target goes first (an option's value never starts the list)
    head = [target] if target and not _has_target(rest, run_parser) else []
    return argv[:i + 1] + head + extra + rest


def _has_target(rest: list[str], run_parser: argparse.ArgumentParser) -> bool:
    """Whether the typed arguments hold the positional MODEL|PLAN (an argument that is no option's value)."""
    takes_value = {s for a in run_parser._actions if a.nargs != 0 for s in a.option_strings}
    skip = False
    for a in rest:
        if skip:
            skip = False
            continue
        if a.startswith("-"):
            skip = a in takes_value
            continue
        return True
    return False

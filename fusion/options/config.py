"""``fusion run --config run.yaml``: any option of ``fusion run`` in a YAML file; the command line overrides it.

The file is a mapping of option names (as on the command line without ``--``, dashes or underscores) to values::

    target: examples/models/gpt.py:tiny     # the MODEL|PLAN argument (a command line one wins)
    cluster: examples/clusters/local-4-two-sites.yaml
    steps: 200
    optimizer: adamw
    lr: 3.0e-4
    engine: [part0=torch, part1=numpy]      # a repeatable option takes a list
    no-progress: true                       # a flag: true sets it, false leaves it off

Each value is parsed and checked by its field's own type and choices (:mod:`fusion.options.field`) and becomes
that option's default, so an option given on the command line wins (a repeatable one adds to the file's list).
An unknown key or a bad value is one line naming the file and the key.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from fusion.ir.errors import FusionError
from fusion.options.field import Flag

#: the positional argument's key in a config file
TARGET_KEYS = ("target", "model", "plan")
#: the commands that take --config
CONFIG_COMMANDS = ("run",)


def config_path(argv: list[str]) -> tuple[str | None, str | None]:
    """(the command, its ``--config`` file or None) of a ``fusion`` command line, before it is parsed."""
    i = next((k for k, a in enumerate(argv) if not a.startswith("-")), None)  # global options take no value
    if i is None or argv[i] not in CONFIG_COMMANDS:
        return None, None
    rest = argv[i + 1:]
    path = None
    for k, a in enumerate(rest):
        if a == "--config":
            if k + 1 >= len(rest):
                raise FusionError("--config needs a file (run.yaml)")
            path = rest[k + 1]
        elif a.startswith("--config="):
            path = a.partition("=")[2]
    return argv[i], path


def read_mapping(path: str) -> dict:
    """The YAML mapping in ``path``; FusionError naming the file when it cannot be read or is not a mapping."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as e:
        raise FusionError(f"--config {path}: cannot read it ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise FusionError(f"--config {path}: not YAML ({' '.join(str(e).split())[:200]})") from None
    if not isinstance(data, dict):
        raise FusionError(f"--config {path}: expected a mapping of option: value, got {type(data).__name__}")
    return data


def _value(path: str, key: str, flag: Flag, value: Any) -> Any:
    """One file value as its option's value, checked by the option's own type and choices."""
    if flag.kind == "flag":
        if not isinstance(value, bool):
            raise FusionError(f"--config {path}: {key!r} is a flag: true or false, got {value!r}")
        return value
    values = value if isinstance(value, list) else [value]
    if len(values) > 1 and flag.kind != "append":
        raise FusionError(f"--config {path}: {key!r} takes one value, got a list")
    out = []
    for v in values:
        text = str(v).lower() if isinstance(v, bool) else str(v)
        try:
            v = flag.type(text) if flag.type is not None else text
        except (argparse.ArgumentTypeError, ValueError) as e:
            raise FusionError(f"--config {path}: {key!r} ({flag.flags[-1]}): {e}") from None
        if flag.choices is not None and v not in flag.choices:
            raise FusionError(f"--config {path}: {key!r} ({flag.flags[-1]}): invalid choice {v!r} (choose from "
                              f"{', '.join(map(str, flag.choices))})")
        out.append(v)
    return out if flag.kind == "append" else out[0]


def load_config(path: str, command) -> dict[str, Any]:
    """Field name -> value of every option ``path`` sets for ``command`` (its positional under ``target``)."""
    from fusion.options.parser import fields

    by_name: dict[str, tuple[str, Flag]] = {}
    positional = None
    for _, f, flag in fields(command.options):
        if flag.kind == "positional":
            positional = f.name
        elif f.name != "config":
            for spelling in flag.flags:
                if spelling.startswith("--"):
                    by_name[spelling[2:]] = (f.name, flag)
    out: dict[str, Any] = {}
    for key, value in read_mapping(path).items():
        name = str(key).replace("_", "-")
        if name in TARGET_KEYS and positional is not None:
            out[positional] = str(value)
            continue
        if name not in by_name:
            raise FusionError(f"--config {path}: unknown option {key!r} (options: target, {', '.join(sorted(by_name))})")
        dest, flag = by_name[name]
        out[dest] = _value(path, str(key), flag, value)
    return out

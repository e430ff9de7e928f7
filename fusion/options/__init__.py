"""fusion's options: one tree of typed dataclasses per command (:mod:`fusion.options.commands`), built from
sections (compile, training, data, launch, listening, security) whose fields carry their flag, default, type,
choices and help (:mod:`fusion.options.field`). The argparse parser is generated from the tree
(:mod:`fusion.options.parser`), a ``--config`` YAML file is read into it (:mod:`fusion.options.config`), and each
command's ``check()`` refuses bad values once, before any work. How to add an option: docs/design.md."""
from __future__ import annotations

import argparse
from typing import Any


def parse(argv: list[str]) -> tuple[argparse.Namespace, Any]:
    """(the parsed command line: global flags and the command's name; the command's typed options tree, None
    without a command). A ``--config`` file's values are the defaults the command line overrides."""
    from fusion.options.commands import COMMANDS
    from fusion.options.config import config_path, load_config
    from fusion.options.parser import build_parser, options_of

    command, path = config_path(argv)
    config = {command: load_config(path, COMMANDS[command])} if path else None
    ns = build_parser(config).parse_args(argv)
    return ns, (options_of(ns) if getattr(ns, "command", None) else None)

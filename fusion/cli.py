"""The ``fusion`` command line.

Each subcommand lives in ``fusion/commands/<name>.py`` and provides
``add_parser(subparsers)`` and ``run(args) -> int``. Any
:class:`~fusion.ir.errors.FusionError` becomes a one-line message on stderr
and exit status 2.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

from .ir.errors import FusionError

#: subcommand modules, in the order ``fusion --help`` lists them
COMMANDS = [
    "fusion.commands.graph",
    "fusion.commands.compile",
    "fusion.commands.inspect",
    "fusion.commands.profile",
    "fusion.commands.run",
    "fusion.commands.executor",
    "fusion.commands.coordinator",
]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fusion", description="Train one model on many heterogeneous GPUs over slow links (FusionLLM).")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-v info, -vv debug)")
    from . import __version__

    p.add_argument("--version", action="version", version=f"fusion {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for modname in COMMANDS:
        importlib.import_module(modname).add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=[logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)],
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not getattr(args, "command", None):
        parser.print_help()
        return 0
    try:
        return int(args.run(args) or 0)
    except FusionError as e:
        print(f"fusion {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

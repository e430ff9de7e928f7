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

from fusion.ir.errors import FusionError

#: subcommand modules, in the order ``fusion --help`` lists them
COMMANDS = [
    "fusion.commands.graph",
    "fusion.commands.compile",
    "fusion.commands.inspect",
    "fusion.commands.profile",
    "fusion.commands.run",
    "fusion.commands.export",
    "fusion.commands.executor",
    "fusion.commands.coordinator",
    "fusion.commands.keys",
    "fusion.commands.relay",
]


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default (unless it has none worth showing or says it already)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        h = action.help or ""
        d = action.default
        if (not action.option_strings or "default" in h or d is None or d is False or d == [] or d is argparse.SUPPRESS
                or isinstance(action, (argparse._HelpAction, argparse._VersionAction, argparse._CountAction))):
            return h
        return h + " (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """An argparse parser whose usage errors are one line (and exit status 2)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")

    def parse_args(self, args=None, namespace=None):
        """As argparse's, but an unknown option is reported by the subcommand it was given to (``fusion run:
        error: unrecognized arguments: --batch-size 8 (did you mean --batch?)``), not by ``fusion``."""
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            sub = next((a for a in self._actions if isinstance(a, argparse._SubParsersAction)), None)
            owner = sub.choices.get(getattr(ns, "command", None)) if sub is not None else None
            (owner or self).error(f"unrecognized arguments: {' '.join(extras)}{_did_you_mean(extras, owner or self)}")
        return ns


#: names other training tools use for an option fusion spells otherwise
OTHER_NAMES = {"--batch-size": "--global-batch", "--max-steps": "--steps", "--learning-rate": "--lr",
               "--num-steps": "--steps", "--train-steps": "--steps", "--dataset": "--data"}


def _did_you_mean(extras: list[str], parser: argparse.ArgumentParser) -> str:
    """`` (did you mean --x?)`` for the first unknown option that another tool's name for one of ``parser``'s
    (:data:`OTHER_NAMES`) or close to one of them, else ''."""
    import difflib

    known = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    for e in extras:
        if e.startswith("--"):
            name = e.split("=", 1)[0]
            close = [OTHER_NAMES[name]] if OTHER_NAMES.get(name) in known else \
                difflib.get_close_matches(name, known, n=1, cutoff=0.6)
            if close:
                return f" (did you mean {close[0]}?)"
    return ""


VERBOSE_HELP = "more logging (-v info, -vv debug); before or after the command"
TRACEBACK_HELP = ("on an error, also print the traceback of its cause (your model's or data function's own, when "
                  "they raised it); -vv does too")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="fusion", formatter_class=HelpFormatter,
               description="Train one model on many heterogeneous GPUs over slow links (FusionLLM).")
    p.add_argument("-v", "--verbose", action="count", default=0, help=VERBOSE_HELP)
    from fusion import __version__

    p.add_argument("--version", action="version", version=f"fusion {__version__}")
    p.add_argument("--traceback", action="store_true", help=TRACEBACK_HELP)
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for modname in COMMANDS:
        importlib.import_module(modname).add_parser(sub)
    for sp in sub.choices.values():
        sp.formatter_class = HelpFormatter
        # -v after the command too; its own dest, summed with the one before the command
        sp.add_argument("-v", "--verbose", action="count", default=0, dest="verbose_after", help=VERBOSE_HELP)
        sp.add_argument("--traceback", action="store_true", dest="traceback_after", help=TRACEBACK_HELP)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        from fusion.commands.runconfig import expand

        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        argv = expand(argv, parser, sub.choices["run"])  # fusion run --config run.yaml: its options, then the typed ones
    except FusionError as e:
        print(f"fusion run: error: {one_line(str(e))}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    # long-running commands (executor, coordinator) log at info by default: they say what they wait for
    level = args.verbose + getattr(args, "verbose_after", 0) + getattr(args, "default_verbosity", 0)
    logging.basicConfig(level=[logging.WARNING, logging.INFO, logging.DEBUG][min(level, 2)],
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not getattr(args, "command", None):
        parser.print_help()
        return 0
    try:
        return int(args.run(args) or 0)
    except FusionError as e:
        if args.traceback or getattr(args, "traceback_after", False) or level >= 2:
            print_cause(e)
        print(f"fusion {args.command}: error: {one_line(str(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def print_cause(e: BaseException) -> None:
    """The traceback of what caused ``e`` (its innermost explicit cause: the user's exception when their code
    raised it, e.g. the model's forward run on its example), or of ``e`` itself, on stderr."""
    import traceback

    inner = e
    while inner.__cause__ is not None:
        inner = inner.__cause__
    sys.stderr.write("".join(traceback.format_exception(type(inner), inner, inner.__traceback__, chain=False)))


def one_line(text: str, limit: int = 600) -> str:
    """A message on one line, cut to ``limit`` characters (the rest is never what the user needs first)."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 20].rstrip() + f" ... ({len(text)} chars)"


if __name__ == "__main__":
    sys.exit(main())

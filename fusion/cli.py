"""The ``fusion`` command line.

Each command's options are a typed tree (:mod:`fusion.options`: the parser is generated from it, ``--config``
is read into it, ``check()`` refuses bad values before any work); the command itself lives in
``fusion/commands/<name>.py`` as ``run(options) -> int``. Any
:class:`~fusion.ir.errors.FusionError` becomes a one-line message on stderr
and exit status 2.
"""
from __future__ import annotations

import logging
import sys

from fusion.ir.errors import FusionError
from fusion.options.parser import build_parser  # the parser, generated from the options tree


def main(argv: list[str] | None = None) -> int:
    import importlib

    from fusion.options import parse
    from fusion.options.commands import COMMANDS

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args, options = parse(argv)
    except FusionError as e:  # a --config file that cannot be read into the options
        print(f"fusion run: error: {one_line(str(e))}", file=sys.stderr)
        return 2
    # long-running commands (executor, coordinator) log at info by default: they say what they wait for
    level = args.verbose + getattr(args, "verbose_after", 0) + getattr(args, "default_verbosity", 0)
    logging.basicConfig(level=[logging.WARNING, logging.INFO, logging.DEBUG][min(level, 2)],
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if options is None:
        build_parser().print_help()
        return 0
    try:
        options.check()  # every option check of the command, once, before it does any work
        rc = int(importlib.import_module(COMMANDS[args.command].module).run(options) or 0)
        sys.stdout.flush()  # here, not at exit: a reader that left is a BrokenPipeError below, not a shutdown warning
        return rc
    except FusionError as e:
        if args.traceback or getattr(args, "traceback_after", False) or level >= 2:
            print_cause(e)
        print(f"fusion {args.command}: error: {one_line(str(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `fusion inspect PLAN | head`: the reader left; say nothing more, as `cat` does
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes at exit
        return 141  # 128 + SIGPIPE, what a shell reports for a tool the pipe stopped


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

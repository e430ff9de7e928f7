"""The ``fusion`` argparse parser, generated from the options tree (:mod:`fusion.options.commands`): one
subparser per :data:`~fusion.options.commands.COMMANDS` entry, one argument group per section (and per ``group``
of a section's fields), every flag, default, type, choices and help from its field. :func:`options_of` turns a
parsed namespace back into the command's typed tree. The only module that declares argparse options."""
from __future__ import annotations

import argparse
import dataclasses
import difflib
from typing import Any, Iterator

from fusion.options.commands import COMMANDS
from fusion.options.field import Flag, default_of, flag_of
from fusion.options.help import FullHelp, GroupHelp, HelpGroup, group_key

VERBOSE_HELP = "more logging (-v info, -vv debug); before or after the command"
TRACEBACK_HELP = ("on an error, also print the traceback of its cause (your model's or data function's own, when "
                  "they raised it); -vv does too")
#: names other training tools use for an option fusion spells otherwise
OTHER_NAMES = {"--batch-size": "--global-batch", "--max-steps": "--steps", "--learning-rate": "--lr",
               "--num-steps": "--steps", "--train-steps": "--steps", "--dataset": "--data"}


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


def _did_you_mean(extras: list[str], parser: argparse.ArgumentParser) -> str:
    """`` (did you mean --x?)`` for the first unknown option that another tool's name for one of ``parser``'s
    (:data:`OTHER_NAMES`) or close to one of them, else ''."""
    known = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    for e in extras:
        if e.startswith("--"):
            name = e.split("=", 1)[0]
            close = [OTHER_NAMES[name]] if OTHER_NAMES.get(name) in known else \
                difflib.get_close_matches(name, known, n=1, cutoff=0.6)
            if close:
                return f" (did you mean {close[0]}?)"
    return ""


def fields(tree: type) -> Iterator[tuple[str | None, dataclasses.Field, Flag]]:
    """(section title or None for the command's own, field, its flag) of every option of a command's tree."""
    for f in dataclasses.fields(tree):
        sec = f.metadata.get("section")
        if sec is not None:
            for g in dataclasses.fields(sec):
                yield sec.TITLE, g, flag_of(g)
        elif flag_of(f) is not None:
            yield None, f, flag_of(f)


def add_option(container, f: dataclasses.Field, flag: Flag, default: Any = dataclasses.MISSING) -> argparse.Action:
    """One argparse argument from field ``f`` (``default``: a ``--config`` file's value instead of the field's)."""
    value = default_of(f) if default is dataclasses.MISSING else default
    kw: dict[str, Any] = {"help": argparse.SUPPRESS if flag.hidden else flag.help}
    if flag.kind == "positional":
        if default is not dataclasses.MISSING:  # a config file named it: the command line may leave it out
            kw.update(nargs="?", default=value)
        return container.add_argument(f.name, metavar=flag.metavar, **kw)
    kw["dest"] = f.name
    if flag.kind == "flag":
        return container.add_argument(*flag.flags, action="store_true", default=bool(value), **kw)
    if flag.kind == "append":
        kw["action"] = "append"
    for k in ("type", "metavar"):
        if getattr(flag, k) is not None:
            kw[k] = getattr(flag, k)
    if flag.choices is not None:
        kw["choices"] = list(flag.choices)
    return container.add_argument(*flag.flags, default=value, required=flag.required and default is dataclasses.MISSING,
                                  **kw)


def add_command(sub, command, config: dict[str, Any] | None = None) -> argparse.ArgumentParser:
    """The subparser of ``command`` (a :class:`~fusion.options.commands.Command`); ``config``: field -> value from
    a ``--config`` file, the defaults the command line overrides. Its ``--help`` is short
    (:mod:`fusion.options.help`): the essential options per group; ``--help GROUP`` and ``--help-all`` the rest."""
    p = sub.add_parser(command.name, help=command.help, description=command.description,
                       formatter_class=HelpFormatter, add_help=False)
    own = HelpGroup("options", "options", "options")
    helps: list[HelpGroup] = [own]
    p.add_argument("-h", "--help", action=GroupHelp, groups=helps, description=command.help,
                   help="this short help; --help GROUP: one group of options in full")
    p.add_argument("--help-all", action=FullHelp, help="every option, grouped")
    groups: dict[str, Any] = {}
    exclusive: dict[str, Any] = {}
    note = " a MODEL (a PLAN has these fixed already)" if command.name == "run" else ""
    for title, f, flag in fields(command.options):
        name = None if title is None else f"{title}{note if title == 'compiling' else ''}" + \
            (f": {flag.group}" if flag.group else "")
        if name is not None and name not in groups:
            groups[name] = p.add_argument_group(name)
            helps.append(HelpGroup(group_key(flag.group or title), name, flag.group or title))
        container = p if name is None else groups[name]
        if flag.exclusive:
            if flag.exclusive not in exclusive:
                exclusive[flag.exclusive] = container.add_mutually_exclusive_group()
            container = exclusive[flag.exclusive]
        action = add_option(container, f, flag, (config or {}).get(f.name, dataclasses.MISSING))
        group = own if name is None else next(h for h in helps if h.title == name)
        group.actions.append(action)
        if (flag.essential or flag.required) and not flag.hidden:
            group.essential.append(action)
    own.actions += [p.add_argument("-v", "--verbose", action="count", default=0, dest="verbose_after",
                                   help=VERBOSE_HELP),
                    p.add_argument("--traceback", action="store_true", dest="traceback_after", help=TRACEBACK_HELP)]
    p.set_defaults(default_verbosity=command.default_verbosity)
    return p


def build_parser(config: dict[str, dict[str, Any]] | None = None) -> argparse.ArgumentParser:
    """The ``fusion`` parser; ``config``: command -> (field -> value) read from a ``--config`` file."""
    from fusion import __version__

    p = Parser(prog="fusion", formatter_class=HelpFormatter,
               description="Train one model on many heterogeneous GPUs over slow links (FusionLLM).")
    p.add_argument("-v", "--verbose", action="count", default=0, help=VERBOSE_HELP)
    p.add_argument("--version", action="version", version=f"fusion {__version__}")
    p.add_argument("--traceback", action="store_true", help=TRACEBACK_HELP)
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for command in COMMANDS.values():
        add_command(sub, command, (config or {}).get(command.name))
    return p


def options_of(ns: argparse.Namespace) -> Any:
    """The typed options tree of the command ``ns`` was parsed for."""
    tree = COMMANDS[ns.command].options
    kw = {}
    for f in dataclasses.fields(tree):
        sec = f.metadata.get("section")
        kw[f.name] = sec(**{g.name: getattr(ns, g.name) for g in dataclasses.fields(sec)}) if sec else getattr(ns, f.name)
    return tree(**kw)

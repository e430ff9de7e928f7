"""Short help by default (issue 38): ``fusion COMMAND --help`` shows the usage line, the command's one line, and
per group of the options tree only its essential options (a field declared with ``essential=True``, or a required
one) and how many others it has; ``--help GROUP`` shows one group in full and ``--help-all`` every option, grouped
as the tree groups them. The parser (:mod:`fusion.options.parser`) adds the two actions and fills the groups."""
from __future__ import annotations

import argparse
import shutil
import sys
import textwrap
from dataclasses import dataclass, field

#: the short help's widest line (narrower on a narrower terminal)
MAX_WIDTH = 100
#: the column an essential option's one line of help starts at
HELP_COLUMN = 24
#: a command whose full help is at most this many lines shows it all on ``--help``
SHORT_LINES = 60


@dataclass
class HelpGroup:
    """One group of a command's ``--help``: an options-tree section, or one ``group`` of a section's fields."""

    #: what ``--help GROUP`` takes: the first word of the group's own title (``compression``, ``training``)
    key: str
    #: the group's heading in ``--help-all`` (argparse's argument group title)
    title: str
    #: its heading in the short help: the group's own title (``compression``, not ``compiling a MODEL ...:
    #: compression``)
    heading: str
    #: the group's options, in declaration order
    actions: list[argparse.Action] = field(default_factory=list)
    #: those the short help lists (the rest are counted)
    essential: list[argparse.Action] = field(default_factory=list)


def group_key(title: str) -> str:
    """``--help GROUP``'s name of the group titled ``title`` (its first word, lower case)."""
    return title.split()[0].lower()


def shown(action: argparse.Action) -> bool:
    """An option ``--help-all`` lists (not a hidden one, not a help action itself)."""
    return action.help is not argparse.SUPPRESS and not isinstance(action, (GroupHelp, FullHelp))


def usage(parser: argparse.ArgumentParser, groups: list[HelpGroup]) -> str:
    """``usage: fusion run MODEL|PLAN [options]``: the positionals and required options, the rest as [options]."""
    words = []
    for g in groups:
        for a in g.actions:
            if not a.option_strings:
                words.append(a.metavar or a.dest)
            elif a.required:
                words.append(f"{a.option_strings[-1]} {a.metavar or a.dest.upper()}")
    return f"usage: {parser.prog} {' '.join(words + ['[options]'])}"


def one_line(action: argparse.Action, width: int) -> str:
    """``  --steps STEPS          train until ...``: the option and the first clause of its help, cut to ``width``."""
    if action.option_strings:
        inv = ", ".join(action.option_strings)
        if action.nargs != 0:
            inv += " " + (action.metavar or (("{" + ",".join(map(str, action.choices)) + "}") if action.choices
                                             else action.dest.upper()))
    else:
        inv = action.metavar or action.dest
    text = (action.help or "").replace("%%", "%").split("; ")[0]
    head = f"  {inv:<{HELP_COLUMN - 3}} "
    if len(head) > HELP_COLUMN:  # a long option: its help on the next line, as argparse does
        head = f"  {inv}\n" + " " * HELP_COLUMN
    return head + textwrap.shorten(text, width - HELP_COLUMN, placeholder=" ...")


def short_help(parser: argparse.ArgumentParser, groups: list[HelpGroup], description: str) -> str:
    """The default ``--help``: usage, the command's one line, each group's essential options and the count of its
    others, and how to see them all."""
    width = min(MAX_WIDTH, shutil.get_terminal_size().columns)
    lines = [usage(parser, groups), "", description, ""]
    total = 0
    for g in groups:
        opts = [a for a in g.actions if shown(a) and a.option_strings]
        total += len(opts)
        essential = [a for a in g.essential if a.option_strings]
        more = len(opts) - len(essential)
        if not opts:
            continue
        noun = "more" if essential else "option" if more == 1 else "options"
        tail = f" ({more} {noun}: --help {g.key})"
        lines.append(f"{g.heading}:{tail if more else ''}")
        lines += [one_line(a, width) for a in essential]
    lines += ["", f"all {total} options: {parser.prog} --help-all (or --help GROUP)"]
    return "\n".join(lines) + "\n"


def group_help(parser: argparse.ArgumentParser, groups: list[HelpGroup], group: HelpGroup) -> str:
    """``--help GROUP``: the usage line and that group in full, as ``--help-all`` shows it."""
    f = parser._get_formatter()
    f.add_text(usage(parser, groups))
    f.start_section(group.title)
    f.add_arguments([a for a in group.actions if shown(a)])
    f.end_section()
    return f.format_help()


class GroupHelp(argparse.Action):
    """``-h, --help [GROUP]``: the short help, or one group in full; an unknown GROUP is one line, exit 2."""

    def __init__(self, option_strings, dest, groups: list[HelpGroup], description: str, **kw):
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs="?",
                         metavar="GROUP", **kw)
        self.groups = groups
        self.description = description

    def __call__(self, parser, namespace, values, option_string=None):
        if values is None:
            full = parser.format_help()
            short = full.count("\n") <= SHORT_LINES
            parser._print_message(full if short else short_help(parser, self.groups, self.description), sys.stdout)
            parser.exit()
        match = [g for g in self.groups if values.lower() in (g.key, g.title.lower())]
        if not match:
            keys = ", ".join(g.key for g in self.groups if any(a.option_strings for a in g.actions))
            parser.error(f"--help {values}: no such group of options (groups: {keys})")
        parser._print_message(group_help(parser, self.groups, match[0]), sys.stdout)
        parser.exit()


class FullHelp(argparse.Action):
    """``--help-all``: every option, grouped as the options tree groups them (argparse's full help)."""

    def __init__(self, option_strings, dest, **kw):
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.print_help()
        parser.exit()

"""What one command-line option is: :class:`Flag`, attached to a dataclass field by :func:`option`, and
:class:`Section`, the base of a node of the options tree (a group of fields with its own :meth:`Section.check`).

A field declared with :func:`option` is everything fusion knows about that option: its flag spelling, default,
value type, choices, metavar and help. The argparse parsers (:mod:`fusion.options.parser`) and the ``--config``
loader (:mod:`fusion.options.config`) are generated from these fields; nothing else declares an option.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

#: the kinds of option: a value, a flag (store_true), a repeatable value (append), a positional argument
KINDS = ("value", "flag", "append", "positional")


@dataclass(frozen=True)
class Flag:
    """How one dataclass field appears on the command line and in a ``--config`` file."""

    #: the spellings on the command line, the long one last (``("-o", "--output")``); empty for a positional
    flags: tuple[str, ...]
    #: the one line of ``--help`` (argparse's ``%%`` escapes included); the default is appended by the formatter
    help: str
    #: value, flag, append or positional (:data:`KINDS`)
    kind: str = "value"
    #: parses one command-line string into the value (an ``argparse`` type: raises ArgumentTypeError or ValueError)
    type: Callable[[str], Any] | None = None
    #: the values allowed (None: any the type accepts)
    choices: tuple | None = None
    #: the placeholder in ``--help`` (None: argparse's, the dest in capitals)
    metavar: str | None = None
    #: the command refuses to start without it
    required: bool = False
    #: kept out of ``--help`` (an internal flag one fusion process passes another)
    hidden: bool = False
    #: the ``--help`` group inside the section (None: the section's own title)
    group: str | None = None
    #: the name of a mutually exclusive set this flag is part of (None: none)
    exclusive: str | None = None
    #: shown in the short default ``--help`` (the others are counted per group; ``--help-all`` lists them all);
    #: a required option always is
    essential: bool = False

    @property
    def name(self) -> str:
        """The long spelling without dashes (``output``), as a ``--config`` key takes it."""
        return self.flags[-1].lstrip("-") if self.flags else ""


def option(*flags: str, help: str, default: Any = None, kind: str | None = None, type: Callable | None = None,
           choices=None, metavar: str | None = None, required: bool = False, hidden: bool = False,
           group: str | None = None, exclusive: str | None = None, essential: bool = False) -> Any:
    """A dataclass field that is a command-line option (``flags`` empty: a positional argument). ``kind`` defaults
    to ``positional`` without flags, ``append`` for a list default, else ``value``."""
    if kind is None:
        kind = "positional" if not flags else "append" if isinstance(default, list) else "value"
    if kind not in KINDS:
        raise ValueError(f"option kind {kind!r}: expected one of {KINDS}")
    meta = {"flag": Flag(tuple(flags), help, kind, type, tuple(choices) if choices is not None else None, metavar,
                         required, hidden, group, exclusive, essential)}
    if kind == "flag":
        default = False
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda d=tuple(default): list(d), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def flag_of(f: dataclasses.Field) -> Flag | None:
    """The :class:`Flag` of a dataclass field (None for a field that is no option)."""
    return f.metadata.get("flag")


def default_of(f: dataclasses.Field) -> Any:
    """The default value of a dataclass field (a fresh list for a repeatable option)."""
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


@dataclass
class Section:
    """A node of the options tree: a dataclass of options (declared with :func:`option`) that belong together.
    ``TITLE`` heads its group in ``--help``; :meth:`check` refuses values that cannot be right, before any work."""

    TITLE: ClassVar[str] = "options"

    def check(self) -> None:
        """Raise FusionError (one line naming the option) for a value this section alone can tell is wrong."""

"""Short help by default (issue 38, fusion/options/help.py): ``fusion COMMAND --help`` is at most 60 lines, lists
every group of the options tree and every essential (or required) option; ``--help-all`` lists every option of the
tree (walked here, so a new option cannot be left out); ``--help GROUP`` shows one group in full; an unknown GROUP
is one line and exit status 2."""
from __future__ import annotations

import pytest

from fusion.options import parse
from fusion.options.commands import COMMANDS
from fusion.options.help import SHORT_LINES, group_key
from fusion.options.parser import fields

LONG = ("run", "compile", "coordinator", "executor")  # the commands whose full help is longer than SHORT_LINES


def help_of(capsys, monkeypatch, *argv: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``fusion ARGV`` on a 100-column terminal."""
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit) as e:
        parse(list(argv))
    out = capsys.readouterr()
    return e.value.code or 0, out.out, out.err


def visible(name: str):
    """(section title, field, flag) of every option of ``name``'s tree that --help shows."""
    return [(t, f, fl) for t, f, fl in fields(COMMANDS[name].options) if not fl.hidden]


@pytest.mark.parametrize("name", LONG)
def test_the_default_help_is_short_and_names_every_group_and_essential(name, capsys, monkeypatch):
    rc, out, _ = help_of(capsys, monkeypatch, name, "--help")
    assert rc == 0
    lines = out.splitlines()
    assert len(lines) <= SHORT_LINES, out
    assert lines[0].startswith(f"usage: fusion {name} ") and COMMANDS[name].help in lines[2]
    assert lines[-1].startswith("all ") and f"fusion {name} --help-all" in lines[-1]
    for title, f, flag in visible(name):
        if flag.flags:
            key = group_key(flag.group or title) if title else "options"
            assert f"--help {key})" in out, (name, key)
        if flag.flags and (flag.essential or flag.required):
            assert f"  {', '.join(flag.flags)} " in out, (name, flag.flags)
        elif flag.flags:  # the others are counted, not listed
            assert not any(line.startswith(f"  {flag.flags[-1]} ") for line in lines), (name, flag.flags)
    rc, full, _ = help_of(capsys, monkeypatch, name, "--help-all")
    assert len(full.splitlines()) > SHORT_LINES  # else the short help would be the full one


@pytest.mark.parametrize("name", list(COMMANDS))
def test_help_all_lists_every_option_of_the_tree(name, capsys, monkeypatch):
    rc, out, _ = help_of(capsys, monkeypatch, name, "--help-all")
    assert rc == 0
    for _, f, flag in visible(name):
        for spelling in flag.flags or (flag.metavar or f.name,):
            assert spelling in out, (name, spelling)
    n = sum(1 for _, _, fl in visible(name) if fl.flags) + 2  # and -v, --traceback
    if name in LONG:
        assert f"all {n} options:" in help_of(capsys, monkeypatch, name, "-h")[1]


def test_a_short_command_shows_its_whole_help(capsys, monkeypatch):
    _, out, _ = help_of(capsys, monkeypatch, "graph", "--help")
    assert out == help_of(capsys, monkeypatch, "graph", "--help-all")[1]


def test_help_group_shows_that_group_in_full(capsys, monkeypatch):
    rc, out, _ = help_of(capsys, monkeypatch, "run", "--help", "compression")
    assert rc == 0 and out.startswith("usage: fusion run MODEL|PLAN [options]")
    compression = [fl for _, _, fl in visible("run") if fl.group == "compression"]
    others = [fl for _, _, fl in visible("run") if fl.flags and fl.group != "compression"]
    assert compression and all(fl.flags[-1] in out for fl in compression)
    assert not any(f"  {fl.flags[-1]} " in out for fl in others)


def test_an_unknown_help_group_is_one_line_and_status_2(capsys, monkeypatch):
    rc, out, err = help_of(capsys, monkeypatch, "run", "--help", "colours")
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and "--help colours: no such group" in err and "compression" in err

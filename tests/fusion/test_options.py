"""The options tree (fusion/options, issue 37): every option is one field with its flag and help; the parser,
--config and the typed tree all come from it; argparse and YAML give the same tree; adding an option is one
place; no other module declares argparse options and the executors host no CLI checks."""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from fusion.options import parse
from fusion.options.commands import COMMANDS, Command, section
from fusion.options.field import Section, option
from fusion.options.parser import fields

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_field_has_help_and_a_flag_and_one_name(name):
    seen_dest, seen_flag = set(), set()
    for _, f, flag in fields(COMMANDS[name].options):
        assert flag is not None, f"{name}: field {f.name} is no option"
        assert flag.help.strip(), f"{name}: {f.name} has no help"
        assert flag.flags or flag.kind == "positional", f"{name}: {f.name} has no flag"
        assert all(s.startswith("-") for s in flag.flags)
        assert f.name not in seen_dest, f"{name}: two fields named {f.name}"
        assert not seen_flag & set(flag.flags), f"{name}: {flag.flags} spelled twice"
        seen_dest.add(f.name)
        seen_flag |= set(flag.flags)
    for f in dataclasses.fields(COMMANDS[name].options):  # a command's fields: options or sections, nothing else
        assert f.metadata.get("flag") or f.metadata.get("section"), f"{name}: {f.name}"


def test_a_shared_section_is_declared_once():
    """run and coordinator take the same training and data options: the same section classes."""
    def sections(cmd):
        return {f.metadata["section"] for f in dataclasses.fields(COMMANDS[cmd].options) if f.metadata.get("section")}
    shared = sections("run") & sections("coordinator")
    assert {s.__name__ for s in shared} == {"TrainOptions", "DataOptions"}
    assert {s.__name__ for s in sections("executor") & sections("coordinator")} == {"Security"}
    assert {s.__name__ for s in sections("compile") & sections("run")} == {"CompileOptions"}


ARGV = ["--steps", "7", "--lr", "0.2", "--engine", "numpy", "--engine", "part0=torch", "--no-progress",
        "--join-at", "4:1", "--val-split", "2.5", "--data", "text:/tmp", "--checkpoint-every", "3", "--trace", "off",
        "--compress", "quant:bits=8", "--inner-steps", "20", "--dp-sync", "diloco", "--replicas", "2"]
YAML = """target: m.py:f
steps: 7
lr: 0.2
engine: [numpy, part0=torch]
no-progress: true
join_at: ["4:1"]
val-split: 2.5
data: text:/tmp
checkpoint_every: 3
trace: "off"
compress: quant:bits=8
inner-steps: 20
dp-sync: diloco
replicas: 2
"""


def test_argparse_and_yaml_give_the_same_tree(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(YAML)
    typed = parse(["run", "m.py:f", *ARGV])[1]
    from_file = parse(["run", "--config", str(cfg)])[1]
    assert dataclasses.replace(from_file, config=None) == typed
    assert typed.train.join_at == [(4, 1)] and typed.compile.engine == ["numpy", "part0=torch"]


def test_the_defaults_are_the_fields_defaults():
    o = parse(["run", "m.py:f"])[1]
    assert o.compile == type(o.compile)() and o.train == type(o.train)() and o.launch == type(o.launch)()


def test_adding_an_option_is_one_place(monkeypatch, tmp_path, capsys):
    """One field in a section gives the flag, its --help line, its --config key, its check and its typed value."""
    from fusion.ir.errors import FusionError

    @dataclasses.dataclass
    class Colour(Section):
        TITLE = "colours"
        colour: str = option("--colour", default="red", choices=("red", "blue"), help="the colour of the demo")

        def check(self):
            if self.colour == "blue":
                raise FusionError("--colour blue: not today")

    @dataclasses.dataclass
    class Demo:
        target: str = option(help="what to colour")
        config: str | None = option("--config", help="a YAML file")
        colours: Colour = section(Colour)

        def check(self):
            self.colours.check()

    monkeypatch.setitem(COMMANDS, "run", Command("run", Demo, "demo", "a demo", "A demo."))
    assert parse(["run", "x", "--colour", "blue"])[1].colours.colour == "blue"
    assert parse(["run", "x"])[1].colours.colour == "red"
    cfg = tmp_path / "c.yaml"
    cfg.write_text("colour: blue\n")
    opts = parse(["run", "x", "--config", str(cfg)])[1]
    with pytest.raises(FusionError, match="not today"):
        opts.check()
    with pytest.raises(SystemExit):
        parse(["run", "x", "--colour", "green"])
    with pytest.raises(SystemExit):
        parse(["run", "--help"])
    assert "colours:" in capsys.readouterr().out


def _declares_argparse_options(file: Path) -> bool:
    tree = ast.parse(file.read_text())
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "add_argument"
               for n in ast.walk(tree))


def test_one_module_declares_argparse_options():
    files = [f.relative_to(ROOT).as_posix() for f in sorted((ROOT / "fusion").rglob("*.py"))
             if _declares_argparse_options(f)]
    assert files == ["fusion/options/parser.py"]


def test_the_executors_host_no_cli_checks():
    """No executor module parses or checks command-line options (they are fusion/options' checks)."""
    for f in sorted((ROOT / "executors").rglob("*.py")):
        text = f.read_text()
        assert "import argparse" not in text and "ArgumentTypeError" not in text, f


def test_commands_functions_are_short():
    """fusion/commands/: every function at most 60 lines (named steps, not one long body)."""
    long = []
    for f in sorted((ROOT / "fusion" / "commands").glob("*.py")):
        for n in ast.walk(ast.parse(f.read_text())):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 60:
                long.append(f"{f.name}:{n.name} ({n.end_lineno - n.lineno + 1} lines)")
    assert not long, long

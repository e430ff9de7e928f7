"""The layer order of the package, read from every module's imports (docs/design.md).

Lowest first: ``fusion.ir`` imports nothing else of the project; ``fusion.kernels`` at most
the IR; the compiler passes in ``fusion/`` (cluster, cost, partition, compress, compile, ...)
the IR, the kernels and the plan format; the plan format (``fusion.plan``) the IR and the
kernels; ``fusion.executors`` the IR, the kernels and the plan format, never a compiler pass;
the CLI (``fusion.cli``, ``fusion.commands``) anything. The root package (``fusion/__init__.py``)
counts as the IR: every import of a sub-package runs it, so it may hold only the version and the
IR's public names.
Imports inside functions count: a lazy import is still a dependency.
"""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"ir": "fusion.ir", "kernels": "fusion.kernels", "executors": "fusion.executors", "fusion": "fusion"}
ALLOWED = {
    "ir": {"ir"},
    "kernels": {"ir", "kernels"},
    "plan": {"ir", "kernels", "plan"},
    "compiler": {"ir", "kernels", "plan", "compiler"},
    "executors": {"ir", "kernels", "plan", "executors"},
    "cli": {"ir", "kernels", "plan", "compiler", "executors", "cli"},
}


def layer(module: str) -> str | None:
    """The layer of a ``fusion`` module name (None for other packages)."""
    parts = module.split(".")
    if parts[0] != "fusion":
        return None
    if len(parts) == 1:
        return "ir"  # the root package: its version and the IR's public names, nothing else
    if parts[1] in ("cli", "commands"):
        return "cli"
    if parts[1] in ("ir", "kernels", "executors", "plan"):
        return parts[1]
    return "compiler"


def modules() -> list[tuple[Path, str, bool]]:
    """(file, module name, is a package __init__) of every module of the package."""
    out = []
    for folder, pkg in FOLDERS.items():
        for f in sorted((ROOT / folder).rglob("*.py")):
            rel = f.relative_to(ROOT / folder).with_suffix("")
            name = ".".join([pkg, *rel.parts])
            out.append((f, name.removesuffix(".__init__"), f.name == "__init__.py"))
    return out


def imports(file: Path, module: str, is_init: bool) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``file``, relative ones resolved."""
    found = []
    for node in ast.walk(ast.parse(file.read_text(), str(file))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_init else 0)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.append((node.lineno, name))
    return found


def violations(root_modules=None) -> list[str]:
    bad = []
    for file, module, is_init in root_modules or modules():
        here = layer(module)
        for line, target in imports(file, module, is_init):
            there = layer(target)
            if there is not None and there not in ALLOWED[here]:
                where = file.relative_to(ROOT) if file.is_relative_to(ROOT) else file
                bad.append(f"{where}:{line}: {here} layer imports {target} ({there} layer)")
    return bad


def test_no_import_goes_up_the_layers():
    assert violations() == []


def test_an_upward_import_is_caught(tmp_path):
    """The check itself can fail: an IR module importing the executors is named with its line."""
    f = tmp_path / "bad.py"
    f.write_text("import numpy\n\n\ndef f():\n    from fusion.executors.runtime import compnode\n")
    assert violations([(f, "fusion.ir.bad", False)]) == [
        f"{f}:5: ir layer imports fusion.executors.runtime (executors layer)"]


@pytest.mark.parametrize("module,expected", [
    ("fusion.ir.graph", "ir"), ("fusion.kernels.sparse", "kernels"), ("fusion.plan", "plan"),
    ("fusion.cost.estimate", "compiler"), ("fusion.executors.runtime.compnode", "executors"),
    ("fusion.commands.run", "cli"), ("fusion", "ir"), ("numpy", None),
])
def test_layer_of_a_module(module, expected):
    assert layer(module) == expected

"""The layer order of the package, read from every module's imports (docs/design.md).

Lowest first: ``fusion.ir`` imports nothing else of the project; ``fusion.kernels`` at most
the IR; the compiler passes in ``fusion/`` (cluster, cost, partition, compress, compile, ...)
the IR, the kernels and the plan format; the plan format (``fusion.plan``) the IR and the
kernels; ``fusion.executors`` the IR, the kernels and the plan format, never a compiler pass;
the CLI (``fusion.cli``, ``fusion.commands``, ``fusion.options``) anything. The root package (``fusion/__init__.py``)
counts as the IR: every import of a sub-package runs it, so it may hold only the version and the
IR's public names.
Imports inside functions count: a lazy import is still a dependency.

Within any layer, no module imports one that imports it back, however indirectly: the module import
graph has no cycle (issue 37). A cycle means two modules share a piece that belongs to neither.
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
    if parts[1] in ("cli", "commands", "options"):
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
        found += imports_of(node, module, is_init)
    return found


def imports_of(node: ast.AST, module: str, is_init: bool) -> list[tuple[int, str]]:
    """(line, absolute module name) of what one AST node of ``module`` imports (none for other nodes)."""
    if isinstance(node, ast.Import):
        return [(node.lineno, a.name) for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        base = module.split(".")
        base = base[: len(base) - node.level + (1 if is_init else 0)]
        return [(node.lineno, ".".join(base + ([node.module] if node.module else [])))]
    return [(node.lineno, node.module or "")]


def import_graph(root_modules=None) -> dict[str, set[str]]:
    """Module -> the modules of the package it imports (lazy ones included). ``from pkg import name`` is an import
    of the submodule ``pkg.name`` when there is one, else of ``pkg``; ``import a.b.c`` is one of the deepest module
    of the package that the dotted name names. The parent package a submodule import loads is not counted: every
    module loads its package first, and a package's ``__init__`` re-exporting its modules is no cycle."""
    found = root_modules or modules()
    known = {module for _, module, _ in found}
    graph: dict[str, set[str]] = {module: set() for module in known}
    for file, module, is_init in found:
        for node in ast.walk(ast.parse(file.read_text(), str(file))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                (_, base), = imports_of(node, module, is_init)
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
            else:
                continue
            for name in names:
                parts = name.split(".")
                while parts and ".".join(parts) not in known:
                    parts.pop()
                if parts and ".".join(parts) != module:
                    graph[module].add(".".join(parts))
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted: every module of one
    imports every other, directly or through the others."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                scc = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    scc.append(w)
                    if w == v:
                        break
                if len(scc) > 1:
                    out.append(sorted(scc))
    return sorted(out)


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


def test_no_import_cycle():
    """No two modules of the package import each other, directly or through others, lazy imports included."""
    cycles = import_cycles(import_graph())
    assert not cycles, "modules that import each other: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_an_import_cycle_is_caught(tmp_path):
    """The check itself can fail: a lazy import back closes a cycle; a package importing its own modules does not."""
    (tmp_path / "pkg").mkdir()
    files = {"fusion.pkg": "from fusion.pkg.a import f\n",
             "fusion.pkg.a": "from fusion.pkg import b\n\n\ndef f():\n    return b\n",
             "fusion.pkg.b": "def g():\n    from .c import h\n",
             "fusion.pkg.c": "import fusion.pkg.a\n\n\ndef h():\n    pass\n"}
    found = []
    for module, text in files.items():
        f = tmp_path / f"{module.replace('.', '_')}.py"
        f.write_text(text)
        found.append((f, module, module == "fusion.pkg"))
    graph = import_graph(found)
    assert graph == {"fusion.pkg": {"fusion.pkg.a"}, "fusion.pkg.a": {"fusion.pkg.b"},
                     "fusion.pkg.b": {"fusion.pkg.c"}, "fusion.pkg.c": {"fusion.pkg.a"}}
    assert import_cycles(graph) == [["fusion.pkg.a", "fusion.pkg.b", "fusion.pkg.c"]]
    graph["fusion.pkg.c"] = set()
    assert import_cycles(graph) == []

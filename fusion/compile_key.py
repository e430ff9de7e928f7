"""The key of a compile-cache entry (:mod:`fusion.compile_cache`): a SHA-256 over what determines a plan.

Hashed, without running the model file (reading files only, so a cache hit costs no import of torch or the model):

- the model file's bytes, its resolved path and the function name (``file.py:function``; for ``.onnx`` the file);
- every local Python file the model file imports, followed transitively: ``import x`` / ``from x import y`` /
  relative imports resolved (by :mod:`ast`, without importing) against the model file's folder (what
  :func:`fusion.loader.load_function` puts on ``sys.path``) and the folders of ``$PYTHONPATH``;
- the versions of the installed packages those files import (``torch``, ``transformers``, ...), of Python, and of
  fusion, plus a SHA-256 of fusion's own source (its ``.py`` and ``.json`` files: a developer's edit to the
  compiler is a miss even where the version string did not change);
- the cluster file's bytes (or the shipped scenario's name);
- every compile option's value (the fields of ``fusion.options.compile.CompileOptions``), the bytes of a file an option names
  (``--node-times``), and the ``fusion run`` options the compile reads (``--steps`` for an lr schedule without
  ``--lr-decay-steps``, ``--data`` with ``--compress``).

Not hashed (a hit may then be stale: give ``--no-cache``): files the model function reads at run time (a config
file, a tokenizer, a checkpoint, anything downloaded; an ONNX model's external data files), environment variables it reads, modules imported
dynamically (``importlib.import_module(name)``, ``__import__``) or from folders not named above, editable
installs of other packages whose source changed without a version change, and randomness the function does not
seed. The example batch's shapes are not hashed separately: they follow from the hashed source (learning them
would mean running the function, i.e. importing torch and the model's libraries, seconds a hit must not spend).
"""
from __future__ import annotations

import ast
import hashlib
import json
import os
import platform
import sys
from dataclasses import dataclass, field
from pathlib import Path

#: the folders holding fusion's own source (fusion/, and beside it in a checkout ir/, executors/, kernels/)
_FUSION_DIR = Path(__file__).resolve().parent


@dataclass(frozen=True)
class CompileKey:
    """A cache key: ``digest`` (SHA-256 hex) and ``inputs``, the JSON summary of what went into it (kept in the
    entry's manifest, so a user can see why two compiles hit or missed)."""

    digest: str
    inputs: dict = field(default_factory=dict, compare=False)

    @property
    def short(self) -> str:
        return self.digest[:12]


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fusion_roots() -> list[Path]:
    """fusion's source folders: the package, and in a source checkout ir/, executors/ and kernels/ beside it."""
    import fusion

    return sorted({Path(p).resolve() for p in fusion.__path__} | {_FUSION_DIR})


_FUSION_SOURCE: str | None = None


def fusion_source_digest() -> str:
    """SHA-256 over fusion's own ``.py`` and ``.json`` files (relative path and bytes; about 2 MB, a few ms)."""
    global _FUSION_SOURCE
    if _FUSION_SOURCE is None:
        h = hashlib.sha256()
        for root in _fusion_roots():
            for ext in ("*.py", "*.json"):
                for f in sorted(root.rglob(ext)):
                    if "__pycache__" in f.parts or any(p.startswith(".") for p in f.relative_to(root).parts):
                        continue
                    h.update(f"{root.name}/{f.relative_to(root).as_posix()}\0".encode())
                    h.update(f.read_bytes())
                    h.update(b"\0")
        _FUSION_SOURCE = h.hexdigest()
    return _FUSION_SOURCE


def search_roots(model_file: Path) -> list[Path]:
    """Where the model file's imports are looked for: its folder, then ``$PYTHONPATH``'s folders."""
    roots = [model_file.resolve().parent]
    for p in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        if p and Path(p).is_dir() and Path(p).resolve() not in roots:
            roots.append(Path(p).resolve())
    return roots


def _module_file(parts: list[str], base: Path) -> Path | None:
    """``base/a/b.py`` or ``base/a/b/__init__.py`` for ``parts = ["a", "b"]`` (None if neither is a file)."""
    if not parts:
        init = base / "__init__.py"
        return init if init.is_file() else None
    stem = base.joinpath(*parts)
    for f in (stem.with_name(stem.name + ".py"), stem / "__init__.py"):
        if f.is_file():
            return f
    return None


def _imported(tree: ast.AST) -> list[tuple[int, str, list[str]]]:
    """(level, module, names) of each import statement: ``import a.b`` -> (0, "a.b", []), ``from .x import y`` ->
    (1, "x", ["y"])."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((0, a.name, []) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            out.append((node.level, node.module or "", [a.name for a in node.names]))
    return out


def local_sources(model_file: Path) -> tuple[list[Path], set[str]]:
    """The model file and every local Python file it imports, transitively (resolved paths, sorted), and the
    top-level names of the other modules imported (installed packages or the standard library).

    A file that does not parse is listed (its bytes are hashed) and not followed."""
    roots = search_roots(model_file)
    seen: dict[Path, None] = {}
    external: set[str] = set()
    todo = [model_file.resolve()]
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen[f] = None
        try:
            tree = ast.parse(f.read_bytes(), filename=str(f))
        except (SyntaxError, ValueError, OSError):
            continue
        for level, module, names in _imported(tree):
            parts = module.split(".") if module else []
            if level:  # relative: from the file's own folder (up level - 1)
                bases = [f.parent.parents[level - 2] if level > 1 else f.parent]
            else:
                bases = roots
            found = False
            if not level and parts and parts[0] == "fusion":  # fusion's own source: hashed whole (versions)
                continue
            for base in bases:
                for i in range(1, len(parts) + 1):  # a, a.b, a.b.c: each package's __init__ runs too
                    m = _module_file(parts[:i], base)
                    if m is not None:
                        todo.append(m.resolve())
                        found = True
                for n in names:  # from a import b: b may be a submodule
                    m = _module_file([*parts, n], base)
                    if m is not None:
                        todo.append(m.resolve())
                        found = True
                if level and not parts:
                    m = _module_file([], base)
                    if m is not None:
                        todo.append(m.resolve())
                if found:
                    break
            if not found and not level and parts:
                external.add(parts[0])
    return sorted(seen), external


def package_versions(names: set[str]) -> dict[str, str]:
    """Installed version of each imported top-level module (standard library and fusion left out; a module no
    distribution provides: ``"?"``)."""
    from importlib import metadata

    out = {}
    dists = None
    for name in sorted(names - set(sys.stdlib_module_names) - {"fusion", "__future__"}):
        try:
            out[name] = metadata.version(name)
            continue
        except metadata.PackageNotFoundError:
            pass
        if dists is None:
            dists = metadata.packages_distributions()
        vs = []
        for d in dists.get(name, []):
            try:
                vs.append(f"{d}=={metadata.version(d)}")
            except metadata.PackageNotFoundError:
                pass
        out[name] = ",".join(sorted(vs)) or "?"
    return out


def _cluster_input(cluster: str) -> dict:
    p = Path(cluster)
    if p.is_file():
        return {"file": str(p.resolve()), "sha256": file_sha256(p)}
    return {"name": cluster}  # a shipped scenario (its data is fusion's source)


def _jsonable(v):
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    return repr(v)


#: compile options whose value names a file the compile reads: its bytes are hashed too
FILE_OPTIONS = ("node_times",)


def compile_options(job) -> dict:
    """The option values the compile reads: every compile option of ``job.options`` (its ``values()``: all but
    ``--no-cache``), and of ``fusion run``'s own options those :func:`fusion.commands.compile.compile_from_args`
    reads: ``job.steps`` (the lr schedule's length when ``--lr-decay-steps`` is not given, and the cap on the DP
    planner's DiLoCo warm-up when ``--sync-warmup`` is not given) and ``job.data`` (the
    corpus size of ``--compress``'s delta buffers; None under ``fusion compile``). ``job``: a
    :class:`fusion.options.compile.CompileJob`."""
    c = job.options
    opts = {d: _jsonable(v) for d, v in sorted(c.values().items())}
    planned_warmup = c.strategy == "dp" and c.dp_sync != "every" and c.sync_warmup is None  # capped by the steps
    if (c.lr_schedule != "constant" and c.lr_decay_steps is None) or planned_warmup:
        opts["steps"] = job.steps
    if (c.compress is not None or c.compress_bwd is not None) and job.data is not None:
        opts["data"] = _jsonable(job.data)
    for d in FILE_OPTIONS:
        path = opts.get(d)
        if path is not None and Path(path).is_file():
            opts[f"{d}:sha256"] = file_sha256(Path(path))
    return opts


def compile_key(target: str, cluster: str, options: dict) -> CompileKey | None:
    """The key of compiling ``target`` (``file.py:function`` or ``model.onnx[:loss]``) for ``cluster`` with
    ``options`` (:func:`compile_options`); None where the target's file is not there (the compile then says why)."""
    import fusion

    if target.endswith(".onnx") or ".onnx:" in target:
        path, _, func = target.partition(".onnx")
        model_file, func = Path(path + ".onnx"), func.lstrip(":")
        files, external = [model_file.resolve()] if model_file.is_file() else [], {"onnx"}
    else:
        path, _, func = target.rpartition(":")
        model_file = Path(path)
        if not model_file.is_file():
            return None
        files, external = local_sources(model_file)
    if not files:
        return None
    base = model_file.resolve().parent
    sources = {}
    for f in files:
        try:
            rel = f.relative_to(base).as_posix()
        except ValueError:
            rel = str(f)
        sources[rel] = file_sha256(f)
    inputs = {
        "model": {"file": str(model_file.resolve()), "function": func, "sources": sources},
        "cluster": _cluster_input(cluster),
        "options": options,
        "versions": {"fusion": fusion.__version__, "fusion_source": fusion_source_digest(),
                     "python": platform.python_version(), **package_versions(external | {"torch", "numpy"})},
    }
    blob = json.dumps(inputs, sort_keys=True, separators=(",", ":")).encode()
    return CompileKey(hashlib.sha256(b"fusion-compile-cache/1\0" + blob).hexdigest(), inputs)

"""The compile cache: a second ``fusion compile`` / ``fusion run MODEL`` of the same model, cluster and options
copies the plan the first one wrote instead of tracing and compiling again.

Entries live in ``$FUSION_CACHE/plans/<key>/`` (default ``$XDG_CACHE_HOME/fusion``, else ``~/.cache/fusion``;
``FUSION_CACHE=off`` turns the cache off), one folder per :class:`~fusion.compile_key.CompileKey`::

    <key>/plan/         the plan folder exactly as :func:`fusion.plan.save_plan` wrote it (plan.json, weights, plugins/)
    <key>/entry.json    the manifest: the key, what went into it, the SHA-256 of each plan file, the compile's seconds

An entry is written into ``.tmp-<key>-<pid>/`` and renamed into place, so a crash never leaves half of one. It holds
JSON and safetensors only: nothing in the cache is unpickled or imported (a plan's plugin files are the user's own
model files, which a fresh compile would import as well). On a lookup every file's SHA-256 is checked and the plan
is parsed; an entry that fails either is removed with one warning line and the compile runs afresh. The cache keeps
the :data:`MAX_ENTRIES` most recently used entries and at most :data:`MAX_BYTES` in all (oldest used removed first;
a plan larger than the bound is not stored). The key holds fusion's version and a hash of its source, so an entry
is never used by another fusion.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path


from fusion.compile_key import CompileKey, file_sha256

#: entries kept (the most recently used); ``$FUSION_CACHE_ENTRIES`` overrides
MAX_ENTRIES = 32
#: bytes kept in all; ``$FUSION_CACHE_BYTES`` overrides
MAX_BYTES = 4 << 30
ENTRY_FORMAT = "fusion.compile-cache"
ENTRY_VERSION = 1


def cache_off() -> bool:
    """``FUSION_CACHE=off``: no compile uses or fills the cache (as ``--no-cache`` on every command)."""
    return os.environ.get("FUSION_CACHE", "").strip().lower() == "off"


def cache_root() -> Path:
    """``$FUSION_CACHE/plans``, else ``$XDG_CACHE_HOME/fusion/plans``, else ``~/.cache/fusion/plans``."""
    base = os.environ.get("FUSION_CACHE")
    if not base:
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = str(Path(xdg) / "fusion") if xdg else str(Path.home() / ".cache" / "fusion")
    return Path(base) / "plans"


def _env_int(name: str, default: int) -> int:
    try:
        return max(0, int(os.environ.get(name, default)))
    except ValueError:
        return default


def _warn(line: str) -> None:
    print(f"warning: {line}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class CacheHit:
    """A verified entry: its folder and manifest (whose ``describe`` is the compile's summary line)."""

    key: CompileKey
    plan_dir: Path
    manifest: dict

    def load(self):
        """The entry's :class:`~fusion.plan.Plan` (parsing it imports torch: a ``fusion compile`` hit skips it)."""
        from fusion.plan import load_plan

        return load_plan(self.plan_dir)


@dataclass
class CompileCache:
    """The cache in ``root`` (:func:`cache_root`), bounded to ``max_entries`` entries and ``max_bytes`` bytes."""

    root: Path
    max_entries: int = MAX_ENTRIES
    max_bytes: int = MAX_BYTES

    @classmethod
    def default(cls) -> "CompileCache":
        return cls(cache_root(), _env_int("FUSION_CACHE_ENTRIES", MAX_ENTRIES), _env_int("FUSION_CACHE_BYTES", MAX_BYTES))

    def entry(self, key: CompileKey) -> Path:
        return self.root / key.digest

    # --- lookup
    def lookup(self, key: CompileKey) -> CacheHit | None:
        """The verified entry of ``key``, or None (none there, or a corrupt one, removed with one warning)."""
        folder = self.entry(key)
        if not folder.is_dir():
            return None
        try:
            hit = self._verify(key, folder)
        except _Corrupt as e:
            shutil.rmtree(folder, ignore_errors=True)
            _warn(f"compile cache entry {key.short} in {self.root} is corrupt ({e}); removed it, compiling afresh")
            return None
        try:
            os.utime(folder / "entry.json")  # most recently used: evicted last
        except OSError:
            pass
        return hit

    def _verify(self, key: CompileKey, folder: Path) -> CacheHit:
        from fusion.plan import PLAN_FORMAT

        try:
            manifest = json.loads((folder / "entry.json").read_text())
        except FileNotFoundError:
            raise _Corrupt("no entry.json") from None
        except (OSError, ValueError) as e:
            raise _Corrupt(f"entry.json: {e}") from None
        if not isinstance(manifest, dict) or manifest.get("format") != ENTRY_FORMAT \
                or manifest.get("version") != ENTRY_VERSION or manifest.get("key") != key.digest:
            raise _Corrupt("entry.json is not this key's manifest")
        files = manifest.get("files")
        if not isinstance(files, dict) or "plan.json" not in files:
            raise _Corrupt("entry.json lists no plan files")
        plan_dir = folder / "plan"
        for rel, digest in files.items():
            f = plan_dir / rel
            if ".." in Path(rel).parts or Path(rel).is_absolute():
                raise _Corrupt(f"entry.json names a file outside the entry: {rel}")
            if not f.is_file():
                raise _Corrupt(f"missing {rel}")
            if file_sha256(f) != digest:
                raise _Corrupt(f"{rel} does not match its SHA-256")
        try:  # the SHA-256s say the files are those stored; the plan must still be a fusion plan
            data = json.loads((plan_dir / "plan.json").read_text())
        except (OSError, ValueError) as e:
            raise _Corrupt(f"plan.json: {e}") from None
        if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT or not isinstance(manifest.get("describe"), str):
            raise _Corrupt("plan.json is not a fusion plan")
        return CacheHit(key, plan_dir, manifest)

    # --- store
    def store(self, key: CompileKey, plan, params: dict | None, compile_s: float, describe: str) -> Path | None:
        """Write ``plan`` (and ``params``) as ``key``'s entry, atomically, with ``describe`` (the compile's summary
        line, said again on a hit); then evict. A failure (disk full, a read-only cache) is one warning: the
        compile's own output is written already. Returns the entry or None."""
        from fusion.plan import save_plan

        tmp = self.root / f".tmp-{key.digest}-{os.getpid()}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._remove_stale_tmp()
            shutil.rmtree(tmp, ignore_errors=True)
            save_plan(plan, tmp / "plan", params or None)
            files = {f.relative_to(tmp / "plan").as_posix(): file_sha256(f)
                     for f in sorted((tmp / "plan").rglob("*")) if f.is_file()}
            size = sum(f.stat().st_size for f in (tmp / "plan").rglob("*") if f.is_file())
            if size > self.max_bytes:
                shutil.rmtree(tmp, ignore_errors=True)
                _warn(f"compile cache: the plan ({size / 2**20:.0f} MiB) exceeds the cache's bound "
                      f"({self.max_bytes / 2**20:.0f} MiB, $FUSION_CACHE_BYTES); not cached")
                return None
            manifest = {"format": ENTRY_FORMAT, "version": ENTRY_VERSION, "key": key.digest, "created": time.time(),
                        "compile_s": round(compile_s, 3), "bytes": size, "describe": describe, "files": files, "inputs": key.inputs}
            (tmp / "entry.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))
            final = self.entry(key)
            try:
                os.rename(tmp, final)
            except OSError:  # another process stored the same key first (or an old entry is there): keep it
                if not final.is_dir():
                    raise
                shutil.rmtree(tmp, ignore_errors=True)
            self.evict()
            return final
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            _warn(f"compile cache: could not store the plan in {self.root} ({e}); not cached")
            return None

    def _remove_stale_tmp(self) -> None:
        """``.tmp-<key>-<pid>`` folders of processes that are gone (a crash while storing)."""
        from fusion.ir.files import _alive

        for d in self.root.glob(".tmp-*"):
            pid = d.name.rpartition("-")[2]
            if pid.isdigit() and (int(pid) == os.getpid() or _alive(int(pid))):
                continue
            shutil.rmtree(d, ignore_errors=True)

    def entries(self) -> list[tuple[float, int, Path]]:
        """(last use, bytes, folder) of each entry, most recently used first."""
        out = []
        for d in self.root.iterdir() if self.root.is_dir() else ():
            if d.name.startswith(".") or not d.is_dir():
                continue
            try:
                used = (d / "entry.json").stat().st_mtime
            except OSError:
                used = 0.0  # no manifest: oldest, evicted first
            size = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
            out.append((used, size, d))
        return sorted(out, key=lambda e: (-e[0], e[2].name))

    def evict(self) -> list[Path]:
        """Remove the least recently used entries beyond :attr:`max_entries` or :attr:`max_bytes`."""
        removed, total = [], 0
        for i, (_, size, d) in enumerate(self.entries()):
            total += size
            if i >= self.max_entries or total > self.max_bytes:
                shutil.rmtree(d, ignore_errors=True)
                removed.append(d)
        return removed


class _Corrupt(Exception):
    """An entry that failed verification (its reason)."""


def copy_plan(hit: CacheHit, out: str | Path) -> Path:
    """Write the entry's plan files into ``out`` in :func:`fusion.plan.save_plan`'s order (plugins and weights first,
    plan.json last, each atomically): the same bytes the compile that made the entry wrote."""
    from fusion.ir.files import atomic_write, remove_stale_tmp

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    remove_stale_tmp(out)
    names = sorted(hit.manifest["files"], key=lambda rel: rel == "plan.json")
    for rel in names:
        atomic_write(out / rel, lambda t, src=hit.plan_dir / rel: shutil.copyfile(src, t))
    return out

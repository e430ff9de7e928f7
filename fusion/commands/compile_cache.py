"""The compile cache in ``fusion compile`` and ``fusion run MODEL`` (:mod:`fusion.compile_cache`): look the key up
before tracing; on a hit, one line on stderr and the cached plan; on a miss, compile and store."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from fusion.compile_cache import CacheHit, CompileCache, cache_off, copy_plan
from fusion.compile_key import CompileKey
from fusion.options.compile import CompileJob


@dataclass
class Compiled:
    """A plan compiled here (``params``: the model's initial weights) or found in the cache (``hit``)."""

    cluster_file: str
    fresh: Any = None  #: the plan compiled here (None on a hit)
    cluster: Any = None  #: the loaded cluster (compiled here only)
    params: dict | None = None
    hit: CacheHit | None = None
    key: CompileKey | None = None
    cache: CompileCache | None = None
    compile_s: float = 0.0
    #: ``describe_plan(plan, cluster)`` of :mod:`fusion.commands.compile` (handed in: that module calls this one)
    describe_fn: Callable[[Any, Any], str] | None = None
    _loaded: Any = None

    @property
    def plan(self):
        """The plan (on a hit parsed from the entry when first asked: ``fusion run`` needs it, ``compile`` not)."""
        if self.fresh is not None:
            return self.fresh
        if self._loaded is None:
            self._loaded = self.hit.load()
        return self._loaded

    def describe(self) -> str:
        """:func:`~fusion.commands.compile.describe_plan`'s line (on a hit the one the compile said)."""
        return self.hit.manifest["describe"] if self.hit is not None else self.describe_fn(self.fresh, self.cluster)

    def save(self, out: str | Path) -> Path:
        """Write the plan folder ``out``: the cached files on a hit, else :func:`~fusion.plan.save_plan`, and then
        the cache entry (a failure to store is a warning only)."""
        from fusion.plan import save_plan

        if self.hit is not None:
            return copy_plan(self.hit, out)
        path = save_plan(self.fresh, out, self.params or None)
        if self.cache is not None and self.key is not None:
            self.cache.store(self.key, self.fresh, self.params, self.compile_s, self.describe())
        return path


def cache_key(job: CompileJob) -> tuple[CompileCache | None, CompileKey | None]:
    """The cache and this compile's key (None, None with ``--no-cache``, or where no key can be made)."""
    from fusion.compile_key import compile_key, compile_options

    if job.options.no_cache or cache_off():
        return None, None
    key = compile_key(job.target, job.cluster, compile_options(job))
    return (CompileCache.default(), key) if key is not None else (None, None)


def compile_cached(job: CompileJob, compile_fn: Callable, describe_fn: Callable,
                   check: Callable[[], object] | None = None) -> Compiled:
    """The plan of ``job.target`` for ``job.cluster`` with ``job``'s compile options: from the cache when it holds
    the key (``compile cache hit: <key> (<s> s)`` on stderr), else ``check()`` (the option checks that import
    torch: an entry exists only for options that passed them) and ``compile_fn(job, model, cluster)``.
    ``compile_fn`` / ``describe_fn``: :mod:`fusion.commands.compile`'s ``compile_from_args`` / ``describe_plan``
    (passed in, so that module and this one do not import each other)."""
    t0 = time.monotonic()
    cache, key = cache_key(job)
    hit = cache.lookup(key) if cache is not None else None
    if hit is not None:
        print(f"compile cache hit: {key.short} ({time.monotonic() - t0:.2f} s)", file=sys.stderr, flush=True)
        return Compiled(job.cluster, hit=hit, key=key, cache=cache, describe_fn=describe_fn)
    if check is not None:
        check()
    from fusion.cluster import load_cluster
    from fusion.loader import load_model
    from fusion.loss import choose_loss

    cluster = load_cluster(job.cluster)
    model = choose_loss(load_model(job.target), job.options.loss, job.target)
    plan = compile_fn(job, model, cluster)
    return Compiled(job.cluster, plan, cluster, params=model.params, key=key, cache=cache,
                    compile_s=time.monotonic() - t0, describe_fn=describe_fn)

"""Chrome-trace timelines (the JSON that chrome://tracing and Perfetto open).

Each CompNode records complete events (``"ph": "X"``) on named threads:
``compute`` (forward, backward, idle, optimizer, grad-sync, checkpoint),
``send -> <peer>`` (time a message spends on the emulated or real wire) and
``recv`` (decoding and checking arrivals). Timestamps are wall-clock
microseconds, so the files of all CompNodes line up when loaded together.

The file layout is ordinary Chrome-trace JSON written one event a line
(:func:`write_events`), so a long run's trace is written and merged as a
stream (:func:`iter_events`): neither the CompNode nor the coordinator ever
holds a whole run's events in memory.
"""
from __future__ import annotations

import json
import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator, TextIO

#: the first line of a trace file written by :func:`write_events`
HEAD = '{"traceEvents": ['


def now_us() -> float:
    return time.time() * 1e6


class Tracer:
    """Collects spans of one process; thread-safe; bounded to ``max_events``.

    spill: a file to which every ``chunk`` events are appended (one JSON
    object a line) and dropped from memory, so a long run's trace costs
    ``chunk`` events of memory, not all of them; :meth:`write` merges the file
    back and removes it.
    """

    def __init__(self, process: str, pid: int = 0, max_events: int = 500_000, enabled: bool = True,
                 spill: str | Path | None = None, chunk: int = 5_000):
        self.process, self.pid, self.max_events, self.enabled = process, pid, max_events, enabled
        self.spill, self.chunk, self._spilled = (Path(spill) if spill else None), chunk, 0
        self._events: list[dict] = []
        self._tids: dict[str, int] = {}
        self._lock = threading.Lock()
        self.dropped = 0

    def _tid(self, thread: str) -> int:
        tid = self._tids.get(thread)
        if tid is None:
            tid = self._tids[thread] = len(self._tids) + 1
        return tid

    def add(self, name: str, cat: str, start_us: float, end_us: float, thread: str = "compute", **args: Any) -> None:
        """One span ``[start_us, end_us]`` on ``thread``."""
        if not self.enabled:
            return
        with self._lock:
            if len(self._events) + self._spilled >= self.max_events:
                self.dropped += 1
                return
            ev = {"name": name, "cat": cat, "ph": "X", "ts": round(start_us, 1), "dur": round(max(0.0, end_us - start_us), 1),
                  "pid": self.pid, "tid": self._tid(thread)}
            if args:
                ev["args"] = args
            self._events.append(ev)
            if self.spill is not None and len(self._events) >= self.chunk:
                self._spill_locked()

    def _spill_locked(self) -> None:
        try:
            self.spill.parent.mkdir(parents=True, exist_ok=True)
            with open(self.spill, "a") as f:
                f.writelines(json.dumps(e) + "\n" for e in self._events)
        except OSError:
            self.spill = None  # keep the events in memory (bounded by max_events) rather than lose them
            return
        self._spilled += len(self._events)
        self._events.clear()

    def _spilled_events(self) -> Iterator[dict]:
        """The events spilled to the file so far, read back one line at a time."""
        if self.spill is None or not self._spilled:
            return
        with open(self.spill) as f:
            for line in f:
                if line.strip():
                    yield json.loads(line)

    @contextmanager
    def span(self, name: str, cat: str, thread: str = "compute", **args: Any) -> Iterator[None]:
        t0 = now_us()
        try:
            yield
        finally:
            self.add(name, cat, t0, now_us(), thread, **args)

    def events(self) -> list[dict]:
        with self._lock:
            return [*self._spilled_events(), *self._events]

    def _meta(self) -> list[dict]:
        meta = [{"name": "process_name", "ph": "M", "pid": self.pid, "tid": 0, "args": {"name": self.process}}]
        return meta + [{"name": "thread_name", "ph": "M", "pid": self.pid, "tid": tid, "args": {"name": t}}
                       for t, tid in self._tids.items()]

    def _other(self) -> dict:
        return {"displayTimeUnit": "ms", "otherData": {"process": self.process, "dropped_events": self.dropped}}

    def to_json(self) -> dict:
        with self._lock:
            return {"traceEvents": [*self._meta(), *self._spilled_events(), *self._events], **self._other()}

    def write(self, path: str | Path) -> Path:
        """Write the trace atomically (tmp file + rename), streaming the spilled events from their file: the
        memory this takes does not grow with the run's length."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        with self._lock, open(tmp, "w") as f:
            write_events(f, (*self._meta(),), self._spilled_events(), self._events, tail=self._other())
        os.replace(tmp, path)
        if self.spill is not None:
            self.spill.unlink(missing_ok=True)
        return path


def write_events(f: TextIO, *streams: Iterable[dict], tail: dict | None = None) -> int:
    """Write a Chrome-trace JSON object to ``f``, one event a line, from ``streams`` in order (each consumed
    lazily), then the ``tail`` keys (``displayTimeUnit``, ``otherData``); returns the number of events."""
    f.write(HEAD)
    n = 0
    for stream in streams:
        for ev in stream:
            f.write(("\n" if n == 0 else ",\n") + json.dumps(ev))
            n += 1
    rest = json.dumps(tail or {})[1:]  # the tail's keys after the array: '"k": v}' (or '}' when empty)
    f.write("\n]" + (", " + rest if rest != "}" else "}") + "\n")
    return n


def iter_events(path: str | Path) -> Iterator[dict]:
    """The events of a trace file, one at a time: a file :func:`write_events` wrote is read a line at a time;
    any other JSON trace (an object with ``traceEvents``, or a bare array) is parsed whole."""
    path = Path(path)
    with open(path) as f:
        first = f.readline()
        if first.rstrip("\n") != HEAD:
            f.seek(0)
            data = json.load(f)
            yield from (data["traceEvents"] if isinstance(data, dict) else data)
            return
        for line in f:
            line = line.rstrip("\n").rstrip(",")
            if not line or line.startswith("]"):
                continue
            ev = json.loads(line)
            if not isinstance(ev, dict):
                raise ValueError(f"{path}: a trace event must be an object, got {line[:80]!r}")
            yield ev

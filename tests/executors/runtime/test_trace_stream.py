"""Traces are written and merged as streams: the memory a run's end takes does not grow with its length (issue 28:
8,000 steps cost +320 MB per executor and +385 MB for the coordinator when both read their traces back whole)."""
from __future__ import annotations

import json
import tracemalloc

from fusion.commands.report import merge_traces
from fusion.executors.runtime.trace_events import Tracer, iter_events

EVENTS = 25_000  # ~3 MB of JSON, ~15 MB as Python objects


def _filled(tmp_path, name: str, pid: int) -> Tracer:
    t = Tracer(f"CompNode {name}", pid, max_events=10 * EVENTS, spill=tmp_path / f"{name}.spill", chunk=2_000)
    for i in range(EVENTS):
        t.add("F0" if i % 2 else "B0", "forward" if i % 2 else "backward", i * 10.0, i * 10.0 + 5, mb=i % 4)
    return t


def _peak(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_write_and_merge_stream_in_bounded_memory(tmp_path):
    a, b = _filled(tmp_path, "part0", 0), _filled(tmp_path, "part1", 1)
    want_a = a.events()
    (tmp_path / "trace").mkdir()
    peak_write = _peak(lambda: a.write(tmp_path / "trace" / "part0.json"))
    b.write(tmp_path / "trace" / "part1.json")
    assert not (tmp_path / "part0.spill").exists()
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, "time": 1.0 + s, "iteration_s": 0.5, "loss": 1.0}) + "\n"
                               for s in range(50)) + '{"step": 50, "ti')  # a torn last line is skipped
    peak_merge = _peak(lambda: merge_traces(tmp_path / "trace", tmp_path / "trace.json", metrics))
    # the whole trace as Python objects is tens of MB; a stream holds a chunk (2,000 events) at most
    assert peak_write < 3 << 20, peak_write
    assert peak_merge < 3 << 20, peak_merge

    part0 = json.loads((tmp_path / "trace" / "part0.json").read_text())
    assert part0["otherData"] == {"process": "CompNode part0", "dropped_events": 0}
    assert [e for e in part0["traceEvents"] if e["ph"] == "X"] == want_a  # every event, in order
    merged = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    spans = [e for e in merged if e["ph"] == "X"]
    assert len(spans) == 2 * EVENTS + 50
    coord = [e for e in merged if e.get("args", {}).get("name") == "coordinator"]
    assert coord and coord[0]["pid"] == 2  # after the CompNodes' pids
    assert list(iter_events(tmp_path / "trace.json")) == merged


def test_iter_events_reads_a_trace_written_whole(tmp_path):
    f = tmp_path / "old.json"
    events = [{"name": "F0", "ph": "X", "ts": 1, "dur": 2, "pid": 0, "tid": 1}]
    f.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    assert list(iter_events(f)) == events
    f.write_text(json.dumps(events))
    assert list(iter_events(f)) == events


def test_a_torn_compnode_trace_keeps_what_was_written(tmp_path):
    (tmp_path / "trace").mkdir()
    t = Tracer("CompNode part0", 0)
    for i in range(10):
        t.add("F0", "forward", i, i + 1)
    t.write(tmp_path / "trace" / "part0.json")
    text = (tmp_path / "trace" / "part0.json").read_text()
    (tmp_path / "trace" / "part1.json").write_text(text[: len(text) // 2])  # killed mid-write by hand
    out = merge_traces(tmp_path / "trace", tmp_path / "trace.json")
    merged = json.loads(out.read_text())["traceEvents"]
    assert sum(e["ph"] == "X" for e in merged) >= 10


def test_a_stopped_run_waits_for_executors_still_writing_their_traces(tmp_path):
    """A 10,000-step run under load lost trace.json: writing each executor's 30 MB trace outlasted the 10 s grace after
    stop and SIGTERM cut it off. An executor still writing is waited for; one that writes nothing is not."""
    import subprocess
    import sys
    import time

    from fusion.executors.runtime.launcher import _wait_all, _wait_while_writing

    folder = tmp_path / "trace"
    folder.mkdir()
    writer = ("import sys, time\nfor i in range(12):\n    open(sys.argv[1], 'a').write('x' * 1000)\n"
              "    time.sleep(0.25)\n")  # ~3 s of writing, then exit 0
    procs = {"p0": subprocess.Popen([sys.executable, "-c", writer, str(folder / "p0.json.tmp")]),
             "p1": subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])}  # hangs, writes nothing
    try:
        deadline = time.monotonic() + 120
        while not (folder / "p0.json.tmp").exists() and time.monotonic() < deadline:  # (a slow start under load)
            time.sleep(0.05)
        status = _wait_all(procs, 0.5)
        assert status == {"p0": None, "p1": None}  # the grace is over: before, both were terminated here
        t0 = time.monotonic()
        status = _wait_while_writing(procs, status, folder, idle_s=3.0)
        assert status["p0"] == 0, status  # its trace finished
        assert status["p1"] is None and time.monotonic() - t0 < 30  # no wait for a process that writes nothing
    finally:
        for p in procs.values():
            p.kill()
            p.wait()

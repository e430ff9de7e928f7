"""A run's plot, trace and CSV are written beside their files and renamed into place: a write that fails (a full
disk) leaves the previous file whole and no ``.tmp`` behind (issue 39: ``loss.png`` was truncated to 0 bytes and
``metrics.csv.tmp`` left over)."""
import errno
import json

import pytest

from fusion.commands.report import finish_run


def _metrics(run, steps):
    run.mkdir(exist_ok=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 3.0 - 0.1 * s, "iteration_s": 0.1,
                                                           "samples_per_s": 40.0, "time": 1.0 + s, "parts": {}}) + "\n"
                                               for s in range(steps)))


def test_a_failing_write_leaves_the_previous_outputs_whole(tmp_path, monkeypatch):
    run = tmp_path / "run"
    _metrics(run, 3)
    written = finish_run(run, "first")
    assert {"plot", "csv"} <= set(written)
    png, csv = (run / "loss.png").read_bytes(), (run / "metrics.csv").read_text()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"

    def full(self, fname, *a, **kw):  # a disk that fills up in the middle of the write
        with open(fname, "wb") as f:
            f.write(b"\x89PNG")
        raise OSError(errno.ENOSPC, "No space left on device")

    import csv as csv_mod

    def full_rows(self, rows):
        self.writer.writerow(["partial"])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("matplotlib.figure.Figure.savefig", full)
    monkeypatch.setattr(csv_mod.DictWriter, "writerows", full_rows)
    _metrics(run, 5)
    written = finish_run(run, "second")
    assert "plot" not in written and "csv" not in written
    assert (run / "loss.png").read_bytes() == png and (run / "metrics.csv").read_text() == csv
    assert not list(run.glob("*.tmp")), list(run.glob("*.tmp"))


@pytest.mark.parametrize("steps", [1, 4])
def test_the_outputs_are_written_whole(tmp_path, steps):
    run = tmp_path / "run"
    _metrics(run, steps)
    finish_run(run)
    assert (run / "loss.png").stat().st_size > 1000 and len((run / "metrics.csv").read_text().splitlines()) == steps + 1
    assert not list(run.glob("*.tmp"))

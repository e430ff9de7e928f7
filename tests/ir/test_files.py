"""``fusion.ir.files``: whole-or-nothing writes, their hash, and the clean-up after a crash."""
import hashlib
import os
import subprocess
import sys

import pytest

from fusion.ir.files import atomic_write, remove_stale_tmp, sha256_file


def test_an_atomic_write_returns_the_hash_of_what_it_wrote_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "sub" / "a.bin"
    digest = atomic_write(target, lambda t: t.write_bytes(b"x" * (3 << 20)))
    assert digest == sha256_file(target) == hashlib.sha256(b"x" * (3 << 20)).hexdigest()
    assert sorted(p.name for p in target.parent.iterdir()) == ["a.bin"]

    def crash(t):
        t.write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(target, crash)
    assert target.read_bytes() == b"x" * (3 << 20)  # the old file, whole
    assert sorted(p.name for p in target.parent.iterdir()) == ["a.bin"]


def test_only_temporaries_of_dead_writers_are_removed(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    (tmp_path / f"plan.json.tmp{pid}").write_text("left by a crash")
    (tmp_path / f"plan.json.tmp{os.getpid()}").write_text("being written by this process")
    (tmp_path / "plan.json").write_text("{}")
    gone = remove_stale_tmp(tmp_path)
    assert [p.name for p in gone] == [f"plan.json.tmp{pid}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json", f"plan.json.tmp{os.getpid()}"]

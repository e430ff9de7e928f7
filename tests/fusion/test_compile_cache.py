"""The compile cache (issue 38; fusion.compile_cache, fusion.compile_key): a second compile of the same model,
cluster and options is a hit with the same plan files; any change that can change the plan is a miss."""
import json
from pathlib import Path

import pytest

from fusion.cli import main

ROOT = Path(__file__).resolve().parents[2]
LOCAL = ROOT / "examples" / "clusters" / "local-4-two-sites.yaml"

MODEL = '''
import torch
from torch import nn

from helper import WIDTH


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, WIDTH)
        self.b = nn.Linear(WIDTH, WIDTH)
        self.c = nn.Linear(WIDTH, 4)

    def forward(self, x, y):
        h = torch.relu(self.b(torch.relu(self.a(x))))
        return nn.functional.cross_entropy(self.c(h), y)


def model():
    torch.manual_seed(0)
    return Net(), {"x": torch.randn(4, 8), "y": torch.randint(0, 4, (4,))}
'''


@pytest.fixture()
def project(tmp_path, monkeypatch):
    """A model file, the helper module it imports, a cluster file and a cache folder, all under tmp_path."""
    d = tmp_path / "proj"
    d.mkdir()
    (d / "model.py").write_text(MODEL)
    (d / "helper.py").write_text("WIDTH = 16\n")
    (d / "cluster.yaml").write_bytes(LOCAL.read_bytes())
    monkeypatch.setenv("FUSION_CACHE", str(tmp_path / "cache"))
    return d


def compile_(project, out, *extra, capsys=None):
    """``fusion compile`` of the project's model into ``out``; returns stderr's lines."""
    rc = main(["compile", f"{project / 'model.py'}:model", "--cluster", str(project / "cluster.yaml"),
               "--strategy", "equal-flops", "-o", str(out), *map(str, extra)])
    err = capsys.readouterr().err if capsys is not None else ""
    assert rc == 0, err
    return err.splitlines()


def hits(lines):
    return [ln for ln in lines if ln.startswith("compile cache hit: ")]


def files_of(folder: Path) -> dict[str, bytes]:
    return {f.relative_to(folder).as_posix(): f.read_bytes() for f in sorted(folder.rglob("*")) if f.is_file()}


def entries(tmp_path):
    root = tmp_path / "cache" / "plans"
    return sorted(d for d in root.iterdir() if not d.name.startswith(".")) if root.is_dir() else []


def without_compile_s(plan_json: bytes) -> dict:
    d = json.loads(plan_json)
    d["predicted"].pop("compile_s", None)  # how long that compile took: the only field two compiles differ in
    return d


def test_second_compile_is_a_hit_with_the_same_files(project, tmp_path, capsys):
    first = compile_(project, tmp_path / "a", capsys=capsys)
    assert hits(first) == [] and len(entries(tmp_path)) == 1
    second = compile_(project, tmp_path / "b", capsys=capsys)
    (line,) = hits(second)
    key = entries(tmp_path)[0].name
    assert line.startswith(f"compile cache hit: {key[:12]} (") and line.endswith(" s)")
    a, b = files_of(tmp_path / "a"), files_of(tmp_path / "b")
    assert set(a) == {"plan.json", "weights.safetensors"} and a == b  # byte for byte, initial weights included
    # and what a fresh compile writes (--no-cache: no lookup, no store), but for the seconds it took
    assert hits(compile_(project, tmp_path / "c", "--no-cache", capsys=capsys)) == []
    c = files_of(tmp_path / "c")
    assert c["weights.safetensors"] == a["weights.safetensors"]
    assert without_compile_s(c["plan.json"]) == without_compile_s(a["plan.json"])


@pytest.mark.parametrize("change", ["model", "helper", "cluster", "--lr", "--seed", "--strategy", "--micro-batches"])
def test_a_change_that_can_change_the_plan_is_a_miss(project, tmp_path, capsys, change):
    compile_(project, tmp_path / "a", capsys=capsys)
    extra = []
    if change == "model":
        (project / "model.py").write_text(MODEL.replace("randn(4, 8)", "randn(4, 8) * 2"))
    elif change == "helper":
        (project / "helper.py").write_text("WIDTH = 24\n")
    elif change == "cluster":
        (project / "cluster.yaml").write_text((project / "cluster.yaml").read_text() + "\n# another cluster\n")
    else:
        extra = [change, {"--lr": 0.5, "--seed": 3, "--strategy": "equal-count", "--micro-batches": 2}[change]]
    assert hits(compile_(project, tmp_path / "b", *extra, capsys=capsys)) == []
    assert len(entries(tmp_path)) == 2
    assert hits(compile_(project, tmp_path / "c", *extra, capsys=capsys))  # and that one is cached in its turn


def test_no_cache_neither_uses_nor_fills_the_cache(project, tmp_path, capsys):
    compile_(project, tmp_path / "a", "--no-cache", capsys=capsys)
    assert entries(tmp_path) == []
    compile_(project, tmp_path / "b", capsys=capsys)
    assert hits(compile_(project, tmp_path / "c", "--no-cache", capsys=capsys)) == []


@pytest.mark.parametrize("damage", ["bad json", "missing weights", "changed plan", "no manifest"])
def test_a_corrupt_entry_is_removed_with_one_warning_and_recompiled(project, tmp_path, capsys, damage):
    compile_(project, tmp_path / "a", capsys=capsys)
    (entry,) = entries(tmp_path)
    if damage == "bad json":
        (entry / "plan" / "plan.json").write_text("{not json")
    elif damage == "missing weights":
        (entry / "plan" / "weights.safetensors").unlink()
    elif damage == "changed plan":
        (entry / "plan" / "plan.json").write_text((entry / "plan" / "plan.json").read_text().replace('"lr": 0.01',
                                                                                                      '"lr": 9'))
    else:
        (entry / "entry.json").unlink()
    err = compile_(project, tmp_path / "b", capsys=capsys)
    warnings = [ln for ln in err if ln.startswith("warning:")]
    assert len(warnings) == 1 and "corrupt" in warnings[0] and entry.name[:12] in warnings[0], err
    assert hits(err) == []
    a, b = files_of(tmp_path / "a"), files_of(tmp_path / "b")
    assert b["weights.safetensors"] == a["weights.safetensors"]
    assert without_compile_s(b["plan.json"]) == without_compile_s(a["plan.json"])
    assert hits(compile_(project, tmp_path / "c", capsys=capsys))  # the fresh compile stored a sound entry again
    assert files_of(tmp_path / "c") == b


def test_the_cache_keeps_the_newest_entries(project, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FUSION_CACHE_ENTRIES", "2")
    for seed in (1, 2, 3):
        compile_(project, tmp_path / f"s{seed}", "--seed", seed, capsys=capsys)
    assert len(entries(tmp_path)) == 2
    assert hits(compile_(project, tmp_path / "again3", "--seed", 3, capsys=capsys))
    assert hits(compile_(project, tmp_path / "again1", "--seed", 1, capsys=capsys)) == []  # evicted: the oldest


def test_key_follows_imports_found_without_running_the_file(tmp_path):
    from fusion.compile_key import local_sources

    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "layers.py").write_text("from . import util\nimport numpy\n")
    (tmp_path / "pkg" / "util.py").write_text("import os\n")
    (tmp_path / "m.py").write_text("import torch\nfrom pkg.layers import Block\nraise SystemExit('never run')\n")
    files, external = local_sources(tmp_path / "m.py")
    assert [f.relative_to(tmp_path).as_posix() for f in files] == ["m.py", "pkg/__init__.py", "pkg/layers.py",
                                                                    "pkg/util.py"]
    assert {"torch", "numpy", "os"} <= external


def test_run_of_a_model_hits_the_cache_and_resume_runs_its_own_plan(cli, tmp_path):
    """``fusion run MODEL``: the compile of ``fusion compile`` is a hit (the same key: no run-only option changes
    the plan), RUN/plan holds the cached files, and ``--resume`` runs RUN/plan as before (no lookup)."""
    d = tmp_path / "proj"
    d.mkdir()
    (d / "model.py").write_text(MODEL)
    (d / "helper.py").write_text("WIDTH = 16\n")
    env = {"FUSION_CACHE": str(tmp_path / "cache")}
    opts = ["--cluster", str(LOCAL), "--strategy", "equal-flops", "--micro-batches", "2"]
    r = cli.run(["compile", f"{d / 'model.py'}:model", *opts, "-o", str(tmp_path / "p")], tmp_path, 300, env=env)
    assert r.returncode == 0 and "compile cache hit" not in r.stderr, r.stderr[-2000:]
    run = tmp_path / "run"
    common = [f"{d / 'model.py'}:model", *opts, "--no-progress", "--data", "synthetic", "--out", str(run),
              "--checkpoint-every", "1"]
    r = cli.run(["run", *common, "--steps", "2"], tmp_path, 300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert len([ln for ln in r.stderr.splitlines() if ln.startswith("compile cache hit: ")]) == 1, r.stderr
    assert files_of(run / "plan") == files_of(tmp_path / "p")
    (d / "helper.py").write_text("WIDTH = 24\n")  # a resume never recompiles: RUN/plan is the run's plan
    r = cli.run(["run", *common, "--steps", "3", "--resume"], tmp_path, 300, env=env)
    assert r.returncode == 0 and "resuming at step 2" in r.stderr, r.stderr[-3000:]
    assert "compile cache hit" not in r.stderr
    assert files_of(run / "plan") == files_of(tmp_path / "p")


def test_every_option_the_compile_reads_is_in_the_key(tmp_path):
    """A guard for later options: each compile option compile_from_args reads (and each run option of the job) is
    hashed by compile_options (an option read but not hashed would make a changed value a stale hit)."""
    import dataclasses

    from fusion.cluster import load_cluster
    from fusion.commands.compile import compile_from_args
    from fusion.compile_key import compile_options
    from fusion.loader import load_model
    from fusion.options import parse
    from fusion.options.compile import CompileOptions

    read: set[str] = set()

    class Recording(CompileOptions):
        def __getattribute__(self, name):
            if name in CompileOptions.__dataclass_fields__:
                read.add(name)
            return object.__getattribute__(self, name)

    @dataclasses.dataclass
    class RecordingJob:
        target: str
        cluster: str
        options: CompileOptions
        steps_: int | None
        data_: str | None

        @property
        def steps(self):
            read.add("steps")
            return self.steps_

        @property
        def data(self):
            read.add("data")
            return self.data_

    (tmp_path / "model.py").write_text(MODEL)
    (tmp_path / "helper.py").write_text("WIDTH = 16\n")
    spec = f"{tmp_path / 'model.py'}:model"
    for extra in ([], ["--compress", "quant:bits=8", "--lr-schedule", "cosine", "--warmup-steps", "1"]):
        job = parse(["run", spec, "--cluster", str(LOCAL), "--strategy", "equal-flops", "--steps", "5", *extra])[1].job()
        options = Recording(**{f.name: getattr(job.options, f.name) for f in dataclasses.fields(CompileOptions)})
        read.clear()
        compile_from_args(RecordingJob(job.target, job.cluster, options, job.steps, job.data),
                          load_model(spec), load_cluster(LOCAL))
        seen = set(read)
        hashed = set(compile_options(job))
        assert {"lr", "seed", "strategy", "engine"} <= seen  # the recording sees the reads
        assert seen - hashed == set()
        if extra:
            assert {"steps", "data"} <= hashed

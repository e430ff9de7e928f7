"""Every `fusion` command in the README's and docs' code blocks runs, as written, in a scratch folder.

Commands are read from the fenced blocks of README.md and docs/*.md (continuation lines joined, comments
dropped). The only changes: `--steps N` becomes `--steps 2` (the README's 30- and 50-step runs are the
same commands, shorter), and the two-host recipe's host addresses and ports (10.0.0.x, 5600-5602) become
loopback and free ports so that both "hosts" run here. Synopsis lines (`[--option]`, `PLAN_DIR`) and
printed output (`fusion compile: error: ...`) are not commands. `pip` and `python -m pytest` lines are
what CI runs; `python benchmarks/...` lines are benchmarks, run on their own. A block with `--ray` is the
recipe for a real Ray cluster: tests/fusion/test_run_ray.py runs it on a two-node Ray cluster it starts.

Each command runs in a process of its own, forked from one that has imported torch (tests/fusion/forked_cli.py,
the session's `cli` fixture: the same argv, folder, output and exit status as `python -m fusion.cli`, without
2-4 s of imports per command).
A command that names no output and reads nothing but examples/ and benchmarks/ (the same copies on every page)
runs once even where several pages show it.
"""
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fusion.cli_helpers import free_ports
from tests.fusion.forked_cli import ForkedCli, fusion_env

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def commands(md: Path) -> list[list[str]]:
    """The code blocks of ``md`` that hold fusion commands, each as its list of commands."""
    blocks = []
    for m in re.finditer(r"```[a-z]*\n(.*?)```", md.read_text(), re.S):
        joined = m.group(1).replace("\\\n", " ")
        cmds = []
        for line in joined.splitlines():
            line = line.strip()
            if not re.match(r"fusion (graph|compile|inspect|profile|run|executor|coordinator|keys|export) ", line) \
                    or line.startswith("fusion run PLAN ──"):
                continue  # printed output, a diagram
            cmd = shlex.join(shlex.split(line, comments=True))  # drop the trailing comment
            if "[" in cmd or re.search(r"\b(PLAN_DIR|MODEL\.py|CLUSTER\.json)\b", cmd):
                continue  # a synopsis, not a command
            cmds.append(cmd)
        if cmds:
            blocks.append(cmds)
    return blocks


def test_the_docs_hold_the_commands_we_expect():
    """The extraction itself: if a doc's commands move or change shape, this says so."""
    readme = [c for b in commands(ROOT / "README.md") for c in b]
    assert "fusion run examples/models/gpt.py:tiny --cluster examples/clusters/local-4-two-sites.yaml " \
           "--strategy equal-flops --steps 30" in readme  # the main job, verbatim as .ci/run runs it
    assert any(c.startswith("fusion compile") and "--compress-ratio 100" in c and "equal-flops" in c for c in readme)
    assert {c.split()[1] for c in readme} >= {"compile", "run"}
    # the depth lives in docs/: every command of the CLI is shown in some page, each where its topic is
    every = [c for d in DOCS for b in commands(d) for c in b]
    assert {c.split()[1] for c in every} >= {"graph", "compile", "inspect", "run", "profile", "keys", "executor",
                                              "coordinator"}
    security = [c for b in commands(ROOT / "docs" / "security.md") for c in b]
    assert any(c.startswith("fusion keys runs/tiny.plan") for c in security)
    dp = [c for b in commands(ROOT / "docs" / "data-parallel.md") for c in b]
    assert any("--replicas 2" in c for c in dp) and any("--strategy dtfm" in c for c in dp)
    runtime = [c for b in commands(ROOT / "docs" / "runtime.md") for c in b]
    assert any(c.startswith("fusion executor plan/ --node part1") for c in runtime)
    assert not any("--node p0" in c or "--node p1" in c for b in map(commands, DOCS) for cc in b for c in cc)


@pytest.fixture(scope="module")
def ran_once() -> dict[str, str]:
    """Commands that depend on nothing but their text (:func:`reads_only_the_examples`), each with the page that
    ran it."""
    return {}


def _run(cli: ForkedCli, cmd: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    argv = shlex.split(cmd)
    assert argv[0] == "fusion"
    try:
        return cli.run(argv[1:], cwd, timeout)
    except subprocess.TimeoutExpired as e:  # name the command and show where it stopped
        pytest.fail(f"`{cmd}` did not end within {timeout:g} s; its stderr ended:\n{(e.stderr or '')[-4000:]}")


def reads_only_the_examples(cmd: str) -> bool:
    """Whether ``cmd``'s result depends on its text alone: it names no output (a later command of its page could
    read that) and every path it names lies under examples/ or benchmarks/, copied alike into every page's folder."""
    argv = shlex.split(cmd)
    return not {"-o", "--out"} & set(argv) and all(a.startswith(("examples/", "benchmarks/")) for a in argv if "/" in a)


def test_what_runs_once_across_pages():
    """The rule that lets a command shown on two pages run once: the main job qualifies; commands naming an
    output, or reading a plan an earlier command wrote, do not."""
    main_job = "fusion run examples/models/gpt.py:tiny --cluster examples/clusters/local-4-two-sites.yaml " \
               "--strategy equal-flops --steps 2"
    assert reads_only_the_examples(main_job)
    assert not reads_only_the_examples("fusion run runs/tiny.plan --steps 2 --emulate-links")
    assert not reads_only_the_examples("fusion compile examples/models/gpt.py:tiny --cluster "
                                       "examples/clusters/local-4-two-sites.yaml --compress auto -o plan-auto")
    assert not reads_only_the_examples(main_job + " --out runs/knobs")
    assert not reads_only_the_examples("fusion inspect plan-auto/")


def _scratch(tmp_path: Path) -> Path:
    for d in ("examples", "benchmarks"):
        shutil.copytree(ROOT / d, tmp_path / d, ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def _short(cmd: str) -> str:
    return re.sub(r"--steps \d+", "--steps 2", cmd)


def multi_host(block: list[str]) -> bool:
    """The two-host recipe (`--node`) and the Ray cluster recipe (`--ray`) need more than this folder."""
    return any("--node" in c or "--ray" in c for c in block)


SINGLE_HOST = [d for d in DOCS if any(not multi_host(b) for b in commands(d))]


@pytest.mark.parametrize("md", SINGLE_HOST, ids=lambda p: p.name)
def test_doc_commands_run_as_written(md, tmp_path, cli, ran_once):
    cwd = _scratch(tmp_path)
    seen = set()
    ran = 0
    for block in commands(md):
        if multi_host(block):
            continue  # the two-host recipe: below; the Ray recipe: tests/fusion/test_run_ray.py
        for cmd in block:
            cmd = _short(cmd)
            if cmd in seen:
                continue
            seen.add(cmd)
            if cmd in ran_once:
                print(f"{md.name}: `{cmd}` already ran (for {ran_once[cmd]}); its result depends on its text alone")
                ran += 1
                continue
            r = _run(cli, cmd, cwd)
            assert r.returncode == 0, f"{md.name}: `{cmd}` exited {r.returncode}:\n{r.stderr[-3000:]}"
            if cmd.startswith("fusion compile") and "--compress-ratio" in cmd:
                _shows_cut_and_compression(md, cmd, r.stdout + r.stderr)
            if reads_only_the_examples(cmd):
                ran_once[cmd] = md.name
            ran += 1
    assert ran


def _shows_cut_and_compression(md: Path, cmd: str, output: str) -> None:
    """A compile example that names compression shows it: several parts and compressed cut edges."""
    m = re.search(r"(\d+) parts? on .*?(\d+) compressed edges", output)
    assert m, f"{md.name}: `{cmd}` printed no part/compressed-edge summary:\n{output[-2000:]}"
    parts, edges = int(m.group(1)), int(m.group(2))
    assert parts > 1 and edges > 0, f"{md.name}: `{cmd}` gives {parts} parts and {edges} compressed edges"


def test_two_host_recipe_runs_on_loopback(tmp_path, cli):
    """docs/runtime.md's two-host block: compile, then the coordinator and one executor per "host" at once."""
    cwd = _scratch(tmp_path)
    (block,) = [b for b in commands(ROOT / "docs" / "runtime.md")
                if any("--node" in c for c in b) and not any("--dial-out" in c for c in b)]  # (NAT: test_nat.py)
    ports = dict(zip(("5600", "5601", "5602"), map(str, free_ports(3))))

    def local(text: str) -> str:
        text = re.sub(r"10\.0\.0\.\d+", "127.0.0.1", text)
        for old, new in ports.items():
            text = text.replace(old, new)
        return text.replace("/data/run1", str(tmp_path / "run1"))

    cluster = cwd / "examples" / "clusters" / "two-hosts.yaml"
    cluster.write_text(local(cluster.read_text()))
    compile_cmd, keys_cmd, *live = [local(_short(c)) for c in block]
    assert compile_cmd.startswith("fusion compile") and keys_cmd.startswith("fusion keys")
    assert [c.split()[1] for c in live] == ["coordinator", "executor", "executor"]
    assert all("--key keys/" in c for c in live)  # the recipe runs CURVE: every process with its own secret key
    for c in (compile_cmd, keys_cmd):
        r = _run(cli, c, cwd)
        assert r.returncode == 0, r.stderr
    procs = []
    try:
        for c in live:
            procs.append(subprocess.Popen([sys.executable, "-m", "fusion.cli", *shlex.split(c)[1:]], cwd=cwd,
                                          env=fusion_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        outs = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for c, p, (_, err) in zip(live, procs, outs):
        assert p.returncode == 0, f"`{c}` exited {p.returncode}:\n{err[-3000:]}"
    coord_err = outs[0][1]
    assert "part0 up" in coord_err and "part1 ready" in coord_err
    assert "said hello to the coordinator" in outs[2][1]  # executors say what they wait for
    assert len((tmp_path / "run1" / "metrics.jsonl").read_text().splitlines()) == 2

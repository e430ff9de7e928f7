"""benchmarks/wan_torch.py (issue 29's PyTorch baseline) and benchmarks/wan_model.py (the model and data it shares
with fusion): two ranks of torch.distributed.pipelining on loopback train exactly what one process of plain PyTorch
trains on the same GPT and batches (every step's loss and every validation loss, rtol 1e-5), and ``fusion run`` with
the wan_model entries starts from the same loss (same model, same init, same batches)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import wan_torch  # noqa: E402
from wan_model import gpt_setup  # noqa: E402

from tests.fusion.cli_helpers import free_ports  # noqa: E402

STEPS, EVAL_EVERY, EVAL_BATCHES = 3, 2, 2
TWO = ("name: two\ndevices:\n"
       "  - {name: cpu-0, peak_flops: 50 GFLOPS, memory: 4 GB}\n"
       "  - {name: cpu-1, peak_flops: 50 GFLOPS, memory: 4 GB}\n"
       "links:\n  default: {latency: 1 ms, bandwidth: 1 Gbit/s}\n")


def one_process(setup, steps: int, eval_every: int, eval_batches: int) -> tuple[list[float], list[list[float]], float]:
    """Plain PyTorch in this process: the whole GPT, the whole batch per step, the setup's AdamW. Returns the
    losses, the validation losses and step 0's squared gradient norm counted as the pipeline holds the
    parameters (the tied embedding twice: on the first stage and, as the head's copy, on the last)."""
    m = setup.module()
    opt = torch.optim.AdamW(m.parameters(), lr=setup.lr, betas=setup.betas, eps=setup.eps,
                            weight_decay=setup.weight_decay)
    losses, val = [], []
    for s in range(steps):
        b = {k: torch.from_numpy(v) for k, v in setup.train_batch(s).items()}
        opt.zero_grad(set_to_none=True)
        loss = m(b["idx"], b["targets"])
        loss.backward()
        if s == 0:
            grad_sq = sum(float((p.grad.double() ** 2).sum()) for p in m.parameters())
            grad_sq += float((m.lm_head.weight.grad.double() ** 2).sum())
        opt.step()
        losses.append(float(loss.detach()))
        if (s + 1) % eval_every == 0 or s + 1 == steps:
            with torch.no_grad():
                v = [float(m(*(torch.from_numpy(setup.val_batch(k)[n]) for n in ("idx", "targets"))))
                     for k in range(eval_batches)]
            val.append([s + 1, sum(v) / len(v)])
    return losses, val, grad_sq


def two_ranks(out: Path, env: dict, *extra: str, world: int = 2, micro_batches: int = 2) -> list[subprocess.Popen]:
    """wan_torch.py's ranks on loopback (two unless ``world``): the tiny GPT, seed 3, STEPS steps of 8 rows in
    ``micro_batches`` micro-batches."""
    (port,) = free_ports(1)
    return [subprocess.Popen(
        [sys.executable, str(REPO / "benchmarks" / "wan_torch.py"), "--rank", str(r), "--world", str(world),
         "--master", f"127.0.0.1:{port}", "--steps", str(STEPS), "--seed", "3", "--micro-batches", str(micro_batches),
         "--batch", "8", "--eval-every", str(EVAL_EVERY), "--eval-batches", str(EVAL_BATCHES), "--model", "tiny",
         "--out", str(out), "--timeout", "120", *extra], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True) for r in range(world)]


def finished(ranks: list[subprocess.Popen], out: Path) -> dict:
    """Wait for every rank (each is killed if the test fails first); all must exit 0; rank 0's JSON."""
    try:
        logs = [p.communicate(timeout=240)[0] for p in ranks]
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in ranks), "\n".join(x[-3000:] for x in logs)
    return json.loads(out.read_text())


def test_pipelining_trains_as_one_process_and_fusion_starts_at_the_same_loss(tmp_path):
    setup = gpt_setup("tiny", seed=3, batch=8, micro_batches=2)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    out = tmp_path / "torch.json"
    ranks = two_ranks(out, env)
    # fusion dense on the same model and batches, 2 parts on loopback, at the same time (2 cores)
    (tmp_path / "two.yaml").write_text(TWO)
    fusion = subprocess.Popen(
        [sys.executable, "-m", "fusion.cli", "run", *setup.fusion_args(), "--cluster", str(tmp_path / "two.yaml"),
         "--strategy", "equal-flops", "--steps", "1", "--threads", "1", "--insecure", "--trace", "off",
         "--no-progress", "--out", str(tmp_path / "fusion")], env={**env, **setup.env}, cwd=REPO,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        logs = [p.communicate(timeout=240)[0] for p in ranks]
        flog = fusion.communicate(timeout=240)[0]
    finally:
        for p in (*ranks, fusion):
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in ranks), "\n".join(x[-3000:] for x in logs)
    assert fusion.returncode == 0, flog[-3000:]

    got = json.loads(out.read_text())
    assert {"samples_per_s", "wall_s", "val", "losses", "schedule", "stages", "model", "seed"} <= set(got)
    assert got["schedule"] in ("gpipe", "1f1b", "interleaved1f1b") and got["stages"] == 2 and got["model"] == "tiny" and got["seed"] == 3
    assert got["samples_per_s"] > 0 and got["wall_s"] >= got["val"][-1][1] > 0
    losses, val, grad_sq = one_process(setup, STEPS, EVAL_EVERY, EVAL_BATCHES)
    np.testing.assert_allclose(got["losses"], losses, rtol=1e-5)
    assert [v[0] for v in got["val"]] == [v[0] for v in val] == [2, 3]
    np.testing.assert_allclose([v[2] for v in got["val"]], [v[1] for v in val], rtol=1e-5)
    assert losses[-1] < losses[0]  # it trains
    # every schedule the probe timed computed step 0's loss and gradient (the one trained with is checked above)
    assert set(got["probe"]) == {"gpipe", "1f1b", "interleaved1f1b"}
    for name, p in got["probe"].items():
        np.testing.assert_allclose([p["loss"], p["grad_sq"]], [losses[0], grad_sq], rtol=1e-5, err_msg=name)

    from fusion.plan import load_plan

    assert len(load_plan(tmp_path / "fusion" / "plan").parts) == 2
    first = json.loads((tmp_path / "fusion" / "metrics.jsonl").read_text().splitlines()[0])
    np.testing.assert_allclose(first["loss"], losses[0], rtol=1e-5)


@pytest.mark.parametrize("wire", ["fp32", "bf16"])
def test_two_pipelines_averaging_gradients_train_as_one_process_on_the_whole_batch(tmp_path, wire):
    """``--replicas 2 --world 4`` (issue 36's DP x PP baseline): two 2-stage pipelines, each on its half of every
    batch's rows (2 of the 4 micro-batches), gradients averaged across them after the backward: every step's loss,
    every held-out loss and step 0's gradient equal one process on the whole batch (rtol 1e-5). ``--dp-wire bf16``
    (DDP's bf16_compress_hook) rounds the averaged gradients to bfloat16: step 0's loss is still exact, the rest
    within rtol 1e-3 and not equal (the rounding happened)."""
    setup = gpt_setup("tiny", seed=3, batch=8, micro_batches=4)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    out = tmp_path / "torch.json"
    got = finished(two_ranks(out, env, "--replicas", "2", "--dp-wire", wire, world=4, micro_batches=4), out)
    assert (got["stages"], got["replicas"], got["dp_wire"]) == (2, 2, wire)
    losses, val, grad_sq = one_process(setup, STEPS, EVAL_EVERY, EVAL_BATCHES)
    if wire == "bf16":
        np.testing.assert_allclose(got["losses"][0], losses[0], rtol=1e-6)
        np.testing.assert_allclose(got["losses"], losses, rtol=1e-3)
        np.testing.assert_allclose([v[2] for v in got["val"]], [v[1] for v in val], rtol=1e-3)
        assert not np.allclose(got["losses"][1:], losses[1:], rtol=1e-7, atol=0)
        return
    np.testing.assert_allclose(got["losses"], losses, rtol=1e-5)
    np.testing.assert_allclose([v[2] for v in got["val"]], [v[1] for v in val], rtol=1e-5)
    assert set(got["probe"]) == {"gpipe", "1f1b", "interleaved1f1b"}  # every schedule, each with its groups
    for name, p in got["probe"].items():
        np.testing.assert_allclose([p["loss"], p["grad_sq"]], [losses[0], grad_sq], rtol=1e-5, err_msg=name)
    # one replica alone (no gradient average) would not: its half of the rows has another loss
    half = {k: torch.from_numpy(v[:4]) for k, v in setup.train_batch(0).items()}
    with torch.no_grad():
        assert abs(float(setup.module()(half["idx"], half["targets"])) - losses[0]) > 1e-4


@pytest.mark.parametrize("argv, says", [
    (["--world", "3"], "do not split into 3 equal stages"),
    (["--world", "4", "--replicas", "3"], "--replicas 3: expected a divisor of --world 4"),
    (["--world", "2", "--replicas", "2"], "at least 2 stages per replica"),
    (["--world", "4", "--replicas", "2", "--micro-batches", "3"], "does not split over 2 replicas"),
    (["--batch", "7"], "batch 7 does not split into 2"),
    (["--rank", "2"], "--rank 2"),
    (["--master", "127.0.0.1"], "--master"),
    (["--model", "huge"], "model 'huge'"),
    (["--schedule", "1f1b", "--micro-batches", "1"], "1F1B needs at least as many micro-batches"),
])
def test_bad_input_is_one_line_and_status_2(argv, says, capsys, tmp_path):
    base = {"--rank": "0", "--world": "2", "--master": "127.0.0.1:1", "--steps": "1", "--batch": "8",
            "--micro-batches": "2", "--model": "tiny", "--out": str(tmp_path / "x.json")}
    base.update(dict(zip(argv[::2], argv[1::2])))
    assert wan_torch.main([x for kv in base.items() for x in kv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err, err
    assert not (tmp_path / "x.json").exists()


def bf16_reference(setup, steps: int, eval_every: int, eval_batches: int) -> tuple[list[float], list[list[float]]]:
    """Plain PyTorch of ``--precision bf16`` in this process: the same two stages (``wan_torch.build_stage``, under
    autocast, a bfloat16 tensor between them) composed in one process, micro-batch by micro-batch with the
    gradients averaged over them, the tied head sharing the embedding, the setup's AdamW."""
    m = setup.module()
    subs = wan_torch.units(m)
    s0 = wan_torch.build_stage(m, subs, 0, 2, None, bf16=True)
    s1 = wan_torch.build_stage(m, subs, 1, 2, m.lm_head.weight, bf16=True)
    opt = torch.optim.AdamW(m.parameters(), lr=setup.lr, betas=setup.betas, eps=setup.eps,
                            weight_decay=setup.weight_decay)
    M, mb = setup.micro_batches, setup.micro_batch

    def mean_loss(batch, train: bool) -> float:
        total = 0.0
        for i in range(M):
            idx, tgt = (torch.from_numpy(batch[k][i * mb:(i + 1) * mb]) for k in ("idx", "targets"))
            between = s0(idx)
            assert between.dtype == torch.bfloat16  # what crosses the wire
            loss = wan_torch.loss_fn(s1(between), tgt)
            if train:
                (loss / M).backward()
            total += float(loss.detach())
        return total / M

    losses, val = [], []
    for s in range(steps):
        opt.zero_grad(set_to_none=True)
        losses.append(mean_loss(setup.train_batch(s), True))
        opt.step()
        if (s + 1) % eval_every == 0 or s + 1 == steps:
            with torch.no_grad():
                v = [mean_loss(setup.val_batch(k), False) for k in range(eval_batches)]
            val.append([s + 1, sum(v) / len(v)])
    return losses, val


def test_bf16_pipelining_sends_bfloat16_and_trains_as_its_one_process_reference(tmp_path):
    """``--precision bf16`` (torch's best wire, bench_wan.py --precision bf16): two ranks over gloo equal the same
    stages composed in one process (losses and validation losses rtol 1e-5), and stay near fp32's (bf16 rounding)."""
    setup = gpt_setup("tiny", seed=3, batch=8, micro_batches=2)
    out = tmp_path / "torch.json"
    got = finished(two_ranks(out, {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
                             "--schedule", "gpipe", "--precision", "bf16"), out)
    assert got["precision"] == "bf16"
    losses, val = bf16_reference(setup, STEPS, EVAL_EVERY, EVAL_BATCHES)
    np.testing.assert_allclose(got["losses"], losses, rtol=1e-5)
    np.testing.assert_allclose([v[2] for v in got["val"]], [v[1] for v in val], rtol=1e-5)
    fp32, _, _ = one_process(setup, STEPS, EVAL_EVERY, EVAL_BATCHES)
    np.testing.assert_allclose(losses, fp32, rtol=2e-2)  # bfloat16 matmuls, not another model
    assert losses != fp32  # (and not fp32 under another name)

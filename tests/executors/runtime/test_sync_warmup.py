"""DiLoCo's synchronous warm-up (``dp_sync.sync_warmup`` N, ``--sync-warmup N``) in the runtime against a plain-PyTorch
reference: R model copies whose first N steps average their gradients (synchronous DP: every copy's own optimizer
steps on the average, so all stay equal), then DiLoCo (Douillard et al. 2023, Algorithm 1) from the weights after
step N, the outer Nesterov SGD fresh, each copy keeping its optimizer state, outer boundaries at N + H, N + 2H, ...
With ``dp_sync.inner_lr`` the copies' optimizers step at that lr after step N (the warm-up at the plan's lr).
Every loss at rtol 1e-5, the final weights at rtol 1e-4; ``N >= --steps`` is one line, exit 2."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fusion.plan import DPSync, load_plan
from tests.executors.runtime.test_diloco import ADAMW, ALL, SGD_M, assert_matches, with_sync
from tests.executors.runtime.test_dp import MB, one_stage, run_dp, save_dp_plan


def warmup_reference(model, plain_loss, batches, replicas: int, micro: int, make_opt, sync: DPSync):
    """Plain PyTorch: per step (mean loss, replica 0's weights)."""
    names = [n for n in model.params if model.graph.params[n].trainable]
    fixed = {n: torch.tensor(np.asarray(v)) for n, v in model.params.items() if n not in names}
    local = [{n: torch.tensor(np.asarray(model.params[n])).requires_grad_(True) for n in names}
             for _ in range(replicas)]
    opts = [make_opt(list(p.values())) for p in local]
    glob, outer, out = None, None, []
    n_warm, h = sync.sync_warmup, sync.inner_steps

    def start():  # DiLoCo starts: global weights, a fresh outer optimizer
        g = {n: local[0][n].detach().clone() for n in names}
        return g, torch.optim.SGD(list(g.values()), lr=sync.outer_lr, momentum=sync.outer_momentum,
                                  nesterov=sync.nesterov and sync.outer_momentum > 0)

    if n_warm == 0:
        glob, outer = start()
    for step, batch in enumerate(batches):
        shares = {n: torch.as_tensor(v).chunk(replicas) for n, v in batch.items()}
        losses = []
        for r in range(replicas):
            opts[r].zero_grad()
            rows = {n: v[r] for n, v in shares.items()}
            for m in range(micro):
                c = {n: v.chunk(micro)[m] for n, v in rows.items()}
                lc = plain_loss({**fixed, **local[r]}, c)
                (lc / micro).backward()
                losses.append(lc.item())
        if step < n_warm:  # synchronous DP: the replicas' gradients averaged
            for n in names:
                g = torch.stack([local[r][n].grad for r in range(replicas)]).sum(0) / replicas
                for r in range(replicas):
                    local[r][n].grad = g.clone()
        elif sync.inner_lr is not None:  # DiLoCo runs: the replicas' own (inner) lr from here on
            for r in range(replicas):
                for group in opts[r].param_groups:
                    group["lr"] = sync.inner_lr
        for r in range(replicas):
            opts[r].step()
        done = step + 1
        if done == n_warm:
            glob, outer = start()
        elif done > n_warm and (done - n_warm) % h == 0:
            outer.zero_grad()
            for n in names:
                glob[n].grad = torch.stack([glob[n] - local[r][n].detach() for r in range(replicas)]).sum(0) / replicas
            outer.step()
            with torch.no_grad():
                for r in range(replicas):
                    for n in names:
                        local[r][n].copy_(glob[n])
        out.append((float(np.mean(losses)), {n: v.detach().clone().numpy() for n, v in local[0].items()}))
    return out


CASES = [  # (model, inner optimizer, engines, H, replicas, warm-up)
    ("mlp", ADAMW, {"r1.p0": "numpy"}, 2, 2, 3),
    ("cnn", SGD_M, None, 3, 3, 2),
]


@pytest.mark.parametrize("name,opt,engines,H,R,N", CASES, ids=[f"{c[0]}-{c[4]}x-H{c[3]}-N{c[5]}" for c in CASES])
def test_sync_warmup_matches_a_plain_pytorch_reference(tmp_path, name, opt, engines, H, R, N):
    build, _, plain_loss, batch_fn = ALL[name]
    model = build(mb=MB)
    micro = 1
    plan_dir = save_dp_plan(tmp_path, model, one_stage(model), R, micro_batches=micro, optimizer=opt[0],
                            engines=engines)
    sync = DPSync("diloco", inner_steps=H, outer_lr=0.7, outer_momentum=0.6, sync_warmup=N)
    with_sync(plan_dir, model, sync)
    assert load_plan(plan_dir).dp_sync.sync_warmup == N
    batches = [batch_fn(s, R * micro * MB) for s in range(N + 2 * H + 1)]
    reports, state, states = run_dp(plan_dir, tmp_path / "run", batches)
    assert_matches(reports, state, warmup_reference(model, plain_loss, batches, R, micro, opt[1], sync))
    outer = [r.parts["p0"].get("outer") for r in reports]
    assert [o["step"] for o in outer if o] == [N + H, N + 2 * H]
    assert all("allreduce_s" in r.parts["p0"] for r in reports[:N])
    assert not any("allreduce_s" in r.parts["p0"] for r in reports[N:])
    # without the warm-up the run is another (the reference would not match): the test can tell them apart
    plain = warmup_reference(model, plain_loss, batches, R, micro, opt[1], DPSync("diloco", inner_steps=H,
                                                                                  outer_lr=0.7, outer_momentum=0.6))
    assert not np.allclose([r.loss for r in reports], [p[0] for p in plain], rtol=1e-5)


INNER_LR_CASES = [  # (model, inner optimizer, engines, H, replicas, warm-up, inner lr)
    ("mlp", ADAMW, {"r1.p0": "numpy"}, 2, 2, 2, 0.004),  # AdamW at 0.01 in the warm-up, 0.004 after it
    ("cnn", SGD_M, None, 2, 2, 0, 0.03),  # no warm-up: the inner lr from the first step
]


@pytest.mark.parametrize("name,opt,engines,H,R,N,lr", INNER_LR_CASES,
                         ids=[f"{c[0]}-N{c[5]}-lr{c[6]}" for c in INNER_LR_CASES])
def test_inner_lr_matches_a_plain_pytorch_reference(tmp_path, name, opt, engines, H, R, N, lr):
    """``dp_sync.inner_lr``: the replicas' optimizers (torch and NumPy engines) step at it once DiLoCo runs, the
    warm-up at the plan's lr; equal to the reference, and not to the same run at the plan's lr."""
    build, _, plain_loss, batch_fn = ALL[name]
    model = build(mb=MB)
    plan_dir = save_dp_plan(tmp_path, model, one_stage(model), R, micro_batches=1, optimizer=opt[0], engines=engines)
    sync = DPSync("diloco", inner_steps=H, outer_lr=0.7, outer_momentum=0.6, sync_warmup=N, inner_lr=lr)
    with_sync(plan_dir, model, sync)
    assert load_plan(plan_dir).dp_sync.inner_lr == lr
    batches = [batch_fn(s, R * MB) for s in range(N + 2 * H + 1)]
    reports, state, _ = run_dp(plan_dir, tmp_path / "run", batches)
    assert_matches(reports, state, warmup_reference(model, plain_loss, batches, R, 1, opt[1], sync))
    assert [r.lr for r in reports] == [opt[0].lr] * N + [lr] * (2 * H + 1)  # the coordinator's record of it
    plain = warmup_reference(model, plain_loss, batches, R, 1, opt[1], DPSync("diloco", inner_steps=H, outer_lr=0.7,
                                                                             outer_momentum=0.6, sync_warmup=N))
    assert not np.allclose([r.loss for r in reports], [p[0] for p in plain], rtol=1e-5)


def test_warmup_of_the_whole_run_or_with_shares_is_one_line(tmp_path, capsys):
    from fusion.cli import main
    from tests.fusion.cli_helpers import one_line
    from tests.fusion.test_diloco_cli import LOCAL

    missing = str(tmp_path / "missing.py:nothing")
    for opts, says in [(["--steps", "5", "--sync-warmup", "5"], "--sync-warmup 5: the synchronous warm-up must be "
                                                               "shorter than the run (--steps 5)"),
                       (["--sync-warmup", "-1"], "--sync-warmup must be an integer >= 0, got -1"),
                       (["--sync-warmup", "2", "--replica-shares", "0=3"], "--sync-warmup: the synchronous warm-up "
                                                                           "averages equal shares")]:
        assert main(["run", missing, "--cluster", LOCAL, "--replicas", "2", "--dp-sync", "diloco", *opts,
                     "--out", str(tmp_path / "run")]) == 2
        assert says in one_line(capsys)
    assert main(["compile", missing, "--cluster", LOCAL, "--replicas", "2", "--sync-warmup", "3",
                 "-o", str(tmp_path / "x")]) == 2
    assert "--sync-warmup is an option of --dp-sync diloco" in one_line(capsys)
    for opts in (["--pseudo-codec", "quant:bits=8"], ["--sync-warmup", "3"]):  # a warm-up codec needs both
        assert main(["compile", missing, "--cluster", LOCAL, "--replicas", "2", "--dp-sync", "diloco", "--dp-codec",
                     "quant:bits=8", *opts, "-o", str(tmp_path / "x")]) == 2
        assert "runs only in its synchronous warm-up: give --sync-warmup N and a --pseudo-codec" in one_line(capsys)
    assert not (tmp_path / "run").exists() and not (tmp_path / "x").exists()


def test_a_warm_up_under_dp_codec_is_synchronous_dp_under_that_codec(tmp_path):
    """``--dp-codec`` with DiLoCo (``--sync-warmup N --pseudo-codec ...``): the warm-up's gradient all-reduce travels
    under the plan's ``dp_codec``. Its steps equal synchronous DP under the same codec (``--dp-sync every
    --dp-codec``, checked against plain PyTorch in test_dp.py) bit for bit, through step N's loss (the first
    computed from the warm-up's weights); they differ from the exact warm-up (so the codec ran), DiLoCo's outer
    steps follow at N + H, and a plan whose DiLoCo has no warm-up or no pseudo-gradient codec is refused."""
    from fusion.plan import PlanError, save_plan

    build, _, _, batch_fn = ALL["mlp"]
    model = build(mb=MB)
    R, N, H = 2, 3, 2
    q8 = {"algo": "quant", "bits": 8}
    batches = [batch_fn(s, R * MB) for s in range(N + H + 1)]

    def plan_with(name: str, sync: DPSync | None, codec: dict | None):
        plan_dir = save_dp_plan(tmp_path / name, model, one_stage(model), R, micro_batches=1, optimizer=ADAMW[0])
        plan = load_plan(plan_dir)
        plan.dp_codec = codec
        if sync is not None:
            plan.dp_sync = sync
        save_plan(plan, plan_dir, params=model.params)
        return plan_dir

    diloco = DPSync("diloco", inner_steps=H, outer_lr=0.7, outer_momentum=0.6, sync_warmup=N, codec=q8)
    got, _, _ = run_dp(plan_with("warm", diloco, q8), tmp_path / "warm" / "run", batches)
    every, _, _ = run_dp(plan_with("every", None, q8), tmp_path / "every" / "run", batches[:N + 1])
    exact, _, _ = run_dp(plan_with("exact", diloco, None), tmp_path / "exact" / "run", batches[:N + 1])
    np.testing.assert_array_equal([r.loss for r in got[:N + 1]], [r.loss for r in every])
    assert [r.loss for r in got[1:N + 1]] != [r.loss for r in exact[1:]]
    assert [o["step"] for o in (r.parts["p0"].get("outer") for r in got) if o] == [N + H]
    for bad in (DPSync("diloco", inner_steps=H, outer_lr=0.7, outer_momentum=0.6, sync_warmup=N),
                DPSync("diloco", inner_steps=H, outer_lr=0.7, outer_momentum=0.6, codec=q8)):
        with pytest.raises(PlanError, match="dp_codec: DiLoCo runs the per-step gradient all-reduce only in its"):
            load_plan(plan_with(f"bad{bad.sync_warmup}", bad, q8))

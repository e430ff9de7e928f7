"""Per-replica inner steps (``dp_sync.inner_steps_per_replica``, ``--inner-steps auto``; issue 34): replica r takes
H_r inner steps in the last H_r global steps of each round of H = max H_r, and the outer average weighs its
pseudo-gradient by the samples it saw (H_r x its micro-batches per step).

The multi-process runs (one executor per part, loopback) are compared step by step with a plain-PyTorch
reference of that algorithm written here: R model copies with their own torch.optim inner optimizers, replica r
stepping on its share of the global batch only at the round positions it is active, and at every round's end
the sample-weighted mean pseudo-gradient ``global - local`` fed to torch's Nesterov SGD on the global weights,
which every copy then continues from."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fusion.plan import DPSync, OptimizerConfig, PlanError, load_plan
from tests.executors.runtime.test_diloco import ALL, SGD_M, assert_matches, with_sync
from tests.executors.runtime.test_dp import MB, one_stage, run_dp, save_dp_plan

CLIP = (OptimizerConfig("sgd", lr=0.1, momentum=0.9, clip_grad_norm=0.5),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))


def reference(model, plain_loss, batches, counts, per, sync, make_opt, clip=None):
    """Plain-PyTorch DiLoCo with per-replica inner steps: per step (mean loss over the micro-batches of the
    replicas that stepped, replica 0's weights)."""
    names = [k for k in model.params if model.graph.params[k].trainable]
    glob = {k: torch.tensor(np.asarray(model.params[k])) for k in names}
    fixed = {k: torch.tensor(np.asarray(v)) for k, v in model.params.items() if k not in glob}
    outer = torch.optim.SGD(list(glob.values()), lr=sync.outer_lr, momentum=sync.outer_momentum,
                            nesterov=sync.nesterov and sync.outer_momentum > 0)
    R, H = len(counts), sync.inner_steps
    local = [{k: v.clone().requires_grad_(True) for k, v in glob.items()} for _ in range(R)]
    opts = [make_opt(list(p.values())) for p in local]
    seen = [per[r] * counts[r] for r in range(R)]  # samples per round, in micro-batches
    out = []
    for step, batch in enumerate(batches):
        rows = len(next(iter(batch.values())))
        sizes = [c * rows // sum(counts) for c in counts]
        shares = {k: torch.as_tensor(v).split(sizes) for k, v in batch.items()}
        losses = []
        for r in range(R):
            if step % H < H - per[r]:  # idle: the first H - H_r steps of the round
                continue
            n = counts[r]
            opts[r].zero_grad()
            for m in range(n):
                c = {k: v[r].chunk(n)[m] for k, v in shares.items()}
                lc = plain_loss({**fixed, **local[r]}, c)
                (lc / n).backward()
                losses.append(lc.item())
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(list(local[r].values()), clip)
            opts[r].step()
        if (step + 1) % H == 0:
            outer.zero_grad()
            for k, g in glob.items():
                g.grad = sum((g - local[r][k].detach()) * (seen[r] / sum(seen)) for r in range(R))
            outer.step()
            with torch.no_grad():
                for r in range(R):
                    for k in names:
                        local[r][k].copy_(glob[k])
        out.append((float(np.mean(losses)), {k: v.detach().clone().numpy() for k, v in local[0].items()}))
    return out


CASES = [  # (replicas, micro-batches per replica, shares, H_r, inner optimizer, engines)
    (3, 1, {}, {0: 4, 1: 2, 2: 1}, SGD_M, None),  # a ring of three, rounds of 4 steps
    (2, 2, {0: 3.0, 1: 1.0}, {0: 3, 1: 2}, CLIP, {"r1.p0": "numpy"}),  # unequal shares, clipping, a NumPy replica
]


@pytest.mark.parametrize("R,micro,shares,per,opt,engines", CASES, ids=["3x1-H421", "2x1-shares-clip-numpy"])
def test_per_replica_inner_steps_match_a_plain_pytorch_reference(tmp_path, R, micro, shares, per, opt, engines):
    build, _, plain_loss, batch_fn = ALL["mlp"]
    model = build(mb=MB)
    plan_dir = save_dp_plan(tmp_path, model, one_stage(model), R, micro_batches=micro, optimizer=opt[0],
                            engines=engines)
    H = max(per.values())
    sync = DPSync("diloco", inner_steps=H, outer_lr=0.7, outer_momentum=0.6, shares=shares,
                  inner_steps_per_replica=per)
    with_sync(plan_dir, model, sync)
    assert load_plan(plan_dir).dp_sync.inner_steps_per_replica == per
    from fusion.executors.runtime.dp.outer import replica_micro_batches

    counts = replica_micro_batches(load_plan(plan_dir))
    batches = [batch_fn(s, R * micro * MB) for s in range(2 * H)]
    reports, state, states = run_dp(plan_dir, tmp_path / "run", batches)
    clip = opt[0].clip_grad_norm
    assert_matches(reports, state, reference(model, plain_loss, batches, counts, per, sync, opt[1], clip))
    for other in states[1:]:  # after the last outer step every replica holds the global weights
        for k, v in states[0].items():
            np.testing.assert_allclose(other[k], v, rtol=1e-6, atol=1e-7, err_msg=k)
    parts = {r: ("p0" if r == 0 else f"r{r}.p0") for r in range(R)}
    for rep in reports:  # replica r is idle in the round's first H - H_r steps: no loss, no optimizer step
        pos = rep.step % H
        for r, p in parts.items():
            assert bool(rep.parts[p].get("idle_step")) == (pos < H - per[r]), (rep.step, r)
    outer = [rep.step + 1 for rep in reports if "outer" in rep.parts["p0"]]
    assert outer == [H, 2 * H]
    for rep in reports:  # the metrics' samples are those trained on; metrics.jsonl names the idle parts
        active = [r for r in range(R) if rep.step % H >= H - per[r]]
        assert rep.samples == MB * sum(counts[r] for r in active)
        assert rep.metrics_line().get("idle_parts", []) == [parts[r] for r in range(R) if r not in active]


def test_resume_mid_round_is_bit_exact(tmp_path):
    """H = 2, replica 1 takes H_r = 1 (idle in the first step of each round): run 4 steps with a checkpoint after
    step 3 (written while replica 1 is idle, mid-round), resume there and run step 4 again: the same loss and final
    weights, bit for bit."""
    from fusion.executors.runtime.coordinator import CoordinatorConfig
    from fusion.executors.runtime.launcher import LocalCluster

    build, _, _, batch_fn = ALL["mlp"]
    model = build(mb=MB)
    plan_dir = save_dp_plan(tmp_path, model, one_stage(model), 2, micro_batches=1, optimizer=SGD_M[0])
    with_sync(plan_dir, model, DPSync("diloco", inner_steps=2, inner_steps_per_replica={0: 2, 1: 1}))
    batches = [batch_fn(s, 2 * MB) for s in range(4)]
    cfg = dict(peer_timeout_s=30, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=3)
    with LocalCluster(plan_dir, tmp_path / "a", CoordinatorConfig(**cfg), threads=1) as lc:
        lc.start()
        full = [lc.coordinator.step(b) for b in batches]
        state = lc.coordinator.fetch_state()
    assert full[2].parts["r1.p0"].get("idle_step") and full[2].parts["r1.p0"]["checkpoint_step"] == 3
    with LocalCluster(plan_dir, tmp_path / "b", CoordinatorConfig(**cfg), threads=1) as lc:
        assert lc.start(resume=True) == 3
        rest = [lc.coordinator.step(b) for b in batches[3:]]
        resumed = lc.coordinator.fetch_state()
    assert [r.loss for r in rest] == [full[3].loss] and "outer" in rest[0].parts["p0"]
    for k, v in state.items():
        np.testing.assert_array_equal(resumed[k], v, err_msg=k)


@pytest.mark.parametrize("change,match", [
    (dict(inner_steps_per_replica={0: 4, 1: 5}), "replica 1's H must be an integer in 1 .. inner_steps"),
    (dict(inner_steps_per_replica={0: 2, 1: 3}), "the fastest replica's H \\(3\\) must be inner_steps \\(4\\)"),
    (dict(inner_steps_per_replica={0: 4, 1: 2}, fragments=2), "with streaming fragments .* are not built"),
    (dict(inner_steps_per_replica={0: 4, 1: 2}, delay=1), "with the overlapped outer step .* are not built"),
    (dict(inner_steps_per_replica={0: 4, 1: 2}, sync_warmup=2), "with the synchronous warm-up .* are not built"),
])
def test_bad_per_replica_inner_steps_are_one_line(change, match):
    with pytest.raises(PlanError, match=match):
        DPSync("diloco", inner_steps=4, **change).check()


def test_the_field_is_written_only_when_set_and_round_trips():
    plain = DPSync("diloco", inner_steps=4)
    assert "inner_steps_per_replica" not in plain.to_dict()  # plans without it keep their bytes (and digest)
    d = DPSync("diloco", inner_steps=4, inner_steps_per_replica={0: 4, 1: 1}).to_dict()
    assert d["inner_steps_per_replica"] == {"0": 4, "1": 1}
    assert DPSync.from_dict(d).inner_steps_per_replica == {0: 4, 1: 1}
    with pytest.raises(PlanError, match="inner_steps_per_replica: expected replica -> H"):
        DPSync.from_dict({**d, "inner_steps_per_replica": {"x": 1}})


def test_which_replicas_step_and_their_round_weights():
    from fusion.executors.runtime.dp.inner_steps import round_weights, stepping_replicas

    s = DPSync("diloco", inner_steps=4, inner_steps_per_replica={0: 4, 1: 2, 2: 1})
    assert [stepping_replicas(s, [0, 1, 2], t) for t in range(1, 9)] == [
        [0], [0], [0, 1], [0, 1, 2], [0], [0], [0, 1], [0, 1, 2]]
    assert round_weights(s, [1, 3, 2]) == [4.0, 6.0, 2.0]
    assert stepping_replicas(DPSync("diloco", inner_steps=4), [0, 1], 1) == [0, 1]

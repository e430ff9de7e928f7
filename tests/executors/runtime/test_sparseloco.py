"""SparseLoCo in the runtime (``dp_sync.codec`` sparseloco, arXiv 2508.15706 Algorithm 1) against a plain-PyTorch
SparseLoCo written here: R model copies with their own inner optimizers, and every H steps each replica's
error-feedback accumulator ``A_r = beta e_r + (theta - theta_r)``, its chunk Top-k with 2-bit values ``S_r``
(torch ops only: a stable descending sort per chunk, the two magnitude levels), ``e_r = A_r - S_r``, and the
outer step ``theta -= alpha mean_r S_r`` (torch.optim.SGD without momentum). Every loss at rtol 1e-5, the final
weights at rtol 1e-4, every replica the same bits."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fusion.plan import DPSync
from tests.executors.runtime.test_diloco import ADAMW, ALL, SGD, assert_matches, with_sync
from tests.executors.runtime.test_dp import MB, one_stage, run_dp, save_dp_plan


def chunk_topk_2bit(a: torch.Tensor, chunk: int, k: int) -> torch.Tensor:
    """S = C(A) of a flat float32 tensor: per chunk the k largest |a| (ties to the lower index), each sent as its
    sign and one magnitude bit (above the midpoint of the kept magnitudes' range), decoded to the mean magnitude
    of its half (float32 levels)."""
    out = torch.zeros(a.numel(), dtype=torch.float64)
    for lo in range(0, a.numel(), chunk):
        c = a[lo:lo + chunk].double()
        sel = torch.sort(c.abs(), descending=True, stable=True).indices[:min(k, c.numel())]
        v = c[sel]
        m = v.abs()
        upper = m > (m.min() + m.max()) / 2
        low_lv = (m[~upper] if (~upper).any() else m[upper]).mean().float().double()
        high_lv = m[upper].mean().float().double() if upper.any() else low_lv
        mag = torch.where(upper, high_lv, low_lv)
        out[lo + sel] = torch.where(v < 0, -mag, mag)
    return out.float()


def sparseloco_reference(model, plain_loss, batches, replicas: int, micro: int, make_opt, sync: DPSync):
    """Plain-PyTorch SparseLoCo: per step (mean loss, replica 0's weights). The flat pseudo-gradient is every
    trainable float32 parameter, names sorted, end to end (the runtime's one bucket)."""
    cfg = sync.codec
    chunk, k, beta = cfg.get("chunk", 4096), cfg.get("k", 64), cfg.get("beta", 0.95)
    names = sorted(k_ for k_ in model.params if model.graph.params[k_].trainable)
    glob = {n: torch.tensor(np.asarray(model.params[n])) for n in names}
    fixed = {n: torch.tensor(np.asarray(v)) for n, v in model.params.items() if n not in glob}
    outer = torch.optim.SGD(list(glob.values()), lr=sync.outer_lr)
    local = [{n: v.clone().requires_grad_(True) for n, v in glob.items()} for _ in range(replicas)]
    opts = [make_opt(list(p.values())) for p in local]
    err = [torch.zeros(sum(glob[n].numel() for n in names)) for _ in range(replicas)]
    out = []
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
            opts[r].step()
        if (step + 1) % sync.inner_steps == 0:
            sent = []
            for r in range(replicas):
                delta = torch.cat([(glob[n] - local[r][n].detach()).reshape(-1) for n in names])
                acc = delta + err[r] * torch.tensor(beta, dtype=torch.float32)  # Algorithm 1, line 1
                s = chunk_topk_2bit(acc, chunk, k)                             # line 2
                err[r] = acc - s                                               # line 3
                sent.append(s)
            mean = torch.stack(sent).sum(0) / replicas
            outer.zero_grad()
            lo = 0
            for n in names:
                glob[n].grad = mean[lo:lo + glob[n].numel()].reshape(glob[n].shape).clone()
                lo += glob[n].numel()
            outer.step()                                                       # line 4
            with torch.no_grad():
                for r in range(replicas):
                    for n in names:
                        local[r][n].copy_(glob[n])
        out.append((float(np.mean(losses)), {n: v.detach().clone().numpy() for n, v in local[0].items()}))
    return out


CASES = [  # (model, inner optimizer, engines, H, replicas, codec cfg)
    ("mlp", ADAMW, {"r1.p0": "numpy"}, 2, 2, {"algo": "sparseloco", "chunk": 16, "k": 4, "beta": 0.9}),
    ("cnn", SGD, None, 2, 3, {"algo": "sparseloco", "chunk": 64, "k": 8}),
]


@pytest.mark.parametrize("name,opt,engines,H,R,codec", CASES, ids=[f"{c[0]}-{c[4]}x-H{c[3]}" for c in CASES])
def test_sparseloco_matches_a_plain_pytorch_reference(tmp_path, name, opt, engines, H, R, codec):
    from fusion.kernels.codecs import CODECS

    build, _, plain_loss, batch_fn = ALL[name]
    model = build(mb=MB)
    micro = 1
    plan_dir = save_dp_plan(tmp_path, model, one_stage(model), R, micro_batches=micro, optimizer=opt[0],
                            engines=engines)
    sync = DPSync("diloco", inner_steps=H, outer_lr=1.0, outer_momentum=0.0, codec=codec, error_feedback=True)
    with_sync(plan_dir, model, sync)
    batches = [batch_fn(s, R * micro * MB) for s in range(4 * H)]
    reports, state, states = run_dp(plan_dir, tmp_path / "run", batches)
    want = sparseloco_reference(model, plain_loss, batches, R, micro, opt[1], sync)
    assert_matches(reports, state, want)
    for other in states[1:]:
        for k, v in states[0].items():
            np.testing.assert_array_equal(other[k], v, err_msg=f"replicas differ in {k}")
    numel = sum(int(np.prod(model.graph.params[k].shape)) for k in model.graph.params if model.graph.params[k].trainable)
    outer = [r.parts["p0"]["outer"] for r in reports if "outer" in r.parts["p0"]]
    wire = CODECS.unit("sparseloco").wire_nbytes(numel, "float32", codec)
    assert len(outer) == 4 and all(o["payload_bytes"] == wire and o["sent_bytes"] == (R - 1) * wire for o in outer)
    assert wire < 2 * numel  # under half the dense float32 bytes (small chunks: the levels weigh)

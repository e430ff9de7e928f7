"""DiLoCo (``Plan.dp_sync.mode == "diloco"``): inner steps without all-reduce, an outer Nesterov step every H.

The multi-process cases start one executor per part (loopback) and compare every step's loss and the
final weights with a single-process DiLoCo written here in plain PyTorch: R model copies, each with its
own torch.optim inner optimizer on its share of the global batch, and every H steps the mean
pseudo-gradient ``global - local`` fed to torch.optim.SGD (Nesterov) on the global weights, which every
copy then continues from. With H = 1, an SGD inner optimizer, outer lr 1 and momentum 0, DiLoCo is
synchronous data parallelism, which the first case checks against a synchronous run.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fusion.plan import DPSync, OptimizerConfig, load_plan, save_plan
from tests.executors.dist_models import MODELS
from tests.executors.runtime.test_dp import MB, one_stage, run_dp, save_dp_plan

SGD = (OptimizerConfig("sgd", lr=0.1), lambda ps: torch.optim.SGD(ps, lr=0.1))
SGD_M = (OptimizerConfig("sgd", lr=0.1, momentum=0.9), lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
ADAMW = (OptimizerConfig("adamw", lr=0.01, weight_decay=0.01), lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.01))


def tiny_mlp(mb: int = 2, seed: int = 0):
    """Linear -> tanh -> Linear -> cross-entropy: a model the NumPy engine runs whole."""
    from fusion.ir.builder import GraphBuilder

    b = GraphBuilder()
    x, y = b.input("x"), b.label("y")
    h = b.function("tanh", "torch.tanh", b.module("fc1", "torch.nn.Linear", x, in_features=6, out_features=8))
    o = b.module("fc2", "torch.nn.Linear", h, in_features=8, out_features=3)
    b.loss("loss", "torch.nn.functional.cross_entropy", o, y)
    return b.build(example={"x": torch.randn(mb, 6), "y": torch.randint(0, 3, (mb,))}, seed=seed)


def mlp_loss(P, batch):
    h = torch.tanh(torch.nn.functional.linear(batch["x"], P["fc1.weight"], P["fc1.bias"]))
    return torch.nn.functional.cross_entropy(torch.nn.functional.linear(h, P["fc2.weight"], P["fc2.bias"]), batch["y"])


def mlp_batch(step: int, rows: int) -> dict[str, np.ndarray]:
    g = np.random.default_rng([5, step])
    return {"x": g.standard_normal((rows, 6)).astype(np.float32), "y": g.integers(0, 3, rows).astype(np.int64)}


ALL = {**MODELS, "mlp": (tiny_mlp, {}, mlp_loss, mlp_batch)}


def with_sync(plan_dir, model, sync: DPSync, algo: str | None = None):
    plan = load_plan(plan_dir)
    plan.dp_sync = sync
    if algo:
        plan.dp_algo = {p: algo for p in plan.parts if plan.parts[p].replica == 0}
    return save_plan(plan, plan_dir, params=model.params)


def _through_codec(deltas: dict, names: list, codec, residual):
    """What the runtime averages of one replica's pseudo-gradient under ``codec``: its buckets (one here: every
    float32 parameter, names sorted, end to end) encoded and decoded once, plus and minus the residual."""
    from fusion.executors.runtime.dp.outer import decode_pseudo, encode_pseudo

    flat = np.concatenate([deltas[k].numpy().reshape(-1) for k in names])
    if residual is not None:
        flat = flat + residual
    got = decode_pseudo(*encode_pseudo(flat, codec), codec)
    out, lo = {}, 0
    for k in names:
        n = deltas[k].numel()
        out[k] = torch.from_numpy(got[lo:lo + n].reshape(tuple(deltas[k].shape)).copy())
        lo += n
    return out, (flat - got if residual is not None else None)


def diloco_reference(model, plain_loss, batches, replicas: int, micro: int, make_opt, sync: DPSync, drop=None,
                     counts=None, drop_at_outer=None, join=None):
    """Plain-PyTorch DiLoCo (Douillard et al. 2023, Algorithm 1): per step (mean loss, global-or-local weights).

    Replica r takes the r-th contiguous share of each global batch, ``micro`` micro-batches with gradient
    accumulation. drop: ``(step, replica)``: from that step on the replica is gone (its inner steps since
    the last outer step are lost) and the survivors share the global batch. counts: each replica's
    micro-batches per step (unequal shares; its pseudo-gradient then weighs count / sum of counts). join:
    ``(step, replica)``: the replica starts late (the others share the global batch until then) and before that
    step, an outer boundary, joins with the global weights, a fresh inner optimizer and zero residual.
    drop_at_outer: ``(step, replica)``: the replica took its inner step of ``step`` (its loss counts) but
    died in that step's outer exchange, which averages the survivors only.

    ``sync.delay`` 1 (the runtime's delayed outer step, ``outer.py``): at a fragment's boundary each
    replica's pseudo-gradient is its progress since its window's start (``anchor - local``), the round
    started at the previous boundary is averaged over the replicas live now and applied to the global
    weights, and every replica rebases ``local = global - its progress`` (its new anchor); a round still in
    flight after the last step is applied to the weights returned last.

    ``sync.overlap`` "eager" with delay 1 (Kale, Douillard and Donchev 2025, arXiv 2502.12996, eager updates):
    every replica r keeps its own global weights and outer optimizer; at a fragment's boundary
    ``Delta_r = global_r - local_r`` and its outer gradient is ``w_r Delta_r + sum_{k != r} w_k Delta_k`` of
    the previous round (zero at the first), then ``local_r = global_r``; after the last step the others'
    terms of the round in flight are applied to the weights returned (replica ``live[0]``'s)."""
    names = [k for k in model.params if model.graph.params[k].trainable]
    glob = {k: torch.tensor(np.asarray(model.params[k])) for k in names}
    fixed = {k: torch.tensor(np.asarray(v)) for k, v in model.params.items() if k not in glob}
    outer = torch.optim.SGD(list(glob.values()), lr=sync.outer_lr, momentum=sync.outer_momentum,
                            nesterov=sync.nesterov and sync.outer_momentum > 0)
    local = [{k: v.clone().requires_grad_(True) for k, v in glob.items()} for _ in range(replicas)]
    opts = [make_opt(list(p.values())) for p in local]
    live = [r for r in range(replicas) if join is None or r != join[1]]
    from fusion.executors.runtime.dp.outer import fragment_buckets

    buckets, index = fragment_buckets({k: (tuple(v.shape), "float32") for k, v in glob.items()}, sync.fragments)
    frags = [sorted(n for b in i for n in buckets[b].names) for i in index]  # streaming fragments' parameters
    residual = [[np.zeros(sum(glob[k].numel() for k in f), np.float32) if sync.error_feedback else None
                 for f in frags] for _ in range(replicas)]
    h, nf = sync.inner_steps, len(frags)
    anchor = [{k: v.detach().clone() for k, v in p.items()} for p in local]  # delay 1: each window's start
    eager = bool(sync.delay) and sync.overlap == "eager"
    globs = [{k: v.clone() for k, v in glob.items()} for _ in range(replicas)]  # eager: each replica's own
    outers = [torch.optim.SGD(list(g.values()), lr=sync.outer_lr, momentum=sync.outer_momentum,
                              nesterov=sync.nesterov and sync.outer_momentum > 0) for g in globs]
    pending = [None] * nf  # delay 1: fragment -> {replica: its decoded pseudo-gradient} of the round in flight

    def share(r, members):  # w_r: sample-weighted over the members live now
        return counts[r] / sum(counts[m] for m in members) if counts else 1 / len(members)

    def apply_eager(r, f, own, others, members):  # replica r's outer step on its own global weights
        outers[r].zero_grad()
        for k in frags[f]:
            g = own[k] * share(r, members)
            for m in members:
                if m != r and others is not None:
                    g = g + others[m][k] * share(m, members)
            globs[r][k].grad = g
        outers[r].step()

    def apply_outer(f, deltas, members):  # deltas: {replica: {name: tensor}}, averaged over members
        outer.zero_grad()  # parameters of the other fragments have no gradient: torch's SGD skips them
        for k, g in ((k, glob[k]) for k in frags[f]):
            if counts:
                g.grad = sum(deltas[r][k] * (counts[r] / sum(counts)) for r in members)
            else:
                g.grad = torch.stack([deltas[r][k] for r in members]).sum(0) / len(members)
        outer.step()

    def start_round(f, raw):  # delay 1: what each live replica sends of fragment f (through the codec)
        sent = {}
        for r in live:
            d = raw[r]
            if sync.codec is not None:
                d, residual[r][f] = _through_codec(d, frags[f], sync.codec, residual[r][f])
            sent[r] = d
        return sent

    out = []
    for step, batch in enumerate(batches):
        if drop is not None and step == drop[0]:
            live.remove(drop[1])
        if join is not None and step == join[0]:  # (its optimizer never stepped: fresh; its residual: zeros)
            with torch.no_grad():
                for k, v in glob.items():
                    local[join[1]][k].copy_(v)
            live = sorted(live + [join[1]])
        sizes = [c * len(next(iter(batch.values()))) // sum(counts) for c in counts] if counts else None
        shares = {k: (torch.as_tensor(v).split(sizes) if sizes else torch.as_tensor(v).chunk(len(live)))
                  for k, v in batch.items()}
        losses = []  # (replica, a micro-batch's loss)
        for i, r in enumerate(live):
            n = counts[r] if counts else micro * replicas // len(live)  # survivors take the global batch's micro-batches
            opts[r].zero_grad()
            rows = {k: v[i] for k, v in shares.items()}
            for m in range(n):
                c = {k: v.chunk(n)[m] for k, v in rows.items()}
                lc = plain_loss({**fixed, **local[r]}, c)
                (lc / n).backward()
                losses.append((r, lc.item()))
            opts[r].step()
        due = [f for f in range(nf) if (step + 1) % h == (f * h) // nf]
        if drop_at_outer is not None and step == drop_at_outer[0]:
            live.remove(drop_at_outer[1])
        if due and eager:
            (f,) = due
            raw = {r: {k: globs[r][k].detach() - local[r][k].detach() for k in frags[f]} for r in live}
            for r in live:
                apply_eager(r, f, raw[r], pending[f], live)
            pending[f] = start_round(f, raw)
            with torch.no_grad():
                for r in live:
                    for k in frags[f]:
                        local[r][k].copy_(globs[r][k])
        elif due and sync.delay:
            (f,) = due
            raw = {r: {k: anchor[r][k] - local[r][k].detach() for k in frags[f]} for r in live}
            if pending[f] is not None:
                apply_outer(f, pending[f], live)
            pending[f] = start_round(f, raw)
            with torch.no_grad():
                for r in live:
                    for k in frags[f]:
                        local[r][k].copy_(glob[k] - raw[r][k])
                        anchor[r][k] = local[r][k].detach().clone()
        elif due:
            (f,) = due
            outer.zero_grad()  # parameters of the other fragments have no gradient: torch's SGD skips them
            deltas = [{k: glob[k] - local[r][k].detach() for k in frags[f]} for r in live]
            if sync.codec is not None:
                for i, r in enumerate(live):
                    deltas[i], residual[r][f] = _through_codec(deltas[i], frags[f], sync.codec, residual[r][f])
            for k, g in ((k, glob[k]) for k in frags[f]):
                if counts:
                    g.grad = sum(d[k] * (counts[r] / sum(counts)) for d, r in zip(deltas, live))
                else:
                    g.grad = torch.stack([d[k] for d in deltas]).sum(0) / len(live)
            outer.step()
            with torch.no_grad():
                for r in live:
                    for k in frags[f]:
                        local[r][k].copy_(glob[k])
        # a replica lost in this step's outer exchange: the step reports the survivors' losses (the lost one's are gone)
        out.append((float(np.mean([x for r, x in losses if r in live])),
                    {k: v.detach().clone().numpy() for k, v in local[live[0]].items()}))
    if eager and any(p is not None for p in pending):  # the others' terms of the rounds in flight
        r0 = live[0]
        final = {k: v.detach().clone() for k, v in local[r0].items()}
        for f, p in enumerate(pending):
            if p is not None:
                before = {k: globs[r0][k].detach().clone() for k in frags[f]}
                apply_eager(r0, f, {k: torch.zeros_like(before[k]) for k in frags[f]}, p, live)
                for k in frags[f]:
                    final[k] = globs[r0][k].detach() - (before[k] - local[r0][k].detach())
        out[-1] = (out[-1][0], {k: v.numpy() for k, v in final.items()})
    elif any(p is not None for p in pending):  # delay 1: the rounds in flight, applied to the weights returned
        r0 = live[0]
        final = {k: v.detach().clone() for k, v in local[r0].items()}
        for f, p in enumerate(pending):
            if p is not None:
                apply_outer(f, p, live)
                for k in frags[f]:
                    final[k] = glob[k].detach() - (anchor[r0][k] - local[r0][k].detach())
        out[-1] = (out[-1][0], {k: v.numpy() for k, v in final.items()})
    return out


def assert_matches(reports, state, expected, rtol_loss=1e-5, rtol_w=1e-4):
    assert len(reports) == len(expected)
    np.testing.assert_allclose([r.loss for r in reports], [e[0] for e in expected], rtol=rtol_loss)
    for k, v in expected[-1][1].items():
        np.testing.assert_allclose(state[k], v, rtol=rtol_w, atol=1e-6, err_msg=f"parameter {k}")


def test_h1_sgd_outer_lr1_no_momentum_equals_synchronous_dp(tmp_path):
    build, _, plain_loss, batch_fn = MODELS["cnn"]
    model = build(mb=MB)
    batches = [batch_fn(s, 2 * MB) for s in range(4)]
    sync_dir = save_dp_plan(tmp_path / "sync", model, one_stage(model), 2, micro_batches=1, optimizer=SGD[0])
    dil_dir = save_dp_plan(tmp_path / "dil", model, one_stage(model), 2, micro_batches=1, optimizer=SGD[0])
    with_sync(dil_dir, model, DPSync("diloco", inner_steps=1, outer_lr=1.0, outer_momentum=0.0))
    sync_r, sync_state, _ = run_dp(sync_dir, tmp_path / "run-sync", batches)
    dil_r, dil_state, dil_states = run_dp(dil_dir, tmp_path / "run-dil", batches)
    np.testing.assert_allclose([r.loss for r in dil_r], [r.loss for r in sync_r], rtol=1e-6)
    for k, v in sync_state.items():
        np.testing.assert_allclose(dil_state[k], v, rtol=1e-6, atol=1e-7, err_msg=k)
        np.testing.assert_array_equal(dil_states[1][k], dil_state[k], err_msg=f"replicas differ in {k}")
    assert all("allreduce_s" not in s for r in dil_r for s in r.parts.values())  # no per-step gradient all-reduce
    assert all(r.parts["p0"]["outer"]["replicas"] == 2 for r in dil_r)


CASES = [  # (model, stages, schedule, inner optimizer, engines, H, replicas, all-reduce)
    ("cnn", 1, "gpipe", ADAMW, None, 3, 3, "ring"),  # a ring of three: reduce-scatter and all-gather of pseudo-gradients
    ("mlp", 1, "gpipe", SGD, {"r1.p0": "numpy"}, 2, 2, "tree"),
    ("gpt", 2, "1f1b", SGD_M, None, 3, 2, "ring"),  # (not AdamW: it blows up the key bias's zero gradient, rounding noise)
    ("gpt", 2, "1f1b", SGD, {"r1.p1": "numpy"}, 2, 2, "ring"),
]


@pytest.mark.parametrize("name,stages,schedule,opt,engines,H,R,algo", CASES,
                         ids=[f"{c[0]}-{c[6]}x{c[1]}-{c[3][0].name}-H{c[5]}{'-numpy' if c[4] else ''}-{c[7]}" for c in CASES])
def test_diloco_matches_a_plain_pytorch_reference(tmp_path, name, stages, schedule, opt, engines, H, R, algo):
    build, splits, plain_loss, batch_fn = ALL[name]
    model = build(mb=MB)
    micro = 2
    assignment = splits[2] if stages == 2 else one_stage(model)
    plan_dir = save_dp_plan(tmp_path, model, assignment, R, schedule=schedule, micro_batches=micro, optimizer=opt[0],
                            engines=engines)
    sync = DPSync("diloco", inner_steps=H, outer_lr=0.7, outer_momentum=0.9)
    with_sync(plan_dir, model, sync, algo)
    assert load_plan(plan_dir).dp_algo_of("p0") == algo
    batches = [batch_fn(s, R * micro * MB) for s in range(3 * H)]
    reports, state, states = run_dp(plan_dir, tmp_path / "run", batches)
    assert_matches(reports, state, diloco_reference(model, plain_loss, batches, R, micro, opt[1], sync))
    tol = {"rtol": 1e-6, "atol": 1e-7} if engines else {"rtol": 0, "atol": 0}  # a NumPy replica rounds its own way
    for other in states[1:]:  # after the last outer step every replica holds the global weights
        for k, v in states[0].items():
            np.testing.assert_allclose(other[k], v, err_msg=f"replicas differ in {k}", **tol)
    outer = [r.parts["p0"].get("outer") for r in reports]
    assert [o["step"] for o in outer if o] == [H, 2 * H, 3 * H]
    nbytes = 4 * sum(int(np.prod(model.graph.params[k].shape)) for k in model.graph.params
                     if model.graph.params[k].trainable and (stages == 1 or k in _params_of(plan_dir, "p0")))
    assert all(o["payload_bytes"] == nbytes for o in outer if o)
    if R == 2:  # two replicas: one swap of the whole buffer
        assert all(o["sent_bytes"] == nbytes for o in outer if o)


def _params_of(plan_dir, part):
    from fusion.ir.boundary import partition

    plan = load_plan(plan_dir)
    sub = partition(plan.graph, plan.assignment)[part]
    return {p for n in sub.nodes for p in plan.graph[n].param_names()}


def test_outer_update_is_torch_sgd_nesterov():
    """The NumPy outer step is torch.optim.SGD's (momentum buffer starts as the first gradient)."""
    from fusion.executors.runtime.dp.outer import outer_update

    rng = np.random.default_rng(0)
    theta = rng.standard_normal(50).astype(np.float32)
    for nesterov, mu in ((True, 0.9), (False, 0.8), (False, 0.0)):
        t = torch.tensor(theta.copy(), requires_grad=True)
        opt = torch.optim.SGD([t], lr=0.7, momentum=mu, nesterov=nesterov)
        mine, v = theta.copy(), np.zeros_like(theta)
        for i in range(4):
            d = rng.standard_normal(50).astype(np.float32)
            t.grad = torch.tensor(d)
            opt.step()
            outer_update(mine, v, d, 0.7, mu, nesterov)
        np.testing.assert_allclose(mine, t.detach().numpy(), rtol=1e-6, atol=1e-6)  # float32 rounding of ~10



@pytest.mark.parametrize("codec", [{"algo": "quant", "bits": 4}, {"algo": "topk", "ratio": 8}], ids=["quant4", "topk8"])
def test_pseudo_gradient_codecs_with_error_feedback_match_the_reference(tmp_path, codec):
    """Each replica encodes its pseudo-gradient (plus its residual) once, all decode all in replica order: the
    replicas hold the same bits, the run equals the reference applying the same codec, and the tensor bytes
    each replica sends are the codec's wire size of the bucket (less its fixed header)."""
    from fusion.kernels.codec import CODECS
    from fusion.kernels.quant import HEADER_NBYTES

    build, _, plain_loss, batch_fn = ALL["mlp"]
    model = build(mb=MB)
    plan_dir = save_dp_plan(tmp_path, model, one_stage(model), 2, micro_batches=1, optimizer=ADAMW[0],
                            engines={"r1.p0": "numpy"})
    sync = DPSync("diloco", inner_steps=2, outer_lr=0.7, outer_momentum=0.9, codec=codec, error_feedback=True)
    with_sync(plan_dir, model, sync)
    batches = [batch_fn(s, 2 * MB) for s in range(6)]
    reports, state, states = run_dp(plan_dir, tmp_path / "run", batches)
    assert_matches(reports, state, diloco_reference(model, plain_loss, batches, 2, 1, ADAMW[1], sync))
    for k, v in states[0].items():
        np.testing.assert_array_equal(states[1][k], v, err_msg=f"replicas differ in {k}")
    numel = sum(int(np.prod(model.graph.params[k].shape)) for k in model.graph.params)
    wire = CODECS.get(codec["algo"]).wire_nbytes(numel, "float32", codec) - (HEADER_NBYTES if codec["algo"] == "quant" else 0)
    outer = [r.parts[p]["outer"] for r in reports for p in ("p0", "r1.p0") if "outer" in r.parts[p]]
    assert len(outer) == 6 and all(o["payload_bytes"] == wire == o["sent_bytes"] for o in outer), (outer, wire)
    assert wire < 4 * numel / 3


@pytest.mark.parametrize("delay,overlap", [(0, "eager"), (1, "delayed"), (1, "eager")],
                         ids=["delay0", "delayed", "eager"])
def test_resume_is_bit_exact_with_the_outer_state_in_the_checkpoint(tmp_path, delay, overlap):
    """Run 6 steps; run 3 (a checkpoint in the middle of an outer window of H = 2, with outer momentum and
    error-feedback residuals that are not zero; with delay 1 the round started at step 2 in flight) and
    resume to 6: the same losses and weights, bit for bit."""
    from fusion.executors.runtime.coordinator import CoordinatorConfig
    from fusion.executors.runtime.launcher import LocalCluster

    build, _, plain_loss, batch_fn = ALL["mlp"]
    model = build(mb=MB)
    plan_dir = save_dp_plan(tmp_path, model, one_stage(model), 2, micro_batches=1, optimizer=ADAMW[0])
    with_sync(plan_dir, model, DPSync("diloco", inner_steps=2, codec={"algo": "quant", "bits": 8}, error_feedback=True,
                                      delay=delay, overlap=overlap))
    batches = [batch_fn(s, 2 * MB) for s in range(6)]
    full, state, _ = run_dp(plan_dir, tmp_path / "full", batches)

    cfg = dict(peer_timeout_s=30, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=3)
    with LocalCluster(plan_dir, tmp_path / "a", CoordinatorConfig(**cfg), threads=1) as lc:
        lc.start()
        first = [lc.coordinator.step(b) for b in batches[:4]]  # step 4 is never checkpointed
    assert (tmp_path / "ckpt" / "step-00000003" / "p0.outer.safetensors").exists()
    if delay:  # the round started at step 2 is in flight at step 3: in the checkpoint
        from fusion.executors.runtime.checkpoint import load_outer

        saved = load_outer(tmp_path / "ckpt", 3, "p0")
        assert saved["round::0"].tolist() == [2] and any(k.startswith("pending::") for k in saved)
    with LocalCluster(plan_dir, tmp_path / "b", CoordinatorConfig(**cfg), threads=1) as lc:
        assert lc.start(resume=True) == 3
        rest = [lc.coordinator.step(b) for b in batches[3:]]
        resumed = lc.coordinator.fetch_state()
    assert [r.loss for r in first[:3] + rest] == [r.loss for r in full]
    for k, v in state.items():
        np.testing.assert_array_equal(resumed[k], v, err_msg=k)


def test_pseudo_inbox_rejects_what_the_group_did_not_send():
    """An encoded pseudo-gradient is taken only from a member of the group, addressed to this part, for the
    current iteration, of the bucket's dtype and length, and once; anything else is a WireError (logged and
    dropped by the transport, never applied)."""
    from fusion.executors.runtime.dp.allreduce import KIND, NotYourTurn, RingInbox, make_buckets
    from fusion.executors.runtime.dp.outer import PseudoInbox, encode_pseudo
    from fusion.ir.errors import WireError
    from fusion.ir.wire import decode, encode

    ring = RingInbox("p0", ["p0", "r1.p0", "r2.p0"], make_buckets({"w": ((10,), "float32")}))
    codec = {"algo": "quant", "bits": 8}
    box = PseudoInbox(ring, codec)

    def msg(n=10, c=codec, **over):
        meta, frames = encode_pseudo(np.arange(n, dtype=np.float32), c)
        h = {"it": 0, "bucket": 0, "step": 0, "chunk": 0, "src": "r1.p0", "dst": "p0", "gather": True,
             "group": ["p0", "r1.p0", "r2.p0"], "payload": meta}
        return decode(encode(KIND, {**h, **over}, frames))

    for sender, m, says in [("r9.p0", msg(src="r9.p0"), "not in p0's data-parallel group"),
                            ("r1.p0", msg(group=None), "says it was sent in the group None"),
                            ("r1.p0", msg(src="r2.p0"), "but came"),
                            ("r1.p0", msg(it=2), "iteration 2, this part is at iteration 0"),  # (1: a step ahead, kept)
                            ("r1.p0", msg(bucket=1), "bucket 1"),
                            ("r1.p0", msg(n=9), r"expected float32\[10\]"),
                            ("r1.p0", msg(c={"algo": "topk", "ratio": 2}), "not what quant makes")]:
        with pytest.raises(WireError, match=says):
            box.accept(sender, m)
    with pytest.raises(NotYourTurn):  # sent after a regroup this part has not made yet: kept by the CompNode
        box.accept("r1.p0", msg(group=["p0", "r1.p0"]))
    box.accept("r1.p0", msg())
    with pytest.raises(WireError, match="duplicate"):
        box.accept("r1.p0", msg())
    np.testing.assert_allclose(box.take(0, 0, "r1.p0"), np.arange(10, dtype=np.float32), atol=0.05)
    after = PseudoInbox(RingInbox("p0", ["p0", "r1.p0"], make_buckets({"w": ((10,), "float32")})), codec)
    after.accept("r1.p0", msg(group=["p0", "r1.p0"]))  # the survivor's resend, taken by the regrouped inbox
    assert after.take(0, 0, "r1.p0") is not None


@pytest.mark.parametrize("codec", [None, {"algo": "quant", "bits": 8}], ids=["exact", "quant8"])
def test_unequal_shares_split_the_batch_and_weight_the_pseudo_gradients_by_samples(tmp_path, codec):
    """dp_sync.shares {0: 3, 1: 1}: of 4 micro-batches per step replica 0 takes 3 and replica 1 one, and the
    outer average weighs their pseudo-gradients 3/4 and 1/4, as the reference does."""
    build, _, plain_loss, batch_fn = ALL["mlp"]
    model = build(mb=MB)
    plan_dir = save_dp_plan(tmp_path, model, one_stage(model), 2, micro_batches=2, optimizer=SGD_M[0],
                            engines={"r1.p0": "numpy"})
    sync = DPSync("diloco", inner_steps=2, codec=codec, shares={0: 3.0, 1: 1.0})
    with_sync(plan_dir, model, sync)
    batches = [batch_fn(s, 4 * MB) for s in range(4)]
    reports, state, states = run_dp(plan_dir, tmp_path / "run", batches)
    ref = diloco_reference(model, plain_loss, batches, 2, 2, SGD_M[1], sync, counts=[3, 1])
    assert_matches(reports, state, ref)
    for k, v in states[0].items():
        np.testing.assert_allclose(states[1][k], v, rtol=1e-6, atol=1e-7, err_msg=k)
    plan = load_plan(plan_dir)
    from fusion.executors.runtime.dp.outer import replica_micro_batches, share_micro_batches

    assert replica_micro_batches(plan) == [3, 1]
    assert share_micro_batches(7, 3, {1: 2.0}) == [2, 3, 2]
    with pytest.raises(Exception, match="replica 1's share 0.01 of 4 micro-batches per step gives it none"):
        share_micro_batches(4, 2, {1: 0.01})


@pytest.mark.parametrize("codec", [None, {"algo": "quant", "bits": 4}], ids=["exact", "quant4-ef"])
def test_streaming_fragments_sync_staggered_and_match_the_reference(tmp_path, codec):
    """dp_sync.fragments 2 with H = 4: the parameters in two fragments of about equal size, fragment 0 synced
    after steps 4 and 8 and fragment 1 after steps 2 and 6, each exchange a fragment's bytes only."""
    from fusion.executors.runtime.dp.outer import fragment_buckets

    build, _, plain_loss, batch_fn = ALL["mlp"]
    model = build(mb=MB)
    plan_dir = save_dp_plan(tmp_path, model, one_stage(model), 2, micro_batches=1, optimizer=SGD_M[0],
                            engines={"r1.p0": "numpy"})
    sync = DPSync("diloco", inner_steps=4, fragments=2, codec=codec, error_feedback=codec is not None)
    with_sync(plan_dir, model, sync)
    batches = [batch_fn(s, 2 * MB) for s in range(8)]
    reports, state, states = run_dp(plan_dir, tmp_path / "run", batches)
    assert_matches(reports, state, diloco_reference(model, plain_loss, batches, 2, 1, SGD_M[1], sync))
    outer = {r.step: r.parts["p0"]["outer"] for r in reports if "outer" in r.parts["p0"]}
    assert {s: o["fragment"] for s, o in outer.items()} == {1: 1, 3: 0, 5: 1, 7: 0}
    buckets, index = fragment_buckets({k: (tuple(p.shape), p.dtype) for k, p in model.graph.params.items()}, 2)
    sizes = [4 * sum(buckets[b].total for b in i) for i in index]
    assert min(sizes) > 0 and sum(sizes) == 4 * sum(int(np.prod(p.shape)) for p in model.graph.params.values())
    if codec is None:
        assert all(o["payload_bytes"] == sizes[o["fragment"]] for o in outer.values())


DELAYED = [  # (model, stages, schedule, inner optimizer, engines, H, fragments, codec, shares, steps)
    # 2 x 1, a NumPy replica, 4-bit pseudo-gradients with error feedback, two streaming fragments, shares 3 : 1
    ("mlp", 1, "gpipe", SGD_M, {"r1.p0": "numpy"}, 4, 2, {"algo": "quant", "bits": 4}, {0: 3.0, 1: 1.0}, 8),
    ("gpt", 2, "1f1b", SGD_M, None, 2, 1, None, {}, 6),  # 2 x 2 (4 processes), exact averaging
]


@pytest.mark.parametrize("overlap", ["eager", "delayed"])
@pytest.mark.parametrize("name,stages,schedule,opt,engines,H,F,codec,shares,steps", DELAYED,
                         ids=["mlp-2x1-numpy-quant4-ef-F2-shares", "gpt-2x2-exact"])
def test_overlapped_outer_step_matches_the_reference_and_differs_from_delay_0(tmp_path, name, stages, schedule, opt,
                                                                              engines, H, F, codec, shares, steps,
                                                                              overlap):
    """dp_sync.delay 1: each round's exchange overlaps the next window. ``overlap`` "delayed": the round is
    applied at the following boundary, the replicas end on the same weights (the last round flushed);
    "eager": each replica applies its own fresh pseudo-gradient at once and the others' one round late, the
    replicas' weights differ. Either way losses and final weights (the last round flushed) equal the
    reference's, and the run is neither delay 0's nor the other variant's."""
    import dataclasses

    build, splits, plain_loss, batch_fn = ALL[name]
    model = build(mb=MB)
    micro = 2
    assignment = splits[2] if stages == 2 else one_stage(model)
    plan_dir = save_dp_plan(tmp_path, model, assignment, 2, schedule=schedule, micro_batches=micro, optimizer=opt[0],
                            engines=engines)
    sync = DPSync("diloco", inner_steps=H, outer_lr=0.7, outer_momentum=0.9, codec=codec,
                  error_feedback=codec is not None, fragments=F, delay=1, shares=shares, overlap=overlap)
    with_sync(plan_dir, model, sync)
    assert load_plan(plan_dir).dp_sync.overlap == overlap
    batches = [batch_fn(s, 2 * micro * MB) for s in range(steps)]
    reports, state, states = run_dp(plan_dir, tmp_path / "run", batches)
    counts = [3, 1] if shares else None
    want = diloco_reference(model, plain_loss, batches, 2, micro, opt[1], sync, counts=counts)
    assert_matches(reports, state, want)
    if overlap == "delayed" and F == 1:  # the last round flushed: both hold the global weights
        for k, v in states[0].items():
            np.testing.assert_allclose(states[1][k], v, rtol=1e-6, atol=1e-7, err_msg=f"replicas differ in {k}")
    if overlap == "eager":  # each replica's own copy of the global weights
        assert max(np.max(np.abs(states[1][k] - v)) for k, v in states[0].items()) > 1e-5
    outer = {r.step: r.parts["p0"]["outer"] for r in reports if "outer" in r.parts["p0"]}
    step_of = {o["round"]: s for s, o in outer.items()}
    for s, o in outer.items():  # each round is applied at its fragment's next boundary, H steps later
        assert o["round"] == s + 1
        assert o["applied_round"] == (None if s + 1 - H < 1 else s + 1 - H)
        if o["applied_round"] is not None:
            assert outer[step_of[o["applied_round"]]]["fragment"] == o["fragment"]
    assert len(outer) == F * steps // H
    first = min(outer) + 1  # the first boundary (completed steps): the same up to it, then not the others'
    later = np.array([r.loss for r in reports[first:]])
    other = "delayed" if overlap == "eager" else "eager"
    for ref in (dataclasses.replace(sync, delay=0), dataclasses.replace(sync, overlap=other)):
        alt = diloco_reference(model, plain_loss, batches, 2, micro, opt[1], ref, counts=counts)
        np.testing.assert_allclose([w[0] for w in want[:first]], [w[0] for w in alt[:first]], rtol=1e-6)
        assert np.max(np.abs(later - [w[0] for w in alt[first:]]) / np.abs(later)) > 1e-3, ref


def test_delayed_inbox_rejects_what_the_group_did_not_send():
    """A delayed round's pseudo-gradient is taken only from a member of the plan's group, addressed to this
    part, for a known bucket and a round not yet collected, at most two rounds per sender and bucket, of the
    bucket's dtype and length (dense without a codec), and once; it is kept until its round is closed."""
    from fusion.executors.runtime.dp.allreduce import KIND, make_buckets
    from fusion.executors.runtime.dp.outer import DelayedInbox
    from fusion.ir.errors import WireError
    from fusion.ir.wire import decode, encode, encode_payload

    box = DelayedInbox("p0", ["p0", "r1.p0"], make_buckets({"w": ((10,), "float32")}), None)

    def msg(a=None, **over):
        meta, frames = encode_payload(np.arange(10, dtype=np.float32) if a is None else a)
        h = {"round": 2, "bucket": 0, "src": "r1.p0", "dst": "p0", "delayed": True, "payload": meta}
        return decode(encode(KIND, {**h, **over}, frames))

    for sender, m, says in [("r9.p0", msg(src="r9.p0"), "not in p0's data-parallel group"),
                            ("r1.p0", msg(dst="r2.p0"), "but came"),
                            ("r1.p0", msg(bucket=1), "bucket 1"),
                            ("r1.p0", msg(round=True), "round True"),
                            ("r1.p0", msg(np.arange(9, dtype=np.float32)), r"expected float32\[10\]"),
                            ("r1.p0", msg(np.arange(10, dtype=np.float64)), r"expected float32\[10\]"),
                            ("r1.p0", msg(3.0), "not a dense buffer")]:
        with pytest.raises(WireError, match=says):
            box.accept(sender, m)
    box.accept("r1.p0", msg())
    with pytest.raises(WireError, match="duplicate"):
        box.accept("r1.p0", msg())
    box.accept("r1.p0", msg(round=4))
    with pytest.raises(WireError, match="2 rounds of bucket 0 from it are waiting"):
        box.accept("r1.p0", msg(round=6))
    np.testing.assert_array_equal(box.take(2, 0, "r1.p0"), np.arange(10, dtype=np.float32))
    assert box.take(2, 0, "r1.p0") is not None  # kept until closed (a flush reads it first)
    box.close(2, [0])
    assert box.take(2, 0, "r1.p0") is None and box.take(4, 0, "r1.p0") is not None
    with pytest.raises(WireError, match="round 2; bucket 0 has collected round 2"):
        box.accept("r1.p0", msg())


def test_a_replica_lost_in_the_middle_of_an_outer_exchange_leaves_it_cleanly(tmp_path):
    """Three replicas, H = 2, --drop-failed-replicas: replica 2 exits right after handing its first all-reduce
    chunk of the outer step after step 2 to the transport (the FUSION_TEST_DIE_IN_OUTER hook). The step was
    committed, so the survivors keep it: they regroup and redo that outer step's average over the two of them
    (replica 2's pseudo-gradient, and a chunk of it that arrived, never counts), report the step with their
    own losses and go on with the global batch re-split over two; no hang, no step lost or applied twice,
    every loss and the final weights equal to the reference that drops replica 2 from that outer average."""
    from fusion.executors.runtime.coordinator import CoordinatorConfig
    from fusion.executors.runtime.launcher import LocalCluster

    build, _, plain_loss, batch_fn = ALL["mlp"]
    model = build(mb=MB)
    plan_dir = save_dp_plan(tmp_path, model, one_stage(model), 3, micro_batches=2, optimizer=SGD_M[0])
    sync = DPSync("diloco", inner_steps=2)
    with_sync(plan_dir, model, sync)
    batches = [batch_fn(s, 3 * 2 * MB) for s in range(4)]
    with LocalCluster(plan_dir, tmp_path / "run", CoordinatorConfig(peer_timeout_s=30, drop_failed_replicas=True),
                      threads=1, part_env={"r2.p0": {"FUSION_TEST_DIE_IN_OUTER": "r2.p0:2"}}) as lc:
        lc.start()
        reports = [lc.coordinator.step(b) for b in batches]
        state = lc.coordinator.fetch_state()
    (drop,) = reports[1].dropped
    assert drop["replica"] == 2 and drop["part"] == "r2.p0" and not drop["redone"]  # committed: kept, not redone
    assert "status 17" in drop["reason"]
    assert all(not getattr(r, "dropped", None) for r in reports[:1] + reports[2:])
    outer = {r.step: r.parts["p0"]["outer"] for r in reports if "outer" in r.parts["p0"]}
    assert sorted(outer) == [1, 3] and all(o["replicas"] == 2 for o in outer.values())
    assert set(reports[1].parts) == {"p0", "r1.p0"}
    want = diloco_reference(model, plain_loss, batches, 3, 2, SGD_M[1], sync, drop_at_outer=(1, 2))
    assert_matches(reports, state, want)

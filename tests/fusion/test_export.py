"""``fusion export RUN -o OUT`` writes weights the user's own module loads with ``strict=True`` (issue 26).

Before: ``final.safetensors`` holds the graph's tensors: a tied weight once (``lm_head.weight`` missing), the
non-persistent buffers the graph reads (``rotary_emb.inv_freq``: "unexpected key"), so a strict load failed.
"""
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]

pytest.importorskip("transformers", reason="transformers is a test-only dependency (pip install -e .[test])")

LLAMA_SRC = '''
import numpy as np
import torch
import transformers

def llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=True)
    ids = torch.randint(0, 64, (2, 8))
    return transformers.LlamaForCausalLM(cfg), {"input_ids": ids, "labels": ids}

def tokens(step):
    ids = np.random.default_rng(step).integers(0, 64, (4, 8))
    return {"input_ids": ids, "labels": ids}
'''

TWO = '''name: two
devices:
  - {name: a, peak_flops: 50 GFLOPS, memory: 4 GB}
  - {name: b, peak_flops: 50 GFLOPS, memory: 4 GB}
links:
  default: {latency: 1 ms, bandwidth: 1 Gbit/s}
'''


def test_a_trained_llama_exports_into_its_own_module_strictly(tmp_path, capsys):
    """A tied-embedding Llama returned as it comes, trained 2 steps cut in two parts (in one process, as the
    runtime's equivalence tests pin a run to), saved as a run saves final.safetensors: the export loads into a
    fresh LlamaForCausalLM with strict=True and its loss on the next batch is the trained graph's."""
    from safetensors.torch import load_file

    from fusion.cli import main
    from fusion.cluster import load_cluster
    from fusion.commands.rundir import prepare_run_dir
    from fusion.compile import compile_model
    from fusion.executors.reference import ReferenceExecutor
    from fusion.loader import load_function, load_model
    from fusion.plan import OptimizerConfig, save_arrays

    (tmp_path / "m.py").write_text(LLAMA_SRC)
    (tmp_path / "two.yaml").write_text(TWO)
    spec, run = f"{tmp_path / 'm.py'}:llama", tmp_path / "run"
    model = load_model(spec)
    assert any(k.endswith("inv_freq") for k in model.params)  # non-persistent, yet a graph tensor
    plan = compile_model(model, load_cluster(str(tmp_path / "two.yaml")), strategy="equal-count")
    ref = ReferenceExecutor(model, plan.assignment, OptimizerConfig(name="sgd", lr=0.5), micro_batches=2)
    tokens = load_function(f"{tmp_path / 'm.py'}:tokens")  # 4 rows: 2 micro-batches of the example's 2
    for s in range(2):
        ref.step(tokens(s))
    prepare_run_dir(run, resume=False, overwrite=False, argv=["fusion", "run", spec, "--cluster", "two.yaml"])
    save_arrays(ref.state(), run / "final.safetensors", {k: p.dtype for k, p in model.graph.params.items()})
    with pytest.raises(RuntimeError, match="Missing key|Unexpected key"):  # what a strict load of the run's file says
        load_function(spec)()[0].load_state_dict(load_file(str(run / "final.safetensors")), strict=True)

    out = tmp_path / "llama.safetensors"
    assert main(["export", str(run), "-o", str(out)]) == 0  # the model named by run.json
    said = capsys.readouterr().out
    assert said.startswith(f"wrote {out}: ") and "1 tied" in said, said
    module = load_function(spec)()[0]
    module.load_state_dict(load_file(str(out)), strict=True)
    assert module.lm_head.weight.data_ptr() == module.model.embed_tokens.weight.data_ptr()  # still tied
    batch = {k: torch.as_tensor(v) for k, v in tokens(2).items()}
    with torch.no_grad():
        got = module(**batch, use_cache=False).loss.item()
    np.testing.assert_allclose(got, ref.step(tokens(2)).loss, rtol=1e-5)
    assert main(["export", str(run), "-o", str(out)]) == 2  # an existing file needs --force
    assert "give --force" in capsys.readouterr().err


def test_the_tiny_gpt_example_exports_its_tied_head(tmp_path):
    """examples/models/gpt.py:tiny ties lm_head to wte: the graph holds it once, the export writes both keys."""
    from safetensors.torch import save_file

    from fusion.cli import main
    from fusion.executors.reference import ReferenceExecutor
    from fusion.loader import load_function, load_model

    spec = f"{REPO / 'examples/models/gpt.py'}:tiny"
    model = load_model(spec)
    module, example = load_function(spec)()
    assert "lm_head.weight" in module.state_dict() and "lm_head.weight" not in model.params
    ref = ReferenceExecutor(model)
    batch = {k: v.numpy() for k, v in example.items()}
    ref.step(batch)
    run = tmp_path / "run"
    run.mkdir()
    save_file({k: torch.as_tensor(v) for k, v in ref.state().items()}, str(run / "final.safetensors"))
    out = tmp_path / "gpt.safetensors"
    assert main(["export", str(run), "--model", spec, "-o", str(out)]) == 0
    from safetensors.torch import load_file

    module.load_state_dict(load_file(str(out)), strict=True)
    with torch.no_grad():
        got = module(**example).item()
    np.testing.assert_allclose(got, ref.step(batch).loss, rtol=1e-5)

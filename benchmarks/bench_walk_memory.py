"""A part's peak forward memory with the graph walk's last-use freeing vs without it (issue 37).

Run:  OMP_NUM_THREADS=1 python benchmarks/bench_walk_memory.py [--repeats 3] [--gpt-batch 1024] [--llama-batch 256]
      (from a checkout other than the installed one: PYTHONPATH=. in front)

Models: the tiny GPT (``examples/models/gpt.py``, its ``TINY`` config) and the tiny Llama
(``examples/models/hf_llama.py:tiny``, built from a ``transformers`` config, nothing downloaded), each traced
at the batch given (so activations, not the few thousand parameters, dominate) and cut into ``--parts``
contiguous parts (:func:`fusion.executors.reference.contiguous_parts`, as the tests cut them). Every part runs
on the torch engine in three configurations:

- ``kept``:     the interpreted walk with ``free_values = False``: every value stays until the walk returns
                (the walk before last-use freeing);
- ``freed``:    the interpreted walk as it is now: each value is dropped after its last reader;
- ``compiled``: the default compiled part (one fx GraphModule; fx's code drops each local after its last
                use), for reference.

What is measured: the resident set's high-water mark during one part's forward over the resident set just
before it (``/proc/self/status`` ``VmHWM`` - ``VmRSS``, the mark reset with ``/proc/self/clear_refs``: 5),
in a fresh process per configuration and repeat, with glibc's mmap threshold fixed at 64 KiB
(``MALLOC_MMAP_THRESHOLD_``) so every tensor of 64 KiB or more is its own mapping and goes back to the
kernel when freed: the figure is then the peak of the memory the forward holds at once (activations,
autograd's saved tensors, what the part sends), not what the allocator happens to cache. ``tracemalloc``
would see none of it (torch allocates outside Python's allocator). Two forwards per part: ``grad`` (the
training forward: autograd records the graph, and what it saves stays for backward) and ``no_grad`` (a
recomputed part's first forward, or evaluation), each after one unmeasured warm-up forward (one-time
allocations of the first call are not the forward's). The parts run in order in one process (each part's inputs
are the previous parts' outputs); a part's stash is dropped before the next part runs. The figure per
configuration is the median over ``--repeats`` processes.

Final line (JSON): per model, the part whose ``kept`` grad forward peaks highest (``part``), ``batch``, and per
forward (``grad``, ``no_grad``) ``kept_mb``, ``freed_mb``, ``compiled_mb`` and ``ratio`` (freed / kept);
``parts`` has every part's figures; ``loadavg`` is ``/proc/loadavg`` at the start and at the end.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ("kept", "freed", "compiled")
MODES = ("grad", "no_grad")


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _traced(model: str, batch: int):
    """The model traced at ``batch`` sequences (a :class:`fusion.ir.model.Model`)."""
    import torch

    from fusion.ir.trace import trace
    from fusion.loader import load_function

    if model == "gpt":
        fn = load_function(f"{ROOT / 'examples/models/gpt.py'}:gpt_model")
        module, example = fn(sys.modules[fn.__module__].TINY, batch=batch, seed=0)
        return trace(module, example)
    from fusion.hf import trace_options

    spec = f"{ROOT / 'examples/models/hf_llama.py'}:tiny"
    module, example = load_function(spec)()
    ids = torch.randint(0, 256, (batch, example["input_ids"].shape[1]), generator=torch.Generator().manual_seed(0))
    example = {"input_ids": ids, "labels": ids}
    return trace(module, example, **trace_options(module, example, {}, spec))


def child(model_name: str, config: str, batch: int, n_parts: int) -> dict:
    """One process: every part's forward peaks (kB over the RSS before it), by part and forward."""
    import torch

    from fusion.executors.engines.torch.engine import TorchPart
    from fusion.executors.reference import contiguous_parts
    from fusion.ir.boundary import partition

    torch.manual_seed(0)
    model = _traced(model_name, batch)
    subs = partition(model.graph, contiguous_parts(model, n_parts))
    outputs: dict = {}
    peaks: dict = {}
    for name in sorted(subs, key=lambda n: int(n[1:])):
        part = TorchPart(model.graph, subs[name], model.params, compiled=config == "compiled")
        assert part.compiled == (config == "compiled"), "the compiled part fell back to the interpreter"
        part.walk.free_values = config != "kept"
        inputs = {k: outputs[k] for k in part.recv_keys}
        feeds = {n: model.example[n] for n in part.walk.placeholders}
        peaks[name] = {}
        with torch.no_grad():  # warm-up: one-time allocations (kernels' first calls) are not the forward's
            part.forward(0, inputs, feeds)
        part.forget()
        for mode in ("no_grad", "grad"):
            gc.collect()
            Path("/proc/self/clear_refs").write_text("5")
            before = _status_kb("VmRSS")
            with torch.set_grad_enabled(mode == "grad"):
                sent, _ = part.forward(0, inputs, feeds)
            peaks[name][mode] = _status_kb("VmHWM") - before
            part.forget()
            if mode == "grad":
                outputs.update(sent)
            del sent
    return peaks


def _run_child(model: str, config: str, batch: int, n_parts: int) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    out = subprocess.run([sys.executable, __file__, "--child", model, config, str(batch), str(n_parts)],
                         env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--parts", type=int, default=4)
    ap.add_argument("--gpt-batch", type=int, default=1024)
    ap.add_argument("--llama-batch", type=int, default=256)
    ap.add_argument("--models", default="gpt,llama")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        model, config, batch, n_parts = args.child
        print(json.dumps(child(model, config, int(batch), int(n_parts))))
        return
    load_start = Path("/proc/loadavg").read_text().split()[:3]
    result: dict = {}
    for model in args.models.split(","):
        batch = args.gpt_batch if model == "gpt" else args.llama_batch
        runs: dict = {c: [] for c in CONFIGS}
        for r in range(args.repeats):
            for config in (CONFIGS if r % 2 == 0 else CONFIGS[::-1]):  # alternate the order between repeats
                runs[config].append(_run_child(model, config, batch, args.parts))
        parts = {p: {m: {c: statistics.median(run[p][m] for run in runs[c]) / 1024 for c in CONFIGS} for m in MODES}
                 for p in runs["kept"][0]}
        top = max(parts, key=lambda p: parts[p]["grad"]["kept"])
        summary = {"part": top, "batch": batch, "parts_total": args.parts}
        for m in MODES:
            f = parts[top][m]
            summary[m] = {"kept_mb": round(f["kept"], 1), "freed_mb": round(f["freed"], 1),
                          "compiled_mb": round(f["compiled"], 1), "ratio": round(f["freed"] / f["kept"], 3)}
        summary["parts"] = {p: {m: {c: round(v, 1) for c, v in fm.items()} for m, fm in pm.items()}
                            for p, pm in parts.items()}
        result[model] = summary
        print(f"{model}: batch {batch}, {top} of {args.parts}: " + "; ".join(
            f"{m} forward {summary[m]['kept_mb']} MB kept -> {summary[m]['freed_mb']} MB freed "
            f"(x{summary[m]['ratio']}; compiled {summary[m]['compiled_mb']} MB)" for m in MODES), flush=True)
    result["measure"] = ("VmHWM - VmRSS over one part's forward, MB, median of fresh processes, "
                         "MALLOC_MMAP_THRESHOLD_=65536")
    result["repeats"] = args.repeats
    result["loadavg"] = {"start": load_start, "end": Path("/proc/loadavg").read_text().split()[:3]}
    print(json.dumps(result))


if __name__ == "__main__":
    main()

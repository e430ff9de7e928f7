"""A model file's user-registered ops travel inside the plan folder."""
import subprocess
import sys
import textwrap

from fusion.ir.registry import import_plugins
from fusion.loader import load_model
from fusion.plan import Part, Plan, load_plan, save_plan

MODEL = textwrap.dedent('''
    import torch, fusion
    from fusion.ir.builder import GraphBuilder

    @fusion.register_module("Halve")
    class Halve(torch.nn.Module):
        def forward(self, x):
            return x / 2

    def model():
        b = GraphBuilder()
        x, y = b.input("x"), b.label("y")
        h = b.module("half", "Halve", x)
        o = b.module("fc", "torch.nn.Linear", h, in_features=3, out_features=2)
        b.loss("loss", "torch.nn.functional.cross_entropy", o, y)
        return b.build(example={"x": torch.randn(2, 3), "y": torch.tensor([0, 1])})
''')


def test_plugin_file_is_copied_into_the_plan_and_imports_in_a_fresh_process(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "halve_model.py").write_text(MODEL)
    model = load_model(f"{src / 'halve_model.py'}:model")
    assert model.graph.plugins == [str((src / "halve_model.py").resolve())]
    plan = Plan(model.graph, {"devices": [{"name": "d0"}]}, {"p0": Part("p0", "d0")}, {n: "p0" for n in model.graph.nodes})
    out = save_plan(plan, tmp_path / "plan")
    assert (out / "plugins" / "halve_model.py").is_file()
    assert load_plan(out).graph.plugins == ["plugins/halve_model.py"]
    (src / "halve_model.py").unlink()  # the original is gone: only the plan's copy remains
    code = ("import sys; from fusion.plan import load_plan; from fusion.ir.registry import import_plugins, REGISTRY;"
            f"p = load_plan({str(out)!r}); import_plugins(p.graph.plugins, base={str(out)!r}, trusted=True);"
            "assert REGISTRY.is_known('Halve'); print('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


def test_missing_plugin_file_is_a_clear_error(tmp_path):
    import pytest

    from fusion.ir.errors import FusionError

    with pytest.raises(FusionError, match="no such file"):
        import_plugins(["plugins/gone.py"], base=str(tmp_path), trusted=True)

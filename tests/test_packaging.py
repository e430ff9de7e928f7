"""The distribution ships every package of the checkout: a folder with an ``__init__.py`` that pyproject.toml's
``packages`` list lacks installs fine as editable and is missing from a regular install (``fusion.options`` and
``fusion.executors.runtime.dp`` once were: `fusion` then failed to start in CI's fresh venv)."""
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_in_pyproject():
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(tool["packages"])
    folders = {name: ROOT / path for name, path in tool["package-dir"].items()}
    found = set()
    for name, base in folders.items():
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base)
            found.add(".".join([name, *rel.parts]) if rel.parts else name)
    assert sorted(found - listed) == []
    assert sorted(listed - found) == []

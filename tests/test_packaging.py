"""Every package folder of the source tree is installed: a folder with an ``__init__.py`` that pyproject's
``packages`` list lacks works from a checkout and fails only after a non-editable install (.ci/run caught
``fusion.kernels.codecs`` missing that way: the README's main job died at import)."""
from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed_in_pyproject():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {".".join((pkg, *init.parent.relative_to(ROOT / folder).parts))
             for pkg, folder in cfg["package-dir"].items() for init in (ROOT / folder).rglob("__init__.py")}
    assert {"fusion.kernels.codecs", "fusion.executors.runtime", "fusion.commands"} <= found  # the walk sees them
    missing = sorted(found - set(cfg["packages"]))
    assert not missing, f"package folders not in pyproject's packages: {missing}"

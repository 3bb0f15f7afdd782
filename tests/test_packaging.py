"""The wheel ships every code package: each folder with an __init__.py under
the four code folders is listed in pyproject.toml (editable installs would
hide a missing one)."""

from pathlib import Path

import pytest

from . import ROOT

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11


def test_every_code_package_is_listed_in_pyproject():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = set()
    for name, folder in config["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([name, *rel.parts]))
    missing = sorted(found - listed)
    assert not missing, f"pyproject.toml [tool.setuptools] packages lacks {missing}"

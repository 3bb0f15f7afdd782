"""Where the repository's non-package code lives, checked on the source: no test
imports a module of scripts/ (their fixtures live under tests/; scripts/ and
demo/ may import tests.builders, not the other way round); the top of scripts/
holds only the user-facing tools, the benchmarks being in scripts/bench/; and
every ``scripts.…`` or ``demo.…`` module that code imports exists."""

from __future__ import annotations

import ast
from pathlib import Path

from tests import ROOT

# The top of scripts/: set-up, the demo, the test suite, chromium for the trace tests.
USER_TOOLS = {"setup.sh", "demo.sh", "test.sh", "install_chromium.sh"}
SCRIPTS_TOP = USER_TOOLS | {"__init__.py", "bench"}


def _python_files(folder: str) -> list[Path]:
    return sorted(p for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)


def _imported(path: Path) -> set[str]:
    """Every module ``path`` imports (those inside functions too); ``from pkg import name`` counts as
    ``pkg`` and as ``pkg.name``."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def test_no_test_imports_a_script():
    offenders = sorted(f"{p.relative_to(ROOT)}: {name}" for p in _python_files("tests") for name in _imported(p)
                       if name == "scripts" or name.startswith("scripts."))
    assert not offenders, "tests importing modules of scripts/ (move what they need under tests/ or demo/):\n" + \
        "\n".join(offenders)


def test_scripts_top_holds_only_the_user_facing_tools():
    top = {p.name for p in (ROOT / "scripts").iterdir() if p.name != "__pycache__"}
    assert top <= SCRIPTS_TOP, f"scripts/ holds more than the user-facing tools: {sorted(top - SCRIPTS_TOP)} " \
        "(benchmarks and probes go in scripts/bench/, demo training in demo/)"
    assert USER_TOOLS <= top, sorted(USER_TOOLS - top)
    assert (ROOT / "scripts" / "bench" / "__init__.py").is_file()


def test_imported_script_and_demo_modules_exist():
    """A module moved or renamed leaves no import of its old name behind (in scripts/, demo/, tests/)."""
    missing = set()
    for folder in ("scripts", "demo", "tests"):
        for path in _python_files(folder):
            for name in _imported(path):
                if not name.startswith(("scripts.", "demo.")):
                    continue
                base = ROOT.joinpath(*name.split("."))
                parent = base.parent
                # scripts.bench.harness (from its package) names a module; demo.task.X a name in one.
                if not (base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()
                        or parent.with_suffix(".py").is_file()):
                    missing.add(f"{path.relative_to(ROOT)}: {name}")
    assert not missing, "imports of modules that do not exist:\n" + "\n".join(sorted(missing))

"""dlm's test suite, a package: tests import their helpers as ``tests.builders`` and
the demo package as ``demo.*`` (the repository root is on pytest's pythonpath)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository root
# mlx-vlm 0.7.10 installed apart; the tests that compare with it skip without it.
PEER = ROOT / ".peer"

"""dlm.runtime on a Linux MLX without its backend library (``pip install mlx``
alone): one line naming what to install, from the API and from the commands.
A stand-in ``mlx`` package whose core fails to load as the real one does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dlm.runtime.platform import backend

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="macOS wheels carry Metal")


def _env(tmp_path: Path) -> dict:
    fake = tmp_path / "mlx"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "core.py").write_text(
        "raise ImportError('libmlx.so: cannot open shared object file: No such file or directory')\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}


def test_the_api_raises_one_clear_import_error(tmp_path):
    r = subprocess.run([sys.executable, "-c", "import dlm.runtime"], env=_env(tmp_path),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: MLX is installed without a backend library (libmlx.so: cannot open")
    assert 'pip install "dlm[cpu]"' in last and "dlm[cuda13]" in last


@pytest.mark.parametrize("command,module", [("dlm-run", "dlm.runtime.cli.main"), ("dlm-convert", "dlm.convert.cli"),
                                            ("dlm-verify", "dlm.verify.cli")])
def test_a_command_prints_the_line_without_a_traceback(tmp_path, command, module):
    code = f"import sys; sys.argv[0] = {command!r}; from {module} import main; main()"
    r = subprocess.run([sys.executable, "-c", code], env=_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.startswith("error: MLX is installed without a backend library") and "dlm[cpu]" in r.stderr


def test_the_installed_backend_is_named():
    import mlx.core as mx

    found = backend.installed()  # scripts/setup.sh installs exactly one (DLM_MLX_BACKEND)
    assert len(found) == 1
    device = "gpu" if mx.default_device() == mx.gpu else "cpu"
    assert backend.describe() == f"{device} ({found[0]})" and backend.conflict() is None


def test_two_backends_are_a_warning(monkeypatch):
    monkeypatch.setattr(backend, "installed", lambda: ["mlx-cpu 0.32.4", "mlx-cuda-13 0.32.4"])
    assert "more than one backend shares mlx/lib/libmlx.so" in backend.describe()
    note = backend.conflict()
    assert note.startswith("warning: several MLX backends are installed (mlx-cpu 0.32.4, mlx-cuda-13 0.32.4)")
    assert "now: cpu" in note

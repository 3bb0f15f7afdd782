"""dlm.runtime loads an optimized BLAS ahead of MLX on Linux (MLX's Linux CPU
wheel bundles the reference BLAS); DLM_BLAS chooses or opts out. Run in fresh
interpreters: the choice is made once, before MLX is imported."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from dlm.runtime import blas

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the bundled reference BLAS is Linux-only")

CODE = "import dlm.runtime.blas as b, mlx.core as mx; mx.eval(mx.ones((4, 4)) @ mx.ones((4, 4))); print(b.STATUS)"


def _status(**env):
    r = subprocess.run([sys.executable, "-c", CODE], env={**os.environ, **env}, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip(), r.stderr


def test_an_installed_openblas_replaces_the_reference_blas():
    found = [p.format(arch=platform.machine()) for p in blas.CANDIDATES]
    if not any(Path(p).is_file() for p in found):
        pytest.skip("no OpenBLAS on this machine (scripts/setup.sh installs libopenblas0-pthread)")
    status, _ = _status(DLM_BLAS="")
    assert status in found
    mapped = subprocess.run([sys.executable, "-c", CODE + "; print(open('/proc/self/maps').read())"],
                            capture_output=True, text=True, timeout=120, env={**os.environ, "DLM_BLAS": ""})
    assert "libopenblas" in mapped.stdout


def test_dlm_blas_opts_out_or_names_a_library():
    assert _status(DLM_BLAS="reference")[0] == "reference"
    status, err = _status(DLM_BLAS="/no/such/libblas.so")
    assert status == "reference" and "DLM_BLAS=/no/such/libblas.so cannot be loaded" in err

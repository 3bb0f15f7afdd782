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

from dlm.runtime.platform import blas

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the bundled reference BLAS is Linux-only")

CODE = "import dlm.runtime.platform.blas as b, mlx.core as mx; mx.eval(mx.ones((4, 4)) @ mx.ones((4, 4))); print(b.STATUS)"


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


IDLE = ("import os, time, dlm.runtime.platform.blas as b, mlx.core as mx; a = mx.random.normal((768, 768)); mx.eval(a); "
        "mx.eval(a @ a); t = time.process_time(); time.sleep(0.3); "
        "print(b.STATUS, os.environ.get('OPENBLAS_THREAD_TIMEOUT'), time.process_time() - t)")


def _idle(env: dict) -> tuple[str, str, float]:
    """(the BLAS, OPENBLAS_THREAD_TIMEOUT as the process saw it, its CPU seconds over a 0.3 s sleep after a GEMM)."""
    r = subprocess.run([sys.executable, "-c", IDLE], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    status, timeout, cpu = r.stdout.split()
    return status, timeout, float(cpu)


def test_openblas_threads_sleep_when_idle():
    """After a threaded GEMM, OpenBLAS's workers spun ~0.1 s at their default
    timeout (0.13 s of CPU in a 0.3 s sleep, measured): dlm shortens the spin
    unless the environment chose one."""
    found = [p.format(arch=platform.machine()) for p in blas.CANDIDATES]
    if not any(Path(p).is_file() for p in found) or (os.cpu_count() or 1) < 2:
        pytest.skip("needs OpenBLAS and two cores (its worker threads)")
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"} | {"DLM_BLAS": ""}
    status, timeout, cpu = _idle(env)
    assert status in found and timeout == str(blas.THREAD_TIMEOUT)
    assert cpu < 0.03  # the process sleeps: no worker spins
    assert _idle(env | {"OPENBLAS_THREAD_TIMEOUT": "24"})[1] == "24"  # the user's own value stays

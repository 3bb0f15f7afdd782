"""dlm.runtime keeps float32 matrix products in full float32 on GPUs
(MLX_ENABLE_TF32=0) unless the environment chooses; the choice is shown in
--profile and recorded in dlm-verify's report. Fresh interpreters: MLX reads
the variable once."""

from __future__ import annotations

import os
import subprocess
import sys

CODE = ("import os, dlm.runtime, mlx.core as mx; from dlm.runtime.platform import precision as p; "
        "mx.eval(mx.ones((4, 4)) @ mx.ones((4, 4))); print(os.environ.get('MLX_ENABLE_TF32'), '|', p.describe())")


def _run(value=None):
    env = {k: v for k, v in os.environ.items() if k != "MLX_ENABLE_TF32"}  # this process set it on import
    if value is not None:
        env["MLX_ENABLE_TF32"] = value
    r = subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return [part.strip() for part in r.stdout.split("|")]


def test_unset_means_full_float32():
    assert _run() == ["0", "full float32 (MLX_ENABLE_TF32=0)"]


def test_the_environment_chooses():
    value, line = _run("1")
    assert value == "1" and line.startswith("TF32-class") and "MLX_ENABLE_TF32=1 from the environment" in line
    value, line = _run("0")
    assert value == "0" and line == "full float32 (MLX_ENABLE_TF32=0 from the environment)"

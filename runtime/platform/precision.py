"""Full-precision float32 matrix products on every MLX backend, by default.

MLX runs float32 matmul-family ops (matmul, quantized and gathered matmuls,
convolution, attention) at TF32-class precision (a 10-bit mantissa) where the
hardware has matrix units: CUDA tensor cores (Ampere and newer) and the neural
accelerators of Apple's M5 generation. ``MLX_ENABLE_TF32`` (default 1) is the
switch (ml-explore/mlx#3860 and MLX's "Numerical Precision" page). Measured on
an H200 with MLX 0.32.4's CUDA backend (scripts/bench/cuda_bench.sh, 2026-12-04): the
tiny LLaDA-2's float32 logits differed from the PyTorch reference by up to 0.053
(under 1e-4 on the CPU backend) and greedy commit streams diverged.

A float32 model exists to compute in float32: dlm-verify's parity, the debug
canvas, a conversion someone checks by hand. So dlm sets
``MLX_ENABLE_TF32=0`` on import unless the environment already sets it;
``MLX_ENABLE_TF32=1`` opts into the faster approximate products. Models that
compute in bfloat16/float16 (the Hub checkpoints, 4-bit conversions on a GPU)
are unaffected. MLX reads the variable once, at its first such op: a program
that ran MLX matmuls before importing dlm keeps what MLX read then.
"""

from __future__ import annotations

import os

VARIABLE = "MLX_ENABLE_TF32"

# "full" (dlm set MLX_ENABLE_TF32=0), or the environment's own value.
STATUS = "unset"


def use_full_float32() -> None:
    global STATUS
    value = os.environ.get(VARIABLE)
    if value is None:
        os.environ[VARIABLE] = "0"
        STATUS = "full"
    else:
        STATUS = f"{VARIABLE}={value} from the environment"


def describe() -> str:
    """One line for ``--profile`` and reports: how float32 matmuls run."""
    if STATUS == "full":
        return "full float32 (MLX_ENABLE_TF32=0)"
    if os.environ.get(VARIABLE, "1") == "0":
        return f"full float32 ({STATUS})"
    return f"TF32-class on GPUs with matrix units ({STATUS})"

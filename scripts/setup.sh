#!/usr/bin/env bash
# Idempotent set-up: a virtual environment in .venv with dlm installed (editable).
# torch is pinned to 2.13.0 on purpose: an unpinned `torch` pulls a multi-GB CUDA
# build on Linux. For the CPU-only wheel from PyTorch's own index on a machine
# that reaches it, set DLM_TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade pip
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    $PIP install -q "${DLM_TORCH_SPEC:-torch==2.13.0}" \
        ${DLM_TORCH_INDEX_URL:+--index-url "$DLM_TORCH_INDEX_URL"}
fi
# MLX's backend on Linux: DLM_MLX_BACKEND=cpu (default), cuda12 or cuda13 (an NVIDIA GPU). The
# backend wheels share mlx/lib/libmlx.so: remove the others first, and reinstall the chosen one if
# removing another took the shared file with it.
extras=test
backend=
if [ "$(uname -s)" = Linux ]; then
    backend=${DLM_MLX_BACKEND:-cpu}
    case $backend in
    cpu) others="mlx-cuda-12 mlx-cuda-13"; dist=mlx-cpu ;;
    cuda12) others="mlx-cpu mlx-cuda-13"; dist=mlx-cuda-12 ;;
    cuda13) others="mlx-cpu mlx-cuda-12"; dist=mlx-cuda-13 ;;
    *) echo "DLM_MLX_BACKEND must be cpu, cuda12 or cuda13 (got '$backend')" >&2; exit 2 ;;
    esac
    extras="$backend,test"
    for other in $others; do
        if $PIP show -q "$other" >/dev/null 2>&1; then $PIP uninstall -q -y "$other"; fi
    done
fi
# Quiet unless it fails (setuptools prints build warnings on every editable install).
log=$(mktemp)
if ! $PIP install -q -e ".[$extras]" >"$log" 2>&1; then
    cat "$log" >&2
    rm -f "$log"
    exit 1
fi
rm -f "$log"
if [ -n "$backend" ] && ! .venv/bin/python -c "import mlx.core" >/dev/null 2>&1; then
    $PIP install -q --force-reinstall --no-deps "$dist==$(.venv/bin/python -c 'from importlib.metadata import version; print(version("mlx"))')"
fi
# MLX's Linux CPU wheel bundles the reference BLAS; dlm loads an optimized one
# ahead of it (dlm.runtime.blas). Install Debian's OpenBLAS where we can.
if [ "$(uname -s)" = Linux ] && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ] \
   && ! ls /usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0 >/dev/null 2>&1; then
    if ! apt-get install -y -qq libopenblas0-pthread >/dev/null 2>&1; then
        apt-get update -qq >/dev/null 2>&1 || true
        apt-get install -y -qq libopenblas0-pthread >/dev/null 2>&1 \
            || echo "note: could not install libopenblas0-pthread; MLX will use its slow reference BLAS" >&2
    fi
fi

"""An optimized BLAS for MLX's CPU backend on Linux.

The ``mlx[cpu]`` wheel on Linux vendors the reference (netlib) BLAS: float32
matmul runs at a few GFLOP/s. An optimized BLAS with the standard symbol names
(OpenBLAS, MKL), loaded with RTLD_GLOBAL *before* MLX, takes its place: the
dynamic linker resolves MLX's ``cblas_sgemm`` / LAPACK calls to the first
definition in the global scope. ``dlm.runtime`` does this on import, so every
dlm command and the Python API get it; nothing changes on macOS (Accelerate),
or when MLX was imported first.

OpenBLAS's idle worker threads spin for ``2^OPENBLAS_THREAD_TIMEOUT`` cycles
(default 2^28, ~0.1 s) after each threaded call, burning a core that MLX's own
threads and the server want; dlm sets the timeout to ``THREAD_TIMEOUT`` (2^20,
~0.3 ms: back-to-back GEMMs of a forward still find them awake) unless the
environment sets one. Measured in README "The server's socket, and the step
between canvases".

``DLM_BLAS``: unset = the first library found of ``CANDIDATES``; a path = that
library; ``reference`` = leave MLX's own BLAS. ``scripts/setup.sh`` installs
Debian's OpenBLAS where it can; otherwise the commands say in one line what to
install (``hint()``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import sys
from pathlib import Path
from typing import Optional

from . import settings

THREAD_TIMEOUT = 20  # OpenBLAS's idle spin before its threads sleep: 2^20 cycles

CANDIDATES = (
    "/usr/lib/{arch}-linux-gnu/openblas-pthread/libopenblas.so.0",  # Debian / Ubuntu libopenblas0-pthread
    "/usr/lib/{arch}-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",  # Fedora / RHEL openblas
    "/usr/lib/libopenblas.so.0",  # Arch
)
INSTALL_HINT = "apt-get install libopenblas0-pthread (Debian/Ubuntu) or dnf install openblas (Fedora)"

# What happened at import: "off" (not Linux, or MLX came first), "reference"
# (DLM_BLAS=reference, or nothing found), or the path of the library in use.
STATUS = "off"
_MISSING = False


def _vendors_reference_blas() -> bool:
    """Whether the installed MLX is the Linux wheel with the bundled netlib BLAS."""
    try:
        from importlib.metadata import PackageNotFoundError, files
    except ImportError:  # pragma: no cover
        return False
    for dist in ("mlx-cpu", "mlx"):
        try:
            names = [str(f) for f in (files(dist) or [])]
        except PackageNotFoundError:
            continue
        if any(Path(n).name.startswith("libblas") for n in names):
            return True
    return False


def _find() -> Optional[str]:
    arch = platform.machine()
    for pattern in CANDIDATES:
        path = pattern.format(arch=arch)
        if Path(path).is_file():
            return path
    return ctypes.util.find_library("openblas")


def use_optimized_blas() -> str:
    """Load an optimized BLAS ahead of MLX (see the module docstring); returns STATUS."""
    global STATUS, _MISSING
    if not sys.platform.startswith("linux") or "mlx.core" in sys.modules:
        return STATUS
    choice = settings.BLAS.get()  # None when unset
    if choice and choice.lower() == "reference":
        STATUS = "reference"
        return STATUS
    path = choice or _find()
    if path is None:
        STATUS, _MISSING = "reference", _vendors_reference_blas()
        return STATUS
    if "openblas" in Path(path).name.lower():  # read once, when the library starts its threads
        os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", str(THREAD_TIMEOUT))
    try:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError as exc:
        if choice:  # the user named it: say so
            print(f"warning: DLM_BLAS={choice} cannot be loaded ({exc}); using MLX's own BLAS", file=sys.stderr)
        STATUS, _MISSING = "reference", _vendors_reference_blas()
        return STATUS
    STATUS = path
    return STATUS


def hint() -> Optional[str]:
    """One line for the CLIs when MLX runs on the slow reference BLAS and no
    optimized one was found (None otherwise)."""
    if not _MISSING:
        return None
    return (f"note: MLX uses its reference BLAS here (float32 matmul is many times slower); install "
            f"OpenBLAS: {INSTALL_HINT}, or set DLM_BLAS=/path/to/libopenblas.so")

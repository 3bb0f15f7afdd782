"""Which MLX backend is installed, and a clear error when there is none.

On Linux the ``mlx`` wheel holds only the Python bindings; the library comes
from one backend package: ``mlx-cpu`` (``mlx[cpu]``), ``mlx-cuda-12`` or
``mlx-cuda-13`` (``mlx[cuda12]``, ``mlx[cuda13]``). They all install the same
file, ``mlx/lib/libmlx.so``, so the last one installed wins and removing one
breaks the other: dlm leaves the choice to an extra (``dlm[cpu]``,
``dlm[cuda13]``; ``DLM_MLX_BACKEND`` in scripts/setup.sh) rather than pinning
``mlx[cpu]``, which would overwrite a CUDA install. macOS wheels carry Metal.
"""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path
from typing import Optional

LINUX_BACKENDS = ("mlx-cpu", "mlx-cuda-12", "mlx-cuda-13")
COMMANDS = ("dlm-run", "dlm-convert", "dlm-verify")
INSTALL = 'pip install "dlm[cpu]" (or "dlm[cuda13]" / "dlm[cuda12]" for an NVIDIA GPU), or "mlx[cpu]" directly'


def installed() -> list[str]:
    """The MLX backend packages installed, as ``name version``."""
    found = []
    for name in LINUX_BACKENDS:
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            pass
    return found


def require() -> None:
    """Import MLX's core, turning a missing Linux backend into one clear line."""
    try:
        import mlx.core  # noqa: F401
    except ImportError as exc:
        if not sys.platform.startswith("linux") or "libmlx" not in str(exc):
            raise
        message = f"MLX is installed without a backend library ({exc}); {INSTALL}"
        if Path(sys.argv[0]).name in COMMANDS:  # a dlm command: the line, not a traceback
            print(f"error: {message}", file=sys.stderr)
            raise SystemExit(2) from None
        raise ImportError(message) from None


def device_name() -> str:
    """MLX's default device as ``cpu`` or ``gpu``."""
    import mlx.core as mx

    device = mx.default_device()
    return getattr(device.type, "name", str(device))


def describe() -> str:
    """``--profile``'s line: the device and the backend package, and a warning
    when two backends overwrote each other's library."""
    line = device_name()
    found = installed() if sys.platform.startswith("linux") else []
    if found:
        line += f" ({', '.join(found)})"
    if len(found) > 1:
        line += " - more than one backend shares mlx/lib/libmlx.so: uninstall all but one, then reinstall it"
    return line


def conflict() -> Optional[str]:
    """A one-line warning for the CLIs when several Linux backends are installed."""
    found = installed() if sys.platform.startswith("linux") else []
    if len(found) < 2:
        return None
    return (f"warning: several MLX backends are installed ({', '.join(found)}); they share mlx/lib/libmlx.so and "
            f"the last installed wins (now: {device_name()}). Uninstall all but one, then reinstall it.")

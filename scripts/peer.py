"""mlx-vlm, the peer the benchmarks compare with: installed outside the
environment (``pip install --no-deps --target .peer mlx-vlm==0.7.10 ...``, and
for its server mlx-audio and cryptography: README "Benchmarks") so dlm's own
dependencies stay as pinned."""

from __future__ import annotations

import sys


def load_mlx_vlm(peer_dir: str):
    """``(mlx_vlm.load, its version)`` from ``peer_dir``, or ``(None, None)``
    with a line on stderr when it is not installed there (dlm is timed alone)."""
    import dlm.runtime  # noqa: F401  (before mlx-vlm imports MLX: the optimized BLAS, dlm.runtime.blas)

    if peer_dir not in sys.path:
        sys.path.append(peer_dir)
    try:
        import mlx_vlm
        from mlx_vlm import load
    except Exception as exc:  # pragma: no cover - depends on the machine
        print(f"mlx-vlm unavailable ({exc}); timing dlm only", file=sys.stderr)
        return None, None
    return load, getattr(mlx_vlm, "__version__", "?")


def warm_up(tools: dict, call=lambda fn: fn()) -> None:
    """One untimed run of each tool through ``call``. A peer that cannot run this
    model here (mlx-vlm's bf16 experts on MLX's CPU backend: gather_mm is
    float32-only there) is dropped from ``tools`` with a line on stderr, so the
    row is dlm's alone; dlm's own errors propagate."""
    for name, fn in list(tools.items()):
        try:
            call(fn)
        except Exception as exc:
            if name == "dlm":
                raise
            print(f"{name} failed on this model ({type(exc).__name__}: {exc}); timing dlm only", file=sys.stderr)
            del tools[name]

"""The memory budget of one generation, checked before anything is allocated.

MLX's CPU backend dies (SIGSEGV) when an allocation fails instead of raising,
so a request whose KV cache, canvas/block and logits cannot fit must be
refused before the first array exists. Each family's session estimates what it
will hold (``memory_bytes``); ``check_budget`` compares that with the budget:
``--memory-budget`` GB, else 80% of the machine's memory less what MLX already
holds (the model's weights).
"""

from __future__ import annotations

import os
from typing import Optional

from .errors import GenerationError

DEFAULT_FRACTION = 0.8


def machine_memory_bytes() -> int:
    """Total memory the device can use (Metal/CUDA report it; else physical RAM)."""
    import mlx.core as mx

    try:
        size = int(mx.device_info().get("memory_size") or 0)
    except Exception:  # older MLX, or a backend without device_info
        size = 0
    if size:
        return size
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * 2**30


def scores_materialized() -> bool:
    """Whether attention builds its full score matrix: MLX's CPU backend falls back
    to a plain softmax(q k^T) v; Metal and CUDA run fused kernels that do not."""
    import mlx.core as mx

    return mx.default_device() == mx.cpu


_FIXED: list = []  # over several ranks: the smallest rank's budget, fixed at load


def fix_budget(nbytes: int) -> None:
    """Over several ranks the budget must be the same on every rank (each admits and
    refuses the same requests, or their collectives stop pairing up): the loader fixes
    it at the smallest rank's, rather than each rank reading its own memory later."""
    _FIXED[:] = [nbytes]


def budget_bytes(budget_gb: Optional[float] = None) -> int:
    if budget_gb is not None:
        return int(budget_gb * 1e9)
    if _FIXED:
        return _FIXED[0]
    import mlx.core as mx

    return max(0, int(DEFAULT_FRACTION * machine_memory_bytes()) - mx.get_active_memory())


def check_budget(need: int, budget_gb: Optional[float], what: str, hint: str) -> None:
    """GenerationError when ``need`` bytes exceed the budget; ``what`` lists the
    parts of the estimate, ``hint`` the flags that shrink it."""
    budget = budget_bytes(budget_gb)
    if need > budget:
        source = "--memory-budget" if budget_gb is not None else (
            f"{int(DEFAULT_FRACTION * 100)}% of this machine's memory less the model; set --memory-budget")
        raise GenerationError(
            f"this generation needs about {size_text(need)} ({what}), over the memory budget of "
            f"{size_text(budget)} ({source}); {hint}"
        )


def size_text(n: float) -> str:
    """Bytes as GB from 1 GB, as MB (or kB, bytes) below it: never "0.00 GB"."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} bytes"

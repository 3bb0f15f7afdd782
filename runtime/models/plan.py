"""What a family's weight plan tells the converter to write."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence


@dataclass(frozen=True)
class TensorPlan:
    """One output tensor: its MLX name, the source tensors it reads, and how.

    ``combine`` gets the source arrays (mx.array, in ``sources`` order) and
    returns the output array; None means "the single source, unchanged".
    ``keep_float32`` pins the dtype (e.g. LLaDA-2's expert_bias) whatever --dtype says.
    """

    name: str
    sources: tuple[str, ...]
    combine: Optional[Callable[[Sequence], object]] = None
    keep_float32: bool = False

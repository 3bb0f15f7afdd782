"""Weight-map building blocks: ``TensorPlan`` (what a family's convert-time plan
tells the converter to write) and ``Renamed`` (a lazy view under other names,
for the MLX -> HF direction verify uses)."""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Mapping
from typing import Callable, Iterator, Optional, Sequence


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


class Renamed(Mapping):
    """A lazy view of a weight mapping under other names: ``rename(name)``
    returns the new name, or None to leave a tensor out."""

    def __init__(self, source: Mapping, rename):
        self.source = source
        self._map = {}
        for name in source:
            new = rename(name)
            if new is not None:
                self._map[new] = name

    def __len__(self) -> int:
        return len(self._map)

    def __iter__(self) -> Iterator[str]:
        return iter(self._map)

    def __getitem__(self, name: str):
        return self.source[self._map[name]]

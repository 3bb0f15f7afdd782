"""Slicing a loaded model's modules for one rank of a distributed run.

A family's ``shard(model, world)`` (declared on its ``Family``) calls these on
its modules right after the loader has put the (lazily read) weights in: each
keeps this rank's slice and drops the rest, one tensor at a time, so a rank never
holds more than its share plus one tensor being read. Its forward adds the
collectives (dlm.runtime.platform.distributed).

* ``keep_rows``: output features [lo, hi) of a linear (its bias too) or rows of an
  embedding table: all-to-sharded, or a vocabulary slice;
* ``keep_cols``: input features [lo, hi) of a linear: sharded-to-all (the caller
  sums the ranks' products and adds the bias once);
* ``keep_experts``: experts [lo, hi) of a stacked (switch) projection;
* ``local_routes``: a rank's view of the routing under expert parallelism.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..platform.distributed import DistributedError, World

_ARRAYS = ("weight", "scales", "biases", "bias")


def _take(module: nn.Module, name: str, value: mx.array) -> None:
    """Replace an array by an evaluated copy of its slice, so the whole tensor it was
    read from is freed once nothing else refers to it."""
    value = mx.contiguous(value)
    mx.eval(value)
    module[name] = value


def keep_rows(module: nn.Module, lo: int, hi: int) -> None:
    """Output rows [lo, hi) of every array of ``module`` (Linear, QuantizedLinear, Embedding)."""
    keep_row_ranges(module, [(lo, hi)])


def keep_row_ranges(module: nn.Module, ranges: list[tuple[int, int]]) -> None:
    """The output rows of ``ranges``, in order (a fused projection's per-head pieces)."""
    for name in _ARRAYS:
        if name in module:
            a = module[name]
            _take(module, name, a[ranges[0][0]:ranges[0][1]] if len(ranges) == 1
                  else mx.concatenate([a[lo:hi] for lo, hi in ranges]))


def keep_cols(module: nn.Module, lo: int, hi: int, keep_bias: bool) -> None:
    """Input columns [lo, hi) of a linear; its bias stays only where ``keep_bias``
    (one rank adds it after the sum). A quantized weight splits on its groups."""
    if "scales" in module:
        g = module.group_size
        if lo % g or hi % g:
            raise DistributedError(f"a quantized linear with groups of {g} cannot split its inputs at [{lo}, {hi})")
        _take(module, "scales", module["scales"][:, lo // g:hi // g])
        if "biases" in module:
            _take(module, "biases", module["biases"][:, lo // g:hi // g])
        lo, hi = lo * module.bits // 32, hi * module.bits // 32  # packed columns: whole groups
    _take(module, "weight", module["weight"][:, lo:hi])
    if "bias" in module and not keep_bias:
        _take(module, "bias", mx.zeros_like(module["bias"]))


def keep_experts(module: nn.Module, lo: int, hi: int) -> None:
    """Experts [lo, hi) of a stacked [experts, out, in] projection (and its scales/biases)."""
    for name in _ARRAYS:
        if name in module:
            _take(module, name, module[name][lo:hi])


def local_routes(indices: mx.array, weights: mx.array, lo: int, hi: int) -> tuple[mx.array, mx.array]:
    """Expert parallel: this rank holds experts [lo, hi). The slots routed to them keep
    their weight and get the local index; the others go to local expert 0 with weight
    0, so the shapes (and the compiled graphs) stay those of one rank, and the sum over
    the ranks counts every slot once."""
    mine = (indices >= lo) & (indices < hi)
    return mx.where(mine, indices - lo, 0), mx.where(mine, weights, 0)


def divisible(what: str, n: int, w: World, limit: str) -> None:
    """``n`` (heads, experts, ...) must split evenly over the ranks, else an error naming ``limit``."""
    if n % w.size:
        raise DistributedError(f"{what}: {n} does not split over {w.size} ranks ({limit})")

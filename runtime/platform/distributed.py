"""One model over the ranks of an ``mlx.launch`` job (``mx.distributed``).

Under ``mlx.launch`` (which sets ``MLX_RANK`` in every rank's environment),
``world()`` is the job's group and the loader shards the model over it; a plain
run has no group (``None``) and stays single-process. Every rank runs the same
loop on the same inputs with the same seed: only rank 0 prints, streams and
serves, and what only rank 0 knows (a request, a cancellation) reaches the
others through ``broadcast``.

The collectives dlm issues go through ``all_sum`` / ``all_gather`` here, which
count them (calls and bytes, per kind) for ``--profile``. A rank that dies makes
its peers' next collective fail or hang: ``Watchdog`` ends a rank that has made
no progress for ``DLM_DISTRIBUTED_TIMEOUT`` seconds, with an error naming it.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import mlx.core as mx

from . import settings as env
from .errors import DlmError


class DistributedError(DlmError):
    """The ranks disagree (model files, shapes) or the model cannot split over them."""


@dataclass(frozen=True)
class World:
    """The group one run is sharded over: ``size`` ranks, this one ``rank``."""

    group: Any
    rank: int
    size: int

    @property
    def primary(self) -> bool:
        """Rank 0: it prints, streams and serves."""
        return self.rank == 0

    def span(self, n: int) -> tuple[int, int]:
        """This rank's share [lo, hi) of ``n`` items (rows, heads, experts): the first
        ``n % size`` ranks take one more."""
        return span(n, self.size, self.rank)

    def vocab_span(self, n: int) -> tuple[int, int]:
        """This rank's vocabulary rows [lo, hi): equal widths of ceil(n / size), the last
        rank's shorter, so that ``gather_last`` joins them in vocabulary order."""
        width = -(-n // self.size)
        return min(n, self.rank * width), min(n, (self.rank + 1) * width)


def span(n: int, size: int, rank: int) -> tuple[int, int]:
    base, extra = divmod(n, size)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


_WORLD: list = []  # [World | None] once decided


def launched() -> bool:
    """Whether this process is one rank of an ``mlx.launch`` job."""
    return "MLX_RANK" in os.environ


def world() -> Optional[World]:
    """The job's group when launched over two ranks or more, else None (decided once)."""
    if not _WORLD:
        w = None
        if launched():
            group = mx.distributed.init(strict=True)
            if group.size() > 1:
                w = World(group, group.rank(), group.size())
        _WORLD.append(w)
    return _WORLD[0]


def primary() -> bool:
    """True on rank 0 and in a single-process run."""
    w = world()
    return w is None or w.primary


# -- collectives, counted --------------------------------------------------------


@dataclass
class Counts:
    """Collectives issued (graph nodes built) and their bytes, per kind."""

    calls: dict = field(default_factory=dict)
    bytes: dict = field(default_factory=dict)

    def add(self, kind: str, x: mx.array) -> None:
        self.calls[kind] = self.calls.get(kind, 0) + 1
        self.bytes[kind] = self.bytes.get(kind, 0) + x.nbytes

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()

    def total(self) -> tuple[int, int]:
        return sum(self.calls.values()), sum(self.bytes.values())


COUNTS = Counts()


def all_sum(x: mx.array, w: World) -> mx.array:
    COUNTS.add("all_sum", x)
    return mx.distributed.all_sum(x, group=w.group)


def all_gather(x: mx.array, w: World) -> mx.array:
    """Every rank's ``x`` stacked along a new first axis [size, ...] (equal shapes)."""
    COUNTS.add("all_gather", x)
    return mx.distributed.all_gather(x[None], group=w.group).reshape(w.size, *x.shape)


def gather_last(x: mx.array, w: World, total: int) -> mx.array:
    """Each rank's ``vocab_span(total)`` slice along the last axis, joined in rank order:
    a vocabulary-split head's logits (the last rank's short slice padded for the gather)."""
    pad = -(-total // w.size) - x.shape[-1]
    if pad:
        x = mx.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    parts = all_gather(x, w)  # [size, ..., n]
    joined = mx.moveaxis(parts, 0, -2)  # [..., size, n]
    return joined.reshape(*x.shape[:-1], -1)[..., :total]


# -- what only rank 0 knows -------------------------------------------------------


def broadcast(value: Any, w: Optional[World]) -> Any:
    """Rank 0's ``value`` (JSON-able) on every rank: its length, then its bytes, each
    in one all_sum where the other ranks add zeros."""
    if w is None:
        return value
    data = json.dumps(value).encode() if w.primary else b""
    n = int(all_sum(mx.array([len(data)], dtype=mx.int32), w).item())
    buf = mx.array(list(data), dtype=mx.int32) if w.primary else mx.zeros((n,), dtype=mx.int32)
    if n == 0:
        return json.loads(data) if w.primary else None
    got = all_sum(buf, w)
    return json.loads(bytes(got.astype(mx.uint8).tolist()).decode())


def agree(what: str, value: str, w: Optional[World]) -> None:
    """Every rank holds the same ``value`` (a digest of the model files, a shape),
    else a DistributedError on every rank naming the ranks that differ."""
    if w is None:
        return
    digest = hashlib.sha256(value.encode()).digest()[:8]
    mine = mx.array(list(digest), dtype=mx.int32)
    every = all_gather(mine, w).tolist()
    odd = [r for r, d in enumerate(every) if d != every[0]]
    if odd:
        raise DistributedError(f"{what} differs between rank 0 and rank(s) {', '.join(map(str, odd))}: every rank "
                               "must load the same model files")


# -- a rank that stops answering ----------------------------------------------------


class Watchdog:
    """Ends this rank (exit status 1, one line on stderr) when ``beat`` has not been
    called for ``timeout`` seconds while ``busy``: a dead or stuck peer leaves the
    others waiting in a collective that never completes."""

    def __init__(self, w: World, timeout: Optional[float] = None):
        self.w = w
        self.timeout = float(timeout if timeout is not None else env.DISTRIBUTED_TIMEOUT.get())
        self.last = time.monotonic()
        self.busy = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="dlm-watchdog", daemon=True)

    def __enter__(self) -> "Watchdog":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()

    def beat(self) -> None:
        self.last = time.monotonic()

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout / 4)):
            if self.busy and time.monotonic() - self.last > self.timeout:
                print(f"error: rank {self.w.rank} of {self.w.size}: no progress for {self.timeout:.0f} s (a rank "
                      "died or hangs); stopping (DLM_DISTRIBUTED_TIMEOUT sets the limit)", file=sys.stderr,
                      flush=True)
                os._exit(1)

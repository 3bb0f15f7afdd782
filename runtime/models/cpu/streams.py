"""Row-parallel quantized kernels on MLX's CPU backend.

MLX's CPU quantized kernels (``quantized_matmul``, ``gather_qmm``) run on one
thread, and every CPU stream has a thread of its own. So a quantized matmul
whose rows are independent is split by rows over one stream per core and the
pieces concatenated: each row is computed by the same kernel on the same
inputs, so the result is bit-identical (tests/test_cpu_streams.py).
Measured on this project's 2-core machine (``python -m scripts.bench.cpu_streams``):
4-bit experts at the released DiffusionGemma shape (32 of 128 experts, one
256-token canvas top-8) 7.98 s on one stream vs 4.40 s on two (1.81x); an 8-bit
tied head over 256 rows, vocab slice 8192, 5.67 vs 3.17 s (1.79x); bit-identical.

Off on Metal/CUDA (their kernels are parallel already), inside ``mx.compile``
(callers run these eagerly), and with ``DLM_CPU_STREAMS=1``.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Callable

import mlx.core as mx

from ...platform import settings

MIN_ROWS = 16  # rows per piece below which splitting costs more than it saves
# Bytes of input per piece below which elementwise work over rows (a small
# vocabulary's sampling) runs faster whole: a piece on another stream costs a
# thread hand-off and a cross-stream wait inside the step's graph. Measured
# (LLaDA-2 sampling, 2 cores): 32 KB pieces 1.04-1.20x the whole, 64 KB 0.94x,
# 256 KB 0.66-0.76x; in a tiny model's step, 16-row pieces of a 256-entry
# vocabulary cost 0.3-1.3 ms a step (scripts/bench/closed_loop.py).
VOCAB_MIN_PIECE_BYTES = 256 << 10

# MLX streams belong to the thread that made them ("There is no Stream(cpu, N) in
# current thread" elsewhere): the server's worker thread gets its own.
_local = threading.local()


def cpu_streams() -> list:
    """One CPU stream per core (``DLM_CPU_STREAMS`` overrides the count); [] off the CPU."""
    if mx.default_device() != mx.cpu:
        return []
    streams = getattr(_local, "streams", None)
    if streams is None:
        n = cores()
        streams = _local.streams = [mx.new_stream(mx.cpu) for _ in range(n if n > 1 else 0)]
    return streams


def synchronize_thread() -> None:
    """Wait for all MLX work this thread queued: its default stream's and its
    CPU streams' (made here or not at all). A thread that ends with work still
    queued (an async_eval, a split's pieces) leaves MLX's stream threads
    computing into a process that may be exiting."""
    for stream in getattr(_local, "streams", None) or []:
        mx.synchronize(stream)
    mx.synchronize()


def cores() -> int:
    """The CPU work's parallelism: one per core, or ``DLM_CPU_STREAMS``."""
    return settings.CPU_STREAMS.get() or (os.cpu_count() or 1)


def parallel() -> bool:
    return len(cpu_streams()) > 1


def split_rows(fn: Callable[..., mx.array], *arrays: mx.array, piece_bytes: int = 0,
               min_piece_bytes: int = 0) -> mx.array:
    """``fn(*arrays)`` with the arrays' leading (row) axis split over the CPU
    streams; ``fn`` must treat rows independently. ``fn`` may return a tuple
    of arrays (each with the rows as its leading axis). ``piece_bytes``: also
    cut the rows into pieces of about that many bytes of ``arrays[0]`` (taking
    turns on the streams), a piece starting only once the one a turn back on
    its stream is done (left alone, MLX's scheduler runs every piece's first
    op first, and all their temporaries live at once), so the temporaries
    ``fn`` makes stay that small. ``min_piece_bytes``: split only into pieces of
    at least that many bytes of ``arrays[0]`` (work as light as its input:
    ``VOCAB_MIN_PIECE_BYTES``)."""
    streams = cpu_streams()
    rows = arrays[0].shape[0]
    n = min(len(streams), rows // MIN_ROWS)
    if min_piece_bytes:
        n = min(n, arrays[0].nbytes // min_piece_bytes)
    if piece_bytes:
        row_bytes = arrays[0].nbytes // max(rows, 1)
        n = max(n, -(-rows // max(piece_bytes // max(row_bytes, 1), 1)))
    if n < 2:
        return fn(*arrays)
    bounds = [rows * i // n for i in range(n + 1)]
    parts = []
    ahead = max(1, len(streams))
    for i in range(n):
        with mx.stream(streams[i % len(streams)]) if streams else contextlib.nullcontext():
            piece = [a[bounds[i]:bounds[i + 1]] for a in arrays]
            if piece_bytes and i >= ahead:
                before = parts[i - ahead]
                piece = mx.depends(piece, list(before) if isinstance(before, (tuple, list)) else [before])
            parts.append(fn(*piece))
    if isinstance(parts[0], (tuple, list)):
        return tuple(mx.concatenate(pieces, axis=0) for pieces in zip(*parts))
    return mx.concatenate(parts, axis=0)


def split_positions(fn: Callable[[mx.array], mx.array], x: mx.array, piece_bytes: int = 0,
                    min_piece_bytes: int = 0) -> mx.array:
    """``fn`` over ``x`` [..., D], every leading position a row, split over the CPU streams."""
    flat = x.reshape(-1, x.shape[-1])
    out = split_rows(fn, flat, piece_bytes=piece_bytes, min_piece_bytes=min_piece_bytes)
    return out.reshape(*x.shape[:-1], out.shape[-1])

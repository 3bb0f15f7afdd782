"""Quantized weights on the CPU backend, dequantized per call.

MLX's CPU quantized kernels run at ~2 GFLOP/s a thread here, while a float32
GEMM through an optimized BLAS runs at ~140-180 (dlm.runtime.platform.blas). When a
model's float32 weights do not fit in memory (the loader dequantizes at load
when they do), the weights stay quantized and each matmul dequantizes the
weight it needs (one module, one expert, one vocabulary slice) to float32 just
before its GEMM; the copy is freed as soon as that GEMM ran. Measured
(``python -m scripts.bench.cpu_dequant``, 2 cores, OpenBLAS, a full-size verify
beside it): a 256-row 8-bit projection 4096 x 2816 2145 ms on the kernels vs
160 ms dequantized per call (13.4x), a 16384-token head slice 18x, 4-bit
experts at 16 rows each 1.7x (bound by dequantizing); a whole released-geometry
DiffusionGemma step 205 vs 55 s (README).

The dequantized values are exactly those the quantized kernels read (the
same ``mx.dequantize``), so verify's implementation check (the reference fed
the dequantized weights) holds as before. Every sequence of a batch gets its
own GEMM (dlm.runtime.models.rows: linear, linear_each, embedding_matmul), and whether a call dequantizes depends on
one sequence's row count, so batched and solo runs stay identical.

Off on Metal/CUDA (their quantized kernels are the fast path), with fewer than
``MIN_ROWS`` rows a sequence (the kernel reads each weight once; dequantizing
costs more) and when the loader was told to keep the kernels
(``--compute-dtype native|float32``, ``DLM_CPU_DEQUANTIZE=kernels``).
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import mlx.core as mx

from .streams import cpu_streams, parallel

ATTR = "dequantize_per_call"
MIN_ROWS = 4  # rows of one sequence from which dequantizing beats the kernel (bench_cpu_dequant)
SLICE_BYTES = 32 << 20  # float32 bytes of one dequantized piece (a head is cut into vocabulary slices)
AHEAD = 1  # slices dequantized ahead, per CPU stream (peak memory, scripts/bench/cpu_dequant.py)


def per_call(module) -> bool:
    """Whether ``module`` (quantized: it has ``scales``) dequantizes per call."""
    return getattr(module, ATTR, False) and "scales" in module


def mark(model) -> int:
    """Make every quantized module of ``model`` dequantize per call; returns how many."""
    n = 0
    for _, module in model.named_modules():
        if "scales" in module and hasattr(module, "bits"):
            object.__setattr__(module, ATTR, True)
            n += 1
    return n


def sequence_rows(x: mx.array) -> int:
    """Rows one sequence multiplies: [L, in] -> L, [B, L, in] -> L."""
    return x.shape[-2] if x.ndim >= 2 else 1


def wants(module, x: mx.array) -> bool:
    return per_call(module) and sequence_rows(x) >= MIN_ROWS


def dequantized(module, start: int = None, stop: int = None, expert: int = None,
                after=None) -> mx.array:
    """Rows ``start:stop`` of the module's weight (of one ``expert`` of a switch
    layer) as float32, exactly as the quantized kernels see them; not before
    ``after`` (an array, or a list of them: ``linear_each``'s products of one
    slice) is computed, when given."""
    w, scales, biases = module["weight"], module["scales"], module.get("biases")
    if expert is not None:
        w, scales = w[expert], scales[expert]
        biases = None if biases is None else biases[expert]
    if start is not None:
        w, scales = w[start:stop], scales[start:stop]
        biases = None if biases is None else biases[start:stop]
    if after is not None:
        w, scales = mx.depends([w, scales], after if isinstance(after, list) else [after])
    out = mx.dequantize(w, scales, biases, group_size=module.group_size, bits=module.bits, mode=module.mode)
    return out.astype(mx.float32)


def _slices(module) -> list[tuple[int, int]]:
    """Output-row slices of about SLICE_BYTES float32 each."""
    rows = module["weight"].shape[-2]
    cols = module["weight"].shape[-1] * 32 // module.bits
    n = max(1, math.ceil(rows * cols * 4 / SLICE_BYTES))
    return [(rows * i // n, rows * (i + 1) // n) for i in range(n)]


def pieces(module, piece) -> list:
    """``piece(start, stop, weight)`` for each output-row slice (float32 weight),
    the slices taking turns on the CPU streams (dequantizing is single-threaded).
    A slice is not dequantized before the piece AHEAD turns back is computed:
    left alone, MLX's scheduler dequantizes most slices of a head before their
    GEMMs run. The 8-bit tied head at the released vocabulary over 256 rows:
    +2.5 GB peak without (a probe before this change), +0.70 GB with
    (scripts/bench/cpu_dequant.py; the quantized kernel: 0.54 GB, the output)."""
    slices = _slices(module)
    streams = cpu_streams() if len(slices) > 1 else []
    ahead = AHEAD * max(1, len(streams))
    parts = []
    for i, (a, b) in enumerate(slices):
        with mx.stream(streams[i % len(streams)]) if streams else nullcontext():
            w = dequantized(module, a, b, after=parts[i - ahead] if i >= ahead else None)
            parts.append(piece(a, b, w))
    return parts


def splits(module) -> bool:
    """A quantized module (it has ``scales``) on the CPU backend with several
    streams: its kernel is single-threaded, so callers split its rows (not one
    dequantized per call: ``pieces`` spreads its slices instead)."""
    return "scales" in module and parallel() and not per_call(module)

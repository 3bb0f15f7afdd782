"""Matmuls that give every sequence of a batch exactly the numbers it gets alone.

Batched generation (dlm.runtime.batch) runs B sequences through one forward
with a leading batch axis, and promises each the commit stream it would get on
its own. Row-wise work (norms, softmax, RoPE, routing, elementwise math, and
``gather_mm``, which multiplies one row at a time) gives a row the same result
whatever rows surround it. A plain matmul does not: ``x [B, L, in] @ W.T``
becomes one GEMM of B*L rows, and an optimized BLAS picks its kernels and its
thread split by the row count. Measured with OpenBLAS 0.3.21 on this
project's CPU (2 threads): a row's float32 result changes whenever its
4-row kernel group or the thread boundary moves, so merged rows differ from the
sequence alone in the last bits (tests/*/test_batch.py's bitwise test fails
with merged rows; no commit stream of the tiny test models flipped). A broadcast
weight (``x [B, L, in] @ W.T [B, in, out]`` with a stride-0 batch) makes MLX
run one GEMM per sequence with that sequence's own row count: the very call the
sequence makes alone.

``linear`` and ``matmul`` do that for an input with a batch axis of more than
one sequence and are the plain call otherwise (a sequence alone runs exactly
what it ran before). Quantized matmuls run merged: MLX's own CPU kernel
computes every row on its own (checked in tests/test_batch_rows.py); those
dequantized per call (cpu/dequant.py) get one GEMM per sequence as float ones do.

These are the CPU backend's guarantees. On CUDA (one H200 run, with TF32
products) tests/test_batch_rows.py's bit-for-bit checks failed: a batched
cuBLAS call need not run the sequence's own kernel (scripts/bench/cuda_bench.sh
measures the cost of these per-sequence GEMMs there: bench_batch --merged-rows).
"""

from __future__ import annotations

import math

import mlx.core as mx

from .cpu import dequant


def _batched(x: mx.array) -> bool:
    return x.ndim >= 3 and x.shape[0] > 1


# MLX's CPU matmul (0.32.4) finds each batch element's matrices through 32-bit
# element offsets: with a broadcast weight, element i's offset i * in * out
# wraps past 2^31 and the GEMM reads outside the weight (a segfault, or rows
# silently wrong: the released DiffusionGemma's tied head, 262144 x 2816, from
# a batch of 4; scripts/bench/probe_batch_offsets.py). Such a batch runs its
# sequences' GEMMs one op each: the same GEMM calls.
OFFSET_LIMIT = 2**31


def _one_op(x: mx.array, w: mx.array) -> bool:
    return (math.prod(x.shape[:-2]) - 1) * w.size < OFFSET_LIMIT


def _each(product, x: mx.array) -> mx.array:
    """``product(rows)`` of every sequence of ``x`` [..., L, in], stacked back."""
    flat = x.reshape(-1, *x.shape[-2:])
    y = mx.stack([product(flat[i]) for i in range(flat.shape[0])])
    return y.reshape(*x.shape[:-2], *y.shape[-2:])


def matmul(x: mx.array, w: mx.array) -> mx.array:
    """``x @ w`` for a 2-D ``w``, one GEMM per sequence of ``x``'s batch axis."""
    if not _batched(x):
        return x @ w
    if not _one_op(x, w):
        return _each(lambda rows: rows @ w, x)
    return x @ mx.broadcast_to(w, x.shape[:-2] + w.shape)


def linear(module, x: mx.array) -> mx.array:
    """``module(x)`` (an ``nn.Linear``, or a quantized one), one GEMM per sequence."""
    if "scales" in module:
        return dequantized_linear(module, x) if dequant.wants(module, x) else module(x)
    if not _batched(x):
        return module(x)
    w = module["weight"].T
    if "bias" not in module:
        return matmul(x, w)
    if not _one_op(x, w):
        return _each(lambda rows: mx.addmm(module["bias"], rows, w), x)
    return mx.addmm(module["bias"], x, mx.broadcast_to(w, x.shape[:-2] + w.shape))


def as_linear(embedding, x: mx.array) -> mx.array:
    """``embedding.as_linear(x)`` (tied output head), one GEMM per sequence."""
    if "scales" in embedding:
        return dequantized_linear(embedding, x) if dequant.wants(embedding, x) else embedding.as_linear(x)
    if not _batched(x):
        return embedding.as_linear(x)
    return matmul(x, embedding["weight"].T)


def dequantized_linear(module, x: mx.array) -> mx.array:
    """``x @ W.T`` (+ bias) of a quantized linear or a tied quantized embedding
    (``as_linear``), the weight dequantized per output slice; one GEMM per
    sequence of a batch. Output in ``x``'s dtype."""
    return linear_each(module, [x])[0]


def linear_each(module, xs: list[mx.array]) -> list[mx.array]:
    """``linear`` of each of ``xs`` (inputs of any row counts, a batch's
    sequences that cannot stack: LLaDA-2's masked rows), each output slice
    dequantized once for all of them; each input gets the GEMMs it gets alone."""
    if not xs:
        return []
    xfs = [x.astype(mx.float32) for x in xs]
    parts = dequant.pieces(module, lambda a, b, w: [matmul(xf, w.T) for xf in xfs])
    out = []
    for j, x in enumerate(xs):
        y = mx.concatenate([p[j] for p in parts], axis=-1) if len(parts) > 1 else parts[0][j]
        if "bias" in module:
            y = y + module["bias"].astype(mx.float32)
        out.append(y.astype(x.dtype))
    return out


def embedding_matmul(module, p: mx.array) -> mx.array:
    """``p @ W`` of a quantized embedding (``p`` [..., vocab], float32 out):
    each vocabulary slice dequantized per call, the slices' products summed."""
    pf = p.astype(mx.float32)
    parts = dequant.pieces(module, lambda a, b, w: matmul(pf[..., a:b], w))
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def per_sequence(rows: int, sequences: int) -> int:
    """Rows of one sequence in a flat [sequences * rows_each, ...] batch."""
    if sequences < 1 or rows % sequences:
        raise ValueError(f"{rows} rows do not split into {sequences} equal sequences")
    return rows // sequences

"""The CPU backend's routed-expert kernels and the choice between them.

The CPU backend's ``gather_mm`` is float32-only, so the loader keeps
half-precision expert weights in float32 there (``cpu_float32_experts``) and
the switch layers round their output back to the activation dtype. Large float
experts run ``by_count`` (one GEMM per expert, the experts with as many token
copies stacked in one ``gather_mm``); quantized experts dequantized per call
(dequant.py) run ``by_expert``, one expert dequantized at a time, once a step
for all the sequences of a batch; small float experts over enough positions
multiply every token by all the experts (``dense``). ``switch.SwitchMLP`` asks
``stacks`` / ``grouped`` which kernel its experts take (the families reach
this module through switch.py only).

The layers asked about are switch.py's stacked-expert linears, told apart
here by what they hold (as dequant.py does): a quantized one
(``QuantizedSwitchLinear``) has ``scales``, a float one (``SwitchLinear``)
does not; both read one expert's weight with ``expert_weight``. (switch.py
imports this module, so this module does not import switch.py.)
"""

from __future__ import annotations

from contextlib import nullcontext

import mlx.core as mx
import numpy as np

from ..rows import per_sequence
from .dequant import per_call
from .streams import cpu_streams, parallel
from ...platform.settings import CPU_EXPERTS

# Experts dequantized per call run one expert at a time (by_expert) from about this many token
# copies per expert (scripts/bench/experts.py and its LLaDA-2 shapes, float32 then: 1-2 rows per
# expert 0.4-0.6x gather_mm, 8 rows 1.6x, 16 rows 2.5x). The CPU's own kernels take experts this
# large (in x out; small experts are cheaper fused in one gather_mm graph).
GROUPED_MIN_ROWS_PER_EXPERT = 6
GROUPED_MIN_WEIGHT = 1 << 20


def _mode() -> str:
    """DLM_CPU_EXPERTS: "gather" = gather_mm always, "each" = float experts one
    matmul per expert (by_expert) as before by_count; for benchmarks."""
    return CPU_EXPERTS.get()


def _quantized(layer) -> bool:
    """A quantized switch layer (``QuantizedSwitchLinear``: it has ``scales``);
    else a float one (``SwitchLinear``)."""
    return "scales" in layer


def _float_like(layer) -> bool:
    """A float switch layer, or a quantized one dequantized per call."""
    return not _quantized(layer) or per_call(layer)


def _expert_size(layer) -> int:
    """One expert's weight elements (unpacked)."""
    w = layer["weight"]
    return w.shape[-2] * w.shape[-1] * (32 // layer.bits if "scales" in layer else 1)


def cpu_float_experts(*layers) -> bool:
    """Large float experts on the CPU backend (or quantized ones dequantized per
    call): they run eagerly (outside mx.compile), ``by_count`` (``stacks``) or
    ``by_expert`` (``grouped``). DLM_CPU_EXPERTS=gather: gather_mm always (benchmarks)."""
    if _mode() == "gather":
        return False
    return (mx.default_device() == mx.cpu
            and all(_float_like(layer) for layer in layers)
            and min(_expert_size(layer) for layer in layers) >= GROUPED_MIN_WEIGHT)


def cpu_eager_experts(*layers) -> bool:
    """Experts that run outside mx.compile on the CPU backend: large float ones
    (``cpu_float_experts``) and quantized ones, whose single-threaded kernel is
    split over the CPU streams (streams.py)."""
    if cpu_float_experts(*layers):
        return True
    return parallel() and all(_quantized(layer) for layer in layers)


def stacks(*layers) -> bool:
    """Whether the experts run ``by_count``, whatever the number of token
    copies: large float experts on the CPU backend (``cpu_float_experts``, not
    dequantized per call). On Metal/CUDA gather_mm is the fast path and stays
    inside the compiled graphs."""
    return (cpu_float_experts(*layers) and all(not _quantized(layer) for layer in layers)
            and _mode() != "each")


def grouped(rows: int, num_experts: int, *layers) -> bool:
    """Whether ``rows`` token copies run one expert at a time (``by_expert``)
    rather than through gather_qmm: experts dequantized per call on the CPU
    backend (and float ones under DLM_CPU_EXPERTS=each), with enough rows per
    expert for the per-expert matmuls to pay."""
    return (cpu_float_experts(*layers) and not stacks(*layers)
            and rows >= GROUPED_MIN_ROWS_PER_EXPERT * num_experts)


# Below this many weight elements in one projection's whole expert tensor (E x out x in), and
# from DENSE_MIN_ROWS token positions per sequence, the CPU multiplies every token by all the
# experts in one product and keeps the chosen ones (``dense``): gather_mm's one small product per
# token copy costs more there (README "LLaDA-2 runtime": the small geometry, 32 experts of
# 256x64, went from 71.3 to 92.4 tok/s; with 8 positions gather_mm was still the faster).
DENSE_MAX_WEIGHT = 1 << 20
DENSE_MIN_ROWS = 32


def dense(rows: int, *layers) -> bool:
    """Whether ``rows`` token positions of one sequence take the dense path: small
    float experts on the CPU backend (DLM_CPU_EXPERTS=gather: never)."""
    if _mode() == "gather":
        return False
    return (mx.default_device() == mx.cpu and rows >= DENSE_MIN_ROWS
            and all(not _quantized(layer) for layer in layers)
            and max(layer["weight"].size for layer in layers) <= DENSE_MAX_WEIGHT)


def by_expert(x: mx.array, idx: mx.array, num_experts: int, expert_fn, spread: bool = False,
              sequences: int = 1) -> mx.array:
    """Route each token copy to its expert: ``x`` [N, in], ``idx`` [N, K] ->
    [N, K, out]. ``expert_fn(e, blocks)`` multiplies each block of rows routed
    to expert ``e`` and returns their outputs, reading (or dequantizing) the
    expert's weight once for all of them.

    ``sequences``: ``x`` holds that many equal-length sequences' rows, in order
    (batched generation). Each sequence is sorted by expert as it is alone and
    gets its own block, so its own GEMM per expert (the call it makes alone:
    rows.py), but the experts go one after the other across the sequences: an
    expert's weight is read from memory, or dequantized, once a step rather than
    once a sequence (at the released DiffusionGemma geometry a layer's experts
    are 3 GB of float32, one expert 24 MB: it stays in the cache for the
    batch). Reads the per-expert counts on the host (one sync per call), so it
    runs outside mx.compile. ``spread``: experts take turns on the CPU streams
    (per-call dequantization is single-threaded)."""
    streams = cpu_streams() if spread else []
    N, K = idx.shape
    n = per_sequence(N, sequences)
    ids = idx.reshape(sequences, n * K)
    counts = [np.bincount(row, minlength=num_experts) for row in np.array(ids)]
    starts = [np.cumsum(c) - c for c in counts]
    orders = [mx.argsort(ids[s]) for s in range(sequences)]
    rows = [x[s * n:(s + 1) * n][orders[s] // K] for s in range(sequences)]
    where = [np.empty(n * K, dtype=np.int32) for _ in range(sequences)]  # each sorted copy's row of y
    outs, done = [], 0
    for i, expert in enumerate(np.flatnonzero(np.sum(counts, axis=0))):
        takers = [(s, int(starts[s][expert]), int(counts[s][expert])) for s in range(sequences) if counts[s][expert]]
        with mx.stream(streams[i % len(streams)]) if streams else nullcontext():
            outs.extend(expert_fn(int(expert), [rows[s][a:a + c] for s, a, c in takers]))
        for s, a, c in takers:
            where[s][a:a + c] = np.arange(done, done + c)
            done += c
    y = mx.concatenate(outs, axis=0) if len(outs) > 1 else outs[0]
    back = [mx.array(where[s])[mx.argsort(orders[s])] for s in range(sequences)]
    return y[mx.concatenate(back) if sequences > 1 else back[0]].reshape(N, K, -1)


def by_count(x: mx.array, idx: mx.array, stack_fn, sequences: int = 1) -> mx.array:
    """Route each token copy to its expert: ``x`` [N, in], ``idx`` [N, K] ->
    [N, K, out], one GEMM per expert that has copies, the experts with the same
    number ``c`` of copies stacked into one op: ``stack_fn(rows [G, c, in],
    experts [G] uint32) -> [G, c, out]`` (the family's projections, each a
    ``SwitchLinear`` called with those indices: ``gather_mm``, one GEMM per
    group).

    Why: MLX's CPU ``gather_mm`` runs one GEMM per batch element, so fed one row
    per token copy (the gather path) it reads an expert's weight once per copy,
    and one matmul op per expert (``by_expert``) pays MLX's per-op cost, a
    gather and a scatter on each of up to 256 experts. At the released shapes
    (``python -m scripts.bench.experts``) this runs a DiffusionGemma canvas's
    experts ~2.8x faster than one op per expert and a LLaDA2.0-mini block's
    ~1.5x faster than the sorted gather.

    ``sequences``: ``x`` holds that many equal-length sequences' rows, in
    order (batched generation). Each sequence sorts its copies by expert as it
    does alone, and each (sequence, expert) group is its own GEMM of its own
    ``c`` rows: the call it makes alone, whatever else shares the op, so a batch
    gives each sequence its own bits. An expert's groups are adjacent across the
    sequences, so where they share a count its weight is read from memory once
    for them. Reads the routing on the host (one sync a call): runs outside
    mx.compile."""
    N, K = idx.shape
    n = per_sequence(N, sequences)
    ids = np.array(idx).reshape(sequences, n * K)
    by_copies: dict[int, list] = {}
    for s in range(sequences):
        order = np.argsort(ids[s], kind="stable")
        experts, first, counts = np.unique(ids[s][order], return_index=True, return_counts=True)
        for e, a, c in zip(experts.tolist(), first.tolist(), counts.tolist()):
            by_copies.setdefault(c, []).append((e, s, order[a:a + c] + s * n * K))
    outs, where, done = [], np.empty(N * K, dtype=np.int32), 0
    for c in sorted(by_copies):
        groups = sorted(by_copies[c], key=lambda g: g[:2])
        copies = np.concatenate([g[2] for g in groups])
        rows = x[mx.array((copies // K).astype(np.int32))].reshape(len(groups), c, -1)
        y = stack_fn(rows, mx.array([g[0] for g in groups], dtype=mx.uint32))
        outs.append(y.reshape(len(groups) * c, -1))
        where[copies] = np.arange(done, done + copies.size)
        done += copies.size
    y = mx.concatenate(outs, axis=0) if len(outs) > 1 else outs[0]
    return y[mx.array(where)].reshape(N, K, -1)


def cpu_float32_experts(model) -> None:
    """On the CPU backend keep unquantized half-precision expert weights in
    float32 (a load-time pass over ``model``'s float switch layers: the modules
    with ``expert_weight`` and no ``scales``)."""
    if mx.default_device() != mx.cpu:
        return
    updates = [
        (f"{name}.weight", module["weight"].astype(mx.float32))
        for name, module in model.named_modules()
        if hasattr(module, "expert_weight") and not _quantized(module) and module["weight"].dtype != mx.float32
    ]
    if updates:
        model.load_weights(updates, strict=False)

"""DiffusionGemma per-step sampling rules as small MLX functions.

Each works on arrays shaped [..., L] (per position) or [..., L, V] (logits), so
it is unit-testable on hand-made inputs. The rules are transformers 5.24's
``generation_diffusion_gemma.py`` (``_denoising_step``, ``EntropyBoundSampler``,
``StableAndConfidentStoppingCriteria``).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

ENTROPY_BOUND = "entropy-bound"
CONFIDENCE_THRESHOLD = "confidence-threshold"
SAMPLERS = (ENTROPY_BOUND, CONFIDENCE_THRESHOLD)


def linear_temperature(cur_step: int, n_steps: int, t_min: float, t_max: float) -> np.float32:
    """T = t_min + (t_max - t_min) * (cur_step / N) in float32; cur_step runs N..1."""
    f = np.float32
    return f(f(t_min) + f(f(t_max - t_min) * (f(cur_step) / f(n_steps))))


def token_entropy(logits: mx.array) -> mx.array:
    """Entropy of Categorical(logits=logits) per position (float32), as torch computes it."""
    x = logits.astype(mx.float32)
    logp = x - mx.logsumexp(x, axis=-1, keepdims=True)
    logp = mx.maximum(logp, np.finfo(np.float32).min)
    return -(logp * mx.exp(logp)).sum(axis=-1)


def entropy_bound_accept(entropy: mx.array, bound: float) -> mx.array:
    """Accept the lowest-entropy positions whose entropy sum, excluding the
    largest accepted one, is <= bound (rank 0 always). Returns bool [..., L]."""
    order = mx.argsort(entropy, axis=-1)
    sorted_h = mx.take_along_axis(entropy, order, axis=-1)
    selected = (mx.cumsum(sorted_h, axis=-1) - sorted_h) <= bound
    return mx.take_along_axis(selected, mx.argsort(order, axis=-1), axis=-1)


def confidence_accept(top1: mx.array, revealed: mx.array, threshold: float) -> mx.array:
    """Newly revealed positions: unrevealed ones whose top-1 probability exceeds
    ``threshold``; if none does, the single most confident unrevealed one
    (none once everything is revealed). Returns bool [..., L]."""
    candidates = (top1 > threshold) & ~revealed
    best = mx.argmax(mx.where(revealed, -1.0, top1), axis=-1, keepdims=True)
    fallback = (mx.arange(top1.shape[-1]) == best) & ~revealed
    return mx.where(candidates.any(axis=-1, keepdims=True), candidates, fallback)


def stable(argmax: mx.array, history: list[mx.array], window: int) -> mx.array:
    """Per canvas (the last axis): the argmax canvas equals each of the last
    ``window`` ones (0: always stable; fewer than ``window`` earlier steps: not
    stable, as the -1 initialised history)."""
    if window == 0:
        return mx.array(True)
    if len(history) < window:
        return mx.array(False)
    ok = mx.array(True)
    for previous in history[-window:]:
        ok = ok & mx.all(previous == argmax, axis=-1)
    return ok


def confident(entropy: mx.array, threshold: float) -> mx.array:
    """Per canvas (the last axis): mean per-position entropy strictly below
    ``threshold`` (a row reduction, so a canvas gets the same mean alone or in
    a batch)."""
    return mx.mean(entropy, axis=-1) < threshold


def debug_canvas_pattern(n: int, length: int, vocab: int) -> mx.array:
    """The n-th fixed "random" canvas of debug-canvas mode (lablup/mlxcel's ``debug_canvas_pattern``):
    x[i] = ((i + 1) * 7919 + n * 104729) mod V."""
    i = np.arange(1, length + 1, dtype=np.int64)
    return mx.array(((i * 7919 + n * 104729) % vocab).astype(np.int32))


def canvas_length(remaining: int, min_length: int, max_length: int, full: bool) -> int:
    """min(max_canvas, max(remaining, min_canvas)), or max_canvas with full canvases."""
    if full:
        return max_length
    return min(max_length, max(remaining, min_length))

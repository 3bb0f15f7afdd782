"""LLaDA-2 per-step rules (MLX, no host syncs; at scale on the CPU backend the
sampler reads its logits into numpy, cpu/vocab.py): the per-step reveal quota,
the shared uniform stream, top-k/top-p filtering, sampling and the reveal rule."""

from __future__ import annotations

import os
from typing import Optional

import mlx.core as mx
import numpy as np

from ..cpu import vocab as cpu_vocab


def transfer_quota(block_length: int, steps: int) -> list[int]:
    """What each step must reveal at least: bl // steps, remainder to the first steps."""
    base, extra = divmod(block_length, steps)
    return [base + (1 if s < extra else 0) for s in range(steps)]


class UniformStream:
    """The shared sampling randomness: uniforms in [0, 1) from numpy's PCG64.
    The PyTorch reference draws from the same stream, so both sample alike."""

    def __init__(self, seed: Optional[int]):
        if seed is None:
            seed = int.from_bytes(os.urandom(8), "little")
        self.rng = np.random.default_rng(seed)

    def __call__(self, n: int) -> np.ndarray:
        return self.rng.random(n, dtype=np.float64).astype(np.float32)


def filter_logits(logits, top_k=None, top_p=None):
    """Hub top-k (ties kept) and top-p (drop tokens whose exclusive cumulative mass > p)."""
    if top_k:
        k = min(int(top_k), logits.shape[-1])
        kth = mx.topk(logits, k, axis=-1).min(axis=-1, keepdims=True)
        logits = mx.where(logits < kth, -mx.inf, logits)
    if top_p is not None and top_p < 1:
        order = mx.argsort(-logits, axis=-1)
        sorted_logits = mx.take_along_axis(logits, order, axis=-1)
        probs = mx.softmax(sorted_logits, axis=-1)
        drop = (mx.cumsum(probs, axis=-1) - probs) > top_p
        drop = mx.concatenate([mx.zeros_like(drop[..., :1]), drop[..., 1:]], axis=-1)
        drop = mx.take_along_axis(drop, mx.argsort(order, axis=-1), axis=-1)
        logits = mx.where(drop, -mx.inf, logits)
    return logits


def on_host(entries: int, s) -> bool:
    """Whether ``sample`` over ``entries`` logits runs through numpy (cpu/vocab.py:
    the CPU backend at scale; top-k/top-p filtering stays in MLX)."""
    return cpu_vocab.takes(entries) and not s.top_k and (s.top_p is None or s.top_p >= 1)


def sample(logits, s, uniforms: Optional[np.ndarray], host: Optional[bool] = None):
    """(tokens, confidence of each chosen token) for [..., n, V] float32 logits
    (uniforms [..., n]); ``s`` carries temperature, top_k, top_p and
    reference_sampling (the Settings). Every row is computed on its own.
    ``host``: through numpy or not (default: ``on_host`` of these logits; a
    batch passes what one block alone takes, so both get the same bits)."""
    greedy = s.temperature == 0 and not s.reference_sampling
    if on_host(logits.size, s) if host is None else host:
        lead = logits.shape[:-1]  # the CPU backend at scale: numpy's vector exp (cpu/vocab.py)
        tok, conf = cpu_vocab.sample_rows(logits, s.temperature, None if greedy else uniforms)
        return tok.reshape(lead), conf.reshape(lead)
    if greedy:
        tok = mx.argmax(logits, axis=-1)
        conf = mx.exp(mx.max(logits, axis=-1) - mx.logsumexp(logits, axis=-1))
        return tok, conf
    if s.temperature > 0 and s.temperature != 1:
        logits = logits / s.temperature
    probs = mx.softmax(filter_logits(logits, s.top_k, s.top_p), axis=-1)
    cdf = mx.cumsum(probs, axis=-1)
    target = mx.array(uniforms)[..., None] * cdf[..., -1:]
    tok = mx.minimum((cdf <= target).sum(axis=-1), probs.shape[-1] - 1)
    return tok, mx.take_along_axis(probs, tok[..., None], axis=-1)[..., 0]


def reveal(active, conf, threshold, quota):
    """Every active position above the threshold if there are at least
    ``quota`` of them, else the ``quota`` most confident active positions.
    ``active``/``conf`` [..., n]; ``threshold``/``quota`` scalars or [..., 1]
    (one per block of a batch)."""
    conf = mx.where(active, conf, -mx.inf)
    high = conf > threshold
    # Rank = positions ahead in (confidence desc, position asc): exact ties go
    # to the lowest position, as in the reference.
    n = conf.shape[-1]
    ahead = (conf[..., None, :] > conf[..., :, None]) | (
        (conf[..., None, :] == conf[..., :, None]) & (mx.arange(n)[None, :] < mx.arange(n)[:, None])
    )
    top = (ahead.sum(-1) < quota) & active
    return mx.where(high.sum(-1, keepdims=True) >= quota, high, top)

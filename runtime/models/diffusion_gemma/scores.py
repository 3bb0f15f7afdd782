"""A denoising step's work over the full vocabulary, in as few passes as the math allows.

Everything a step needs from its logits [..., L, V] comes from one exponential
per entry (the step of transformers' ``generation_diffusion_gemma.py``: ``_denoising_step``):

    proc    = logits / T                      argmax = argmax(proc)
    z       = proc - proc[argmax]             e = exp(z),  s = Σ e
    softmax(proc) = e / s                     entropy = log s - Σ e·z / s
    top-1 probability = 1 / s                 (the confidence-threshold sampler)

The entropy is torch's ``-Σ softmax(proc) · log_softmax(proc)`` rewritten
(log_softmax = z - log s), and the softmax is the self-conditioning input of
the next step, so the decoder takes no second pass of its own. A categorical
draw at temperature 1 reads the same softmax: one uniform per position, found
in its running sum (inverse-CDF sampling: the distribution softmax(proc),
up to float32 rounding of the running sum), instead of V Gumbel draws per
position. Exactness is unchanged: argmax and the debug canvas never draw.

Why: on MLX's CPU backend an exponential or tanh costs ~14 ns per entry on one
thread, so at the released geometry (256 positions x 262144) each such pass
took ~0.95 s, and the old step made six (softcap, two in the entropy, Gumbel
noise with two logs, the next step's softmax): 5.6 s of a 10.9 s step.
``python -m scripts.bench.vocab`` measures the before and after. Rows are
independent, so on the CPU the rows are split over the CPU streams (one per
core; bit-identical to one stream, tests/diffusion_gemma/test_scores.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..cpu import vocab as cpu_vocab
from ..cpu.streams import VOCAB_MIN_PIECE_BYTES, split_rows

_F32_MIN = float(np.finfo(np.float32).min)
_TINY = float(np.finfo(np.float32).tiny)
# Rows are scored a piece of this many bytes of logits at a time: the pass makes
# a few temporaries the size of its input, which at the released geometry
# (256 x 262144 float32, 268 MB) would otherwise add ~1 GB to a step's peak.
PIECE_BYTES = 32 << 20


def _split_rows(fn, *arrays: mx.array):
    """``fn`` over rows of logits-sized arrays, split over the CPU streams where it pays, in bounded pieces."""
    return split_rows(fn, *arrays, piece_bytes=PIECE_BYTES, min_piece_bytes=VOCAB_MIN_PIECE_BYTES)


@dataclass
class Scores:
    logits: mx.array  # [..., L, V] float32
    t: mx.array  # the step's temperature (a scalar, or [B, 1, 1]: one per sequence)
    argmax: mx.array  # [..., L] int32, of proc
    entropy: mx.array  # [..., L] float32
    probs: mx.array  # [..., L, V] softmax(proc), float32
    total: mx.array  # [..., L, 1] Σ exp(proc - max proc)

    @property
    def proc(self) -> mx.array:
        """logits / T (computed where asked for: the trace, a half-precision
        self-conditioning input, a draw at another temperature), so the step
        holds one [L, V] array of its own, the softmax."""
        return self.logits / self.t

    @property
    def top1(self) -> mx.array:
        """The largest probability per position (its weight is exactly 1)."""
        return 1.0 / self.total[..., 0]


@mx.compile
def _score_rows(logits: mx.array, t: mx.array):
    proc = logits / t
    argmax = mx.argmax(proc, axis=-1)
    # -inf entries (a masked vocabulary) weigh 0 and add 0 to the entropy, as torch's clamp does.
    z = mx.maximum(proc - mx.take_along_axis(proc, argmax[:, None], axis=-1), _F32_MIN)
    weights = mx.exp(z)
    total = weights.sum(axis=-1, keepdims=True)
    entropy = mx.log(total[:, 0]) - (weights * z).sum(axis=-1) / total[:, 0]
    return argmax.astype(mx.int32), entropy, weights / total, total


def score(logits: mx.array, t) -> Scores:
    """The step's scores of float32 ``logits`` [..., V] at temperature ``t`` (lazy;
    evaluated through numpy at scale on the CPU backend, cpu/vocab.py): a scalar,
    or one per sequence ([B, 1, 1] for [B, L, V]; each row divides by its own,
    the same division as alone)."""
    t = t if isinstance(t, mx.array) else mx.array(t, dtype=mx.float32)
    lead, vocab = logits.shape[:-1], logits.shape[-1]
    rows = logits.reshape(-1, vocab)
    # One temperature per sequence (a batch's canvases at different steps): one per row.
    per_row = mx.broadcast_to(t, (*lead, 1)).reshape(-1, 1) if t.ndim else None
    if cpu_vocab.wanted(logits):  # the CPU backend at scale: numpy's vector exp (cpu/vocab.py)
        argmax, entropy, probs, total = cpu_vocab.score_rows(logits, t.item() if per_row is None
                                                             else np.array(per_row))
    elif per_row is None:
        argmax, entropy, probs, total = _split_rows(lambda r: _score_rows(r, t), rows)
    else:
        argmax, entropy, probs, total = _split_rows(_score_rows, rows, per_row)
    return Scores(logits, t, argmax.reshape(lead), entropy.reshape(lead), probs.reshape(*lead, vocab),
                  total.reshape(*lead, 1))


@mx.compile
def _inverse_cdf_rows(weights: mx.array, u: mx.array) -> mx.array:
    running = mx.cumsum(weights, axis=-1)
    # The first index whose running sum reaches u * Σ: never a zero weight (u > 0 is forced).
    target = mx.maximum(u * running[:, -1], _TINY)
    return (running < target[:, None]).astype(mx.int32).sum(axis=-1)


@mx.compile
def _tempered_rows(proc: mx.array, argmax: mx.array, temperature: mx.array) -> mx.array:
    x = proc / temperature
    return mx.exp(mx.maximum(x - mx.take_along_axis(x, argmax[:, None], axis=-1), _F32_MIN))


def sample(scores: Scores, temperature: float, u: mx.array) -> mx.array:
    """A draw from softmax(proc / temperature) per position, ``u`` [..., L] uniform
    in [0, 1); temperature 1 reuses the step's own softmax (no extra exponential)."""
    lead, vocab = scores.argmax.shape, scores.probs.shape[-1]
    flat_u = u.reshape(-1)
    if temperature == 1:
        draw = _split_rows(_inverse_cdf_rows, scores.probs.reshape(-1, vocab), flat_u)
    else:
        temp = mx.array(temperature, dtype=mx.float32)
        draw = _split_rows(lambda p, a, r: _inverse_cdf_rows(_tempered_rows(p, a, temp), r),
                           scores.proc.reshape(-1, vocab), scores.argmax.reshape(-1), flat_u)
    return draw.reshape(lead)

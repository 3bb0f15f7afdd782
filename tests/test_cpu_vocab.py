"""numpy's vector loops for the full-vocabulary row math on the CPU backend
(cpu/vocab.py): the same formulas as the MLX path, checked against float64 math,
each row computed on its own (the same bits alone, together and in any piece
split), taken only where the policy says."""

from __future__ import annotations

import numpy as np
import pytest

from dlm.runtime import api  # noqa: F401  (dlm.runtime before MLX: the optimized BLAS)

import mlx.core as mx  # noqa: E402  (isort: skip)
from dlm.runtime.models.cpu import vocab as cpu_vocab  # noqa: E402


def _logits(rows=7, vocab=1001, seed=0):
    """Rows of an odd length (no vector-width multiple), a peaked, a flat and a masked one."""
    x = np.random.default_rng(seed).normal(size=(rows, vocab)).astype(np.float32) * 6
    x[1, 17] = 80.0
    x[2] = 0.0
    x[3, :400] = -np.inf
    return x


def _float64(x: np.ndarray, t: float):
    proc = (x / np.float32(t)).astype(np.float64)  # proc as float32 holds it (torch's too), then exact math
    z = proc - proc.max(-1, keepdims=True)
    e = np.exp(z)
    s = e.sum(-1)
    p = e / s[:, None]
    logp = np.where(p > 0, z - np.log(s)[:, None], 0.0)
    return proc.argmax(-1), -(p * logp).sum(-1), p, s


@pytest.mark.parametrize("t", [1.0, 0.45])
def test_scores_match_float64(t):
    x = _logits()
    argmax, entropy, probs, total = (np.array(a) for a in cpu_vocab.score_rows(mx.array(x), t))
    want = _float64(x, t)
    assert argmax.dtype == np.int32 and argmax.tolist() == want[0].tolist()
    assert np.abs(entropy - want[1]).max() < 2e-6
    assert np.abs(probs - want[2]).max() < 2e-7 and probs[3, :400].max() == 0.0
    assert np.abs(total[:, 0] - want[3]).max() / want[3].max() < 1e-6 and total.shape == (7, 1)


def test_softcap_matches_float64():
    x = _logits()[:3] * 10
    got = np.array(cpu_vocab.softcap(mx.array(x).astype(mx.bfloat16), 30.0))
    want = np.tanh(np.array(mx.array(x).astype(mx.bfloat16).astype(mx.float32), np.float64) / 30) * 30
    assert got.dtype == np.float32 and np.abs(got - want).max() < 1e-5


def test_rows_alone_and_in_pieces_are_the_same_bits(monkeypatch):
    """Each row alone, all rows at once, and rows cut into one-row pieces on the
    thread pool: bit for bit (a batch and the sequence alone take these paths)."""
    x = _logits(rows=9, seed=3)
    together = [np.array(a) for a in cpu_vocab.score_rows(mx.array(x), 0.7)]
    capped = np.array(cpu_vocab.softcap(mx.array(x), 30.0))
    for i in range(len(x)):
        alone = [np.array(a) for a in cpu_vocab.score_rows(mx.array(x[i : i + 1]), 0.7)]
        assert all(np.array_equal(a[0], b[i]) for a, b in zip(alone, together))
        assert np.array_equal(np.array(cpu_vocab.softcap(mx.array(x[i : i + 1]), 30.0))[0], capped[i])
    monkeypatch.setattr(cpu_vocab, "PIECE_BYTES", 4 * x.shape[1])  # one row per task
    pieces = [np.array(a) for a in cpu_vocab.score_rows(mx.array(x), 0.7)]
    assert all(np.array_equal(a, b) for a, b in zip(pieces, together))
    assert np.array_equal(np.array(cpu_vocab.softcap(mx.array(x), 30.0)), capped)


def test_the_policy(monkeypatch):
    small, large = mx.zeros((4, 100)), mx.zeros((16, cpu_vocab.MIN_ENTRIES // 16))
    monkeypatch.delenv("DLM_CPU_VOCAB", raising=False)
    assert not cpu_vocab.wanted(small) and cpu_vocab.wanted(large)
    monkeypatch.setenv("DLM_CPU_VOCAB", "mlx")
    assert not cpu_vocab.wanted(large)
    monkeypatch.setenv("DLM_CPU_VOCAB", "numpy")
    assert cpu_vocab.wanted(small)


def test_llada2_sampler_matches_float64(monkeypatch):
    """LLaDA-2's sampler: greedy (argmax, its probability) and inverse-CDF draws at
    a temperature against float64 math; the masked last token is never drawn."""
    x = np.random.default_rng(5).normal(size=(6, 777)).astype(np.float32) * 3
    x[:, -1] = -np.inf
    x[2, 5] = 30.0
    tok, conf = (np.array(a) for a in cpu_vocab.sample_rows(mx.array(x), 0.0))
    p = _float64(x, 1.0)[2]
    assert tok.dtype == np.uint32 and tok.tolist() == x.argmax(-1).tolist()
    assert np.abs(conf - p.max(-1)).max() < 1e-6
    u = np.linspace(0.03, 0.97, 6).astype(np.float32)
    for t in (0.7, 1.0):
        tok, conf = (np.array(a) for a in cpu_vocab.sample_rows(mx.array(x), t, u))
        p = _float64(x, t)[2]
        want = [int(np.searchsorted(np.cumsum(row), ui, side="right")) for row, ui in zip(p, u)]
        assert tok.dtype == np.int32 and tok.tolist() == want and (tok < 776).all()
        assert np.abs(conf - p[np.arange(6), tok]).max() < 1e-6
    first = cpu_vocab.sample_rows(mx.array(x), 0.7, u)
    monkeypatch.setattr(cpu_vocab, "PIECE_BYTES", 4 * x.shape[1])  # one row per task: the same bits
    again = cpu_vocab.sample_rows(mx.array(x), 0.7, u)
    assert all(np.array_equal(np.array(a), np.array(b)) for a, b in zip(again, first))

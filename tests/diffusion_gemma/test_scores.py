"""The fused vocabulary pass of a denoising step (scores.py) against torch's own
definitions (Categorical entropy, softmax, the argmax), the inverse-CDF draw
against the distribution it must follow, and the CPU-stream split against one
stream, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from dlm.runtime import api  # noqa: F401  (dlm.runtime before MLX: the optimized BLAS)

import mlx.core as mx  # noqa: E402  (isort: skip)
from dlm.runtime.models.cpu import streams as cpu_streams  # noqa: E402
from dlm.runtime.models.diffusion_gemma import scores as V  # noqa: E402
from dlm.runtime.models.diffusion_gemma.model import softcap  # noqa: E402


def _logits(rows=6, vocab=300, scale=4.0, seed=0):
    x = np.random.default_rng(seed).normal(size=(1, rows, vocab)).astype(np.float32) * scale
    x[0, 1, 17] = 40.0  # a peaked position
    x[0, 2] = 0.0  # a flat one
    return x


@pytest.mark.parametrize("t", [1.0, 0.45])
def test_scores_match_torch(t):
    import torch

    x = _logits()
    x[0, 3, :100] = -np.inf  # a masked vocabulary: weight 0, nothing added to the entropy
    s = V.score(mx.array(x), t)
    proc = torch.tensor(x) / torch.tensor(np.float32(t))
    assert np.array_equal(np.array(s.proc), proc.numpy())
    assert np.array(s.argmax).tolist() == proc.argmax(-1).tolist()
    ent = torch.distributions.Categorical(logits=proc).entropy().numpy()
    assert np.abs(np.array(s.entropy) - ent).max() < 2e-5
    probs = torch.softmax(proc, -1).numpy()
    assert np.abs(np.array(s.probs) - probs).max() < 1e-6
    assert np.array(s.probs)[0, 3, :100].max() == 0.0
    top1 = torch.exp(proc.max(-1).values - torch.logsumexp(proc, -1)).numpy()
    assert np.abs(np.array(s.top1) - top1).max() < 1e-6


def test_entropy_follows_the_temperature():
    x = mx.array(_logits(seed=1))
    hot, cold = V.score(x, 1.0).entropy, V.score(x, 0.4).entropy
    assert (np.array(cold) <= np.array(hot) + 1e-6).all() and (np.array(cold) < np.array(hot) - 1e-3).any()


@pytest.mark.parametrize("temperature", [1.0, 0.5, 1.7])
def test_draws_follow_the_distribution(temperature):
    """Frequencies over many rows within 5 standard errors of softmax(proc / temperature)."""
    rng = np.random.default_rng(2)
    row = (rng.normal(size=12) * 1.5).astype(np.float32)
    row[4] = -np.inf  # never drawn
    n = 40000
    x = mx.array(np.broadcast_to(row, (n, row.size)).copy())
    s = V.score(x, 0.8)
    draw = np.array(V.sample(s, temperature, mx.random.uniform(shape=(n,), key=mx.random.key(3))))
    z = row.astype(np.float64) / np.float32(0.8) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    freq = np.bincount(draw, minlength=row.size) / n
    assert freq[4] == 0
    assert (np.abs(freq - p) <= 5 * np.sqrt(p * (1 - p) / n) + 1e-9).all(), (freq, p)


def test_draw_edges_never_pick_a_zero_weight():
    row = np.full(8, -np.inf, np.float32)
    row[[2, 5]] = [0.0, 1.0]
    x = mx.array(np.stack([row] * 3))
    u = mx.array(np.array([0.0, np.nextafter(np.float32(1), np.float32(0)), 0.5], np.float32))
    for temperature in (1.0, 0.7):
        draw = np.array(V.sample(V.score(x, 1.0), temperature, u)).tolist()
        assert draw[0] == 2 and draw[1] == 5 and draw[2] in (2, 5)


def test_split_over_cpu_streams_is_bitwise_one_stream(monkeypatch):
    """Rows split over the CPU streams give exactly what one stream gives."""
    if not cpu_streams.parallel():
        pytest.skip("one CPU core: nothing is split")
    x = mx.array(_logits(rows=2 * cpu_streams.MIN_ROWS + 3, vocab=8000, seed=4))
    assert x.nbytes >= 2 * cpu_streams.VOCAB_MIN_PIECE_BYTES  # big enough to be split
    split = V.score(x, 0.6)
    u = mx.random.uniform(shape=split.argmax.shape, key=mx.random.key(5))
    split_draws = [V.sample(split, t, u) for t in (1.0, 0.5)]
    split_cap = softcap(x * 5, 30.0)
    monkeypatch.setattr(cpu_streams, "cpu_streams", lambda: [])
    one = V.score(x, 0.6)
    for a, b in zip((split.proc, split.argmax, split.entropy, split.probs, split.total),
                    (one.proc, one.argmax, one.entropy, one.probs, one.total)):
        assert np.array_equal(np.array(a), np.array(b))
    for t, d in zip((1.0, 0.5), split_draws):
        assert np.array_equal(np.array(V.sample(one, t, u)), np.array(d))
    one_cap = softcap(x * 5, 30.0)
    assert np.array_equal(np.array(split_cap), np.array(one_cap))
    assert np.allclose(np.array(one_cap), 30 * np.tanh(np.array(x) * 5 / 30), atol=1e-5)


@pytest.mark.parametrize("path", ["mlx", "numpy"])
def test_a_temperature_per_sequence_is_each_alone(monkeypatch, path):
    """A batch's canvases at different steps of the schedule are scored in one
    pass, a temperature per sequence ([B, 1, 1]); each sequence gets the bits it
    gets alone at its own temperature, in MLX and through numpy (cpu/vocab.py)."""
    monkeypatch.setenv("DLM_CPU_VOCAB", path)
    x = np.concatenate([_logits(seed=s) for s in range(3)])  # [3, 6, 300]
    temps = [0.8, 0.45, 0.6]
    together = V.score(mx.array(x), mx.array(np.array(temps, dtype=np.float32).reshape(3, 1, 1)))
    for i, t in enumerate(temps):
        alone = V.score(mx.array(x[i : i + 1]), t)
        for a, b in zip((alone.proc, alone.argmax, alone.entropy, alone.probs, alone.total),
                        (together.proc, together.argmax, together.entropy, together.probs, together.total)):
            assert np.array_equal(np.array(a)[0], np.array(b)[i])
    assert not np.array_equal(np.array(together.probs)[0], np.array(V.score(mx.array(x[:1]), 0.45).probs)[0])

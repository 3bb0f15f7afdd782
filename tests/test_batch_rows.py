"""dlm.runtime.models.rows: a batch's matmuls give each sequence, bit for bit,
what the same call gives it alone (whatever rows the BLAS would merge)."""

from __future__ import annotations

import numpy as np
import pytest

from dlm.runtime.models import rows  # before MLX: dlm.runtime loads the optimized BLAS ahead of it

import mlx.core as mx  # noqa: E402  (isort: skip)
import mlx.nn as nn  # noqa: E402  (isort: skip)


def batch(seed, shape):
    return mx.array(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


def alone(fn, x):
    return [fn(x[b : b + 1]) for b in range(x.shape[0])]


def equal_per_sequence(got, want):
    mx.eval(got, want)
    return all(np.array_equal(np.array(got[b : b + 1]), np.array(w)) for b, w in enumerate(want))


@pytest.mark.parametrize("length", [1, 5, 8, 13])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_per_sequence(length, bias):
    layer = nn.Linear(256, 320, bias=bias)
    x = batch(length, (3, length, 256))
    assert equal_per_sequence(rows.linear(layer, x), alone(layer, x))
    assert np.array_equal(np.array(rows.linear(layer, x[:1])), np.array(layer(x[:1])))  # alone: the plain call


@pytest.mark.parametrize("bias", [False, True])
def test_batches_past_mlx_offsets_run_one_op_a_sequence(monkeypatch, bias):
    """Past MLX's 32-bit batch offsets (rows.OFFSET_LIMIT; a segfault at the
    released vocabulary from 4 sequences) each sequence's GEMM runs as its own
    op: the same bits as the one-op batch and as the sequence alone."""
    layer = nn.Linear(256, 320, bias=bias)
    x = batch(7, (4, 9, 256))
    one_op = rows.linear(layer, x)
    monkeypatch.setattr(rows, "OFFSET_LIMIT", 3 * 256 * 320)  # the 4th sequence's offset reaches it
    assert rows._one_op(x[:3], layer["weight"]) and not rows._one_op(x, layer["weight"])
    assert np.array_equal(np.array(rows.linear(layer, x)), np.array(one_op))
    assert equal_per_sequence(rows.linear(layer, x), alone(layer, x))
    monkeypatch.setattr(rows, "OFFSET_LIMIT", 1)
    w = batch(8, (256, 64))
    y = rows.matmul(x.reshape(2, 2, 9, 256), w)  # two batch axes
    assert y.shape == (2, 2, 9, 64) and equal_per_sequence(y.reshape(4, 9, 64), alone(lambda r: r @ w, x))


def test_quantized_linear_and_tied_head_per_sequence():
    layer = nn.QuantizedLinear.from_linear(nn.Linear(256, 128, bias=False), group_size=64, bits=4)
    x = batch(1, (4, 7, 256))
    assert equal_per_sequence(rows.linear(layer, x), alone(layer, x))
    emb = nn.Embedding(300, 256)
    assert equal_per_sequence(rows.as_linear(emb, x), alone(emb.as_linear, x))
    w = batch(2, (256, 96))
    assert equal_per_sequence(rows.matmul(x, w), alone(lambda s: s @ w, x))


def test_per_sequence_rows():
    assert rows.per_sequence(12, 3) == 4
    with pytest.raises(ValueError, match="13 rows do not split into 3 equal sequences"):
        rows.per_sequence(13, 3)


@pytest.mark.parametrize("mode", ["", "each", "gather"], ids=["by-count", "by-expert", "gather"])
def test_routed_experts_per_sequence(monkeypatch, mode):
    """Experts given a batch of sequences (``sequences``) compute each as alone,
    through every CPU kernel (DLM_CPU_EXPERTS)."""
    from dlm.runtime.models.cpu import experts as cpu_experts
    from dlm.runtime.models.diffusion_gemma import ModelArgs
    from dlm.runtime.models.diffusion_gemma.layers import Experts
    from dlm.runtime.models.llada2_moe.model import SwitchGLU
    from tests.builders import DG_TEXT

    monkeypatch.setattr(cpu_experts, "GROUPED_MIN_WEIGHT", 1)
    monkeypatch.setattr(cpu_experts, "GROUPED_MIN_ROWS_PER_EXPERT", 1)
    monkeypatch.setenv("DLM_CPU_EXPERTS", mode)
    args = ModelArgs.from_config({"model_type": "diffusion_gemma_text", **DG_TEXT})
    experts, glu = Experts(args), SwitchGLU(64, 48, 4)
    from mlx.utils import tree_flatten

    for module in (experts, glu):
        module.load_weights([(k, batch(i, v.shape) * 0.1) for i, (k, v) in enumerate(tree_flatten(module.parameters()))])
    x = batch(5, (3 * 7, 64))
    idx = mx.array(np.random.default_rng(6).integers(0, 4, (3 * 7, 2)).astype(np.int32))
    w = mx.softmax(batch(7, (3 * 7, 2)), -1)
    got = experts(x, idx, w, 3)
    want = [experts(x[i * 7:(i + 1) * 7], idx[i * 7:(i + 1) * 7], w[i * 7:(i + 1) * 7]) for i in range(3)]
    assert np.array_equal(np.array(got), np.concatenate([np.array(a) for a in want]))
    got = glu(x, idx, 3)
    want = [glu(x[i * 7:(i + 1) * 7], idx[i * 7:(i + 1) * 7]) for i in range(3)]
    assert np.array_equal(np.array(got), np.concatenate([np.array(a) for a in want]))

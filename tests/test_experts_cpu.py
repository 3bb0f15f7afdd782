"""The CPU expert kernels: grouped (one dense matmul per expert) and dense (every
token through all the experts at once) equal gather_mm."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dlm.runtime.models import switch


def _random(module, seed=0):
    from mlx.utils import tree_flatten

    rng = np.random.default_rng(seed)
    module.load_weights([(n, mx.array(rng.standard_normal(v.shape).astype(np.float32) * 0.05))
                         for n, v in tree_flatten(module.parameters())])


def _routing(rows, experts, k, seed=1):
    rng = np.random.default_rng(seed)
    idx = np.argsort(-rng.standard_normal((rows, experts)), axis=1)[:, :k].astype(np.int32)
    idx[: rows // 2, 0] = 0  # a crowded expert
    return mx.array(idx)


def _both(monkeypatch, fn):
    monkeypatch.setenv("DLM_CPU_EXPERTS", "gather")
    want = np.array(fn())
    monkeypatch.delenv("DLM_CPU_EXPERTS")
    return np.array(fn()), want


@pytest.fixture
def small_experts_grouped(monkeypatch):
    """The tiny test experts take the grouped path (its size floor is for speed, not correctness)."""
    monkeypatch.setattr(switch, "GROUPED_MIN_WEIGHT", 1)


def test_policy(monkeypatch):
    layer = switch.SwitchLinear(1024, 1024, 4)
    assert switch.grouped(6 * 4, 4, layer) == (mx.default_device() == mx.cpu)
    assert not switch.grouped(6 * 4 - 1, 4, layer)
    assert not switch.grouped(10_000, 4, switch.SwitchLinear(256, 256, 4))  # small: one fused gather_mm
    monkeypatch.setenv("DLM_CPU_EXPERTS", "gather")
    assert not switch.grouped(10_000, 4, layer)


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the grouped kernel is the CPU backend's")
def test_diffusion_gemma_experts_grouped_equal_gather(monkeypatch, small_experts_grouped):
    from dlm.runtime.models.diffusion_gemma import ModelArgs
    from dlm.runtime.models.diffusion_gemma.layers import Experts
    from tests.builders import DG_TEXT

    args = ModelArgs.from_config({"model_type": "diffusion_gemma_text", **DG_TEXT})
    experts = Experts(args)
    _random(experts)
    x = mx.array(np.random.default_rng(2).standard_normal((64, args.hidden_size)).astype(np.float32))
    idx = _routing(64, args.num_experts, args.top_k_experts)
    w = mx.softmax(mx.array(np.random.default_rng(3).standard_normal((64, 2)).astype(np.float32)), -1)
    assert switch.grouped(idx.size, args.num_experts, experts.gate_up_proj)
    got, want = _both(monkeypatch, lambda: experts(x, idx, w))
    assert np.abs(got - want).max() < 1e-5 and np.abs(want).max() > 1e-2


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the grouped kernel is the CPU backend's")
def test_llada2_switch_glu_grouped_equal_gather(monkeypatch, small_experts_grouped):
    from dlm.runtime.models.llada2_moe.model import SwitchGLU

    glu = SwitchGLU(32, 16, 8)
    _random(glu)
    x = mx.array(np.random.default_rng(4).standard_normal((40, 32)).astype(np.float32))
    idx = _routing(40, 8, 2)
    got, want = _both(monkeypatch, lambda: glu(x, idx))
    assert got.shape == (40, 2, 32)
    assert np.abs(got - want).max() < 1e-5 and np.abs(want).max() > 1e-3


def test_dense_policy(monkeypatch):
    small = switch.SwitchLinear(256, 64, 32)  # 524288 elements: the LLaDA-2 small geometry
    on_cpu = mx.default_device() == mx.cpu
    assert switch.dense(32, small) == on_cpu and not switch.dense(31, small)
    assert not switch.dense(10_000, switch.SwitchLinear(2048, 512, 8))  # 8M: big experts gather or group
    monkeypatch.setenv("DLM_CPU_EXPERTS", "gather")
    assert not switch.dense(10_000, small)


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the dense kernel is the CPU backend's")
def test_llada2_moe_dense_equals_gather(monkeypatch):
    """The routed experts' weighted sum through all the experts at once equals the
    gather_mm sum, for two sequences of 40 positions (each multiplied on its own)."""
    from dlm.runtime.models.llada2_moe.config import ModelArgs
    from dlm.runtime.models.llada2_moe.model import SparseMoe
    from tests.builders import llada2_hub_config

    args = ModelArgs.from_config(llada2_hub_config())
    moe = SparseMoe(args)
    _random(moe)
    moe.gate.expert_bias = mx.zeros_like(moe.gate.expert_bias)
    x = mx.array(np.random.default_rng(5).standard_normal((2, 40, args.hidden_size)).astype(np.float32))
    sw = moe.switch_mlp
    assert switch.dense(40, sw.gate_proj, sw.up_proj, sw.down_proj)
    got, want = _both(monkeypatch, lambda: moe(x))
    assert got.shape == (2, 40, args.hidden_size)
    assert np.abs(got - want).max() < 1e-5 and np.abs(want).max() > 1e-3
    alone = np.array(moe(x[1:]))  # a sequence alone: the very numbers it gets in the batch
    assert np.array_equal(alone[0], got[1])


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the grouped kernel is the CPU backend's")
def test_decoder_pass_grouped_equal_gather(monkeypatch, tiny_dg_mlx_dir, small_experts_grouped):
    """A whole compiled decoder pass whose experts run grouped (canvas 64 x top-2 over 4 experts)."""
    from dlm.runtime import api

    def logits():
        loaded = api.load(tiny_dg_mlx_dir)  # a fresh model: compiled pieces follow the policy
        experts = loaded.model.layers[0].experts
        assert switch.grouped(64 * 2, 4, experts.gate_up_proj, experts.down_proj) == experts.eager
        cache = loaded.model.make_cache()
        loaded.model.prefill(list(range(3, 40)), cache)
        return loaded.model.decode(mx.array(np.arange(64, dtype=np.int32) % 300 + 3), cache)

    got, want = _both(monkeypatch, logits)
    assert np.abs(got - want).max() < 1e-4
    assert switch.cpu_float_experts(switch.SwitchLinear(8, 8, 4))  # the default run was grouped

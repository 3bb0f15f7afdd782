"""The CPU expert kernels equal gather_mm: stacked by copy count (float experts:
one GEMM per expert), one expert at a time (experts dequantized per call) and
dense (every token through all the experts at once)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dlm.runtime.models import switch
from dlm.runtime.models.cpu import experts as cpu_experts


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


def _both(monkeypatch, fn, mode=""):
    """``fn()`` under DLM_CPU_EXPERTS=``mode`` ("": the default kernels) and under gather_mm."""
    monkeypatch.setenv("DLM_CPU_EXPERTS", "gather")
    want = np.array(fn())
    monkeypatch.setenv("DLM_CPU_EXPERTS", mode)
    return np.array(fn()), want


MODES = pytest.mark.parametrize("mode", ["", "each"], ids=["by-count", "by-expert"])


@pytest.fixture
def small_experts_grouped(monkeypatch):
    """The tiny test experts take the CPU's own kernels (their size floor is for speed, not correctness)."""
    monkeypatch.setattr(cpu_experts, "GROUPED_MIN_WEIGHT", 1)


def test_policy(monkeypatch):
    layer = switch.SwitchLinear(1024, 1024, 4)
    on_cpu = mx.default_device() == mx.cpu
    assert cpu_experts.stacks(layer) == on_cpu and not cpu_experts.grouped(10_000, 4, layer)
    assert not cpu_experts.stacks(switch.SwitchLinear(256, 256, 4))  # small: one fused gather_mm
    monkeypatch.setenv("DLM_CPU_EXPERTS", "each")  # float experts one at a time, as before by_count
    assert not cpu_experts.stacks(layer)
    assert cpu_experts.grouped(6 * 4, 4, layer) == on_cpu and not cpu_experts.grouped(6 * 4 - 1, 4, layer)
    monkeypatch.setenv("DLM_CPU_EXPERTS", "gather")
    assert not cpu_experts.stacks(layer) and not cpu_experts.grouped(10_000, 4, layer)


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the grouped kernels are the CPU backend's")
@MODES
def test_diffusion_gemma_experts_grouped_equal_gather(monkeypatch, small_experts_grouped, mode):
    from dlm.runtime.models.diffusion_gemma import ModelArgs
    from dlm.runtime.models.diffusion_gemma.layers import Experts
    from tests.builders import DG_TEXT

    args = ModelArgs.from_config({"model_type": "diffusion_gemma_text", **DG_TEXT})
    experts = Experts(args)
    _random(experts)
    x = mx.array(np.random.default_rng(2).standard_normal((64, args.hidden_size)).astype(np.float32))
    idx = _routing(64, args.num_experts, args.top_k_experts)
    w = mx.softmax(mx.array(np.random.default_rng(3).standard_normal((64, 2)).astype(np.float32)), -1)
    monkeypatch.setenv("DLM_CPU_EXPERTS", mode)
    assert cpu_experts.stacks(experts.gate_up_proj, experts.down_proj) == (mode == "")
    assert cpu_experts.grouped(idx.size, args.num_experts, experts.gate_up_proj) == (mode == "each")
    got, want = _both(monkeypatch, lambda: experts(x, idx, w), mode)
    assert np.abs(got - want).max() < 1e-5 and np.abs(want).max() > 1e-2


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the grouped kernels are the CPU backend's")
@MODES
def test_llada2_switch_glu_grouped_equal_gather(monkeypatch, small_experts_grouped, mode):
    from dlm.runtime.models.llada2_moe.model import SwitchGLU

    glu = SwitchGLU(32, 16, 8)
    _random(glu)
    x = mx.array(np.random.default_rng(4).standard_normal((40, 32)).astype(np.float32))
    idx = _routing(40, 8, 2)
    got, want = _both(monkeypatch, lambda: glu(x, idx), mode)
    assert got.shape == (40, 2, 32)
    assert np.abs(got - want).max() < 1e-5 and np.abs(want).max() > 1e-3


def test_dense_policy(monkeypatch):
    small = switch.SwitchLinear(256, 64, 32)  # 524288 elements: the LLaDA-2 small geometry
    on_cpu = mx.default_device() == mx.cpu
    assert cpu_experts.dense(32, small) == on_cpu and not cpu_experts.dense(31, small)
    assert not cpu_experts.dense(10_000, switch.SwitchLinear(2048, 512, 8))  # 8M: big experts gather or group
    monkeypatch.setenv("DLM_CPU_EXPERTS", "gather")
    assert not cpu_experts.dense(10_000, small)


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
    assert cpu_experts.dense(40, sw.gate_proj, sw.up_proj, sw.down_proj)
    got, want = _both(monkeypatch, lambda: moe(x))
    assert got.shape == (2, 40, args.hidden_size)
    assert np.abs(got - want).max() < 1e-5 and np.abs(want).max() > 1e-3
    alone = np.array(moe(x[1:]))  # a sequence alone: the very numbers it gets in the batch
    assert np.array_equal(alone[0], got[1])


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the grouped kernel is the CPU backend's")
def test_decoder_pass_grouped_equal_gather(monkeypatch, tiny_dg_mlx_dir, small_experts_grouped):
    """A whole compiled decoder pass whose experts run by copy count (canvas 64 x top-2 over 4 experts)."""
    from dlm.runtime import api

    def logits():
        loaded = api.load(tiny_dg_mlx_dir)  # a fresh model: compiled pieces follow the policy
        experts = loaded.model.layers[0].experts
        assert cpu_experts.stacks(experts.gate_up_proj, experts.down_proj) == experts.eager
        cache = loaded.model.make_cache()
        loaded.model.prefill(list(range(3, 40)), cache)
        return loaded.model.decode(mx.array(np.arange(64, dtype=np.int32) % 300 + 3), cache)

    got, want = _both(monkeypatch, logits)
    assert np.abs(got - want).max() < 1e-4
    assert cpu_experts.cpu_float_experts(switch.SwitchLinear(8, 8, 4))  # the default run was by_count


@pytest.mark.parametrize("spread", [False, True], ids=["one-stream", "spread"])
def test_by_expert_runs_each_sequence_as_alone_and_each_expert_once(spread):
    """A batch of sequences through ``by_expert``: every sequence gets the bits it
    gets alone (its own sort, its own GEMM per expert), the result is the float64
    math, and each expert's weight is taken once for the whole batch (one
    ``expert_fn`` call holding every sequence's rows), experts in ascending order,
    including experts only some sequences route to."""
    rng = np.random.default_rng(3)
    E, K, n, H, O, S = 6, 2, 10, 16, 12, 3
    w = mx.array(rng.standard_normal((E, O, H)).astype(np.float32))
    x = mx.array(rng.standard_normal((S * n, H)).astype(np.float32))
    idx = np.argsort(-rng.standard_normal((S * n, E)), axis=1)[:, :K].astype(np.int32)
    idx[n:2 * n] = np.where(idx[n:2 * n] == 5, 0, idx[n:2 * n])  # sequence 1 never routes to expert 5
    idx[2 * n:, 0] = 4  # sequence 2 crowds expert 4
    idx = np.where((idx == 3) & (np.arange(S * n)[:, None] < n), 1, idx)  # sequence 0 skips expert 3
    idx = mx.array(idx)
    calls = []

    def expert_fn(e, blocks):
        calls.append((e, [b.shape[0] for b in blocks]))
        return [switch.project(b, w[e]) for b in blocks]

    got = cpu_experts.by_expert(x, idx, E, expert_fn, spread, sequences=S)
    assert [e for e, _ in calls] == sorted({int(e) for e in np.array(idx).ravel()})
    assert sum(sum(sizes) for _, sizes in calls) == S * n * K
    per_sequence = [np.bincount(np.array(idx)[s * n:(s + 1) * n].ravel(), minlength=E) for s in range(S)]
    assert per_sequence[1][5] == 0 and per_sequence[0][3] == 0 and per_sequence[2][4] >= n
    assert all(sizes == [int(c[e]) for c in per_sequence if c[e]] for e, sizes in calls)
    want = np.einsum("nh,nkoh->nko", np.array(x).astype(np.float64), np.array(w).astype(np.float64)[np.array(idx)])
    assert np.abs(np.array(got) - want).max() < 1e-4
    for s in range(S):
        alone = cpu_experts.by_expert(x[s * n:(s + 1) * n], idx[s * n:(s + 1) * n], E, expert_fn, spread)
        assert mx.array_equal(alone, got[s * n:(s + 1) * n])


def test_by_count_runs_each_sequence_as_alone_one_op_per_count():
    """A batch of sequences through ``by_count``: one ``stack_fn`` call per number
    of copies an expert got in a sequence, holding every (sequence, expert) group
    with that count, experts in ascending order and each expert's groups
    adjacent; the result is the float64 math, and every sequence gets the bits it
    gets alone."""
    rng = np.random.default_rng(4)
    E, K, n, H, O, S = 6, 2, 10, 16, 12, 3
    w = mx.array(rng.standard_normal((E, O, H)).astype(np.float32))
    x = mx.array(rng.standard_normal((S * n, H)).astype(np.float32))
    idx = np.argsort(-rng.standard_normal((S * n, E)), axis=1)[:, :K].astype(np.int32)
    idx[2 * n:, 0] = 4  # sequence 2 crowds expert 4
    idx = mx.array(idx)
    calls = []

    def stack_fn(rows, experts):
        calls.append((rows.shape[:2], np.array(experts).tolist()))
        return mx.gather_mm(rows, w.swapaxes(-1, -2), rhs_indices=experts)

    got = cpu_experts.by_count(x, idx, stack_fn, sequences=S)
    counts = [np.bincount(np.array(idx)[s * n:(s + 1) * n].ravel(), minlength=E) for s in range(S)]
    per_count = {}
    for s in range(S):
        for e in np.flatnonzero(counts[s]):
            per_count.setdefault(int(counts[s][e]), []).append(int(e))
    assert [c for (_, c), _ in calls] == sorted(per_count) and max(per_count) >= n
    assert all(experts == sorted(per_count[c]) and g == len(experts) for (g, c), experts in calls)
    want = np.einsum("nh,nkoh->nko", np.array(x).astype(np.float64), np.array(w).astype(np.float64)[np.array(idx)])
    assert np.abs(np.array(got) - want).max() < 1e-4
    for s in range(S):
        alone = cpu_experts.by_count(x[s * n:(s + 1) * n], idx[s * n:(s + 1) * n], stack_fn)
        assert mx.array_equal(alone, got[s * n:(s + 1) * n])

"""Quantized weights dequantized per call on the CPU backend
(dlm.runtime.models.cpu.dequant): each piece equals float64 math on the
dequantized weight, a batch equals its sequences alone to the last bit, the
loader picks the policy, and whole 4-bit models of both families pass
dlm-verify's implementation check (the transformers / PyTorch reference fed
the same dequantized weights) with every per-call path exercised."""

from __future__ import annotations

import numpy as np
import pytest

from dlm.runtime import api  # before MLX: dlm.runtime loads the optimized BLAS ahead of it

import mlx.core as mx  # noqa: E402  (isort: skip)
import mlx.nn as nn  # noqa: E402
from dlm.runtime.platform.errors import ConfigError  # noqa: E402
from dlm.runtime.models import rows, switch
from dlm.runtime.models.cpu import dequant as quantized  # noqa: E402
from dlm.runtime.models.cpu import experts as cpu_experts  # noqa: E402
from tests.builders import convert_dir, record_bundle, verify_options  # noqa: E402

pytestmark = pytest.mark.skipif(mx.default_device() != mx.cpu, reason="a CPU-backend compute path")


def _float64(module) -> np.ndarray:
    w = mx.dequantize(module["weight"], module["scales"], module.get("biases"), group_size=module.group_size,
                      bits=module.bits, mode=module.mode)
    return np.array(w.astype(mx.float32)).astype(np.float64)


@pytest.fixture
def small_slices(monkeypatch):
    """Pieces of 4 KiB: every weight here is cut into several slices."""
    monkeypatch.setattr(quantized, "SLICE_BYTES", 4096)


def _marked(module):
    quantized.mark(module)
    assert quantized.per_call(module)
    return module


def test_a_linear_and_a_tied_head_equal_float64_math(small_slices):
    rng = np.random.default_rng(0)
    lin = nn.Linear(128, 40, bias=True)
    lin.weight = mx.array(rng.normal(size=(40, 128)).astype(np.float32))
    lin.bias = mx.array(rng.normal(size=(40,)).astype(np.float32))
    q = _marked(nn.QuantizedLinear.from_linear(lin, group_size=32, bits=4))
    assert len(quantized._slices(q)) > 2
    x = mx.array(rng.normal(size=(3, 9, 128)).astype(np.float32))
    y = rows.linear(q, x)
    want = np.array(x).astype(np.float64) @ _float64(q).T + np.array(q["bias"])
    assert y.dtype == mx.float32 and np.abs(np.array(y) - want).max() < 1e-4
    # Each sequence of the batch gets its own GEMM: the very numbers it gets alone.
    for b in range(3):
        assert mx.array_equal(y[b], rows.linear(q, x[b]))
    emb = nn.Embedding(96, 64)
    emb.weight = mx.array(rng.normal(size=(96, 64)).astype(np.float32))
    qe = _marked(nn.QuantizedEmbedding.from_embedding(emb, group_size=32, bits=8))
    h = mx.array(rng.normal(size=(2, 7, 64)).astype(np.float32))
    out = rows.as_linear(qe, h)
    assert np.abs(np.array(out) - np.array(h).astype(np.float64) @ _float64(qe).T).max() < 1e-4
    assert mx.array_equal(out[1], rows.as_linear(qe, h[1]))
    # Self-conditioning's p @ W: vocabulary slices summed.
    p = mx.softmax(mx.array(rng.normal(size=(2, 5, 96)).astype(np.float32)), axis=-1)
    s = rows.embedding_matmul(qe, p)
    assert np.abs(np.array(s) - np.array(p).astype(np.float64) @ _float64(qe)).max() < 1e-5
    assert mx.array_equal(s[0], rows.embedding_matmul(qe, p[0]))


def test_few_rows_keep_the_kernel():
    rng = np.random.default_rng(1)
    lin = nn.Linear(64, 32, bias=False)
    q = _marked(nn.QuantizedLinear.from_linear(lin, group_size=32, bits=4))
    x = mx.array(rng.normal(size=(1, quantized.MIN_ROWS - 1, 64)).astype(np.float32))
    assert not quantized.wants(q, x)
    kernel = mx.quantized_matmul(x, q["weight"], q["scales"], q["biases"], transpose=True, group_size=32, bits=4)
    assert mx.array_equal(rows.linear(q, x), kernel)


def test_one_expert_equals_float64_math():
    rng = np.random.default_rng(2)
    layer = switch.SwitchLinear(64, 48, 4)
    layer.weight = mx.array(rng.normal(size=(4, 48, 64)).astype(np.float32))
    q = _marked(layer.to_quantized(group_size=32, bits=4))
    x = mx.array(rng.normal(size=(6, 64)).astype(np.float32))
    w = mx.dequantize(q["weight"][2], q["scales"][2], q["biases"][2], group_size=32, bits=4)
    want = np.array(x).astype(np.float64) @ np.array(w).astype(np.float64).T
    assert np.abs(np.array(switch.project(x, q.expert_weight(2))) - want).max() < 1e-4


def test_experts_dequantized_per_call_run_grouped(monkeypatch):
    layer = switch.SwitchLinear(64, 48, 4)
    monkeypatch.setattr(cpu_experts, "GROUPED_MIN_WEIGHT", 64 * 48)  # the unpacked size, not the packed one
    kernels = layer.to_quantized(group_size=32, bits=4)
    assert cpu_experts.cpu_float_experts(layer) and not cpu_experts.cpu_float_experts(kernels)
    assert cpu_experts.cpu_float_experts(_marked(kernels))
    assert cpu_experts.grouped(6 * 4, 4, kernels) and not cpu_experts.grouped(6 * 4 - 1, 4, kernels)


@pytest.fixture(scope="module")
def q4(tiny_dg_q4_dir, tiny_llada2_mlx_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("q4_per_call")
    return {"diffusion_gemma": tiny_dg_q4_dir,
            "llada2_moe": convert_dir(tiny_llada2_mlx_dir.parent / "hf", root / "llada2", quantize=True,
                                      q_bits=4)}


def test_the_loader_picks_the_policy(q4, monkeypatch):
    loaded = api.load(q4["diffusion_gemma"])  # auto, tiny: the float32 weights fit, dequantized at load
    assert loaded.dequantized > 0 and loaded.per_call == 0
    monkeypatch.setenv("DLM_CPU_DEQUANTIZE", "call")
    loaded = api.load(q4["diffusion_gemma"])
    marked = [name for name, m in loaded.model.named_modules() if quantized.per_call(m)]
    assert loaded.dequantized == 0 and loaded.per_call == len(marked) > 0
    assert any(name.endswith("embed_tokens") for name in marked) and any("experts" in n for n in marked)
    assert api.load(q4["diffusion_gemma"], compute_dtype="native").per_call == 0  # native keeps the kernels
    monkeypatch.setenv("DLM_CPU_DEQUANTIZE", "kernels")
    loaded = api.load(q4["diffusion_gemma"])
    assert loaded.dequantized == 0 and loaded.per_call == 0
    monkeypatch.setenv("DLM_CPU_DEQUANTIZE", "sometimes")
    with pytest.raises(ConfigError, match="DLM_CPU_DEQUANTIZE='sometimes'"):
        api.load(q4["diffusion_gemma"])


@pytest.fixture
def per_call_everywhere(monkeypatch):
    """Per-call dequantization with grouped experts and sliced heads, counted by kind."""
    monkeypatch.setenv("DLM_CPU_DEQUANTIZE", "call")
    monkeypatch.setattr(cpu_experts, "GROUPED_MIN_WEIGHT", 1)
    monkeypatch.setattr(cpu_experts, "GROUPED_MIN_ROWS_PER_EXPERT", 1)
    monkeypatch.setattr(quantized, "SLICE_BYTES", 1 << 14)
    kinds = []
    real = quantized.dequantized

    def counted(module, start=None, stop=None, expert=None, after=None):
        kinds.append("expert" if expert is not None else "slice" if start is not None else "whole")
        return real(module, start, stop, expert, after)

    monkeypatch.setattr(quantized, "dequantized", counted)
    return kinds


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("family", ["diffusion_gemma", "llada2_moe"])
def test_a_4bit_model_dequantized_per_call_passes_the_implementation_check(q4, family, per_call_everywhere):
    pytest.importorskip("torch")
    from dlm.verify.suite import run_parity

    # local=False: the layer-local row (a second MLX load fed the reference's
    # layer inputs) is not what this test checks; the implementation check is.
    report = run_parity(q4[family], verify_options(local=False))
    impl = report.check("implementation")
    assert impl.status == "pass", report.table()
    assert impl.metrics["max_abs"] < 1e-4 and impl.metrics["top1"] == 1.0  # float32-exact, same weights
    assert report.check("commit_stream").metrics["identical_fraction"] == 1.0
    assert {"expert", "slice"} <= set(per_call_everywhere)  # grouped experts and the sliced head ran


def test_a_batch_dequantized_per_call_equals_each_request_alone(q4, per_call_everywhere):
    from tests.diffusion_gemma.test_batch import LONG, SHORT, assert_step_logits_equal_solo

    loaded = api.load(q4["diffusion_gemma"])
    assert loaded.per_call > 0
    prompts = [SHORT, LONG, SHORT[:5]]
    options = [{"max_tokens": 12, "max_denoising_steps": 2, "seed": i, "diffusion_max_canvas_length": n,
                "diffusion_min_canvas_length": 2} for i, n in enumerate([5, 7, 5])]
    assert_step_logits_equal_solo(loaded, prompts, options)
    assert {"expert", "slice"} <= set(per_call_everywhere)


def test_a_llada2_batch_shares_its_heads_dequantization(q4, per_call_everywhere, monkeypatch):
    """LLaDA-2's requests run their heads on their own masked rows: in a batch
    each head slice is still dequantized once a step for all of them, and each
    request gets what it gets alone."""
    from tests.llada2_moe.test_batch import PROMPTS, summary

    loaded = api.load(q4["llada2_moe"])
    head = loaded.model.lm_head
    assert quantized.per_call(head)
    reads = []
    real = quantized.dequantized  # the fixture's counter

    def counted(module, *args, **kwargs):
        reads.append(module is head)
        return real(module, *args, **kwargs)

    monkeypatch.setattr(quantized, "dequantized", counted)
    prompts = PROMPTS[:3]
    options = [{"max_tokens": 24, "seed": i, "block_length": 8, "temp": 0.5} for i in range(3)]
    want = [summary(api.generate(loaded, p, o)) for p, o in zip(prompts, options)]
    alone = sum(reads)
    reads.clear()
    assert [summary(r) for r in api.generate_batch(loaded, prompts, options)] == want
    assert 0 < sum(reads) < 0.75 * alone

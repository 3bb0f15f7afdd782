"""DiffusionGemma MLX forward passes against transformers 5.24 (the reference).

float32 logits must agree within 1e-4 (max abs) for: prefill then a decoder
step, with and without self-conditioning, a prompt longer than the sliding
window, and the second canvas after a commit. bfloat16 must run on the CPU
backend (float32 expert fallback) and stay within bf16 noise of transformers'
bf16 model; quantized models must agree with their dequantized float twins.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from dlm.runtime import api
from tests.builders import convert_dir, dequantized_twin, load_diffusion_gemma_hf

SHORT = list(range(2, 14))  # 12 tokens < sliding window 16
LONG = [2] + [(7 * i + 3) % 500 + 5 for i in range(39)]  # 40 tokens > window 16
CANVAS = [5, 9, 33, 400, 7, 8, 100, 3]
CANVAS2 = [11, 12, 13, 140, 15, 16, 17, 511]
TOL = 1e-4


def hf_logits(model, prompt: list[int], canvases: list[list[int]], sc_logits=None):
    """transformers: prefill ``prompt``; encode all but the last of ``canvases`` as commits at
    their positions; return the decoder logits of the last canvas (numpy [L, V])."""
    import torch
    from transformers import DynamicCache

    with torch.no_grad():
        cache = DynamicCache(config=model.config.get_text_config(decoder=True))
        ids = torch.tensor([prompt])
        pos = torch.arange(len(prompt))[None]
        model.model.encoder(input_ids=ids, cache=cache, position_ids=pos)
        cur = len(prompt)
        for c in canvases[:-1]:
            pos = torch.arange(cur, cur + len(c))[None]
            model.model.encoder(input_ids=torch.tensor([c]), cache=cache, position_ids=pos)
            cur += len(c)
        last = canvases[-1]
        sc = None if sc_logits is None else torch.tensor(np.asarray(sc_logits))[None]
        out = model(decoder_input_ids=torch.tensor([last]), cache=cache, self_conditioning_logits=sc,
                    decoder_position_ids=torch.arange(cur, cur + len(last))[None])
        return out.logits[0].float().numpy()


@pytest.fixture(scope="module")
def loaded(tiny_dg_mlx_dir):
    return api.load(tiny_dg_mlx_dir)


def mlx_logits(loaded, prompt, canvases, sc=None, chunk=2048):
    model = loaded.model
    cache = model.make_cache()
    model.prefill(prompt, cache, chunk)
    for c in canvases[:-1]:
        model.encode(c, cache)
    out = model.decode(canvases[-1], cache, None if sc is None else mx.array(sc))
    assert out.dtype == mx.float32
    return np.array(out)[0]


@pytest.mark.parametrize("prompt", [SHORT, LONG], ids=["short", "longer-than-window"])
def test_prefill_then_decoder_step(loaded, tiny_dg_torch, prompt):
    ref = hf_logits(tiny_dg_torch, prompt, [CANVAS])
    got = mlx_logits(loaded, prompt, [CANVAS])
    assert got.shape == ref.shape == (len(CANVAS), 512)
    assert np.abs(got - ref).max() < TOL


@pytest.mark.parametrize("prompt", [SHORT, LONG], ids=["short", "longer-than-window"])
def test_decoder_step_with_self_conditioning(loaded, tiny_dg_torch, prompt):
    # Self-conditioning input = a previous step's processed logits (T = 0.6).
    sc = (hf_logits(tiny_dg_torch, prompt, [CANVAS2]) / np.float32(0.6)).astype(np.float32)
    ref = hf_logits(tiny_dg_torch, prompt, [CANVAS], sc)
    got = mlx_logits(loaded, prompt, [CANVAS], sc)
    assert np.abs(got - ref).max() < TOL
    # and self-conditioning really changes the output
    assert np.abs(ref - hf_logits(tiny_dg_torch, prompt, [CANVAS])).max() > 1e-2


@pytest.mark.parametrize("prompt", [SHORT, LONG], ids=["short", "longer-than-window"])
def test_second_canvas_after_commit(loaded, tiny_dg_torch, prompt):
    ref = hf_logits(tiny_dg_torch, prompt, [CANVAS, CANVAS2])
    got = mlx_logits(loaded, prompt, [CANVAS, CANVAS2])
    assert np.abs(got - ref).max() < TOL


def test_chunked_prefill_is_exact(loaded, tiny_dg_torch):
    # Chunks smaller than the window and not aligned with it.
    ref = hf_logits(tiny_dg_torch, LONG, [CANVAS, CANVAS2])
    got = mlx_logits(loaded, LONG, [CANVAS, CANVAS2], chunk=7)
    assert np.abs(got - ref).max() < TOL


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the grouped kernels are the CPU backend's")
@pytest.mark.parametrize("mode", ["", "each"], ids=["by-count", "by-expert"])
def test_cpu_expert_kernels_match_transformers(tiny_dg_mlx_dir, tiny_dg_torch, monkeypatch, mode):
    """The tiny experts through the CPU's own kernels (their size floor lowered),
    prefill, a committed canvas and a decoder step, against transformers."""
    from dlm.runtime.models.cpu import experts as cpu_experts

    monkeypatch.setattr(cpu_experts, "GROUPED_MIN_WEIGHT", 1)
    monkeypatch.setattr(cpu_experts, "GROUPED_MIN_ROWS_PER_EXPERT", 1)
    monkeypatch.setenv("DLM_CPU_EXPERTS", mode)
    fresh = api.load(tiny_dg_mlx_dir)  # compiled pieces follow the policy of their first use
    experts = fresh.model.layers[0].experts
    assert cpu_experts.stacks(experts.gate_up_proj, experts.down_proj) == (mode == "")
    assert cpu_experts.grouped(len(CANVAS), experts.gate_up_proj["weight"].shape[0],
                               experts.gate_up_proj) == (mode == "each")
    ref = hf_logits(tiny_dg_torch, LONG, [CANVAS, CANVAS2])
    assert np.abs(mlx_logits(fresh, LONG, [CANVAS, CANVAS2]) - ref).max() < TOL


def test_sliding_cache_keeps_window_minus_one(loaded):
    cache = loaded.model.make_cache()
    loaded.model.prefill(LONG, cache)
    window = loaded.args.sliding_window
    for kind, c in zip(loaded.args.layer_types, cache):
        assert c.offset == len(LONG)
        assert c.length == (window - 1 if kind == "sliding_attention" else len(LONG))


def test_resaved_config_form(tiny_dg_torch, tmp_path):
    """A checkpoint written by save_pretrained (per_layer_config) loads and matches."""
    from tests.builders import build_diffusion_gemma

    src = tmp_path / "resaved"
    build_diffusion_gemma(src, form="resaved")
    assert "per_layer_config" in json.loads((src / "config.json").read_text())["text_config"]
    model = api.load(convert_dir(src, tmp_path / "mlx"))
    ref = hf_logits(load_diffusion_gemma_hf(src), SHORT, [CANVAS])
    assert np.abs(mlx_logits(model, SHORT, [CANVAS]) - ref).max() < TOL


def test_hf_directory_loads_as_is(tiny_dg_dir, tiny_dg_torch):
    """sanitize maps HF names (fused experts without .weight, lm_head, encoder copies, vision)."""
    model = api.load(tiny_dg_dir)
    ref = hf_logits(tiny_dg_torch, SHORT, [CANVAS])
    assert np.abs(mlx_logits(model, SHORT, [CANVAS]) - ref).max() < TOL


def test_bfloat16_runs_on_cpu_within_bf16_noise(tiny_dg_dir, tiny_dg_torch, tmp_path):
    bf16 = api.load(convert_dir(tiny_dg_dir, tmp_path / "bf16", dtype="bfloat16"), compute_dtype="native")
    assert bf16.model.dtype == mx.bfloat16 and bf16.compute_dtype == "bfloat16" and not bf16.upcast
    got = mlx_logits(bf16, LONG, [CANVAS, CANVAS2])
    ref_bf16 = hf_logits(load_diffusion_gemma_hf(tiny_dg_dir, "bfloat16"), LONG, [CANVAS, CANVAS2])
    ref_f32 = hf_logits(tiny_dg_torch, LONG, [CANVAS, CANVAS2])
    noise = np.abs(ref_bf16 - ref_f32).max()  # what bf16 rounding alone does
    assert 0 < np.abs(got - ref_bf16).max() <= 3 * noise
    assert (got.argmax(-1) == ref_bf16.argmax(-1)).mean() >= 0.75


QUANT = {
    "affine4-mixed": dict(quantize=True, q_bits=4),
    "affine8": dict(quantize=True, q_bits=8, recipe="uniform"),
    "mxfp4": dict(quantize=True, q_mode="mxfp4"),
    "nvfp4": dict(quantize=True, q_mode="nvfp4"),
}


@pytest.mark.parametrize("name", list(QUANT))
def test_quantized_agrees_with_dequantized_twin(tiny_dg_dir, tmp_path, name):
    qdir = convert_dir(tiny_dg_dir, tmp_path / name, **QUANT[name])
    quant = api.load(qdir, compute_dtype="float32")  # MLX's quantized kernels
    kinds = {type(m).__name__ for _, m in quant.model.named_modules()}
    assert {"QuantizedLinear", "QuantizedSwitchLinear", "QuantizedEmbedding"} <= kinds
    dequantized = api.load(qdir)  # the CPU default: dequantized at load when it fits
    assert dequantized.dequantized and "QuantizedLinear" not in {type(m).__name__ for _, m in
                                                                   dequantized.model.named_modules()}
    twin = api.load(dequantized_twin(qdir, tmp_path / f"{name}-twin"))
    assert "QuantizedLinear" not in {type(m).__name__ for _, m in twin.model.named_modules()}
    sc = np.random.default_rng(0).normal(size=(len(CANVAS), 512)).astype(np.float32) * 3
    for canvases, s in (([CANVAS], None), ([CANVAS, CANVAS2], sc)):
        b = mlx_logits(twin, LONG, canvases, s)
        assert np.abs(mlx_logits(quant, LONG, canvases, s) - b).max() < 1e-4
        assert np.abs(mlx_logits(dequantized, LONG, canvases, s) - b).max() < 1e-4


def test_bfloat16_weights_compute_in_float32_on_the_cpu_by_default(tiny_dg_dir, tmp_path):
    """On the CPU backend a bf16 checkpoint is upcast at load (exactly) and computes in
    float32: it then matches transformers running the same bf16 weights in float32."""
    import torch

    bf16_dir = convert_dir(tiny_dg_dir, tmp_path / "bf16", dtype="bfloat16")
    loaded = api.load(bf16_dir)
    assert loaded.upcast and loaded.compute_dtype == "float32" and loaded.model.dtype == mx.float32
    ref = load_diffusion_gemma_hf(tiny_dg_dir, "bfloat16").to(torch.float32)  # the bf16 values, in f32
    want = hf_logits(ref, LONG, [CANVAS, CANVAS2])
    got = mlx_logits(loaded, LONG, [CANVAS, CANVAS2])
    assert np.abs(got - want).max() < 1e-4


def test_the_float32_upcast_stays_within_the_memory_budget(tiny_dg_dir, tmp_path, monkeypatch):
    """A bf16 model whose float32 copy would not fit keeps bf16 (experts in float32 for gather_mm)."""
    from dlm.runtime.platform import memory

    bf16_dir = convert_dir(tiny_dg_dir, tmp_path / "bf16", dtype="bfloat16")
    monkeypatch.setattr(memory, "budget_bytes", lambda gb=None: 0 if gb is None else int(gb * 1e9))  # a full machine
    loaded = api.load(bf16_dir)
    assert not loaded.upcast and loaded.model.dtype == mx.bfloat16
    experts = loaded.model.layers[0].experts.gate_up_proj
    assert experts["weight"].dtype == mx.float32
    opts = {"max_tokens": 4, "max_denoising_steps": 2, "seed": 0, "memory_budget": 8.0}
    assert api.generate(loaded, [2, 10, 11], opts).token_ids

"""LLaDA-2 MLX model vs dlm's independent PyTorch reference; config, weight
plan, quantization classes and sanitize."""

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import torch

from dlm.runtime.platform.errors import ConfigError, WeightError
from dlm.runtime.models import llada2_moe as L
from dlm.runtime.models.cpu import experts as cpu_experts
from dlm.runtime.models.cpu import dequant as quantized
from dlm.runtime.models.llada2_moe.model import Gate
from dlm.verify.llada2_moe import torch_model as R
from tests.builders import LLADA2_GEOMETRIES, build_llada2, build_llada2_model, llada2_hub_config

torch.set_num_threads(1)


def mlx_model_from_hub(path):
    """The MLX model with the converter's plan applied in memory."""
    cfg = json.loads((path / "config.json").read_text())
    args = L.ModelArgs.from_config(cfg)
    src = mx.load(str(path / "model.safetensors"))
    plans = L.plan_weights(args, {k: (v.shape, str(v.dtype)) for k, v in src.items()}, True)
    weights = {}
    for p in plans:
        arrays = [src[s] for s in p.sources]
        weights[p.name] = p.combine(arrays) if p.combine else arrays[0]
    model = L.Model(args)
    model.load_weights(list(weights.items()), strict=True)
    return model, weights


@pytest.fixture(scope="module", params=sorted(LLADA2_GEOMETRIES))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"llada2_{request.param}")
    ref = build_llada2(path, request.param)
    model, _ = mlx_model_from_hub(path)
    return request.param, ref, model


def _ids(n, seed=0):
    return np.random.RandomState(seed).randint(0, 256, (1, n))


@pytest.mark.parametrize("length", [7, 45])
def test_logits_bidirectional_match_reference(pair, length):
    _, ref, model = pair
    ids = _ids(length, length)
    want = ref(torch.tensor(ids)).numpy()
    got = np.array(model(mx.array(ids)))
    assert got.shape == want.shape
    assert np.abs(got - want).max() < 1e-4


def test_logits_block_causal_and_cached_match_reference(pair):
    _, ref, model = pair
    ids, bl = _ids(40, 3), 16
    want = ref(torch.tensor(ids), R.block_causal_mask(40, bl)).numpy()
    full = np.array(model(mx.array(ids), mask=L.block_causal_mask(0, 40, 0, bl)))
    assert np.abs(full - want).max() < 1e-4
    # Prefix of two blocks in the cache, then the tail attends to it.
    cache = model.make_cache(48)
    model(mx.array(ids[:, :32]), cache, L.block_causal_mask(0, 32, 0, bl), last=1)
    for c in cache:
        c.commit(32)
    tail = np.array(model(mx.array(ids[:, 32:]), cache, L.block_causal_mask(32, 8, 32, bl)))
    assert np.abs(tail - want[:, 32:]).max() < 1e-4
    # The block mask really blocks: a later block changes nothing before it.
    other = ids.copy()
    other[0, 35] = (other[0, 35] + 1) % 256
    moved = np.array(model(mx.array(other), mask=L.block_causal_mask(0, 40, 0, bl)))
    assert np.abs(moved[:, :32] - full[:, :32]).max() == 0
    assert np.abs(moved[:, 32:] - full[:, 32:]).max() > 1e-3


@pytest.mark.parametrize("eager_experts", [False, True], ids=["fused", "around-eager-experts"])
def test_compiled_window_matches_eager_and_reference(tmp_path, monkeypatch, eager_experts):
    """The denoising window through the layers' compiled pieces (a block's first
    step: the finished block and the next, over a cached prefix), whole or around
    experts that run eagerly (CPU-grouped), against the eager layers and the reference."""
    if eager_experts:
        monkeypatch.setattr(cpu_experts, "GROUPED_MIN_WEIGHT", 1)
        monkeypatch.setattr(cpu_experts, "GROUPED_MIN_ROWS_PER_EXPERT", 1)
    ref = build_llada2(tmp_path, "base")
    model, _ = mlx_model_from_hub(tmp_path)
    ids, bl = _ids(48, 5), 16
    want = ref(torch.tensor(ids), R.block_causal_mask(48, bl)).numpy()
    cache = model.make_cache(64)
    model(mx.array(ids[:, :16]), cache, L.block_causal_mask(0, 16, 0, bl), last=1)
    for c in cache:
        c.commit(16)
    window, mask = mx.array(ids[:, 16:]), L.block_causal_mask(16, 32, 16, bl)
    eager = np.array(model(window, cache, mask))  # rewrites the same uncommitted positions
    assert all(layer._compiled is None for layer in model.layers)
    fused = np.array(model(window, cache, mask, compiled=True))
    pieces = [layer._compiled for layer in model.layers]  # made by that call
    assert all(pieces)
    moe = [isinstance(p[1], tuple) for p, layer in zip(pieces, model.layers) if isinstance(layer.mlp, L.model.SparseMoe)]
    assert moe and all(m == eager_experts for m in moe)
    assert np.abs(fused - eager).max() < 1e-5
    assert np.abs(fused - want[:, 16:]).max() < 1e-4


def test_compile_off_and_quantized_cpu_layers_run_eagerly(tmp_path, monkeypatch):
    build_llada2(tmp_path, "base")
    monkeypatch.setenv("DLM_COMPILE", "0")
    model, _ = mlx_model_from_hub(tmp_path)
    model(mx.array(_ids(16)), model.make_cache(16), compiled=True)
    assert all(layer._compiled is None for layer in model.layers)  # never asked for
    # A quantized linear dequantized per call (the CPU loader's choice when float
    # weights do not fit) runs eagerly: its slices go over the CPU streams.
    nn.quantize(model, group_size=32, bits=8, class_predicate=lambda _, m: isinstance(m, nn.Linear))
    assert quantized.mark(model) > 0
    assert all(layer.compiled() is None for layer in model.layers)


def test_router_matches_reference_group_limited():
    """Group-limited routing with a negative-bias expert outside the chosen groups."""
    _, cfg = build_llada2_model("base")
    args = L.ModelArgs.from_config(cfg)
    rc = R.RefConfig.from_dict(cfg)
    gate_t, gate_m = R.Gate(rc), Gate(args)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(rc.num_experts, rc.hidden_size, generator=g)
    b = torch.randn(rc.num_experts, generator=g)
    with torch.no_grad():
        gate_t.weight.copy_(w)
        gate_t.expert_bias.copy_(b)
    gate_m.weight, gate_m.expert_bias = mx.array(w.numpy()), mx.array(b.numpy())
    x = torch.randn(50, rc.hidden_size, generator=g)
    with torch.no_grad():
        idx_t, w_t = gate_t(x)
    idx_m, w_m = gate_m(mx.array(x.numpy()))
    assert np.array_equal(np.array(idx_m), idx_t.numpy())
    assert np.abs(np.array(w_m) - w_t.numpy()).max() < 1e-6
    # Only topk_group groups of 4 experts are ever used per token.
    groups = np.array(idx_m) // (rc.num_experts // rc.n_group)
    assert all(len(set(row)) <= rc.topk_group for row in groups)
    assert np.allclose(np.array(w_m).sum(-1), rc.routed_scaling_factor, atol=1e-5)


# -- config -------------------------------------------------------------------


def test_model_args_real_config_values():
    cfg = llada2_hub_config("base")
    args = L.ModelArgs.from_config(cfg)
    assert (args.rotary_dim, args.mask_token_id, args.eos_token_ids) == (8, 255, [252])
    assert args.use_bias is False and args.tie_word_embeddings is False
    # The hub derives the rotary width from partial_rotary_factor; config rotary_dim is ignored.
    assert L.ModelArgs.from_config(dict(cfg, rotary_dim=2)).rotary_dim == 8
    mini = dict(cfg, vocab_size=157184, hidden_size=2048, head_dim=128, num_experts=256,
                n_group=8, topk_group=4, num_experts_per_tok=8, pad_token_id=156892)
    del mini["mask_token_id"]
    args = L.ModelArgs.from_config(mini)
    assert (args.rotary_dim, args.mask_token_id, args.eos_token_ids) == (64, 156895, [156892])


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_key_value_heads": None}, "num_key_value_heads"),
        ({"num_key_value_heads": 0}, "num_key_value_heads"),
        ({"num_key_value_heads": 3}, "multiple of"),
        ({"topk_group": 5}, "topk_group"),
        ({"num_experts": 15}, "n_group"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4}}, "rope_scaling"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"vocab_size": None}, "vocab_size"),
        ({"model_type": "llama"}, "llada2_moe"),
    ],
)
def test_model_args_errors(change, message):
    cfg = llada2_hub_config("base")
    for k, v in change.items():
        if v is None:
            cfg.pop(k)
        else:
            cfg[k] = v
    with pytest.raises(ConfigError, match=message):
        L.ModelArgs.from_config(cfg, "x/config.json")


# -- weight plan ----------------------------------------------------------------


def _meta(state):
    return {k: (tuple(v.shape), str(v.dtype)) for k, v in state.items()}


def test_plan_stacks_experts_and_keeps_expert_bias_float32():
    model, cfg = build_llada2_model("base")
    args = L.ModelArgs.from_config(cfg)
    state = model.state_dict()
    plans = {p.name: p for p in L.plan_weights(args, _meta(state), True)}
    sw = plans["model.layers.1.mlp.switch_mlp.down_proj.weight"]
    assert sw.sources == tuple(f"model.layers.1.mlp.experts.{e}.down_proj.weight" for e in range(16))
    stacked = sw.combine([mx.array(state[s].numpy()) for s in sw.sources])
    assert stacked.shape == (16, 64, 64)
    assert np.array_equal(np.array(stacked[5]), state["model.layers.1.mlp.experts.5.down_proj.weight"].numpy())
    assert plans["model.layers.1.mlp.gate.expert_bias"].keep_float32
    assert not plans["model.layers.1.mlp.gate.weight"].keep_float32
    assert "lm_head.weight" in plans  # untied
    assert not any(".mlp.experts." in n for n in plans)
    # Every MLX parameter is planned, and nothing else.
    from mlx.utils import tree_flatten

    assert set(plans) == {k for k, _ in tree_flatten(L.Model(args).parameters())}


def test_plan_accepts_merged_expert_layout():
    model, cfg = build_llada2_model("dense2")
    args = L.ModelArgs.from_config(cfg)
    meta = _meta(model.state_dict())
    for i in (2, 3):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            shape = None
            for e in range(8):
                shape = meta.pop(f"model.layers.{i}.mlp.experts.{e}.{proj}.weight")[0]
            meta[f"model.layers.{i}.mlp.experts.{proj}"] = ((8,) + shape, "torch.float32")
    plans = {p.name: p for p in L.plan_weights(args, meta, True)}
    assert plans["model.layers.2.mlp.switch_mlp.up_proj.weight"].sources == ("model.layers.2.mlp.experts.up_proj",)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda m: m.pop("model.layers.1.mlp.experts.3.up_proj.weight"), "missing tensor model.layers.1.mlp.experts.3.up_proj.weight"),
        (lambda m: m.pop("model.layers.2.mlp.gate.expert_bias"), "missing tensor model.layers.2.mlp.gate.expert_bias"),
        (lambda m: m.pop("lm_head.weight"), "missing tensor lm_head.weight"),
        (lambda m: m.__setitem__("model.layers.0.attention.query_key_value.weight", ((64, 64), "f32")),
         r"query_key_value.weight has shape \[64, 64\] but the config implies \[128, 64\]"),
        (lambda m: m.__setitem__("model.layers.9.mlp.gate.weight", ((16, 64), "f32")), "unexpected tensor model.layers.9"),
    ],
)
def test_plan_errors_name_the_tensor(edit, message):
    model, cfg = build_llada2_model("base")
    meta = _meta(model.state_dict())
    edit(meta)
    with pytest.raises(WeightError, match=message):
        L.plan_weights(L.ModelArgs.from_config(cfg), meta, True)


def test_plan_ignores_rotary_buffers():
    model, cfg = build_llada2_model("flat")
    meta = _meta(model.state_dict())
    meta["model.layers.0.attention.rotary_emb.inv_freq"] = ((4,), "f32")
    L.plan_weights(L.ModelArgs.from_config(cfg), meta, True)


@pytest.mark.parametrize(
    "path, cls",
    [
        ("model.word_embeddings", "high"), ("lm_head", "high"),
        ("model.layers.3.attention.query_key_value", "high"), ("model.layers.3.attention.dense", "high"),
        ("model.layers.0.mlp.gate_proj", "high"), ("model.layers.0.mlp.down_proj", "high"),
        ("model.layers.3.mlp.switch_mlp.gate_proj", "low"), ("model.layers.3.mlp.switch_mlp.down_proj", "low"),
        ("model.layers.3.mlp.shared_experts.up_proj", "low"),
        ("model.layers.3.mlp.gate", None), ("model.layers.3.input_layernorm", None),
        ("model.layers.3.attention.query_layernorm", None), ("model.norm", None),
    ],
)
def test_quant_class(path, cls):
    assert L.quant_class(path) == cls


def test_output_config_drops_remote_code_hooks():
    cfg = dict(llada2_hub_config("base"), auto_map={"AutoModel": "modeling_llada2_moe.LLaDA2MoeModel"})
    out = L.output_config(cfg, True)
    assert "auto_map" not in out and out["num_experts"] == 16 and "auto_map" in cfg


# -- sanitize (mlx-community layouts) -----------------------------------------------


def test_sanitize_accepts_mlx_vlm_and_per_expert_layouts(tmp_path):
    build_llada2(tmp_path, "base")
    model, planned = mlx_model_from_hub(tmp_path)
    # mlx-vlm: language_model. prefix, switch_mlp already stacked, expert_bias bf16.
    vlm = {"language_model." + k: v for k, v in planned.items()}
    bias = "language_model.model.layers.1.mlp.gate.expert_bias"
    vlm[bias] = vlm[bias].astype(mx.bfloat16)
    out = L.sanitize(vlm)
    assert set(out) == set(planned)
    assert out["model.layers.1.mlp.gate.expert_bias"].dtype == mx.float32
    # Hub per-expert layout plus a rotary buffer: stacked by sanitize.
    raw = dict(mx.load(str(tmp_path / "model.safetensors")))
    raw["model.layers.1.attention.rotary_emb.inv_freq"] = mx.zeros((4,))
    out = L.sanitize(raw)
    assert set(out) == set(planned)
    assert np.array_equal(np.array(out["model.layers.2.mlp.switch_mlp.up_proj.weight"]),
                          np.array(planned["model.layers.2.mlp.switch_mlp.up_proj.weight"]))


def test_sanitize_bailing_style_and_quantized_gate():
    w = mx.random.normal((16, 64), key=mx.random.key(0))
    q, scales, biases = mx.quantize(w, 64, 8)
    out = L.sanitize({
        "model.layers.1.mlp.gate.gate_proj.weight": q,
        "model.layers.1.mlp.gate.gate_proj.scales": scales,
        "model.layers.1.mlp.gate.gate_proj.biases": biases,
    })
    assert set(out) == {"model.layers.1.mlp.gate.weight"}
    deq = mx.dequantize(q, scales, biases, 64, 8)
    assert np.allclose(np.array(out["model.layers.1.mlp.gate.weight"]), np.array(deq))


def test_sanitize_rejects_gappy_expert_numbering():
    w = mx.zeros((4, 8))
    with pytest.raises(WeightError, match="experts are not numbered"):
        L.sanitize({"model.layers.1.mlp.experts.0.up_proj.weight": w,
                    "model.layers.1.mlp.experts.2.up_proj.weight": w})

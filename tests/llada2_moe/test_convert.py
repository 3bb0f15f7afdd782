"""dlm-convert on tiny llada2_moe checkpoints (hub layout), then dlm's loader."""

import json

import mlx.core as mx
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from dlm.convert.pipeline import ConvertOptions, convert
from dlm.runtime import api
from dlm.runtime.platform.errors import ConfigError, WeightError
from dlm.runtime.models.llada2_moe import to_hf
from dlm.verify.llada2_moe import torch_generate as RG
from dlm.verify.llada2_moe import adapter as A
from dlm.verify.weights import dequantized_weights
from tests.builders import (
    LLADA2_EOS_ID,
    LLADA2_MASK_ID,
    LLADA2_ROLE_END_ID,
    bits_of,
    build_llada2,
    leftovers,
    load_output,
    mx_bits,
    source_tensors,
)

torch.set_num_threads(1)


def run(src, out, **kw):
    return convert(ConvertOptions(source=str(src), output=str(out), progress=False, **kw), echo=lambda s: None)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    path = tmp_path_factory.mktemp("l2_hub")
    ref = build_llada2(path, "dense2")
    return path, ref


@pytest.fixture(scope="module")
def hub_bf16(tmp_path_factory):
    path = tmp_path_factory.mktemp("l2_hub_bf16")
    build_llada2(path, "base", dtype="bfloat16", shards=3)
    return path


def check_quantized(src, got, name, bits):
    """Stored = mx.quantize of the float32 source at ``bits`` (affine, group 64)."""
    want = mx.quantize(mx.array(src[name + ".weight"].float().numpy()), 64, bits)
    for part, arr in zip(("weight", "scales", "biases"), want):
        assert np.array_equal(np.array(got[f"{name}.{part}"]), np.array(arr)), (name, part)


def _logits(loaded, ids):
    return np.array(loaded.model(mx.array([ids])))[0]


def test_float_conversion_stacks_experts_and_matches_reference(hub, tmp_path):
    src, ref = hub
    out = tmp_path / "f32"
    run(src, out)
    got = load_output(out)
    hf = load_file(str(src / "model.safetensors"))
    for i in (2, 3):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            stacked = np.array(got[f"model.layers.{i}.mlp.switch_mlp.{proj}.weight"])
            want = np.stack([hf[f"model.layers.{i}.mlp.experts.{e}.{proj}.weight"].numpy() for e in range(8)])
            assert np.array_equal(stacked, want)
    assert not any(".mlp.experts." in k for k in got)
    assert got["model.layers.2.mlp.gate.expert_bias"].dtype == mx.float32
    assert "lm_head.weight" in got and "model.layers.1.mlp.gate_proj.weight" in got  # 2 dense layers
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dlm"]["source"] == str(src.resolve()) and "quantization" not in cfg
    card = (out / "README.md").read_text()
    assert "--block-length" in card and "dlm-verify:begin" in card and "library_name: mlx" in card
    loaded = api.load(out)
    ids = api.encode_prompt(loaded, "Hello, LLaDA!")
    want = ref(torch.tensor([ids]))[0].numpy()
    assert np.abs(_logits(loaded, ids) - want).max() < 1e-4
    result = api.generate(loaded, ids, {"max_tokens": 40, "block_length": 16, "threshold": 0.9})
    expect = RG.generate(ref, torch.tensor(ids), block_length=16, steps=32, gen_length=40, threshold=0.9,
                        eos_id=[LLADA2_EOS_ID, LLADA2_ROLE_END_ID], mask_id=LLADA2_MASK_ID, hub_sampler=False,
                        suppress_mask=True).tolist()
    assert result.token_ids == [t for t in expect if t not in (LLADA2_EOS_ID, LLADA2_ROLE_END_ID)]


def test_mixed_recipe_classes_and_implementation_parity(hub_bf16, tmp_path):
    out = tmp_path / "q4"
    result = run(hub_bf16, out, quantize=True, q_bits=4, dtype="float32")
    cfg = json.loads((out / "config.json").read_text())
    q = cfg["quantization"]
    assert q == cfg["quantization_config"] and (q["bits"], q["group_size"], q["mode"]) == (4, 64, "affine")
    eight = {"bits": 8, "group_size": 64}
    for path in ("model.word_embeddings", "lm_head", "model.layers.0.mlp.gate_proj",
                 "model.layers.0.mlp.down_proj", "model.layers.2.attention.query_key_value",
                 "model.layers.2.attention.dense"):
        assert q[path] == eight, path
    for path in ("model.layers.1.mlp.switch_mlp.gate_proj", "model.layers.2.mlp.shared_experts.down_proj"):
        assert path not in q  # at --q-bits
    got = load_output(out)
    src = {k: v for f in sorted(hub_bf16.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    check_quantized(src, got, "model.layers.1.mlp.shared_experts.up_proj", 4)
    check_quantized(src, got, "model.layers.2.attention.query_key_value", 8)
    check_quantized(src, got, "lm_head", 8)
    assert "model.layers.1.mlp.gate.scales" not in got  # router never quantized
    assert got["model.layers.1.mlp.gate.weight"].dtype == mx.float32
    assert got["model.layers.1.mlp.gate.expert_bias"].dtype == mx.float32
    assert got["model.layers.1.mlp.switch_mlp.up_proj.weight"].shape == (16, 64, 64 * 4 // 32)
    assert 4 < result.bits_per_weight < 8
    # Implementation parity: the torch reference on the dequantized MLX weights.
    loaded = api.load(out)
    weights = to_hf(dequantized_weights(out, cfg))
    ref = A.load_reference(out, weights=weights)
    ids = api.encode_prompt(loaded, "Quantized?")
    want = ref.model(torch.tensor([ids]))[0].numpy()
    assert np.abs(_logits(loaded, ids) - want).max() < 1e-3


def test_bf16_conversion_keeps_expert_bias_float32_and_runs(hub_bf16, tmp_path):
    out = tmp_path / "bf16"
    run(hub_bf16, out)
    got = load_output(out)
    assert got["model.layers.1.mlp.switch_mlp.up_proj.weight"].dtype == mx.bfloat16
    assert got["model.layers.1.mlp.gate.expert_bias"].dtype == mx.float32
    loaded = api.load(out)
    res = api.generate(loaded, api.encode_prompt(loaded, "hi"), {"max_tokens": 10, "block_length": 8})
    assert len(res.token_ids) <= 10 and LLADA2_MASK_ID not in res.token_ids


def test_merged_expert_layout_converts_identically(hub, tmp_path):
    src, _ = hub
    merged = tmp_path / "merged"
    build_llada2(merged, "dense2", layout="merged")
    run(src, tmp_path / "a")
    run(merged, tmp_path / "b")
    a, b = load_output(tmp_path / "a"), load_output(tmp_path / "b")
    assert set(a) == set(b) and all(np.array_equal(np.array(a[k]), np.array(b[k])) for k in a)


def test_mlx_vlm_layout_loads(hub, tmp_path):
    """An mlx-vlm conversion: language_model. prefix, bf16 expert_bias."""
    src, ref = hub
    run(src, tmp_path / "dlm")
    vlm = tmp_path / "vlm"
    vlm.mkdir()
    weights = load_output(tmp_path / "dlm")
    renamed = {"language_model." + k: (v.astype(mx.bfloat16) if k.endswith("expert_bias") else v)
               for k, v in weights.items()}
    mx.save_safetensors(str(vlm / "model.safetensors"), renamed, metadata={"format": "mlx"})
    for f in (tmp_path / "dlm").iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            (vlm / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((vlm / "config.json").read_text())
    cfg["vision_config"] = {}  # mlx-vlm writes this even for text-only models
    (vlm / "config.json").write_text(json.dumps(cfg))
    a, b = api.load(tmp_path / "dlm"), api.load(vlm)
    ids = [5, 6, 7, 8, 9]
    assert np.abs(_logits(a, ids) - _logits(b, ids)).max() < 1e-3  # bias rounded to bf16 by mlx-vlm


def test_missing_expert_tensor_fails_cleanly(hub, tmp_path):
    src, _ = hub
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (bad / f.name).write_bytes(f.read_bytes())
    state = load_file(str(src / "model.safetensors"))
    del state["model.layers.3.mlp.experts.7.down_proj.weight"]
    save_file(state, str(bad / "model.safetensors"))
    out = tmp_path / "out"
    with pytest.raises(WeightError, match=r"model\.layers\.3\.mlp\.experts\.7\.down_proj\.weight"):
        run(bad, out)
    assert leftovers(tmp_path, out) == []


@pytest.mark.parametrize("flag", ["text_only", "quantize_vision"])
def test_vision_flags_are_refused_for_a_text_only_family(hub, tmp_path, flag):
    """--text-only / --quantize-vision cannot take effect on LLaDA-2 (no vision
    tower ever): an error naming the flag, not a silent no-op (issue 42)."""
    src, _ = hub
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=f"--{flag.replace('_', '-')} does not apply to LLaDA-2"):
        run(src, out, **{flag: True})
    assert leftovers(tmp_path, out) == []


def test_config_without_kv_heads_fails_cleanly(hub, tmp_path):
    src, _ = hub
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in src.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((bad / "config.json").read_text())
    del cfg["num_key_value_heads"]
    (bad / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        run(bad, out)
    assert leftovers(tmp_path, out) == []


def test_llada2_stacks_experts_and_keeps_expert_bias_float32(tmp_path):
    """The generic pipeline runs a family's combine plans (per-expert -> stacked) and keep_float32."""
    src = tmp_path / "llada2"
    build_llada2(src, shards=2)
    tensors = source_tensors(src)
    cfg = json.loads((src / "config.json").read_text())
    layer = cfg["first_k_dense_replace"]
    experts = [tensors[f"model.layers.{layer}.mlp.experts.{e}.up_proj.weight"] for e in range(cfg["num_experts"])]
    stacked = torch.stack(experts)

    out = tmp_path / "bf16"
    run(src, out, dtype="bfloat16")
    got = load_output(out)
    mine = got[f"model.layers.{layer}.mlp.switch_mlp.up_proj.weight"]
    assert mine.dtype == mx.bfloat16 and mine.shape == tuple(stacked.shape)
    assert np.array_equal(mx_bits(mine), bits_of(stacked.to(torch.bfloat16)))
    bias = got[f"model.layers.{layer}.mlp.gate.expert_bias"]
    assert bias.dtype == mx.float32
    assert np.array_equal(mx_bits(bias), bits_of(tensors[f"model.layers.{layer}.mlp.gate.expert_bias"]))

    out = tmp_path / "q4"
    run(src, out, quantize=True)
    got = load_output(out)
    name = f"model.layers.{layer}.mlp.switch_mlp.up_proj"
    want = mx.quantize(mx.array(stacked.numpy()), group_size=64, bits=4)
    assert stacked.shape[-1] % 64 == 0  # the tiny hidden size, so the experts do quantize
    for part, arr in zip(("weight", "scales", "biases"), want):
        assert np.array_equal(np.array(got[f"{name}.{part}"]), np.array(arr)), part

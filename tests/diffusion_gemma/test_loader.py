"""Loading model directories: dlm conversions, mlx-community layouts (un-fused
experts, override blocks), plain HF checkpoints, and clear errors for bad input."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest

from dlm.runtime import api
from dlm.runtime.platform.errors import ConfigError, UnsupportedModelError, WeightError
from dlm.runtime.loader import apply_quantization
from dlm.runtime.models.diffusion_gemma import ModelArgs, Model, sanitize
from tests import PEER
from tests.builders import DG_TEXT

PROMPT, CANVAS = list(range(2, 14)), [5, 9, 33, 400, 7, 8, 100, 3]


def logits(loaded):
    cache = loaded.model.make_cache()
    loaded.model.prefill(PROMPT, cache)
    return np.array(loaded.model.decode(CANVAS, cache))[0]


@pytest.fixture()
def copy_dir(tiny_dg_mlx_dir, tmp_path):
    out = tmp_path / "model"
    shutil.copytree(tiny_dg_mlx_dir, out)
    return out


def test_loaded_fields(tiny_dg_mlx_dir):
    loaded = api.load(tiny_dg_mlx_dir)
    assert loaded.family.name == "diffusion_gemma"
    assert isinstance(loaded.args, ModelArgs) and loaded.args.canvas_length == 8
    assert loaded.generation_config["eos_token_id"] == [1, 106, 50]
    assert loaded.tokenizer.convert_tokens_to_ids("<|channel>") == 100
    assert loaded.model.dtype == mx.float32


def test_unfused_per_expert_keys_load(copy_dir, tiny_dg_mlx_dir):
    """mlx-community-style checkpoints that ship experts one by one."""
    weights = mx.load(str(copy_dir / "model.safetensors"))
    out = {}
    for name, value in weights.items():
        if name.endswith("experts.gate_up_proj.weight"):
            base, m = name[: -len("gate_up_proj.weight")], value.shape[1] // 2
            for e in range(value.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = value[e, :m]
                out[f"{base}{e}.up_proj.weight"] = value[e, m:]
        elif name.endswith("experts.down_proj.weight"):
            base = name[: -len("down_proj.weight")]
            for e in range(value.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = value[e]
        else:
            out[name] = value
    (copy_dir / "model.safetensors.index.json").unlink()
    mx.save_safetensors(str(copy_dir / "model.safetensors"), out)
    assert np.array_equal(logits(api.load(copy_dir)), logits(api.load(tiny_dg_mlx_dir)))


def test_sanitize_rules():
    w = {
        "lm_head.weight": 1, "model.decoder.rotary_emb.inv_freq": 2,
        "model.encoder.language_model.layers.0.layer_scalar": 3,
        "model.encoder.language_model.layers.0.mlp.up_proj.weight": 4,
        "model.encoder.vision_tower.std_bias": 5, "model.encoder.embed_vision.embedding_projection.weight": 6,
        "model.decoder.layers.0.experts.down_proj": 7, "model.decoder.norm.weight": 8,
    }
    assert sanitize(w) == {
        "model.encoder.language_model.layers.0.layer_scalar": 3,
        "model.decoder.layers.0.experts.down_proj.weight": 7, "model.decoder.norm.weight": 8,
    }
    # A model with a vision tower keeps the tower and embed_vision (clip bounds only when used).
    vision = ModelArgs.from_config({"model_type": "diffusion_gemma", "text_config": DG_TEXT,
                                    "vision_config": {"hidden_size": 8}})
    w["model.encoder.vision_tower.encoder.layers.0.mlp.up_proj.input_max"] = 9
    assert sanitize(w, vision) == {
        "model.encoder.language_model.layers.0.layer_scalar": 3,
        "model.encoder.vision_tower.std_bias": 5, "model.encoder.embed_vision.embedding_projection.weight": 6,
        "model.decoder.layers.0.experts.down_proj.weight": 7, "model.decoder.norm.weight": 8,
    }


def test_mlx_vlm_style_override_without_mode(tiny_dg_mlx_dir):
    """mlx-vlm writes 8-bit affine overrides without "mode" inside an mxfp4 block."""
    src = api.load(tiny_dg_mlx_dir)
    args = src.args
    model = Model(args)
    model.load_weights(list(dict(_flat(src.model)).items()))
    import mlx.nn as nn

    nn.quantize(model, class_predicate=lambda p, m: (
        {"group_size": 64, "bits": 8, "mode": "affine"} if p.endswith("self_attn.q_proj")
        else {"group_size": 32, "bits": 4, "mode": "mxfp4"} if p.endswith("experts.gate_up_proj") else False))
    weights = dict(_flat(model))
    block = {"group_size": 32, "bits": 4, "mode": "mxfp4",
             **{f"model.decoder.layers.{i}.self_attn.q_proj": {"group_size": 64, "bits": 8} for i in range(6)}}
    fresh = Model(args)
    apply_quantization(fresh, block, weights)
    fresh.load_weights(list(weights.items()), strict=True)
    q = fresh.model.decoder.layers[0].self_attn.q_proj
    e = fresh.model.decoder.layers[0].experts.gate_up_proj
    assert (q.mode, q.bits) == ("affine", 8) and (e.mode, e.bits) == ("mxfp4", 4)


def _flat(model):
    from mlx.utils import tree_flatten

    return tree_flatten(model.parameters())


def test_not_a_directory(tmp_path):
    with pytest.raises(ConfigError, match="not a directory"):
        api.load(tmp_path / "nope")


def test_missing_config(tmp_path):
    with pytest.raises(ConfigError, match="config.json not found"):
        api.load(tmp_path)


def test_unsupported_family(copy_dir):
    cfg = json.loads((copy_dir / "config.json").read_text())
    cfg["model_type"] = "llama"
    (copy_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="llama"):
        api.load(copy_dir)


def test_missing_weights(copy_dir):
    (copy_dir / "model.safetensors").unlink()
    with pytest.raises(WeightError, match="missing shard"):
        api.load(copy_dir)
    (copy_dir / "model.safetensors.index.json").unlink()
    (copy_dir / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(WeightError, match="only safetensors"):
        api.load(copy_dir)


def test_missing_and_misshaped_tensor(copy_dir):
    weights = mx.load(str(copy_dir / "model.safetensors"))
    name = "model.decoder.layers.3.router.per_expert_scale"
    shorter = dict(weights)
    del shorter[name]
    mx.save_safetensors(str(copy_dir / "model.safetensors"), shorter)
    with pytest.raises(WeightError, match=name.replace(".", r"\.")):
        api.load(copy_dir)
    bad = dict(weights)
    bad[name] = mx.zeros((3,))
    mx.save_safetensors(str(copy_dir / "model.safetensors"), bad)
    with pytest.raises(WeightError, match="shape"):
        api.load(copy_dir)


def test_foreign_quantization_refused(copy_dir):
    cfg = json.loads((copy_dir / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (copy_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="fp8"):
        api.load(copy_dir)


def test_bad_config_value(copy_dir):
    cfg = json.loads((copy_dir / "config.json").read_text())
    del cfg["text_config"]["num_experts"]
    (copy_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="num_experts"):
        api.load(copy_dir)


def test_generation_config_embedded_in_config(copy_dir):
    gen = json.loads((copy_dir / "generation_config.json").read_text())
    (copy_dir / "generation_config.json").unlink()
    cfg = json.loads((copy_dir / "config.json").read_text())
    cfg["generation_config"] = gen
    (copy_dir / "config.json").write_text(json.dumps(cfg))
    assert api.load(copy_dir).generation_config["max_denoising_steps"] == 48


def test_encode_prompt(tiny_dg_mlx_dir):
    loaded = api.load(tiny_dg_mlx_dir)
    tok = loaded.tokenizer
    ids = api.encode_prompt(loaded, "hi", system="be brief")
    text = tok.decode(ids, skip_special_tokens=False)
    assert text == "<bos><|turn>system\nbe brief<turn|>\n<|turn>user\nhi<turn|>\n<|turn>model\n"
    thinking = tok.decode(api.encode_prompt(loaded, "hi", enable_thinking=True), skip_special_tokens=False)
    assert thinking.startswith("<bos><|turn>system\n<|think|>")
    raw = api.encode_prompt(loaded, "hi", chat_template=False)
    assert raw == [2] + tok.encode("hi", add_special_tokens=False)



@pytest.mark.skipif(not (PEER / "mlx_vlm").is_dir(), reason="mlx-vlm 0.7.10 not installed in .peer/")
def test_mlx_vlm_conversion_loads_as_is(tiny_dg_dir, tiny_dg_torch, tmp_path):
    """A conversion written by mlx-vlm (the mlx-community producer: mixed 8/4-bit
    overrides, vision tower kept, generation_config embedded) runs unchanged and
    equals dlm's own conversion with the same recipe."""
    import os
    import subprocess
    import sys

    from tests.builders import convert_dir

    out = tmp_path / "vlm-q4"
    env = {**os.environ, "PYTHONPATH": str(PEER), "HF_HUB_OFFLINE": "1"}
    subprocess.run([sys.executable, "-m", "mlx_vlm.convert", "--hf-path", str(tiny_dg_dir),
                    "--mlx-path", str(out), "-q", "--q-bits", "4"], env=env, check=True,
                   capture_output=True)
    vlm = api.load(out)
    ours = api.load(convert_dir(tiny_dg_dir, tmp_path / "dlm-q4", quantize=True, q_bits=4))
    assert np.array_equal(logits(vlm), logits(ours))
    assert vlm.generation_config["eos_token_id"] == [1, 106, 50]


def test_missing_tokenizer(copy_dir):
    for f in copy_dir.glob("tokenizer*"):
        f.unlink()
    with pytest.raises(ConfigError, match="no tokenizer files"):
        api.load(copy_dir)

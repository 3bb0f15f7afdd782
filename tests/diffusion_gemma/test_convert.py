"""dlm-convert end to end on tiny DiffusionGemma checkpoints built with transformers.

References: the source safetensors (read with safetensors' own loader), the
issue's recipe table, and mx.quantize applied to the whole source tensor.
"""

from __future__ import annotations

import json
import re

import mlx.core as mx
import numpy as np
import pytest
import yaml
from click.testing import CliRunner

from dlm.convert.card import VERIFY_BEGIN, VERIFY_END, update_card_section
from dlm.convert.cli import main
from dlm.convert.pipeline import ConvertOptions, convert
from dlm.runtime.models.diffusion_gemma import ModelArgs
from tests.builders import bits_of, load_output, mx_bits, reshard, source_tensors

VISION_PREFIXES = ("model.encoder.vision_tower.", "model.encoder.embed_vision.")
# The mixed recipe, stated independently of dlm.quantize / quant_class.
HIGH = re.compile(r"(embed_tokens|\.self_attn\.[qkvo]_proj|\.mlp\.(gate|up|down)_proj|\.router\.proj)$")
LOW = re.compile(r"(\.experts\.(gate_up|down)_proj|self_conditioning\.(gate|up|down)_proj)$")


def expected_mlx_names(src_names, keep_vision: bool) -> set[str]:
    """The mlx-community layout, as mlx-vlm 0.7.10's ``diffusion_gemma`` ``Model.sanitize`` writes it."""
    out = set()
    for n in src_names:
        if n == "lm_head.weight":
            continue
        if n.startswith("model.encoder.language_model."):
            if n.endswith(".layer_scalar"):
                out.add(n)
            continue
        if n.startswith(VISION_PREFIXES):
            if keep_vision:
                out.add(n)
            continue
        if n.endswith(("experts.gate_up_proj", "experts.down_proj")):
            n += ".weight"
        out.add(n)
    return out


def hf_name(mlx_name: str) -> str:
    """Source name of an unquantized output tensor (fused experts lose the .weight MLX adds)."""
    if ".experts." in mlx_name and mlx_name.endswith(".weight"):
        return mlx_name[: -len(".weight")]
    return mlx_name


def to_numpy32(t) -> np.ndarray:
    return t.float().numpy()


def quant_error_bound(w: np.ndarray, group_size: int, bits: int, mode: str, eps: float = 0.0) -> np.ndarray:
    """Per-element bound on |w - dequant(quant(w))| for one quantization format.

    affine: one quantization step, (max - min) / (2^bits - 1), per group.
    fp formats: a fraction of the group's largest magnitude (e2m1: 1/4, e4m3: 1/8 -- loose
    bounds that still catch a transposed or misplaced tensor).  ``eps``: relative precision
    of the dtype the scales, biases and dequantized values are stored in (bf16: 2^-8).
    """
    g = w.reshape(-1, w.shape[-1] // group_size, group_size)
    if mode == "affine":
        step = (g.max(-1) - g.min(-1)) / (2**bits - 1)
    else:
        step = np.abs(g).max(-1) * (0.25 if bits == 4 else 0.125)
    step = step + eps * 3 * np.abs(g).max(-1)  # rounding of scale, bias and the result
    return np.broadcast_to(step[..., None], g.shape).reshape(w.shape) + 1e-6


def run(source, out, **kw):
    return convert(ConvertOptions(source=str(source), output=str(out), progress=False, **kw),
                   echo=lambda s: None)


@pytest.fixture(scope="module")
def dg_vision(tmp_path_factory):
    """Re-saved config form, 2-layer vision tower, bf16, widths that every group size divides."""
    from tests.builders import build_diffusion_gemma

    out = tmp_path_factory.mktemp("dg_vision")
    build_diffusion_gemma(out, form="resaved", vision=True, dtype="bfloat16",
                          text_overrides={"intermediate_size": 128, "moe_intermediate_size": 64})
    (out / "processor_config.json").write_text(json.dumps({"processor_class": "Gemma4Processor"}))
    return out


@pytest.fixture(scope="module")
def vision_q4(dg_vision, tmp_path_factory):
    out = tmp_path_factory.mktemp("conv") / "q4"
    result = run(dg_vision, out, quantize=True)
    return out, result


def check_quantized(src, got, path, bits, group_size, mode, dtype=None):
    """Packed layout, error bound, and equality with mx.quantize on the whole source tensor."""
    w = src[path]
    dtype = dtype or (mx.bfloat16 if str(w.dtype) == "torch.bfloat16" else mx.float32)
    ref = mx.array(to_numpy32(w)).astype(dtype)
    want = mx.quantize(ref, group_size=group_size, bits=bits, mode=mode)
    name = path[: -len(".weight")] if path.endswith(".weight") else path
    parts = ("weight", "scales", "biases") if mode == "affine" else ("weight", "scales")
    assert {k for k in got if k.startswith(name + ".")} == {f"{name}.{p}" for p in parts}, name
    for part, arr in zip(parts, want):  # streaming in row chunks == quantizing the whole tensor
        mine = got[f"{name}.{part}"]
        assert mine.dtype == arr.dtype and mine.shape == arr.shape, (name, part)
        assert np.array_equal(np.array(mine.view(mx.uint8)), np.array(arr.view(mx.uint8))), (name, part)
    assert got[f"{name}.weight"].shape[-1] * 32 // bits == w.shape[-1]
    deq = mx.dequantize(*[got[f"{name}.{p}"] for p in parts], group_size=group_size, bits=bits, mode=mode)
    orig = to_numpy32(w)
    err = np.abs(np.array(deq.astype(mx.float32)) - orig)
    eps = 2.0**-8 if ref.dtype == mx.bfloat16 else 2.0**-23
    assert (err <= quant_error_bound(orig, group_size, bits, mode, eps)).all(), name


def test_float_conversion_is_bit_identical_and_config_round_trips(tiny_dg_dir, tmp_path):
    out = tmp_path / "f32"
    result = run(tiny_dg_dir, out)
    src = source_tensors(tiny_dg_dir)
    got = load_output(out)
    assert set(got) == expected_mlx_names(src, keep_vision=True)
    for name, arr in got.items():
        ref = src[hf_name(name)]
        assert arr.shape == tuple(ref.shape), name
        assert arr.dtype == mx.float32
        assert np.array_equal(mx_bits(arr), bits_of(ref)), name
    # encoder and decoder layer scalars are separate tensors, both kept
    assert not np.array_equal(np.array(got["model.encoder.language_model.layers.0.layer_scalar"]),
                              np.array(got["model.decoder.layers.0.layer_scalar"]))
    src_cfg = json.loads((tiny_dg_dir / "config.json").read_text())
    out_cfg = json.loads((out / "config.json").read_text())
    assert ModelArgs.from_config(out_cfg) == ModelArgs.from_config(src_cfg)
    assert {k: v for k, v in out_cfg.items() if k != "dlm"} == src_cfg
    assert out_cfg["dlm"]["source"] == str(tiny_dg_dir.resolve()) and out_cfg["dlm"]["recipe"] is None
    assert "quantization" not in out_cfg
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (out / f).read_bytes() == (tiny_dg_dir / f).read_bytes(), f
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["max_denoising_steps"] == 48 and gen["sampler_config"]["entropy_bound"] == 0.1
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {"model.safetensors"}
    assert index["metadata"]["total_size"] == result.total_bytes
    assert result.parameters == sum(src[hf_name(n)].numel() for n in got)


def test_mixed_recipe_quantizes_per_class(dg_vision, vision_q4):
    out, result = vision_q4
    src = source_tensors(dg_vision)
    got = load_output(out)
    cfg = json.loads((out / "config.json").read_text())
    q = cfg["quantization"]
    assert q == cfg["quantization_config"]
    assert (q["bits"], q["group_size"], q["mode"]) == (4, 64, "affine")
    seen = {"high": 0, "low": 0}
    for mlx_name in expected_mlx_names(src, keep_vision=True):
        module = mlx_name[: -len(".weight")] if mlx_name.endswith(".weight") else mlx_name
        src_name = module if "experts" in module else mlx_name
        if HIGH.search(module) and not module.startswith(VISION_PREFIXES):
            check_quantized(src, got, src_name, 8, 64, "affine")
            assert q[module] == {"bits": 8, "group_size": 64}
            seen["high"] += 1
        elif LOW.search(module):
            check_quantized(src, got, src_name, 4, 64, "affine")
            assert module not in q
            seen["low"] += 1
        else:  # norms, scalars, router.scale, per_expert_scale, vision tower: float, bit-identical
            arr = got[mlx_name]
            assert arr.dtype == mx.bfloat16 and arr.shape == tuple(src[mlx_name].shape), mlx_name
            assert np.array_equal(mx_bits(arr), bits_of(src[mlx_name])), mlx_name
            assert module + ".scales" not in got
    assert seen == {"high": 1 + 6 * 3 + 5 * 4 + 3 + 6, "low": 3 + 6 * 2}
    assert any(n.startswith("model.encoder.vision_tower.") for n in got)
    assert (out / "processor_config.json").is_file()
    # re-saved config form: per_layer_config kept, the flat hub keys added for hub-form readers
    src_cfg = json.loads((dg_vision / "config.json").read_text())
    assert "global_head_dim" not in src_cfg["text_config"]
    assert cfg["text_config"]["per_layer_config"] == src_cfg["text_config"]["per_layer_config"]
    assert (cfg["text_config"]["global_head_dim"], cfg["text_config"]["num_global_key_value_heads"]) == (32, 1)
    assert ModelArgs.from_config(cfg) == ModelArgs.from_config(src_cfg)
    assert result.fallbacks == []
    assert 4.0 < result.bits_per_weight < 16.0


def test_model_card(vision_q4):
    out, result = vision_q4
    text = (out / "README.md").read_text()
    meta = yaml.safe_load(re.match(r"---\n(.*?)\n---\n", text, re.S).group(1))
    assert meta["library_name"] == "mlx" and "mlx" in meta["tags"] and "base_model" not in meta
    assert f"{result.bits_per_weight:.3f} bits per weight" in text
    assert "| 8 | 64 | affine |" in text and "| 4 | 64 | affine |" in text
    assert "dlm-run generate --model q4" in text
    assert text.count(VERIFY_BEGIN) == 1 and text.index(VERIFY_BEGIN) < text.index(VERIFY_END)
    update_card_section(out / "README.md", "| check | result |\n|---|---|\n| logits | pass |")
    update_card_section(out / "README.md", "| check | result |\n|---|---|\n| logits | 1e-5 |")
    new = (out / "README.md").read_text()
    assert "| logits | 1e-5 |" in new and "| logits | pass |" not in new
    assert new.split(VERIFY_BEGIN)[0] == text.split(VERIFY_BEGIN)[0]
    assert new.split(VERIFY_END)[1] == text.split(VERIFY_END)[1]


def test_update_card_section_appends_when_markers_missing(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# model\n")
    update_card_section(readme, "parity: ok")
    text = readme.read_text()
    assert text.startswith("# model\n") and f"{VERIFY_BEGIN}\nparity: ok\n{VERIFY_END}" in text


def test_text_only_drops_vision(dg_vision, tmp_path):
    out = tmp_path / "text"
    run(dg_vision, out, quantize=True, text_only=True)
    got = load_output(out)
    src = source_tensors(dg_vision)
    assert set(n for n in got if not n.endswith((".scales", ".biases"))) == expected_mlx_names(src, False)
    cfg = json.loads((out / "config.json").read_text())
    assert "vision_config" not in cfg and cfg["dlm"]["text_only"] is True
    assert ModelArgs.from_config(cfg).text_only
    assert not (out / "processor_config.json").exists()
    assert "pipeline_tag: text-generation" in (out / "README.md").read_text()


@pytest.mark.parametrize("mode", ["mxfp4", "nvfp4", "mxfp8"])
def test_fp_modes(dg_vision, tmp_path, mode):
    out = tmp_path / mode
    run(dg_vision, out, quantize=True, q_mode=mode)
    src, got = source_tensors(dg_vision), load_output(out)
    q = json.loads((out / "config.json").read_text())["quantization"]
    gs, bits = {"mxfp4": (32, 4), "nvfp4": (16, 4), "mxfp8": (32, 8)}[mode]
    assert (q["bits"], q["group_size"], q["mode"]) == (bits, gs, mode)
    check_quantized(src, got, "model.decoder.layers.5.experts.down_proj", bits, gs, mode)
    check_quantized(src, got, "model.decoder.self_conditioning.up_proj.weight", bits, gs, mode)
    # the 8-bit class stays affine, and says so
    check_quantized(src, got, "model.decoder.layers.5.self_attn.o_proj.weight", 8, 64, "affine")
    assert q["model.decoder.layers.5.self_attn.o_proj"] == {"bits": 8, "group_size": 64, "mode": "affine"}
    assert got["model.decoder.layers.5.experts.down_proj.scales"].dtype == mx.uint8


def test_uniform_recipe_and_group_size_fallback(dg_vision, tmp_path):
    out = tmp_path / "u"
    result = run(dg_vision, out, q_bits=3, q_group_size=128, recipe="uniform", dtype="float32")
    src, got = source_tensors(dg_vision), load_output(out)
    q = json.loads((out / "config.json").read_text())["quantization"]
    assert (q["bits"], q["group_size"], q["mode"]) == (3, 128, "affine")
    # hidden 64 and expert width 64 are not multiples of 128: those stay float and are listed
    expect_false = set()
    for name in expected_mlx_names(src, keep_vision=True):
        module = name[: -len(".weight")] if name.endswith(".weight") else name
        if (HIGH.search(module) or LOW.search(module)) and not module.startswith(VISION_PREFIXES):
            src_name = module if "experts" in module else name
            if src[src_name].shape[-1] % 128:
                expect_false.add(module)
                assert got[name].dtype == mx.float32 and f"{module}.scales" not in got
            else:
                check_quantized(src, got, src_name, 3, 128, "affine", mx.float32)
    assert {k for k, v in q.items() if v is False} == expect_false
    assert not [k for k, v in q.items() if isinstance(v, dict)]
    assert sorted(result.fallbacks) == sorted(expect_false)
    card = (out / "README.md").read_text()
    assert "group-size fallback" in card and "model.decoder.embed_tokens" in card
    # --dtype casts the float tensors, and the config says so
    assert got["model.decoder.norm.weight"].dtype == mx.float32
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"


def test_sharded_input_and_output(tiny_dg_dir, tmp_path):
    src = reshard(tiny_dg_dir, tmp_path / "sharded", 3)
    one = tmp_path / "one"
    many = tmp_path / "many"
    run(tiny_dg_dir, one, quantize=True)
    result = run(src, many, quantize=True, max_shard_bytes=200_000)
    assert len(result.shards) > 2
    assert result.shards[0] == f"model-00001-of-{len(result.shards):05d}.safetensors"
    a, b = load_output(one), load_output(many)
    assert set(a) == set(b)
    for k in a:
        assert np.array_equal(np.array(a[k]), np.array(b[k])), k
    sizes = [(many / f).stat().st_size for f in result.shards]
    assert all(s <= 200_000 + 20_000 for s in sizes)  # data limit plus the header


def test_config_forms_agree():
    """The hub form (flat keys) and the re-saved form (per_layer_config) give one geometry."""
    base = {"model_type": "diffusion_gemma_text", "vocab_size": 512, "hidden_size": 64,
            "intermediate_size": 96, "num_hidden_layers": 12, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4, "top_k_experts": 2,
            "moe_intermediate_size": 32}
    hub = ModelArgs.from_config({**base, "global_head_dim": 32, "num_global_key_value_heads": 1})
    resaved = ModelArgs.from_config({**base, "per_layer_config": {
        "05": {"head_dim": 32, "num_key_value_heads": 1}, "11": {"head_dim": 32, "num_key_value_heads": 1}}})
    assert hub.layer_head_dims == resaved.layer_head_dims == [16] * 5 + [32] + [16] * 5 + [32]
    assert hub.layer_kv_heads == resaved.layer_kv_heads == [2] * 5 + [1] + [2] * 5 + [1]
    missing = ModelArgs.from_config(base)  # transformers: a missing global_head_dim means 512
    assert missing.layer_head_dims[5] == 512 and missing.layer_kv_heads[5] == 2
    only_dim = ModelArgs.from_config({**base, "per_layer_config": {"5": {"head_dim": 64}, "11": {"head_dim": 64}}})
    assert only_dim.layer_head_dims[11] == 64 and only_dim.layer_kv_heads[11] == 2


def test_hub_id_from_offline_cache(tiny_dg_dir, tmp_path, monkeypatch):
    from tests.builders import install_in_hf_cache

    cache = tmp_path / "hub"
    commit = "a" * 40
    install_in_hf_cache(tiny_dg_dir, cache, "google/tiny-diffusiongemma", revision=commit)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(main, ["google/tiny-diffusiongemma", "--q-bits", "4", "--no-progress"])
    assert res.exit_code == 0, res.output
    assert "bits per weight" in res.output
    out = tmp_path / "tiny-diffusiongemma-4bit"
    dlm = json.loads((out / "config.json").read_text())["dlm"]
    assert dlm["source"] == "google/tiny-diffusiongemma" and dlm["commit"] == commit
    text = (out / "README.md").read_text()
    assert "base_model: google/tiny-diffusiongemma" in text and commit in text
    assert set(load_output(out)) >= {"model.decoder.embed_tokens.scales"}
    # a pinned revision resolves too
    res = CliRunner().invoke(main, ["--hf-path", "google/tiny-diffusiongemma", "--revision", commit,
                                    "--mlx-path", "pinned", "--no-progress"])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "pinned" / "config.json").read_text())["dlm"]["revision"] == commit


def test_cli_aliases_and_default_output(tiny_dg_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(main, ["--hf-path", str(tiny_dg_dir), "-q", "--q-mode", "mxfp4",
                                    "--text-only", "--no-progress"])
    assert res.exit_code == 0, res.output
    assert (tmp_path / f"{tiny_dg_dir.name}-mxfp4" / "model.safetensors").is_file()
    res = CliRunner().invoke(main, [str(tiny_dg_dir), "--no-progress", "--dtype", "bfloat16"])
    assert res.exit_code == 0, res.output
    assert "bits per weight" not in res.output
    got = load_output(tmp_path / f"{tiny_dg_dir.name}-bf16")
    assert got["model.decoder.embed_tokens.weight"].dtype == mx.bfloat16
    res = CliRunner().invoke(main, ["--help"])
    assert "--q-bits" in res.output and "--mlx-path" in res.output and "Examples" in res.output


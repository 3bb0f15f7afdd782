"""No silent fallbacks: a config key dlm does not implement is refused (issue 43).

Every family declares the config.json keys it understands (``ModelArgs.config_keys``,
per model_type); ``from_config`` refuses any other key, at any level it checks,
so dlm-convert refuses the checkpoint before writing anything and the loader
refuses an MLX conversion whose config.json carries one. LLaDA2.2's block
routing (``expert_capacity``, ``block_size``) is the case that motivated it: it
was refused until dlm implemented it, and is now accepted.
"""

from __future__ import annotations

import copy
import json
import re

import pytest
from click.testing import CliRunner

from dlm.convert.cli import main as convert_main
from dlm.runtime import loader
from dlm.runtime.models.base import ConfigKeys, check_config_keys
from dlm.runtime.platform.errors import ConfigError
from dlm.runtime.registry import families

from .builders import FAMILY_KITS, build_llada2, copy_checkpoint, leftovers

FAMILIES = {f.name: f for f in families()}
NAMES = sorted(FAMILIES)
UNKNOWN = "is a setting dlm does not implement (it changes the computation); dlm refuses it"

# -- the released configs' keys (values as released, test data) ----------------

# inclusionAI/LLaDA2.0-mini config.json (the keys and values of the identical-architecture
# configs that describe it: dFactory's llada2_mini config, Zigeng/DMax-Math-16B).
LLADA2_0_MINI = {
    "architectures": ["LLaDA2MoeModelLM"],
    "auto_map": {"AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig",
                 "AutoModel": "modeling_llada2_moe.LLaDA2MoeModel",
                 "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM"},
    "model_type": "llada2_moe", "vocab_size": 157184, "hidden_size": 2048, "num_hidden_layers": 20,
    "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 5120,
    "moe_intermediate_size": 512, "first_k_dense_replace": 1, "num_experts": 256, "num_experts_per_tok": 8,
    "num_shared_experts": 1, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
    "score_function": "sigmoid", "norm_topk_prob": True, "moe_router_enable_expert_bias": True,
    "router_dtype": "fp32", "rope_theta": 600000, "partial_rotary_factor": 0.5, "rotary_dim": 64,
    "rope_scaling": None, "rms_norm_eps": 1e-06, "use_qk_norm": True, "use_qkv_bias": False, "use_bias": False,
    "norm_head": False, "norm_softmax": False, "tie_word_embeddings": False, "hidden_act": "silu",
    "max_position_embeddings": 16384, "sliding_window": 4096, "use_sliding_window": False,
    "max_window_layers": 28, "pad_token_id": 156892, "attention_dropout": 0.0, "embedding_dropout": 0.0,
    "output_dropout": 0.0, "initializer_range": 0.02, "use_cache": False, "output_router_logits": False,
    "dtype": "bfloat16", "transformers_version": "4.57.1",
}
# inclusionAI/LLaDA2.1-mini config.json: the same keys, a longer context.
LLADA2_1_MINI = dict(LLADA2_0_MINI, max_position_embeddings=32768)
# inclusionAI/LLaDA2.2-flash's config.json additions over 2.1 (docs/llada2.md, "Configuration and tokens"),
# here on the mini geometry: block routing and the DELETE/SPLIT ids.
LLADA2_2 = dict(LLADA2_1_MINI, expert_capacity=48, block_size=32, delete_token_id=156930,
                split_token_id=156931, rope_theta=3000000, max_position_embeddings=131072)
# A computation-changing key no family implements (MoE capacity factors exist in other MoE configs).
FOREIGN_KEY = "capacity_factor"

_SLIDING, _FULL = "sliding_attention", "full_attention"
# google/diffusiongemma-26B-A4B-it config.json (hub form).
DIFFUSION_GEMMA_26B = {
    "architectures": ["DiffusionGemmaForBlockDiffusion"], "model_type": "diffusion_gemma",
    "canvas_length": 256, "boi_token_id": 255999, "eoi_token_id": 258882, "image_token_id": 258880,
    "eos_token_id": [1, 106], "tie_word_embeddings": True, "initializer_range": 0.02, "dtype": "bfloat16",
    "transformers_version": "5.12.1",
    "text_config": {
        "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 2, "dtype": "bfloat16",
        "eos_token_id": 1, "final_logit_softcapping": 30.0, "global_head_dim": 512, "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2816, "initializer_range": 0.02,
        "intermediate_size": 2112, "layer_types": ([_SLIDING] * 5 + [_FULL]) * 5,
        "max_position_embeddings": 262144, "model_type": "diffusion_gemma_text", "moe_intermediate_size": 704,
        "num_attention_heads": 16, "num_experts": 128, "num_global_key_value_heads": 2, "num_hidden_layers": 30,
        "num_key_value_heads": 8, "pad_token_id": 0, "rms_norm_eps": 1e-06,
        "rope_parameters": {
            _FULL: {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
            _SLIDING: {"rope_theta": 10000.0, "rope_type": "default"},
        },
        "sliding_window": 1024, "tie_word_embeddings": True, "top_k_experts": 8,
        "use_bidirectional_attention": "vision", "vocab_size": 262144,
    },
    "vision_config": {
        "attention_bias": False, "attention_dropout": 0.0, "dtype": "bfloat16", "head_dim": 72,
        "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "initializer_range": 0.02,
        "intermediate_size": 4304, "max_position_embeddings": 131072, "model_type": "gemma4_vision",
        "num_attention_heads": 16, "num_hidden_layers": 27, "num_key_value_heads": 16, "patch_size": 16,
        "pooling_kernel_size": 3, "position_embedding_size": 10240, "rms_norm_eps": 1e-06,
        "rope_parameters": {"rope_theta": 100.0, "rope_type": "default"}, "standardize": True,
        "use_clipped_linears": False,
    },
}


def _resaved(config: dict) -> dict:
    """The form transformers' save_pretrained writes: per_layer_config, no flat global keys."""
    out = copy.deepcopy(config)
    text = out["text_config"]
    dim, kv = text.pop("global_head_dim"), text.pop("num_global_key_value_heads")
    text["per_layer_config"] = {f"{i:02d}": {"head_dim": dim, "num_key_value_heads": kv}
                                for i, t in enumerate(text["layer_types"]) if t == _FULL}
    return out


RELEASED = {
    "LLaDA2.0-mini": LLADA2_0_MINI,
    "LLaDA2.1-mini": LLADA2_1_MINI,
    "LLaDA2.2": LLADA2_2,
    "diffusiongemma-26B-A4B-it": DIFFUSION_GEMMA_26B,
    "diffusiongemma-26B-A4B-it (re-saved)": _resaved(DIFFUSION_GEMMA_26B),
}


def _family(config: dict):
    return next(f for f in families() if config["model_type"] in f.model_types)


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_the_released_configs_are_accepted(name):
    config = RELEASED[name]
    _family(config).config.from_config(copy.deepcopy(config))


def test_llada2_2_turns_block_routing_on_and_checks_its_pool():
    args = _family(LLADA2_2).config.from_config(dict(LLADA2_2))
    assert args.block_routing and (args.expert_capacity, args.block_size) == (48, 32)
    assert not _family(LLADA2_1_MINI).config.from_config(dict(LLADA2_1_MINI)).block_routing
    with pytest.raises(ConfigError, match=re.escape("expert_capacity=4 must be in [num_experts_per_tok=8, "
                                                    "num_experts=256]")):
        _family(LLADA2_2).config.from_config(dict(LLADA2_2, expert_capacity=4))
    with pytest.raises(ConfigError, match="mask_token_id, delete_token_id and split_token_id must differ"):
        _family(LLADA2_2).config.from_config(dict(LLADA2_2, split_token_id=156930))
    with pytest.raises(ConfigError, match=re.escape("split_token_id=157184 is outside the vocabulary")):
        _family(LLADA2_2).config.from_config(dict(LLADA2_2, split_token_id=157184))


# -- every family, every on-disk form ------------------------------------------


@pytest.fixture(scope="module")
def hub_configs(tmp_path_factory):
    """Each family's tiny hub config, by family name."""
    out = {}
    for name in NAMES:
        d = tmp_path_factory.mktemp(name)
        FAMILY_KITS[name].build(d)
        out[name] = json.loads((d / "config.json").read_text())
    return out


def _forms(hub_configs, name):
    return FAMILY_KITS[name].config_forms(hub_configs[name])


@pytest.mark.parametrize("name", NAMES)
def test_every_model_type_declares_its_keys(name):
    family = FAMILIES[name]
    assert sorted(family.config.config_keys) == sorted(family.model_types)
    assert all(isinstance(k, ConfigKeys) for k in family.config.config_keys.values())


@pytest.mark.parametrize("name", NAMES)
def test_every_form_of_the_tiny_configs_is_accepted(hub_configs, name):
    for form, config in _forms(hub_configs, name).items():
        FAMILIES[name].config.from_config(config, f"{form}/config.json")


def _nested_objects(config: dict) -> list[str]:
    """The nested config objects a family reads (text_config, vision_config)."""
    return [k for k in ("text_config", "vision_config") if isinstance(config.get(k), dict)]


@pytest.mark.parametrize("name", NAMES)
def test_an_unknown_key_is_refused_at_top_level_and_nested(hub_configs, name):
    family = FAMILIES[name]
    checked = 0
    for form, config in _forms(hub_configs, name).items():
        places = [""] + [f"{k}." for k in _nested_objects(config)]
        for place in places:
            bad = copy.deepcopy(config)
            (bad[place[:-1]] if place else bad)["frobnicate_attention"] = True
            with pytest.raises(ConfigError) as e:
                family.config.from_config(bad, "x/config.json")
            assert str(e.value) == (f"x/config.json: {place}frobnicate_attention {UNKNOWN} rather than run "
                                    "the model approximately"), (form, place)
            checked += 1
    assert checked >= 3  # a top level and a nested object at least


@pytest.mark.parametrize("value", [None, False, 0, {}])
def test_an_unknown_key_is_refused_whatever_its_value(hub_configs, value):
    """No neutral value passes an unknown key: only the declaration accepts one."""
    config = dict(hub_configs["llada2_moe"], **{FOREIGN_KEY: value})
    with pytest.raises(ConfigError, match=re.escape(f"{FOREIGN_KEY} {UNKNOWN}")):
        FAMILIES["llada2_moe"].config.from_config(config)


def test_diffusion_gemma_checks_its_deeper_objects(hub_configs):
    """per_layer_config entries and rope_parameters are checked key by key too."""
    family = FAMILIES["diffusion_gemma"]
    resaved = _forms(hub_configs, "diffusion_gemma")["resaved"]
    layer = next(iter(resaved["text_config"]["per_layer_config"]))
    bad = copy.deepcopy(resaved)
    bad["text_config"]["per_layer_config"][layer]["sliding_window"] = 8
    with pytest.raises(ConfigError, match=re.escape(f"text_config.per_layer_config.{layer}.sliding_window {UNKNOWN}")):
        family.config.from_config(bad)
    bad = copy.deepcopy(resaved)
    bad["text_config"]["rope_parameters"]["full_attention"]["beta_fast"] = 32
    with pytest.raises(ConfigError, match=re.escape(f"rope_parameters.full_attention.beta_fast {UNKNOWN}")):
        family.config.from_config(bad)
    # The flat form has no vision tower: a vision_config there is not read, so refused.
    flat = dict(_forms(hub_configs, "diffusion_gemma")["text"], vision_config={"hidden_size": 8})
    with pytest.raises(ConfigError, match=re.escape(f"vision_config {UNKNOWN}")):
        family.config.from_config(flat)


@pytest.mark.parametrize("name, path, value, implemented", [
    ("diffusion_gemma", ("text_config", "attention_bias"), True, "false"),
    ("diffusion_gemma", ("tie_word_embeddings",), False, "true"),
    ("llada2_moe", ("score_function",), "softmax", '"sigmoid"'),
    ("llada2_moe", ("use_sliding_window",), True, "false"),
    ("llada2_moe", ("norm_head",), None, "false"),
])
def test_a_fixed_key_at_another_value_is_refused(hub_configs, name, path, value, implemented):
    config = copy.deepcopy(hub_configs[name])
    target = config
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(ConfigError) as e:
        FAMILIES[name].config.from_config(config)
    assert (f"{'.'.join(path)} is {json.dumps(value)} (dlm implements only {implemented}); dlm refuses it"
            in str(e.value)), str(e.value)


def test_the_check_reports_every_problem_at_once():
    keys = ConfigKeys(read=frozenset({"a"}), fixed={"b": (1,)}, nested={"n": ConfigKeys(harmless=frozenset({"x"}))})
    with pytest.raises(ConfigError) as e:
        check_config_keys({"a": 1, "b": 2, "c": 3, "n": {"x": 0, "y": 0}}, keys, "f.json")
    assert str(e.value) == (
        "f.json: c, n.y are settings dlm does not implement (they change the computation); dlm refuses them "
        "rather than run the model approximately; b is 2 (dlm implements only 1); dlm refuses it rather than "
        "run the model approximately")
    # 1 is not true: a fixed value matches with its type.
    with pytest.raises(ConfigError, match="b is true"):
        check_config_keys({"b": True}, keys)


# -- dlm-convert and the loader refuse a checkpoint with an unknown key -------------


@pytest.fixture(scope="module")
def foreign_checkpoint(tmp_path_factory):
    """A tiny LLaDA-2 checkpoint whose config.json has two keys dlm does not implement."""
    src = tmp_path_factory.mktemp("foreign") / "src"
    build_llada2(src, **{FOREIGN_KEY: 1.25, "moe_layer_freq": 2})
    assert json.loads((src / "config.json").read_text())[FOREIGN_KEY] == 1.25
    return src


def test_dlm_convert_refuses_an_unknown_key_and_writes_nothing(foreign_checkpoint, tmp_path):
    out = tmp_path / "out"
    r = CliRunner().invoke(convert_main, [str(foreign_checkpoint), "-o", str(out), "--no-progress"])
    assert r.exit_code == 1, r.output
    assert r.output.startswith("error: ") and "Traceback" not in r.output
    assert f"{FOREIGN_KEY}, moe_layer_freq are settings dlm does not implement" in r.output, r.output
    assert leftovers(tmp_path, out) == []


def test_the_loader_refuses_a_conversion_with_an_unknown_key(tiny_llada2_mlx_dir, tmp_path):
    model = copy_checkpoint(tiny_llada2_mlx_dir, tmp_path / "mlx")
    config = json.loads((model / "config.json").read_text())
    loader.load(model, tokenizer=False)  # the conversion as written loads
    config.update({FOREIGN_KEY: 1.25, "moe_layer_freq": 2})
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as e:
        loader.load(model, tokenizer=False)
    assert str(e.value) == (
        f"{model / 'config.json'}: {FOREIGN_KEY}, moe_layer_freq are settings dlm does not implement "
        "(they change the computation); dlm refuses them rather than run the model approximately")


def test_llada2_takes_mlx_vlms_empty_vision_config_only(hub_configs):
    family = FAMILIES["llada2_moe"]
    for neutral in ({}, None):
        family.config.from_config(dict(hub_configs["llada2_moe"], vision_config=neutral))
    with pytest.raises(ConfigError, match=re.escape('vision_config is {"hidden_size": 8} (dlm implements only '
                                                    '{} or null); dlm refuses it')):
        family.config.from_config(dict(hub_configs["llada2_moe"], vision_config={"hidden_size": 8}))

"""DiffusionGemma config: ``ModelArgs`` from both on-disk forms
(``diffusion_gemma`` with a nested ``text_config``, ``diffusion_gemma_text``
flat), and the config.json dlm-convert writes.
Fields as in transformers 5.24's ``configuration_diffusion_gemma.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...platform.errors import ConfigError
from ..base import METADATA_KEYS, BaseModelArgs, ConfigKeys, ConfigReader, check_config_keys

SLIDING = "sliding_attention"
FULL = "full_attention"
DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
}

# The keys of a DiffusionGemma config.json dlm understands: those of
# google/diffusiongemma-26B-A4B-it's config.json and of what transformers'
# DiffusionGemmaConfig / Gemma4VisionConfig save_pretrained writes (the
# re-saved form's per_layer_config). Any other key, at any of these levels, is
# refused at dlm-convert and at load.
_ROPE = ConfigKeys(read=frozenset({"rope_type", "rope_theta", "partial_rotary_factor", "factor"}))
_TEXT_READ = frozenset({  # what from_config reads of the text config: the computation dlm implements
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "global_head_dim", "num_global_key_value_heads", "layer_types",
    "rms_norm_eps", "sliding_window", "final_logit_softcapping", "num_experts", "top_k_experts",
    "moe_intermediate_size", "hidden_activation", "max_position_embeddings", "pad_token_id", "bos_token_id",
    "eos_token_id", "use_bidirectional_attention",
})
_TEXT_NESTED = {
    # save_pretrained's per-layer overrides: {"05": {"head_dim": 512, "num_key_value_heads": 2}, ...}
    "per_layer_config": ConfigKeys(each=ConfigKeys(read=frozenset({"head_dim", "num_key_value_heads"}))),
    "rope_parameters": ConfigKeys(nested={SLIDING: _ROPE, FULL: _ROPE}),
}
_HARMLESS = METADATA_KEYS | {"initializer_range", "attention_dropout"}  # training only
# The text stack has no biases and shares its embedding with the head and the
# encoder (transformers: tie_word_embeddings false "undoes all ties").
_TEXT_FIXED = {"attention_bias": (False,), "tie_word_embeddings": (True,)}
_TEXT = ConfigKeys(read=_TEXT_READ, harmless=_HARMLESS, fixed=_TEXT_FIXED, nested=_TEXT_NESTED)
_VISION = ConfigKeys(  # VisionArgs.from_config (vision.py) reads these
    read=frozenset({"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "rms_norm_eps", "patch_size", "pooling_kernel_size",
                    "position_embedding_size", "use_clipped_linears", "standardize", "hidden_activation"}),
    # The Gemma 4 vision tower's linears never take a bias, whatever attention_bias says;
    # max_position_embeddings only sizes transformers' RoPE cache.
    harmless=_HARMLESS | {"attention_bias", "max_position_embeddings"},
    nested={"rope_parameters": ConfigKeys(read=frozenset({"rope_type", "rope_theta"}))},
)
_TOP_READ = frozenset({"canvas_length", "image_token_id", "boi_token_id", "eoi_token_id", "eos_token_id"})
CONFIG_KEYS = {
    "diffusion_gemma": ConfigKeys(
        read=_TOP_READ,
        # Gemma 4's soft tokens per image: the image processor's (dlm reads processor_config.json).
        harmless=_HARMLESS | {"vision_soft_tokens_per_image"},
        fixed={"tie_word_embeddings": (True,)},
        nested={"text_config": _TEXT, "vision_config": _VISION},
    ),
    # The flat form: the text config's keys and the top level's (no vision tower).
    "diffusion_gemma_text": ConfigKeys(read=_TEXT_READ | _TOP_READ, harmless=_HARMLESS, fixed=_TEXT_FIXED,
                                       nested=_TEXT_NESTED),
}


@dataclass(kw_only=True)
class ModelArgs(BaseModelArgs):
    vocab_size: int = 262144
    hidden_size: int = 2816
    intermediate_size: int = 2112
    num_hidden_layers: int = 30
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    head_dim: int = 256
    # Per-layer (head_dim, num_kv_heads); filled from global_head_dim /
    # num_global_key_value_heads (hub form) or per_layer_config (re-saved form).
    layer_head_dims: list[int] = field(default_factory=list)
    layer_kv_heads: list[int] = field(default_factory=list)
    layer_types: list[str] = field(default_factory=list)
    rope_parameters: dict = field(default_factory=lambda: dict(DEFAULT_ROPE))
    rms_norm_eps: float = 1e-6
    sliding_window: int = 1024
    final_logit_softcapping: float = 30.0
    num_experts: int = 128
    top_k_experts: int = 8
    moe_intermediate_size: int = 704
    hidden_activation: str = "gelu_pytorch_tanh"
    max_position_embeddings: int = 262144
    canvas_length: int = 256
    pad_token_id: int = 0
    bos_token_id: int = 2
    eos_token_ids: list[int] = field(default_factory=lambda: [1])
    image_token_id: int | None = None
    boi_token_id: int | None = None
    eoi_token_id: int | None = None
    use_bidirectional_attention: str | None = None
    vision_config: dict | None = None
    model_type: str = "diffusion_gemma"
    config_keys = CONFIG_KEYS

    @property
    def text_only(self) -> bool:
        return not self.vision_config

    @classmethod
    def from_config(cls, config: dict, where: str = "config.json") -> "ModelArgs":
        model_type, text, top = _config_parts(config, where)
        check_config_keys(config, cls.config_keys[model_type], where)
        r = ConfigReader(text, where, "text config")
        t = ConfigReader(top, where)
        # Keys are read in this order, so a config with several bad keys
        # reports the same one first.
        args = cls(
            **_layer_fields(r, text, where),
            **_text_fields(r, t, top),
            **_vision_fields(r, t, model_type),
            model_type=model_type,
        )
        _check_args(args, where)
        return args


def _config_parts(config: dict, where: str) -> tuple[str, dict, dict]:
    """(model_type, text config, top-level config): the hub form nests the
    text config; the ``diffusion_gemma_text`` form is flat."""
    model_type = config.get("model_type")
    if model_type == "diffusion_gemma":
        text = config.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError(f"{where}: diffusion_gemma config has no 'text_config' object")
        return model_type, text, config
    if model_type == "diffusion_gemma_text":
        return model_type, config, config
    raise ConfigError(f"{where}: model_type {model_type!r} is not a DiffusionGemma config")


def _layer_types(text: dict, n_layers: int, where: str) -> list[str]:
    """Sliding or full attention per layer; when absent, every sixth layer
    and the last are full."""
    layer_types = list(text.get("layer_types") or [])
    if not layer_types:
        layer_types = [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(n_layers)]
        layer_types[-1] = FULL
    if len(layer_types) != n_layers:
        raise ConfigError(
            f"{where}: layer_types has {len(layer_types)} entries for {n_layers} layers"
        )
    bad = sorted(set(map(str, layer_types)) - {SLIDING, FULL})
    if bad:
        raise ConfigError(f"{where}: unknown layer_types {bad}")
    return layer_types


def _per_layer_overrides(per_layer: dict, where: str) -> dict[int, ConfigReader]:
    """A reader for each layer that ``per_layer_config`` (the re-saved form) overrides."""
    overrides: dict[int, ConfigReader] = {}
    for key, value in per_layer.items():
        try:
            index = int(key)
        except ValueError:
            raise ConfigError(f"{where}: per_layer_config key {key!r} is not a layer index") from None
        if not isinstance(value or {}, dict):
            raise ConfigError(f"{where}: per_layer_config[{key!r}] must be an object")
        overrides[index] = ConfigReader(dict(value or {}), where, f"per_layer_config[{key!r}]")
    return overrides


def _layer_fields(r: ConfigReader, text: dict, where: str) -> dict:
    """The layer count, the attention heads and each layer's (head_dim, kv heads)."""
    n_layers = r.int("num_hidden_layers", minimum=1)
    kv_heads = r.int("num_key_value_heads", minimum=1)
    head_dim = r.int("head_dim", 256, minimum=1)
    layer_types = _layer_types(text, n_layers, where)

    # Full-attention geometry: re-saved form wins (transformers pops the
    # flat keys when per_layer_config exists); a missing global_head_dim
    # means 512 in transformers.
    per_layer = r.dict("per_layer_config", {})
    global_dim = r.int("global_head_dim", 512, minimum=1)
    global_kv = r.int("num_global_key_value_heads", kv_heads, minimum=1)
    overrides = _per_layer_overrides(per_layer, where)
    dims, kvs = [], []
    for i, kind in enumerate(layer_types):
        if i in overrides:
            dims.append(overrides[i].int("head_dim", head_dim, minimum=1))
            kvs.append(overrides[i].int("num_key_value_heads", kv_heads, minimum=1))
        elif kind == FULL and not per_layer:
            dims.append(global_dim)
            kvs.append(global_kv)
        else:
            dims.append(head_dim)
            kvs.append(kv_heads)
    return dict(num_hidden_layers=n_layers, num_key_value_heads=kv_heads, head_dim=head_dim,
                layer_head_dims=dims, layer_kv_heads=kvs, layer_types=layer_types)


def _text_fields(r: ConfigReader, t: ConfigReader, top: dict) -> dict:
    """The text model's sizes, norms, experts, rope and special tokens."""
    rope = dict(DEFAULT_ROPE)
    rope.update(r.dict("rope_parameters", {}))
    vocab = r.int("vocab_size", minimum=1)
    # A top-level eos_token_id (the hub form's) wins over the text config's.
    eos_key = "eos_token_id" if top.get("eos_token_id") is not None else None
    eos_ids = (t.token_ids("eos_token_id", vocab=vocab) if eos_key
               else r.token_ids("eos_token_id", [1], vocab=vocab))
    return dict(
        vocab_size=vocab,
        hidden_size=r.int("hidden_size", minimum=1),
        intermediate_size=r.int("intermediate_size", minimum=1),
        num_attention_heads=r.int("num_attention_heads", minimum=1),
        rope_parameters=rope,
        rms_norm_eps=r.float("rms_norm_eps", 1e-6, positive=True),
        sliding_window=r.int("sliding_window", 1024, minimum=2),
        final_logit_softcapping=r.float("final_logit_softcapping", 0.0) or 30.0,
        num_experts=r.int("num_experts", minimum=1),
        top_k_experts=r.int("top_k_experts", minimum=1),
        moe_intermediate_size=r.int("moe_intermediate_size", minimum=1),
        hidden_activation=r.str("hidden_activation", "gelu_pytorch_tanh"),
        max_position_embeddings=r.int("max_position_embeddings", 262144, minimum=2),
        canvas_length=t.int("canvas_length", 256, minimum=1),
        pad_token_id=r.int("pad_token_id", 0, minimum=0),
        bos_token_id=r.int("bos_token_id", 0, minimum=0) or 2,
        eos_token_ids=eos_ids,
    )


def _vision_fields(r: ConfigReader, t: ConfigReader, model_type: str) -> dict:
    """The image tokens, how they attend, and the vision tower's config (only
    the nested form has one; None: a text-only model)."""
    return dict(
        image_token_id=t.int("image_token_id", None, minimum=0),
        boi_token_id=t.int("boi_token_id", None, minimum=0),
        eoi_token_id=t.int("eoi_token_id", None, minimum=0),
        use_bidirectional_attention=r.str("use_bidirectional_attention", None),
        vision_config=t.dict("vision_config", None) if model_type == "diffusion_gemma" else None,
    )


def _check_args(args: ModelArgs, where: str) -> None:
    """Refuse what the fields allow one by one but the model cannot run."""
    if args.top_k_experts > args.num_experts:
        raise ConfigError(f"{where}: top_k_experts={args.top_k_experts} exceeds num_experts={args.num_experts}")
    if args.use_bidirectional_attention == "all":
        raise ConfigError(f"{where}: use_bidirectional_attention='all' is not supported")
    if args.hidden_activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ConfigError(f"{where}: unsupported hidden_activation {args.hidden_activation!r}")



def output_config(config: dict, text_only: bool) -> dict:
    """config.json to write next to the converted weights."""
    out = dict(config)
    if text_only and out.get("model_type") == "diffusion_gemma":
        out.pop("vision_config", None)
        out.pop("vision_soft_tokens_per_image", None)
    # Re-saved form: also write the flat hub keys (transformers ignores them
    # next to per_layer_config; MLX tools that only read the hub form need them).
    nested = isinstance(out.get("text_config"), dict)
    text = dict(out["text_config"]) if nested else out
    if text.get("per_layer_config"):
        args = ModelArgs.from_config(config)
        full = {(d, kv) for d, kv, t in zip(args.layer_head_dims, args.layer_kv_heads, args.layer_types)
                if t == FULL}
        overridden = {int(k) for k in text["per_layer_config"]}
        if len(full) == 1 and overridden <= {i for i, t in enumerate(args.layer_types) if t == FULL}:
            text["global_head_dim"], text["num_global_key_value_heads"] = full.pop()
        if nested:
            out["text_config"] = text
    return out

"""DiffusionGemma config: ``ModelArgs`` from both on-disk forms
(``diffusion_gemma`` with a nested ``text_config``, ``diffusion_gemma_text``
flat), and the config.json dlm-convert writes.
Reference: ../shared/reference/diffusion_gemma.md (transformers 5.24).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...errors import ConfigError

SLIDING = "sliding_attention"
FULL = "full_attention"
DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
}


@dataclass
class ModelArgs:
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

    @property
    def text_only(self) -> bool:
        return not self.vision_config

    @classmethod
    def from_config(cls, config: dict, where: str = "config.json") -> "ModelArgs":
        model_type = config.get("model_type")
        if model_type == "diffusion_gemma":
            text = config.get("text_config")
            if not isinstance(text, dict):
                raise ConfigError(f"{where}: diffusion_gemma config has no 'text_config' object")
            top = config
        elif model_type == "diffusion_gemma_text":
            text, top = config, config
        else:
            raise ConfigError(f"{where}: model_type {model_type!r} is not a DiffusionGemma config")

        def need(key: str) -> Any:
            if key not in text:
                raise ConfigError(f"{where}: text config is missing required key {key!r}")
            return text[key]

        n_layers = int(need("num_hidden_layers"))
        kv_heads = int(need("num_key_value_heads"))
        head_dim = int(text.get("head_dim", 256))
        layer_types = list(text.get("layer_types") or [])
        if not layer_types:
            layer_types = [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(n_layers)]
            layer_types[-1] = FULL
        if len(layer_types) != n_layers:
            raise ConfigError(
                f"{where}: layer_types has {len(layer_types)} entries for {n_layers} layers"
            )
        bad = sorted(set(layer_types) - {SLIDING, FULL})
        if bad:
            raise ConfigError(f"{where}: unknown layer_types {bad}")

        # Full-attention geometry: re-saved form wins (transformers pops the
        # flat keys when per_layer_config exists); a missing global_head_dim
        # means 512 in transformers.
        per_layer = text.get("per_layer_config") or {}
        global_dim = int(text.get("global_head_dim") or 512)
        global_kv = int(text.get("num_global_key_value_heads") or kv_heads)
        overrides: dict[int, dict] = {}
        for key, value in per_layer.items():
            try:
                overrides[int(key)] = dict(value or {})
            except ValueError as exc:
                raise ConfigError(f"{where}: per_layer_config key {key!r} is not a layer index") from exc
        dims, kvs = [], []
        for i, kind in enumerate(layer_types):
            if i in overrides:
                dims.append(int(overrides[i].get("head_dim", head_dim)))
                kvs.append(int(overrides[i].get("num_key_value_heads", kv_heads)))
            elif kind == FULL and not per_layer:
                dims.append(global_dim)
                kvs.append(global_kv)
            else:
                dims.append(head_dim)
                kvs.append(kv_heads)

        rope = dict(DEFAULT_ROPE)
        rope.update(text.get("rope_parameters") or {})
        eos = top.get("eos_token_id", text.get("eos_token_id", 1))
        eos_ids = [int(e) for e in (eos if isinstance(eos, list) else [eos])]
        args = cls(
            vocab_size=int(need("vocab_size")),
            hidden_size=int(need("hidden_size")),
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=n_layers,
            num_attention_heads=int(need("num_attention_heads")),
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            layer_head_dims=dims,
            layer_kv_heads=kvs,
            layer_types=layer_types,
            rope_parameters=rope,
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            sliding_window=int(text.get("sliding_window", 1024)),
            final_logit_softcapping=float(text.get("final_logit_softcapping") or 30.0),
            num_experts=int(need("num_experts")),
            top_k_experts=int(need("top_k_experts")),
            moe_intermediate_size=int(need("moe_intermediate_size")),
            hidden_activation=str(text.get("hidden_activation", "gelu_pytorch_tanh")),
            max_position_embeddings=int(text.get("max_position_embeddings", 262144)),
            canvas_length=int(top.get("canvas_length", 256)),
            pad_token_id=int(text.get("pad_token_id", 0) or 0),
            bos_token_id=int(text.get("bos_token_id", 2) or 2),
            eos_token_ids=eos_ids,
            image_token_id=top.get("image_token_id"),
            boi_token_id=top.get("boi_token_id"),
            eoi_token_id=top.get("eoi_token_id"),
            use_bidirectional_attention=text.get("use_bidirectional_attention"),
            vision_config=top.get("vision_config") if model_type == "diffusion_gemma" else None,
            model_type=model_type,
        )
        if args.use_bidirectional_attention == "all":
            raise ConfigError(f"{where}: use_bidirectional_attention='all' is not supported")
        if args.hidden_activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ConfigError(f"{where}: unsupported hidden_activation {args.hidden_activation!r}")
        return args



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

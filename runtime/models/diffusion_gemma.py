"""DiffusionGemma (``diffusion_gemma`` / ``diffusion_gemma_text``) for MLX.

This file is the whole family on the MLX side: the config (both on-disk forms),
the HF->MLX weight plan used by dlm-convert, the quantization classes used by
the recipes in ``dlm.quantize``, and the MLX modules used by the runtime.
Reference: ../shared/reference/diffusion_gemma.md (transformers 5.24).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError, WeightError
from ..weights import TensorPlan

# ---------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------
# HF -> MLX weight plan (dlm-convert) and quantization classes (dlm.quantize)
# ---------------------------------------------------------------------------

_DEC = "model.decoder."
_ENC_TEXT = "model.encoder.language_model."
_VISION = ("model.encoder.vision_tower.", "model.encoder.embed_vision.")
_CLIPPED = re.compile(r"\.(input|output)_(max|min)$")
_HIGH = re.compile(r"\.(self_attn\.\w+|mlp\.(gate|up|down))_proj$")
_LOW = re.compile(r"\.(experts\.(gate_up|down)|self_conditioning\.(gate|up|down))_proj$")


def expected_text_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every text tensor of an HF checkpoint with its shape (HF names)."""
    H, I, E, M = args.hidden_size, args.intermediate_size, args.num_experts, args.moe_intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        _DEC + "embed_tokens.weight": (args.vocab_size, H),
        _DEC + "norm.weight": (H,),
        _DEC + "self_conditioning.pre_norm.weight": (H,),
        _DEC + "self_conditioning.gate_proj.weight": (I, H),
        _DEC + "self_conditioning.up_proj.weight": (I, H),
        _DEC + "self_conditioning.down_proj.weight": (H, I),
    }
    norms = (
        "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
        "post_feedforward_layernorm", "pre_feedforward_layernorm_2",
        "post_feedforward_layernorm_1", "post_feedforward_layernorm_2",
    )
    nh = args.num_attention_heads
    for i in range(args.num_hidden_layers):
        p = f"{_DEC}layers.{i}."
        d, kv = args.layer_head_dims[i], args.layer_kv_heads[i]
        for n in norms:
            shapes[p + n + ".weight"] = (H,)
        shapes[p + "layer_scalar"] = (1,)
        shapes[p + "mlp.gate_proj.weight"] = (I, H)
        shapes[p + "mlp.up_proj.weight"] = (I, H)
        shapes[p + "mlp.down_proj.weight"] = (H, I)
        shapes[p + "router.proj.weight"] = (E, H)
        shapes[p + "router.scale"] = (H,)
        shapes[p + "router.per_expert_scale"] = (E,)
        shapes[p + "experts.gate_up_proj"] = (E, 2 * M, H)
        shapes[p + "experts.down_proj"] = (E, H, M)
        shapes[p + "self_attn.q_proj.weight"] = (nh * d, H)
        shapes[p + "self_attn.k_proj.weight"] = (kv * d, H)
        if args.layer_types[i] == SLIDING:
            shapes[p + "self_attn.v_proj.weight"] = (kv * d, H)
        shapes[p + "self_attn.o_proj.weight"] = (H, nh * d)
        shapes[p + "self_attn.q_norm.weight"] = (d,)
        shapes[p + "self_attn.k_norm.weight"] = (d,)
        shapes[f"{_ENC_TEXT}layers.{i}.layer_scalar"] = (1,)
    return shapes


def mlx_name(hf_name: str) -> str:
    """HF tensor name -> MLX name (mlx-community layout: fused experts get .weight)."""
    if hf_name.endswith(("experts.gate_up_proj", "experts.down_proj")):
        return hf_name + ".weight"
    return hf_name


def plan_weights(
    args: ModelArgs, source: dict[str, tuple[tuple[int, ...], str]], text_only: bool
) -> list[TensorPlan]:
    """Map an HF DiffusionGemma checkpoint to MLX tensors.

    ``source`` maps each tensor name in the checkpoint to (shape, dtype).
    Raises WeightError naming the first missing or mis-shaped tensor.
    """
    expected = expected_text_shapes(args)
    keep_vision = not text_only and not args.text_only
    plans: list[TensorPlan] = []
    for name, want in expected.items():
        if name not in source:
            raise WeightError(f"checkpoint is missing tensor {name} (expected shape {list(want)})")
        got = tuple(source[name][0])
        if got != want:
            raise WeightError(
                f"tensor {name} has shape {list(got)} but the config implies {list(want)}"
            )
        plans.append(TensorPlan(mlx_name(name), (name,)))
    for name in source:
        if name in expected:
            continue
        if name.startswith(_VISION):
            if keep_vision and not _CLIPPED.search(name):
                plans.append(TensorPlan(name, (name,)))
            continue
        if (
            name == "lm_head.weight"  # tied to embed_tokens
            or name.startswith(_ENC_TEXT)  # tied copies of the decoder
            or "rotary_emb" in name
            or name.endswith("inv_freq")
        ):
            continue
        raise WeightError(f"unexpected tensor {name} in a DiffusionGemma checkpoint")
    if keep_vision and not any(p.name.startswith(_VISION[0]) for p in plans):
        raise WeightError(
            "config has a vision_config but the checkpoint has no model.encoder.vision_tower.* "
            "tensors; convert with --text-only"
        )
    return plans


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


def quant_class(path: str) -> str | None:
    """Which recipe class a module belongs to.

    "high": kept at 8 bits by the mixed recipe (embeddings, attention, dense
    MLP, router projection); "low": at --q-bits (routed experts,
    self-conditioning); None: never quantized (norms, scalars, router scale,
    per-expert scale, vision tower and embed_vision).
    """
    if path.startswith(_VISION):
        return None
    if path.endswith(("embed_tokens", "router.proj")) or _HIGH.search(path):
        return "high"
    if _LOW.search(path):
        return "low"
    return None


# ---------------------------------------------------------------------------
# MLX modules (runtime): see diffusion_gemma_layers.py
# ---------------------------------------------------------------------------

from .diffusion_gemma_layers import Model, PrefixCache, sanitize  # noqa: E402,F401

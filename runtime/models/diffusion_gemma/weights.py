"""DiffusionGemma weight map, both directions.

* ``plan_weights``: HF checkpoint -> MLX tensors (dlm-convert), checking every
  name and shape against the config;
* ``sanitize``: any supported on-disk layout (dlm, mlx-community, plain HF) ->
  the MLX module tree (load time);
* ``to_hf``: MLX tensors -> HF names (dlm-verify feeds them to the reference);
* ``quant_class``: which recipe class each module belongs to (dlm.quantize).
"""

from __future__ import annotations

import re

import mlx.core as mx

from ...platform.errors import WeightError
from ..plan import Renamed, TensorPlan
from .config import SLIDING, ModelArgs

_DEC = "model.decoder."
_ENC_TEXT = "model.encoder.language_model."
_VISION = ("model.encoder.vision_tower.", "model.encoder.embed_vision.")
_CLIPPED = re.compile(r"\.(input|output)_(max|min)$")
_HIGH = re.compile(r"\.(self_attn\.\w+|mlp\.(gate|up|down))_proj$")
_LOW = re.compile(r"\.(experts\.(gate_up|down)|self_conditioning\.(gate|up|down))_proj$")
_VISION_LINEAR = re.compile(r"^model\.encoder\.vision_tower\.encoder\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.linear$")


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


def hf_name(name: str) -> str | None:
    """MLX tensor name -> HF name (the inverse of mlx_name); None for the tied lm_head."""
    if name == "lm_head.weight":
        return None
    if name.endswith(("experts.gate_up_proj.weight", "experts.down_proj.weight")):
        return name[: -len(".weight")]
    return name


def to_hf(mlx_weights) -> Renamed:
    """MLX weights under HF names, as a lazy view (dlm-verify hands them to the
    PyTorch reference one tensor at a time)."""
    return Renamed(mlx_weights, hf_name)


def plan_weights(
    args: ModelArgs, source: dict[str, tuple[tuple[int, ...], str]], text_only: bool
) -> list[TensorPlan]:
    """Map an HF DiffusionGemma checkpoint to MLX tensors.

    ``source`` maps each tensor name in the checkpoint to (shape, dtype).
    Raises WeightError naming the first missing or mis-shaped tensor.
    """
    expected = expected_text_shapes(args)
    keep_vision = not text_only and not args.text_only
    clipped = keep_vision and bool((args.vision_config or {}).get("use_clipped_linears"))
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
            if keep_vision and (clipped or not _CLIPPED.search(name)):
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


def quant_class(path: str) -> str | None:
    """Which recipe class a module belongs to.

    "high": kept at 8 bits by the mixed recipe (embeddings, attention, dense
    MLP, router projection); "low": at --q-bits (routed experts,
    self-conditioning); "vision": the vision tower's layer linears (float
    unless dlm-convert --quantize-vision); None: never quantized (norms,
    scalars, router scale, per-expert scale, the patch embedder, embed_vision).
    """
    if path.startswith(_VISION):
        return "vision" if _VISION_LINEAR.match(path) else None
    if path.endswith(("embed_tokens", "router.proj")) or _HIGH.search(path):
        return "high"
    if _LOW.search(path):
        return "low"
    return None


# Load time: HF checkpoints and mlx-community conversions load as they are.
_UNFUSED = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(\w+)$")
_DROP = re.compile(r"(^lm_head\.|rotary_emb|inv_freq$)")


def sanitize(weights: dict, args: ModelArgs | None = None) -> dict:
    """Map any supported on-disk layout onto this module tree.

    * HF names: fused experts ``experts.gate_up_proj`` / ``experts.down_proj`` get
      ``.weight``; tied ``lm_head`` and rotary buffers are dropped.
    * Un-fused per-expert keys (``experts.{e}.{gate,up,down}_proj.{weight,scales,biases}``)
      are stacked and gate/up fused along the output axis.
    * ``model.encoder.language_model.*`` keeps only ``layers.{i}.layer_scalar``.
    * Vision tower / embed_vision tensors are dropped when ``args`` has no
      vision tower (a text-only config), and so are the clip bounds of a tower
      without use_clipped_linears.
    """
    out: dict = {}
    unfused: dict[tuple[str, str, str], dict[int, mx.array]] = {}
    vision = None if args is None else args.vision_config
    for name, value in weights.items():
        if _DROP.search(name):
            continue
        if name.startswith(_VISION) and (
            not vision or (_CLIPPED.search(name) and not vision.get("use_clipped_linears"))
        ):
            continue
        if name.startswith("model.encoder.language_model.") and not name.endswith(".layer_scalar"):
            continue
        m = _UNFUSED.match(name)
        if m:
            prefix, e, proj, suffix = m.groups()
            unfused.setdefault((prefix, proj, suffix), {})[int(e)] = value
            continue
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            name += ".weight"
        out[name] = value
    stacked: dict[tuple[str, str, str], mx.array] = {}
    for key, parts in unfused.items():
        stacked[key] = mx.stack([parts[e] for e in sorted(parts)])
    for (prefix, proj, suffix), value in stacked.items():
        if proj == "down_proj":
            out[f"{prefix}.down_proj.{suffix}"] = value
        elif proj == "gate_proj":
            up = stacked.get((prefix, "up_proj", suffix))
            if up is not None:
                out[f"{prefix}.gate_up_proj.{suffix}"] = mx.concatenate([value, up], axis=1)
    return out

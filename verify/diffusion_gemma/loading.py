"""DiffusionGemma's PyTorch reference: transformers' ``DiffusionGemmaForBlockDiffusion``
on CPU, whole in memory or layer-streamed (``dlm.verify.streaming``), from the
checkpoint's safetensors or from a converted model's dequantized weights.
torch and transformers are imported inside the functions."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dlm.runtime.checkpoint import read_json
from dlm.runtime.platform.errors import ConfigError, DlmError, WeightError

from ..protocol import torch_dtype
from .images import VISION_PREFIXES

# Tiny stand-in for the vision tower when the config has none (text-only
# conversions): transformers always builds one, and its default is 150M params.
_STUB_VISION = dict(
    hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1,
    num_key_value_heads=1, head_dim=8, patch_size=4, pooling_kernel_size=2,
    position_embedding_size=8,
)


@dataclass
class Reference:
    model: Any  # DiffusionGemmaForBlockDiffusion
    config: dict
    generation_config: dict
    dtype: str
    path: Path
    notes: list[str] = field(default_factory=list)
    streamer: Any = None  # dlm.verify.streaming.LayerStreamer when layer-streamed
    prefilled: Any = None  # streamed: (prompt key, encoder cache) of the last prefill


# The reference's layer stacks: streamed layer by layer, and captured by the
# per-layer hidden-state diagnostic (the text stacks, in computation order).
TEXT_STACKS = {"encoder": "model.encoder.language_model.layers", "decoder": "model.decoder.layers"}
VISION_STACK = "model.encoder.vision_tower.encoder.layers"


def reference_layers(ref: Reference) -> dict:
    """``{stack: [layer modules]}`` whose outputs the per-layer diagnostic compares."""
    return {name: list(ref.model.get_submodule(path)) for name, path in TEXT_STACKS.items()}


def reference_routers(ref: Reference) -> dict:
    """``{stack + ROUTES: [router modules]}``: each returns its float32 probabilities
    first, which the routing diagnostic compares with MLX's expert ids."""
    from ..layers import ROUTES

    return {name + ROUTES: [layer.router for layer in layers] for name, layers in reference_layers(ref).items()}




def _hf_config_dict(config: dict) -> dict:
    """A config.json (original or converted) as transformers' DiffusionGemmaConfig accepts it."""
    cfg = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config", "dlm")}
    if cfg.get("model_type") == "diffusion_gemma_text":
        # A bare text config: wrap it (the reference class is the full model).
        cfg = {"model_type": "diffusion_gemma", "text_config": cfg}
    if not cfg.get("vision_config"):
        cfg["vision_config"] = dict(_STUB_VISION, model_type="gemma4_vision")
    return cfg


def load_reference(path, *, dtype: str = "float32", weights: dict | None = None,
                   trust_remote_code: bool = False, stream: bool = False) -> Reference:
    """transformers' DiffusionGemmaForBlockDiffusion on CPU (see the protocol).

    DiffusionGemma is native to transformers >= 5.24, so no checkpoint code is
    ever run; ``trust_remote_code`` is accepted for the protocol and ignored.
    ``stream``: the same model with its weights streamed layer by layer
    (``dlm.verify.streaming``): the text layers (each serving both the encoder
    and the decoder) and the vision tower's layers.
    """

    path = Path(path)
    ref_dtype = torch_dtype(dtype)
    config = read_json(path / "config.json", "config")
    if config.get("model_type") not in ("diffusion_gemma", "diffusion_gemma_text"):
        raise ConfigError(f"{path / 'config.json'}: model_type {config.get('model_type')!r} is not DiffusionGemma")
    try:
        from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise DlmError(
            f"the DiffusionGemma reference needs transformers>=5.24 with DiffusionGemma ({exc})"
        ) from None
    gen_path = path / "generation_config.json"
    generation_config = read_json(gen_path, "generation config") if gen_path.exists() else {}
    notes: list[str] = []

    if stream:
        return _streamed(path, config, generation_config, dtype, ref_dtype, weights)
    if weights is None:
        if not any(path.glob("*.safetensors")):
            raise WeightError(
                f"{path}: no *.safetensors files (dlm-verify loads reference weights only from safetensors)"
            )
        try:
            model = DiffusionGemmaForBlockDiffusion.from_pretrained(
                str(path), dtype=ref_dtype, use_safetensors=True
            )
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            raise DlmError(f"could not load the reference from {path}: {exc}") from None
    else:
        hf_config = DiffusionGemmaConfig.from_dict(_hf_config_dict(config))
        from transformers.initialization import no_init_weights

        with no_init_weights():
            model = DiffusionGemmaForBlockDiffusion(hf_config)
        _load_weights(model, weights, ref_dtype)
        notes.append("weights: the MLX model's (dequantized)")
    model = model.to(ref_dtype).eval()
    return Reference(model, config, generation_config, dtype, path, notes)


def _streamed(path: Path, config: dict, generation_config: dict, dtype: str, ref_dtype, weights) -> Reference:
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    from .. import streaming as S

    source = S.as_source(weights, path)
    hf_config = DiffusionGemmaConfig.from_dict(_hf_config_dict(config))
    with S.empty_parameters():
        model = DiffusionGemmaForBlockDiffusion(hf_config)
    model.tie_weights()
    model = model.to(ref_dtype).eval()
    # Text-only weights leave the vision tower unused (no image rows), as whole-model loading does.
    vision = any(str(k).startswith(VISION_PREFIXES) for k in source.keys())
    stacks = S.stacks_of(model, *TEXT_STACKS.values(), *([VISION_STACK] if vision else []))
    optional = (lambda n: False) if vision else (lambda n: n.startswith(VISION_PREFIXES))
    streamer = S.LayerStreamer(model, source, ref_dtype, stacks, optional=optional,
                               strict=weights is not None)
    notes = ["weights: the MLX model's (dequantized)"] if weights is not None else []
    notes.append("layer-streamed: each layer's weights read from disk for every forward pass")
    return Reference(model, config, generation_config, dtype, path, notes, streamer)


def _load_weights(model, weights: dict, target_dtype) -> None:
    """Copy ``{hf_name: array}`` into the model; every decoder tensor and
    encoder layer scalar must be provided (tied encoder weights follow), and
    when the weights hold any vision tower / embed_vision tensor, every one of
    those too (text-only weights leave the tower unused: no image rows)."""
    import torch

    own = dict(model.named_parameters())
    own.update(dict(model.named_buffers()))
    vision = any(str(name).startswith(VISION_PREFIXES) for name in weights)
    need = {
        n for n in own
        if n.startswith("model.decoder.")
        or (n.startswith("model.encoder.language_model.layers.") and n.endswith("layer_scalar"))
        or (vision and n.startswith(VISION_PREFIXES))
    }
    with torch.no_grad():
        for name in weights:
            value = weights[name]
            if name not in own:
                raise WeightError(f"MLX tensor {name} has no counterpart in the PyTorch reference")
            target = own[name]
            src = torch.from_numpy(np.ascontiguousarray(value))
            if tuple(src.shape) != tuple(target.shape):
                raise WeightError(
                    f"MLX tensor {name} has shape {list(src.shape)}; the reference expects {list(target.shape)}"
                )
            target.data = src.to(target_dtype).clone()
            need.discard(name)
    missing = sorted(n for n in need if not n.endswith("inv_freq") and "rotary" not in n
                     and not n.endswith("embed_scale"))
    if missing:
        raise WeightError(f"the MLX model lacks tensor {missing[0]} (and {len(missing) - 1} more)")
    model.tie_weights()

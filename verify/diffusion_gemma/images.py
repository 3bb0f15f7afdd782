"""DiffusionGemma images in the parity suite: which checkpoints take images,
the vision features of both frameworks, and the image inputs of the
reference's encoder and ``generate`` (the adapter's image hooks).

The reference is transformers' own path: ``get_image_features(...)
.pooler_output`` (vision tower + embed_vision) for the features; for a prompt,
``pixel_values`` / ``image_position_ids`` / ``mm_token_type_ids`` go to the
encoder's prefill call (which scatters the features into the image token
positions and makes each image block bidirectional) and to ``generate``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np

from dlm.runtime.models.diffusion_gemma.images import PROCESSOR_FILES

VISION_PREFIXES = ("model.encoder.vision_tower.", "model.encoder.embed_vision.")


def has_vision(config: dict) -> bool:
    """A full DiffusionGemma config with a vision tower (a text-only conversion has no vision_config)."""
    return config.get("model_type") == "diffusion_gemma" and bool(config.get("vision_config"))


def image_support(path, config: dict) -> Optional[str]:
    if not has_vision(config):
        return "has no vision_config in its config.json (a text-only checkpoint)"
    if not any((Path(path) / f).is_file() for f in PROCESSOR_FILES):
        return f"ships no image processor files ({' or '.join(PROCESSOR_FILES)})"
    return None


def is_vision_weight(name: str) -> bool:
    return name.startswith(VISION_PREFIXES)


def torch_image_kwargs(model, ids, images: list) -> dict:
    """The image inputs of the encoder's prefill call and of ``generate`` for a
    prompt ``ids`` ([1, S] long tensor) holding ``images`` (ImageInputs)."""
    import torch

    if not images:
        return {}
    dtype = next(model.model.encoder.vision_tower.parameters()).dtype
    pixels = torch.from_numpy(np.stack([np.asarray(i.pixel_values, np.float32) for i in images])).to(dtype)
    positions = torch.from_numpy(np.stack([np.asarray(i.position_ids, np.int64) for i in images]))
    return {
        "pixel_values": pixels,
        "image_position_ids": positions,
        "mm_token_type_ids": (ids == int(model.config.image_token_id)).long(),
    }


def reference_image_features(ref, image) -> np.ndarray:
    """transformers' ``get_image_features(...).pooler_output`` for one image, float32 [n, hidden]."""
    import torch

    encoder = ref.model.model.encoder
    dtype = next(encoder.vision_tower.parameters()).dtype
    pixels = torch.from_numpy(np.asarray(image.pixel_values, np.float32)[None]).to(dtype)
    positions = torch.from_numpy(np.asarray(image.position_ids, np.int64)[None])
    with torch.no_grad():
        out = encoder.get_image_features(pixels, positions, return_dict=True).pooler_output
    return out.reshape(-1, out.shape[-1]).float().numpy()


def mlx_image_features(loaded, image) -> np.ndarray:
    """The runtime's vision encoder (``Model.encode_image``), float32 [n, hidden]."""
    import mlx.core as mx

    out = loaded.model.encode_image(image.pixel_values, image.position_ids)
    return np.array(out.astype(mx.float32))


def mlx_prefill(loaded, ids: list[int], cache, images: list, collect: Optional[list] = None) -> None:
    """The runtime's prefill of a prompt with images: the vision encoder, then
    the prompt with the features in place and image blocks bidirectional.
    ``collect``: gets each encoder layer's output (``Model.encode``)."""
    import mlx.core as mx

    from dlm.runtime.models.diffusion_gemma.model import image_blocks

    model = loaded.model
    if not images:
        model.prefill(ids, cache, collect=collect)
        return
    features = [model.encode_image(i.pixel_values, i.position_ids) for i in images]
    features = mx.concatenate(features, axis=0) if len(features) > 1 else features[0]
    model.prefill(ids, cache, features=features, blocks=image_blocks(ids, loaded.args.image_token_id),
                  collect=collect)

"""Built-in test images of the parity suite and the prompts that hold them.

The images are drawn in code (numpy + Pillow: no downloads, no files), so
every machine makes the same pixels: a gradient, a checkerboard and a wide
strip, of different sizes and aspect ratios. ``image_prompts`` runs them
through the reference checkpoint's own tokenizer, chat template and image
processor (``dlm.runtime.api.encode_inputs``, as ``dlm-run`` does); bundles
store the processed pixel arrays, so a comparison later needs neither.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dlm.runtime.generation.inputs import ImageInput, PromptInputs

from .protocol import LogitCase

# (text, names of its images in order): one image, then two.
IMAGE_PROMPTS = (
    ("Describe this image in one sentence.", ("gradient",)),
    ("What is different between these two images?", ("checker", "strip")),
)


def _gradient() -> np.ndarray:
    """96 x 64: red grows left to right, green top to bottom, blue constant."""
    y, x = np.mgrid[0:64, 0:96]
    return np.stack([x * 255 // 95, y * 255 // 63, np.full_like(x, 128)], -1)


def _checker() -> np.ndarray:
    """64 x 64: 8-pixel squares in orange-red and blue."""
    y, x = np.mgrid[0:64, 0:64]
    on = ((x // 8 + y // 8) % 2 == 0)[..., None]
    return np.where(on, np.array([230, 60, 40]), np.array([30, 90, 200]))


def _strip() -> np.ndarray:
    """256 x 32: seven colour bands under a horizontal sine of brightness."""
    bands = np.array([[228, 26, 28], [255, 127, 0], [255, 221, 51], [77, 175, 74], [55, 126, 184],
                      [152, 78, 163], [240, 240, 240]], np.float64)
    x = np.arange(256)
    row = bands[np.minimum(x * 7 // 256, 6)] * (0.75 + 0.25 * np.sin(x / 9.0))[:, None]
    y = np.linspace(0.85, 1.0, 32)[:, None, None]
    return row[None] * y


BUILTIN_IMAGES = {"gradient": _gradient, "checker": _checker, "strip": _strip}


def builtin_image(name: str):
    """One built-in image as an RGB PIL image."""
    from PIL import Image

    pixels = np.clip(np.rint(BUILTIN_IMAGES[name]()), 0, 255).astype(np.uint8)
    return Image.fromarray(pixels, "RGB")


@dataclass
class ImagePrompt:
    """A prompt with images: its ids (placeholders expanded) and its images' names, in order."""

    ids: list[int]
    images: list[str]


@dataclass
class ImageSet:
    """The image part of a suite: processed images by name, the prompts that
    hold them, the logit cases on those prompts, and which prompts get a
    commit stream (indices into ``prompts``)."""

    images: dict[str, ImageInput]
    prompts: list[ImagePrompt]
    cases: list[LogitCase] = field(default_factory=list)
    stream_prompts: list[int] = field(default_factory=list)

    def inputs(self, i: int) -> PromptInputs:
        """Prompt ``i`` as the runtime takes it (ids and preprocessed images)."""
        p = self.prompts[i]
        return PromptInputs(list(p.ids), [self.images[n] for n in p.images])

    def prompt_index(self, case: LogitCase) -> int:
        key = tuple(case.prompt_ids)
        for i, p in enumerate(self.prompts):
            if tuple(p.ids) == key:
                return i
        raise ValueError(f"image case {case.name}: its prompt is not one of the image prompts")

    def describe(self) -> list[dict]:
        """JSON-able summary of the images (name, size, soft tokens)."""
        return [{"name": n, "size": list(i.size), "soft_tokens": int(i.soft_tokens)} for n, i in self.images.items()]


def image_prompts(model_dir: str | Path, config: dict, trust_remote_code: bool = False
                  ) -> tuple[dict[str, ImageInput], list[ImagePrompt]]:
    """The built-in image prompts, encoded with the checkpoint's tokenizer,
    chat template and image processor (``api.encode_inputs``; no weights are
    loaded)."""
    from dlm.runtime import api, loader
    from dlm.runtime.registry import family_for_config

    model_dir = Path(model_dir)
    where = str(model_dir / "config.json")
    family = family_for_config(config, where)
    args = family.config.from_config(config, where)
    tokenizer = loader.load_tokenizer(model_dir, trust_remote_code)
    # Only what encode_inputs reads: tokenizer, family, args, path (no model).
    stub = loader.LoadedModel(model_dir, config, args, family, None, tokenizer, source=str(model_dir))
    images: dict[str, ImageInput] = {}
    prompts = []
    for text, names in IMAGE_PROMPTS:
        encoded = api.encode_inputs(stub, text, images=[builtin_image(n) for n in names])
        for name, image in zip(names, encoded.images):
            images.setdefault(name, image)
        prompts.append(ImagePrompt(list(encoded.ids), list(names)))
    return images, prompts

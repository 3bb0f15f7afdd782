"""DiffusionGemma image preprocessing and prompt placeholders (transformers' ``Gemma4Processor``).

The pixels go through transformers' own Gemma 4 image processor, its Pillow
backend (``Gemma4ImageProcessorPil``: aspect-preserving bicubic resize to
multiples of pooling x patch, rescale, patchify, pad with position (-1, -1)),
built from the converted model's processor files. That backend needs neither
torch nor torchvision, so the runtime runs without them; it is the backend
transformers itself picks when torchvision is absent.

Each image token the chat template emits becomes ``boi + image x n + eoi``
(n: the image's soft tokens), as Gemma4Processor does.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ...platform.errors import ConfigError, GenerationError
from ...generation.inputs import ImageInput

PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")


class ImageProcessor:
    def __init__(self, processor, image_token: str, boi_token: str, eoi_token: str, where: str):
        self.processor = processor
        self.image_token, self.boi_token, self.eoi_token = image_token, boi_token, eoi_token
        self.where = where
        self.patch_size = int(processor.patch_size)
        self.pooling = int(processor.pooling_kernel_size)
        self.max_soft_tokens = int(processor.max_soft_tokens)

    @classmethod
    def from_model_dir(cls, path: Path, args, tokenizer) -> "ImageProcessor":
        """From the model's processor files (processor_config.json's
        ``image_processor``, or a preprocessor_config.json) and its tokenizer's
        image tokens; the processor defaults when the files are missing."""
        try:
            from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil
        except ImportError as exc:
            raise ConfigError(f"{path}: image input needs Pillow and transformers' Gemma 4 processor ({exc})")
        found = [f for f in PROCESSOR_FILES if (Path(path) / f).is_file()]
        vision = args.vision_config or {}
        geometry = {k: int(vision[k]) for k in ("patch_size", "pooling_kernel_size") if k in vision}
        where = str(Path(path) / found[0]) if found else f"{path} (no processor files: Gemma 4 defaults)"
        try:  # without processor files: the processor's defaults at the tower's geometry
            processor = (Gemma4ImageProcessorPil.from_pretrained(str(path)) if found
                         else Gemma4ImageProcessorPil(**geometry))
        except Exception as exc:
            raise ConfigError(f"{where}: cannot build the Gemma 4 image processor: {exc}") from None
        for key, want in geometry.items():
            if want != int(getattr(processor, key)):
                raise ConfigError(f"{where}: {key} {getattr(processor, key)} differs from the vision_config's "
                                  f"{want} in config.json")
        return cls(processor, *_image_tokens(tokenizer, args, path), where)

    def preprocess(self, images: list) -> list[ImageInput]:
        """Image sources (paths, bytes, data: URLs, PIL images) -> vision tower inputs."""
        from ...generation.images import open_image

        out = []
        for i, source in enumerate(images):
            image = open_image(source, f"image {i + 1}")
            try:
                batch = self.processor(images=[image], return_tensors="np")
            except Exception as exc:
                raise GenerationError(f"image {i + 1}: the Gemma 4 image processor failed: {exc}") from None
            out.append(ImageInput(
                pixel_values=np.asarray(batch["pixel_values"][0], dtype=np.float32),
                position_ids=np.asarray(batch["image_position_ids"][0], dtype=np.int32),
                soft_tokens=int(batch["num_soft_tokens_per_image"][0]),
                size=tuple(image.size),
            ))
        return out

    def placeholder(self, soft_tokens: int) -> str:
        return f"{self.boi_token}{self.image_token * soft_tokens}{self.eoi_token}"

    def expand(self, text: str, images: list[ImageInput]) -> str:
        """Replace each image token in ``text`` by the image's placeholder run."""
        pieces = text.split(self.image_token)
        found = len(pieces) - 1
        if found != len(images):
            raise GenerationError(
                f"the prompt has {found} image token(s) {self.image_token!r} for {len(images)} image(s); "
                "with a chat template each image is an {\"type\": \"image\"} content part, in a raw "
                f"prompt write {self.image_token!r} where each image goes"
            )
        out = [pieces[0]]
        for image, piece in zip(images, pieces[1:]):
            out += [self.placeholder(image.soft_tokens), piece]
        return "".join(out)


def _image_tokens(tokenizer, args, path) -> tuple[str, str, str]:
    """(image, boi, eoi) token strings: the tokenizer's named tokens, else the config's ids."""
    out = []
    for name, key in (("image_token", "image_token_id"), ("boi_token", "boi_token_id"),
                      ("eoi_token", "eoi_token_id")):
        text = getattr(tokenizer, name, None)
        want = getattr(args, key)
        if want is None:
            raise ConfigError(f"{path}/config.json: a vision model needs {key}")
        if not isinstance(text, str) or not text:
            text = tokenizer.convert_ids_to_tokens(int(want))
        ids = tokenizer.encode(text, add_special_tokens=False) if isinstance(text, str) else []
        if list(ids) != [int(want)]:
            raise ConfigError(f"{path}: the tokenizer's {name} {text!r} is not the single token "
                              f"{key}={want} of config.json")
        out.append(text)
    return out[0], out[1], out[2]

"""Prompt inputs that are more than token ids: a prompt with images.

``PromptInputs`` is what ``api.encode_inputs`` returns and what
``api.stream_generate`` / ``api.generate`` take in place of plain ids. Each
image has already been preprocessed by the model family (its ``images``
module) and its soft-token placeholders expanded in ``ids``, so a session only
has to run the vision encoder and scatter the features.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class ImageInput:
    """One preprocessed image: the vision tower's input and how many soft
    tokens (placeholder ids in the prompt) it turns into."""

    pixel_values: np.ndarray  # [max_patches, patch * patch * 3] float32 in [0, 1]
    position_ids: np.ndarray  # [max_patches, 2] int (x, y); padding (-1, -1)
    soft_tokens: int
    size: tuple[int, int] = (0, 0)  # (width, height) of the image as given


@dataclass
class PromptInputs:
    ids: list[int]
    images: list[ImageInput] = field(default_factory=list)

    @property
    def image_tokens(self) -> int:
        return sum(image.soft_tokens for image in self.images)

    def __len__(self) -> int:
        return len(self.ids)


def split_prompt(prompt) -> tuple[list[int], list[ImageInput]]:
    """(ids, images) of a PromptInputs or a plain id sequence."""
    if isinstance(prompt, PromptInputs):
        return list(prompt.ids), list(prompt.images)
    return [int(t) for t in prompt], []

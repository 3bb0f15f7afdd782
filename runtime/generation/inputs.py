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

from ..platform.errors import GenerationError


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


class TextError(GenerationError):
    """A string no tokenizer can encode (a lone surrogate, which JSON's ``"\\ud800"``
    and argv can carry); ``param`` is where it is (``messages[1].content``)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def check_text(value, name: str, label: str | None = None):
    """``value`` if every string in it (a string, or the lists and dicts of JSON,
    keys included) is valid Unicode; else TextError naming the first bad one
    (``'tools[0].function.description' is not valid UTF-8 text (lone surrogate at
    position 3)``). Every string that reaches a tokenizer or a chat template goes
    through here (``api.encode_inputs``): a lone surrogate is refused, never
    replaced. ``label``: how to show ``name`` (default: quoted)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            shown = f"'{name}'" if label is None else label
            raise TextError(f"{shown} is not valid UTF-8 text (lone surrogate at position {exc.start})",
                            name) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str):
                try:
                    key.encode("utf-8")
                except UnicodeEncodeError as exc:
                    raise TextError(f"'{name}' has a key that is not valid UTF-8 text (lone surrogate at "
                                    f"position {exc.start})", name) from None
            check_text(item, f"{name}.{key}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_text(item, f"{name}[{i}]")
    return value

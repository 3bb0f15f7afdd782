"""What every family's ``ModelArgs`` shares, and a typed reader for config.json.

``BaseModelArgs`` holds the fields the shared code reads of any family (the
generation loop, the server, the CLI): the vocabulary, the EOS ids, the
context length and whether the checkpoint takes images. ``ConfigReader``
reads each value with its type and range checked, so a config value of the
wrong type (``"vocab_size": "abc"``, ``"hidden_size": 64.5``) is a ConfigError
naming the file and the key, never a traceback or a silent truncation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from ..platform import settings
from ..platform.errors import ConfigError

_REQUIRED = object()


def compile_enabled() -> bool:
    """Whether the families fuse their layers' fixed-shape pieces with mx.compile
    (``DLM_COMPILE=0``: off, to compare or to debug)."""
    return settings.COMPILE.get()


@dataclass(kw_only=True)
class BaseModelArgs:
    model_type: str
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: list[int]
    mask_token_id: Optional[int] = None  # the family's mask token, if it has one (LLaDA-2)

    @property
    def text_only(self) -> bool:
        """True when the checkpoint has no vision tower (the default for a family)."""
        return True


class ConfigReader:
    """Typed access to one config dict; errors name ``where`` and the key."""

    def __init__(self, config: dict, where: str = "config.json", what: str = "config"):
        self.config, self.where, self.what = config, where, what

    def _get(self, key: str, default):
        value = self.config.get(key)
        if value is None:
            if default is _REQUIRED:
                raise ConfigError(f"{self.where}: {self.what} is missing required key {key!r}")
            return default, True
        return value, False

    def _bad(self, key: str, want: str, value) -> ConfigError:
        return ConfigError(f"{self.where}: {key} must be {want}, got {value!r}")

    def int(self, key: str, default: Any = _REQUIRED, minimum: Optional[int] = None,
            maximum: Optional[int] = None) -> Any:
        value, defaulted = self._get(key, default)
        if defaulted:
            return value
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._bad(key, "an integer", value)
        if minimum is not None and value < minimum:
            raise self._bad(key, f">= {minimum}", value)
        if maximum is not None and value > maximum:
            raise self._bad(key, f"<= {maximum}", value)
        return value

    def float(self, key: str, default: Any = _REQUIRED, minimum: Optional[float] = None,
              maximum: Optional[float] = None, positive: bool = False) -> Any:
        value, defaulted = self._get(key, default)
        if defaulted:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self._bad(key, "a finite number", value)
        if positive and value <= 0:
            raise self._bad(key, "> 0", value)
        if minimum is not None and value < minimum:
            raise self._bad(key, f">= {minimum}", value)
        if maximum is not None and value > maximum:
            raise self._bad(key, f"<= {maximum}", value)
        return float(value)

    def bool(self, key: str, default: Any = _REQUIRED) -> Any:
        value, defaulted = self._get(key, default)
        if not defaulted and not isinstance(value, bool):
            raise self._bad(key, "true or false", value)
        return value

    def str(self, key: str, default: Any = _REQUIRED) -> Any:
        value, defaulted = self._get(key, default)
        if not defaulted and not isinstance(value, str):
            raise self._bad(key, "a string", value)
        return value

    def dict(self, key: str, default: Any = _REQUIRED) -> Any:
        value, defaulted = self._get(key, default)
        if not defaulted and not isinstance(value, dict):
            raise self._bad(key, "an object", value)
        return value

    def token_ids(self, key: str, default: Any = _REQUIRED, vocab: Optional[int] = None) -> Any:
        """An id or a list of ids (EOS), as a list."""
        value, defaulted = self._get(key, default)
        if defaulted:
            return value
        ids = value if isinstance(value, list) else [value]
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0 or (vocab is not None and t >= vocab):
                want = f"a token id in [0, {vocab})" if vocab else "a token id >= 0"
                raise self._bad(key, f"{want} or a list of them", value)
        return list(ids)

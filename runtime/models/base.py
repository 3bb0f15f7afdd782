"""What every family's ``ModelArgs`` shares, and a typed reader for config.json.

``BaseModelArgs`` holds the fields the shared code reads of any family (the
generation loop, the server, the CLI): the vocabulary, the EOS ids, the
context length and whether the checkpoint takes images. ``ConfigReader``
reads each value with its type and range checked, so a config value of the
wrong type (``"vocab_size": "abc"``, ``"hidden_size": 64.5``) is a ConfigError
naming the file and the key, never a traceback or a silent truncation.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

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
    # The config.json keys the family understands, per model_type it runs: what
    # ``from_config`` checks before it reads anything (``check_config_keys``).
    config_keys: ClassVar[Mapping[str, "ConfigKeys"]] = {}

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


# -- the config keys a family understands ---------------------------------------

# Keys any config.json may carry that never change what the model computes:
# Hugging Face metadata (what wrote the file, the remote-code hooks, the stored
# dtype: a conversion's dtype is dlm's own choice), runtime switches of
# transformers' forward (caches, extra outputs), dlm's provenance block and the
# MLX quantization blocks (read by the loader, not by ``from_config``), and a
# generation config embedded in config.json (generation defaults, not the model).
METADATA_KEYS = frozenset({
    "architectures", "auto_map", "transformers_version", "_name_or_path", "model_type",
    "torch_dtype", "dtype", "use_cache", "output_attentions", "output_hidden_states", "return_dict",
    "dlm", "quantization", "quantization_config", "generation_config",
})


@dataclass(frozen=True)
class ConfigKeys:
    """The keys of one config.json object that a family understands.

    * ``read``: the keys ``from_config`` reads, the computation dlm implements;
    * ``harmless``: keys that do not change what the model computes (metadata,
      training-only settings, ids only the tokenizer uses, keys the reference
      code ignores);
    * ``fixed``: keys dlm implements at these values only (the released ones;
      ``None`` only where it is listed): another value changes the computation
      and is refused;
    * ``nested``: keys whose object value is checked with its own ``ConfigKeys``;
    * ``each``: when set, the object's keys are free (layer indices) and every
      value is an object checked with ``each``.

    Any other key is refused, whatever its value: dlm does not know what it does.
    """

    read: frozenset = frozenset()
    harmless: frozenset = frozenset()
    fixed: Mapping[str, tuple] = field(default_factory=dict)
    nested: Mapping[str, "ConfigKeys"] = field(default_factory=dict)
    each: Optional["ConfigKeys"] = None

    def known(self, key: str) -> bool:
        return key in self.read or key in self.harmless or key in self.fixed or key in self.nested


def _same(value, want) -> bool:
    """Equal with the type: ``1`` is not ``true``, ``0.0`` is not ``false``."""
    return type(value) is type(want) and value == want


def _config_key_problems(config: dict, keys: ConfigKeys, path: str) -> tuple[list[str], list[str]]:
    """(unknown keys, keys with a value dlm does not implement), as dotted paths."""
    unknown, values = [], []
    for key, value in config.items():
        where = f"{path}{key}"
        if keys.each is not None:
            if isinstance(value, dict):
                u, v = _config_key_problems(value, keys.each, f"{where}.")
                unknown += u
                values += v
            continue
        if not keys.known(key):
            unknown.append(where)
        elif key in keys.fixed and not any(_same(value, w) for w in keys.fixed[key]):
            allowed = " or ".join(json.dumps(w) for w in keys.fixed[key])
            values.append(f"{where} is {json.dumps(value)} (dlm implements only {allowed})")
        elif key in keys.nested and isinstance(value, dict):
            u, v = _config_key_problems(value, keys.nested[key], f"{where}.")
            unknown += u
            values += v
    return unknown, values


def check_config_keys(config: dict, keys: ConfigKeys, where: str = "config.json") -> None:
    """Refuse a config whose keys, at any checked level, include one ``keys`` does
    not declare, or a fixed key at another value: such a key changes the
    computation in a way dlm does not implement, so running the model would be
    an approximation nobody asked for. The ConfigError names every such key with
    its dotted path (``text_config.expert_capacity``), the unknown ones sorted."""
    unknown, values = _config_key_problems(config, keys, "")
    unknown.sort()
    problems = []
    if unknown:
        many = len(unknown) > 1
        problems.append(
            f"{', '.join(unknown)} {'are settings' if many else 'is a setting'} dlm does not implement "
            f"({'they change' if many else 'it changes'} the computation); dlm refuses "
            f"{'them' if many else 'it'} rather than run the model approximately")
    if values:
        problems.append(f"{', '.join(values)}; dlm refuses {'these values' if len(values) > 1 else 'it'} "
                        "rather than run the model approximately")
    if problems:
        raise ConfigError(f"{where}: {'; '.join(problems)}")

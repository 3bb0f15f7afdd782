"""Reading a checkpoint directory's metadata: config.json, the safetensors
index and shard list, generation_config.json, and the tokenizer-file check.
One module for dlm-convert, the runtime loader and dlm-verify, so the three
agree on what a model directory is and name the same file in their errors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from .platform.errors import ConfigError, WeightError

INDEX_NAME = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
# Formats dlm never loads: they unpickle (execute) code.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


def read_json(path: Path, what: str) -> dict:
    """A JSON object from ``path``; ConfigError naming the file otherwise."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: {what} not found") from None
    except ValueError as exc:
        raise ConfigError(f"{path}: {what} is not valid JSON: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read {what}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: {what} is not a JSON object")
    return data


def read_config(directory: Path) -> dict:
    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise ConfigError(f"{directory} has no config.json")
    return read_json(directory / "config.json", "config.json")


def read_generation_config(directory: Path, config: Optional[dict] = None) -> dict:
    """generation_config.json, else the copy mlx-vlm embeds in config.json, else {}."""
    path = Path(directory) / "generation_config.json"
    if path.exists():
        return read_json(path, "generation_config.json")
    return dict((config or {}).get("generation_config") or {})


def read_weight_map(directory: Path) -> Optional[dict]:
    """The index's tensor -> shard map, or None without an index."""
    index = Path(directory) / INDEX_NAME
    if not index.is_file():
        return None
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise WeightError(f"{index} is not a valid safetensors index: {exc}") from None
    if not isinstance(weight_map, dict) or not weight_map:
        raise WeightError(f"{index}: no weight_map")
    return dict(weight_map)


def weight_files(directory: Path) -> list[Path]:
    """The safetensors shards of ``directory``: those the index lists, else ``*.safetensors``."""
    directory = Path(directory)
    weight_map = read_weight_map(directory)
    if weight_map is not None:
        files = [directory / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise WeightError(
                f"{INDEX_NAME} lists {len(missing)} missing shard(s) (missing from {directory}): "
                + ", ".join(missing)
            )
        return files
    files = sorted(p for p in directory.glob("*.safetensors") if p.is_file())
    if files:
        return files
    pickled = sorted(p.name for p in directory.glob("*") if p.name.endswith(PICKLE_SUFFIXES))
    if pickled:
        raise WeightError(
            f"{directory} has only pickle weights ({', '.join(pickled[:3])}"
            f"{', ...' if len(pickled) > 3 else ''}); dlm reads only safetensors, because unpickling "
            "can run arbitrary code. Convert them to safetensors first."
        )
    raise WeightError(f"no *.safetensors weights found in {directory}")


def has_tokenizer(directory: Path) -> bool:
    return any((Path(directory) / name).is_file() for name in TOKENIZER_FILES)


def check_tokenizer(directory: Path) -> None:
    if not has_tokenizer(directory):
        raise ConfigError(
            f"{directory} has no tokenizer files (expected one of {', '.join(TOKENIZER_FILES)})"
        )

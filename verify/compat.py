"""What a recorded bundle must share with the converted model it is compared with."""

from __future__ import annotations

from dlm.runtime.platform.errors import ConfigError


def text_config(config: dict) -> dict:
    """The language model's config: ``text_config`` when nested (multimodal), else the config."""
    return config["text_config"] if isinstance(config.get("text_config"), dict) else config


def generation_config_differences(settings: dict, generation_config: dict) -> list[str]:
    """The sampling settings in which the MLX generation_config.json differs from the reference's."""
    def norm(x):
        return x if isinstance(x, list) else [x] if isinstance(x, int) and not isinstance(x, bool) else x

    out = []
    for key, value in settings.items():
        if key in generation_config and norm(generation_config[key]) != norm(value):
            mine = generation_config[key]
            if isinstance(mine, (int, float)) and isinstance(value, (int, float)) and float(mine) == float(value):
                continue
            if key in ("max_denoising_steps", "max_new_tokens", "max_tokens"):
                continue  # the suite sets its own budgets
            out.append(f"{key}: {mine!r} vs {value!r}")
    return out


def check_compatible(bundle, config: dict, where: str) -> None:
    for key in ("vocab_size", "hidden_size", "num_hidden_layers"):
        a, b = text_config(bundle.config).get(key), text_config(config).get(key)
        if a != b:
            raise ConfigError(f"{where}: {key} is {b} but the bundle was recorded with {a}")
    if bundle.config.get("canvas_length") != config.get("canvas_length"):
        raise ConfigError(
            f"{where}: canvas_length {config.get('canvas_length')} differs from the bundle's "
            f"{bundle.config.get('canvas_length')}"
        )

"""Family registry keyed by ``model_type``.

Each family declares itself once, as the ``FAMILY`` object of its package
(``runtime/models/<name>/__init__.py``: dlm.runtime.generation.family.Family);
this module lists them. Nothing else in dlm branches on ``model_type``: every
module asks the registry. What needs every family at once lives here too: the
option catalogue that the CLI flags, the server's request fields and the
refusal of another family's option are built from.

The families are imported on first use, so that ``dlm-convert --help`` does not
pay for MLX model code it will not use.
"""

from __future__ import annotations

import functools
from typing import Iterable

from .generation import options as O
from .generation.family import Family
from .platform.errors import UnsupportedModelError


@functools.cache
def families() -> tuple[Family, ...]:
    from .models import diffusion_gemma, llada2_moe

    return (diffusion_gemma.FAMILY, llada2_moe.FAMILY)


def supported_model_types() -> list[str]:
    return sorted(t for f in families() for t in f.model_types)


def get_family(model_type: str | None, where: str = "config.json") -> Family:
    for family in families():
        if model_type in family.model_types:
            return family
    raise UnsupportedModelError(
        f"{where}: unsupported model_type {model_type!r}; "
        f"dlm supports: {', '.join(supported_model_types())}"
    )


def family_for_config(config: dict, where: str = "config.json") -> Family:
    return get_family(config.get("model_type"), where)


# -- options across the families ---------------------------------------------


def all_options() -> list[tuple[str, O.Option]]:
    """Every (family title, option) declared, in registry order."""
    return [(family.title, option) for family in families() for option in family.options]


def resolve_options(family: Family, options: dict) -> dict:
    """``family``'s own options from ``options``, checked and converted
    (dlm.runtime.generation.options.resolve): another family's option, one
    nothing runs and an unknown key are refused by name."""
    return O.resolve(family.options, options, family.title, family.refused_options, all_options())


def settings(family: Family, options: dict, args, generation_config: dict):
    """The family's generation Settings for ``options`` (checked first) over
    the checkpoint's generation_config over the declared defaults."""
    return family.generation.Settings.from_options(resolve_options(family, options), args, generation_config)


def click_options(exclude: Iterable[str] = (), help_prefix: str = ""):
    """The generation flags of ``dlm-run generate|chat|serve``, one per declared option."""
    return O.click_options(all_options(), exclude, help_prefix)


def request_options() -> dict[str, O.Option]:
    """Request field -> option, for the fields a server request may set."""
    return O.request_options(all_options())

"""Family registry keyed by ``model_type``.

A family is one package under ``runtime/models/<name>/`` (config, weight map,
MLX modules, generation step, options), one verify adapter
``verify/<name>/adapter.py``, and one line in ``FAMILIES`` below. Nothing else
in dlm branches on ``model_type``: every module asks the registry.

Modules are imported lazily so that ``dlm-convert --help`` does not pay for
MLX model code it will not use.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

from .errors import UnsupportedModelError


@dataclass(frozen=True)
class Family:
    name: str  # the package name under runtime/models/ and verify/
    title: str  # what messages call it
    model_types: tuple[str, ...]

    def model(self) -> ModuleType:
        """The family package: ModelArgs, Model, plan_weights, sanitize, quant_class, output_config."""
        return importlib.import_module(f"dlm.runtime.models.{self.name}")

    def generation(self) -> ModuleType:
        """Its generate module: Settings.from_options and the per-canvas/per-block session."""
        return importlib.import_module(f"dlm.runtime.models.{self.name}.generate")

    def options(self) -> tuple:
        """Its generation options (dlm.runtime.options.Option declarations)."""
        return importlib.import_module(f"dlm.runtime.models.{self.name}.options").OPTIONS

    def tool_syntax(self):
        """How its models write tool calls (dlm.runtime.structured.tools.ToolSyntax)."""
        return importlib.import_module(f"dlm.runtime.models.{self.name}.tools").TOOL_SYNTAX

    def reference(self) -> ModuleType:
        """The dlm-verify adapter (dlm.verify.protocol)."""
        return importlib.import_module(f"dlm.verify.{self.name}.adapter")


FAMILIES: tuple[Family, ...] = (
    Family("diffusion_gemma", "DiffusionGemma", ("diffusion_gemma", "diffusion_gemma_text")),
    Family("llada2_moe", "LLaDA-2", ("llada2_moe",)),
)


def supported_model_types() -> list[str]:
    return sorted(t for f in FAMILIES for t in f.model_types)


def get_family(model_type: str | None, where: str = "config.json") -> Family:
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    raise UnsupportedModelError(
        f"{where}: unsupported model_type {model_type!r}; "
        f"dlm supports: {', '.join(supported_model_types())}"
    )


def family_for_config(config: dict, where: str = "config.json") -> Family:
    return get_family(config.get("model_type"), where)

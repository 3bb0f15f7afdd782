"""Family registry keyed by ``model_type``.

A family is one runtime model file (MLX modules, its HF->MLX weight plan and its
quantization classes), one generation loop, and one PyTorch reference.  Nothing
else in dlm branches on ``model_type``: every module asks the registry.

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
    name: str
    model_types: tuple[str, ...]
    # Runtime model file. It exposes: ModelArgs.from_config(dict), Model(args),
    # plan_weights(args, source_meta, text_only), quant_class(path),
    # output_config(config, text_only), sanitize(weights).
    model_module: str
    # Generation loop for this family (settings, stream_generate).
    generate_module: str
    # PyTorch reference used by dlm-verify.
    reference_module: str

    def model(self) -> ModuleType:
        return importlib.import_module(self.model_module)

    def generation(self) -> ModuleType:
        return importlib.import_module(self.generate_module)

    def reference(self) -> ModuleType:
        return importlib.import_module(self.reference_module)


FAMILIES: tuple[Family, ...] = (
    Family(
        name="diffusion_gemma",
        model_types=("diffusion_gemma", "diffusion_gemma_text"),
        model_module="dlm.runtime.models.diffusion_gemma",
        generate_module="dlm.runtime.diffusion_gemma_generate",
        reference_module="dlm.verify.reference_diffusion_gemma",
    ),
    Family(
        name="llada2_moe",
        model_types=("llada2_moe",),
        model_module="dlm.runtime.models.llada2_moe",
        generate_module="dlm.runtime.llada2_generate",
        reference_module="dlm.verify.reference_llada2",
    ),
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

"""An MLX conversion given to dlm-convert as its source: recognised (it runs as
it is; converting it again would only misread its names), and with
``--dequantize`` written back in float, tensor by tensor (memory stays flat)."""

from __future__ import annotations

import functools
from typing import Optional

import mlx.core as mx

from ..runtime.models.quant_modes import module_quantization
from ..runtime.platform.errors import ConfigError
from ..runtime.models.plan import TensorPlan


def mlx_conversion(config: dict, tensors: dict) -> Optional[str]:
    """What kind of MLX conversion a source is, or None for a Hugging Face checkpoint."""
    if isinstance(config.get("quantization"), dict) or any(n.endswith(".scales") for n in tensors):
        return "a quantized MLX conversion"
    if isinstance(config.get("dlm"), dict):
        return "a dlm conversion"
    return None


def _dequantize(arrays, group_size: int, bits: int, mode: str):
    w, scales, *biases = arrays
    return mx.dequantize(w, scales, biases[0] if biases else None, group_size=group_size, bits=bits, mode=mode)


def dequantize_plans(config: dict, tensors: dict) -> list[TensorPlan]:
    """An MLX conversion back to float, tensor by tensor: each quantized module's
    packed weight + scales (+ biases) dequantized with the parameters its
    quantization block gives it; every other tensor as it is."""
    q = config.get("quantization") or config.get("quantization_config") or {}
    plans = []
    for name in tensors:
        module, _, part = name.rpartition(".")
        if part in ("scales", "biases") and f"{module}.scales" in tensors:
            continue
        if part == "weight" and f"{module}.scales" in tensors:
            has_biases = f"{module}.biases" in tensors
            try:
                params = module_quantization(q, module, has_biases)
            except ValueError as exc:
                raise ConfigError(f"config.json quantization of {module}: {exc}") from None
            if params is None:
                raise ConfigError(f"{module} is stored quantized but config.json marks it unquantized")
            sources = (name, f"{module}.scales") + ((f"{module}.biases",) if has_biases else ())
            plans.append(TensorPlan(name, sources, combine=functools.partial(_dequantize, **params)))
        else:
            plans.append(TensorPlan(name, (name,)))
    return plans

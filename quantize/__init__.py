"""Quantization recipes for dlm-convert (see recipes.py)."""

import dlm.runtime  # noqa: F401  (first: the BLAS, float32 precision and MLX backend check, before MLX)

from .recipes import HIGH, MODE_DEFAULTS, QuantizationError, QuantSpec, Recipe, config_block, decide, make_spec

__all__ = ["HIGH", "MODE_DEFAULTS", "QuantizationError", "QuantSpec", "Recipe", "config_block", "decide",
           "make_spec"]

"""Quantization recipes for dlm-convert (see recipes.py)."""

from .recipes import HIGH, MODE_DEFAULTS, QuantizationError, QuantSpec, Recipe, config_block, decide, make_spec

__all__ = ["HIGH", "MODE_DEFAULTS", "QuantizationError", "QuantSpec", "Recipe", "config_block", "decide",
           "make_spec"]

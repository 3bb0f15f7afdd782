"""Quantization recipes: which tensor gets which (bits, group size, mode).

A family classifies its modules with ``quant_class(path)`` ("high", "low" or
None); a recipe turns the class into a spec:

* ``mixed`` (default): "high" modules at 8-bit affine, group 64 (what mlx-vlm's
  DiffusionGemma predicate keeps at 8 bits), "low" modules at the user's
  --q-bits / --q-group-size / --q-mode;
* ``uniform``: every eligible ("high" or "low") module at the user's spec.

"vision" modules (the vision tower's linears) stay in float unless the recipe
has a ``vision`` spec (``dlm-convert --quantize-vision``: 8-bit affine g64).
Modules of class None (norms, scalars, patch embedder, embed_vision...) are never quantized.
A module whose input size is not divisible by its group size stays in float
and is recorded (``false`` in the config block, listed in the model card).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import mlx.core as mx

from ..runtime.platform.errors import DlmError
from ..runtime.models.quant_modes import MODE_DEFAULTS

AFFINE_BITS = (2, 3, 4, 5, 6, 8)
AFFINE_GROUPS = (32, 64, 128)
RECIPES = ("mixed", "uniform")


class QuantizationError(DlmError):
    """Flags that do not describe a valid quantization."""


@dataclass(frozen=True)
class QuantSpec:
    bits: int
    group_size: int
    mode: str = "affine"

    @property
    def label(self) -> str:
        return f"{self.bits}bit" if self.mode == "affine" else self.mode

    def parts(self) -> tuple[str, ...]:
        """Tensor suffixes ``mx.quantize`` produces (affine has biases, fp modes do not)."""
        return ("weight", "scales", "biases") if self.mode == "affine" else ("weight", "scales")

    def quantize(self, w: mx.array) -> tuple[mx.array, ...]:
        return tuple(mx.quantize(w, group_size=self.group_size, bits=self.bits, mode=self.mode))


HIGH = QuantSpec(8, 64, "affine")


def make_spec(bits: Optional[int], group_size: Optional[int], mode: str = "affine") -> QuantSpec:
    """The user's spec, with each mode's defaults; raises QuantizationError on a bad combination."""
    if mode not in MODE_DEFAULTS:
        raise QuantizationError(f"unknown --q-mode {mode!r}; choose from {', '.join(MODE_DEFAULTS)}")
    default_group, default_bits = MODE_DEFAULTS[mode]
    bits = default_bits if bits is None else int(bits)
    group_size = default_group if group_size is None else int(group_size)
    if mode == "affine":
        if bits not in AFFINE_BITS:
            raise QuantizationError(f"--q-bits {bits} is not supported; choose from {AFFINE_BITS}")
        if group_size not in AFFINE_GROUPS:
            raise QuantizationError(
                f"--q-group-size {group_size} is not supported by affine quantization; "
                f"choose from {AFFINE_GROUPS}"
            )
    elif (group_size, bits) != (default_group, default_bits):
        raise QuantizationError(
            f"--q-mode {mode} is fixed at {default_bits} bits with group size {default_group} "
            f"(got --q-bits {bits} --q-group-size {group_size})"
        )
    return QuantSpec(bits, group_size, mode)


@dataclass(frozen=True)
class Recipe:
    name: str  # "mixed" | "uniform"
    low: QuantSpec
    vision: Optional[QuantSpec] = None  # the vision tower's linears (None: float)

    def __post_init__(self):
        if self.name not in RECIPES:
            raise QuantizationError(f"unknown recipe {self.name!r}; choose from {', '.join(RECIPES)}")

    def spec_for(self, qclass: Optional[str]) -> Optional[QuantSpec]:
        if qclass is None:
            return None
        if qclass == "vision":
            return self.vision
        if self.name == "mixed" and qclass == "high":
            return HIGH
        return self.low

    @property
    def label(self) -> str:
        """Suffix for the default output directory: ``4bit``, ``mxfp4``, ``4bit-uniform``."""
        return self.low.label + ("-uniform" if self.name == "uniform" else "")

    def as_dict(self) -> dict:
        out = {"name": self.name, "bits": self.low.bits, "group_size": self.low.group_size,
               "mode": self.low.mode}
        if self.name == "mixed":
            out["high"] = {"bits": HIGH.bits, "group_size": HIGH.group_size, "mode": HIGH.mode}
        if self.vision is not None:
            v = self.vision
            out["vision"] = {"bits": v.bits, "group_size": v.group_size, "mode": v.mode}
        return out


@dataclass(frozen=True)
class Decision:
    """What happens to one output tensor."""

    name: str  # output tensor name (``...q_proj.weight``)
    path: Optional[str]  # module path when the tensor is a module weight
    qclass: Optional[str]
    spec: Optional[QuantSpec]  # None: stays float
    fallback: bool = False  # eligible, but the input size is not divisible by the group size


def decide(
    recipe: Optional[Recipe],
    quant_class: Callable[[str], Optional[str]],
    name: str,
    shape: tuple[int, ...],
    dtype: mx.Dtype,
) -> Decision:
    path = name[: -len(".weight")] if name.endswith(".weight") else None
    qclass = quant_class(path) if path is not None else None
    if recipe is None or qclass is None or len(shape) < 2 or not mx.issubdtype(dtype, mx.floating):
        return Decision(name, path, qclass, None)
    spec = recipe.spec_for(qclass)
    if spec is None:
        return Decision(name, path, qclass, None)
    if shape[-1] % spec.group_size:
        return Decision(name, path, qclass, None, fallback=True)
    return Decision(name, path, qclass, spec)


def config_block(recipe: Recipe, decisions: Iterable[Decision]) -> dict:
    """The ``quantization`` block of config.json (mlx-lm / mlx-vlm form).

    Top level: the recipe's --q-bits spec.  Per-module entries for modules
    quantized differently (``mode`` only when it differs from the top level)
    and ``false`` for eligible modules left in float by the group-size check.
    """
    low = recipe.low
    block: dict = {"group_size": low.group_size, "bits": low.bits, "mode": low.mode}
    for d in decisions:
        if d.fallback:
            block[d.path] = False
        elif d.spec is not None and d.spec != low:
            entry = {"group_size": d.spec.group_size, "bits": d.spec.bits}
            if d.spec.mode != low.mode:
                entry["mode"] = d.spec.mode
            block[d.path] = entry
    return block


def bits_per_weight(stored_bytes: int, parameters: int) -> float:
    """Stored bits per original parameter (scales and biases included), as mlx-lm reports it."""
    return 8.0 * stored_bytes / parameters if parameters else 0.0


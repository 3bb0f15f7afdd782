"""What a family declares about itself, once, in its package's ``__init__.py``.

A family is one package under ``runtime/models/<name>/``; its ``FAMILY`` object
names every part the rest of dlm uses, and ``dlm.runtime.registry`` lists the
families by ``model_type``. Nothing else looks a family's modules up by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Optional

from ..structured.tools import ToolSyntax
from .options import Option


@dataclass(frozen=True)
class Family:
    name: str  # the package name under runtime/models/ and verify/
    title: str  # what messages call it
    model_types: tuple[str, ...]  # config.json model_type values it runs
    config: type  # ModelArgs: from_config(config, where), the checked config.json
    output_config: Callable[..., dict]  # the config.json a conversion writes
    model: type  # the MLX model (Model(args))
    weights: ModuleType  # the weight map both ways: plan_weights, sanitize, quant_class, to_hf
    generation: ModuleType  # Settings.from_options and the per-canvas/per-block Session
    batch: Optional[ModuleType]  # Batch and members for batched generation (None: one at a time)
    options: tuple[Option, ...]  # its generation options
    refused_options: dict[str, str]  # option name -> why this family refuses it
    tool_syntax: ToolSyntax  # how its models write tool calls
    reference: str  # the dlm-verify adapter module (imported by dlm.verify, never by the runtime)
    image_processor: Optional[Any] = None  # the image preprocessing class; None: text-only
    # (loaded, options) -> warning lines for options that take effect but the checkpoint was not trained for
    option_warnings: Optional[Callable[..., list[str]]] = None
    # (model, world) -> lines saying what is split and what replicated: keeps this rank's
    # share of the loaded weights (runtime/models/shard.py); None: single-process only
    shard: Optional[Callable[..., list[str]]] = None

    @property
    def block_name(self) -> str:
        """What one generation unit is called: "canvas" or "block"."""
        return self.generation.Session.block_name

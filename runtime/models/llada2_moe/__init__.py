"""LLaDA2.0 / 2.1 MoE (``llada2_moe``), declared once in ``FAMILY``.

config.py (ModelArgs), weights.py (HF <-> MLX weight map), model.py (MLX
modules, KV cache, block-causal mask), sampling.py (per-step rules),
generate.py (block unmasking and editing), batch.py (batched blocks),
structured.py (constrained blocks), options.py (generation options), tools.py
(tool-call syntax), trace.py (--trace records), shard.py (over several ranks).
"""

from ...generation.family import Family
from . import batch, generate, weights
from .config import ModelArgs, output_config
from .model import Model, block_causal_mask
from .options import OPTIONS, REFUSED
from .shard import shard
from .tools import TOOL_SYNTAX
from .weights import plan_weights, quant_class, sanitize, to_hf

FAMILY = Family(
    name="llada2_moe",
    title="LLaDA-2",
    model_types=("llada2_moe",),
    config=ModelArgs,
    output_config=output_config,
    model=Model,
    weights=weights,
    generation=generate,
    batch=batch,
    options=OPTIONS,
    refused_options=REFUSED,
    tool_syntax=TOOL_SYNTAX,
    reference="dlm.verify.llada2_moe.adapter",
    option_warnings=generate.option_warnings,
    shard=shard,
)

__all__ = ["FAMILY", "Model", "ModelArgs", "block_causal_mask", "output_config", "plan_weights", "quant_class",
           "sanitize", "to_hf"]

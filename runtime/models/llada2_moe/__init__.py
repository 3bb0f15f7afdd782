"""LLaDA2.0 / 2.1 MoE (``llada2_moe``).

config.py (ModelArgs), weights.py (HF <-> MLX weight map), model.py (MLX
modules, KV cache, block-causal mask), sampling.py (per-step rules),
generate.py (block unmasking and editing), options.py (generation options).
The family surface the registry uses is re-exported here.
"""

from .config import ModelArgs, output_config
from .model import Model, block_causal_mask
from .weights import plan_weights, quant_class, sanitize, to_hf

__all__ = ["Model", "ModelArgs", "block_causal_mask", "output_config", "plan_weights", "quant_class",
           "sanitize", "to_hf"]

"""Model families, one package each (``diffusion_gemma/``, ``llada2_moe/``),
plus what they share: ``base`` (the fields every ModelArgs declares),
``switch`` (stacked-expert layers) and ``plan`` (the converter's TensorPlan)."""

"""DiffusionGemma (``diffusion_gemma`` / ``diffusion_gemma_text``).

config.py (ModelArgs), weights.py (HF <-> MLX weight map), layers.py + model.py
(MLX modules), sampling.py + canvas.py (samplers and the canvas denoising loop),
generate.py (settings and the per-canvas step), options.py (generation options),
vision.py (the Gemma 4 vision tower and embed_vision), images.py (image
preprocessing and prompt placeholders).
The family surface the registry uses is re-exported here.
"""

from .config import ModelArgs, output_config
from .images import ImageProcessor
from .model import Model
from .weights import plan_weights, quant_class, sanitize, to_hf

__all__ = ["ImageProcessor", "Model", "ModelArgs", "output_config", "plan_weights", "quant_class", "sanitize",
           "to_hf"]

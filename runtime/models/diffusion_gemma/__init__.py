"""DiffusionGemma (``diffusion_gemma`` / ``diffusion_gemma_text``), declared once in ``FAMILY``.

config.py (ModelArgs), weights.py (HF <-> MLX weight map), layers.py + model.py
(MLX modules), sampling.py + canvas.py (samplers and the canvas denoising loop),
generate.py (settings and the per-canvas step), batch.py (batched canvases),
structured.py (constrained canvases), options.py (generation options), tools.py
(tool-call syntax), trace.py (--trace records), vision.py (the Gemma 4 vision
tower and embed_vision), images.py (image preprocessing and prompt placeholders),
shard.py + parallel.py (one model over the ranks of an ``mlx.launch`` job).
"""

from ...generation.family import Family
from . import batch, generate, shard, weights
from .config import ModelArgs, output_config
from .images import ImageProcessor
from .model import Model
from .options import OPTIONS
from .tools import TOOL_SYNTAX
from .weights import plan_weights, quant_class, sanitize, to_hf

FAMILY = Family(
    name="diffusion_gemma",
    title="DiffusionGemma",
    model_types=("diffusion_gemma", "diffusion_gemma_text"),
    config=ModelArgs,
    output_config=output_config,
    model=Model,
    weights=weights,
    generation=generate,
    batch=batch,
    options=OPTIONS,
    refused_options={},
    tool_syntax=TOOL_SYNTAX,
    reference="dlm.verify.diffusion_gemma.adapter",
    image_processor=ImageProcessor,
    shard=shard.shard,
)

__all__ = ["FAMILY", "ImageProcessor", "Model", "ModelArgs", "output_config", "plan_weights", "quant_class",
           "sanitize", "to_hf"]

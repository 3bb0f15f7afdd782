"""DiffusionGemma's generation options (see dlm.runtime.generation.options); defaults
are applied by generate.Settings.from_options."""

from ...generation.options import (BOOL, FLOAT, INT, MAX_TOKENS, MEMORY_BUDGET, PREFILL_STEP_SIZE, SEED,
                                   SKIP_SPECIAL_TOKENS, STR, Option, defaults)
from . import sampling as S

OPTIONS = (
    MAX_TOKENS,
    Option("max_denoising_steps", INT, "Most denoising steps per canvas.", 48, "generation_config, else {default}",
           minimum=1),
    Option("diffusion_sampler", STR, "Per-step acceptance rule.", S.ENTROPY_BOUND, "entropy-bound, the checkpoint's",
           choices=S.SAMPLERS),
    Option("diffusion_threshold", FLOAT, "confidence-threshold sampler: reveal positions whose top-1 "
           "probability exceeds this.", 0.9, minimum=0.0, maximum=1.0,
           requires=("diffusion_sampler", S.CONFIDENCE_THRESHOLD, S.ENTROPY_BOUND)),
    Option("diffusion_min_canvas_length", INT, "Smallest canvas.", 64, minimum=1,
           at_most="diffusion_max_canvas_length"),
    Option("diffusion_max_canvas_length", INT, "Largest canvas.", default_help="the checkpoint's canvas_length",
           minimum=1),
    Option("diffusion_full_canvas", BOOL, "Always use the full canvas (the reference behaviour)."),
    SEED,
    Option("temp", FLOAT, "Denoiser sampling temperature on top of the checkpoint's t_max->t_min "
           "schedule.", 1.0, "1.0 = the reference; 0 = argmax", minimum=0.0, field="temperature"),
    Option("debug_canvas", BOOL, "Fixed canvas pattern + argmax sampling (parity with the reference; "
           "also DLM_DEBUG_CANVAS=1).", request=False),
    SKIP_SPECIAL_TOKENS,
    PREFILL_STEP_SIZE,
    MEMORY_BUDGET,
)
DEFAULTS = defaults(OPTIONS)

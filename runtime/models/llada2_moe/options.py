"""LLaDA-2's generation options (see dlm.runtime.generation.options); defaults are
applied by generate.Settings.from_options."""

from ...generation.options import (BOOL, FLOAT, INT, MAX_TOKENS, MEMORY_BUDGET, PREFILL_STEP_SIZE, SEED,
                                   SKIP_SPECIAL_TOKENS, STR, Option, defaults)

BLOCK_LENGTH = 32
STEPS = 32
THRESHOLD = 0.95
LINEAR_FLOOR = 0.5  # --threshold-schedule linear without an explicit floor
EDITING_THRESHOLD_21 = 0.9  # the LLaDA2.1 hub generate() default
MAX_POST_STEPS = 16
# LLaDA2.2's generate() defaults (docs/llada2.md): a lower fill threshold, every
# differing prediction edits, and a hard cap on a block's iterations.
THRESHOLD_22 = 0.5
EDITING_THRESHOLD_22 = 0.0
MAX_STEPS_PER_BLOCK = 1000

OPTIONS = (
    MAX_TOKENS,
    Option("max_denoising_steps", INT, "Most denoising steps per block.", STEPS, "generation_config steps, else {default}",
           minimum=1),
    SEED,
    Option("temp", FLOAT, "Sampling temperature.", 0.0, "0: argmax", minimum=0.0, field="temperature"),
    Option("top_k", INT, "Top-k sampling (0: off).", default_help="off", minimum=0, neutral=0),
    Option("top_p", FLOAT, "Top-p sampling (1: off).", default_help="off", minimum=0.0, maximum=1.0, min_open=True,
           neutral=1.0),
    Option("block_length", INT, "Tokens per generation block.", BLOCK_LENGTH, minimum=1),
    Option("threshold", FLOAT, "Reveal every masked position whose confidence exceeds this.",
           THRESHOLD, f"{{default}} ({THRESHOLD_22} on LLaDA2.2)", minimum=0.0, maximum=1.0),
    Option("threshold_schedule", STR, "Constant threshold, or a linear decay to FLOOR over a block's "
           f"steps (linear alone decays to {LINEAR_FLOOR}).", "constant",
           metavar="constant|linear[:FLOOR]"),
    Option("editing_threshold", FLOAT, "LLaDA2.1/2.2 token-to-token editing: rewrite a generated token "
           "when the new one's confidence exceeds this (1.0: off).",
           default_help=f"{EDITING_THRESHOLD_21} on LLaDA2.1, {EDITING_THRESHOLD_22} on LLaDA2.2, off otherwise",
           minimum=0.0, maximum=1.0),
    Option("max_post_steps", INT, "LLaDA2.1/2.2 editing: most passes after a block's last mask is filled.",
           MAX_POST_STEPS, minimum=0),
    Option("max_steps_per_block", INT, "LLaDA2.2 editing: most iterations per block (a safety cap; the last "
           "one fills every mask).", MAX_STEPS_PER_BLOCK, minimum=1),
    Option("reference_sampling", BOOL, "The hub 2.0 sampler, which samples even at --temp 0 (parity work).",
           request=False),
    SKIP_SPECIAL_TOKENS,
    PREFILL_STEP_SIZE,
    MEMORY_BUDGET,
)
# Inputs LLaDA-2 cannot take, refused with this reason.
REFUSED = {name: "LLaDA-2 is text-only" for name in ("image", "images", "audio", "video")}
DEFAULTS = defaults(OPTIONS)

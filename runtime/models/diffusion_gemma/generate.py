"""DiffusionGemma generation: block-autoregressive canvases, each denoised.

Per canvas (reference §4.1): re-encode the previously committed canvas into the
prefix cache at its own positions (the prompt at prefill), draw a canvas, run
up to ``max_denoising_steps`` steps (canvas.py), commit the last step's argmax.
Differences from transformers' generate, on purpose:

* the output never exceeds ``max_tokens`` (the last canvas is trimmed) and stops
  at the first EOS of ``generation_config.eos_token_id`` (all of them; the EOS
  itself is not emitted);
* canvases are ``min(max_canvas, max(remaining, min_canvas))`` long unless
  ``diffusion_full_canvas`` (transformers: always ``canvas_length``).

Options are declared in options.py. ``temp`` 1.0 samples the scheduled
distribution softmax(logits / T(step)) as the reference does; temp t samples
softmax(logits / (T(step) * t)); 0 takes the argmax. The schedule (t_min/t_max
from generation_config) still sets entropies, the stop rule and self-conditioning.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, Optional

from ...errors import GenerationError
from ...events import GenerationEvent
from ...generate import Block, run
from ...options import resolve
from . import sampling as S
from .canvas import DebugDraws, DenoiseConfig, RandomDraws, StepHook, denoise_canvas
from .options import OPTIONS

def _env_debug_canvas() -> bool:
    return os.environ.get("DLM_DEBUG_CANVAS", "").strip().lower() in ("1", "true", "yes", "on")


def _gen(gen: dict, key: str, default):
    value = gen.get(key)
    return default if value is None else value


@dataclass
class Settings:
    max_tokens: int = 256
    denoise: DenoiseConfig = field(default_factory=DenoiseConfig)
    min_canvas: int = 64
    max_canvas: int = 256
    full_canvas: bool = False
    seed: Optional[int] = None
    debug_canvas: bool = False
    eos_token_ids: list[int] = field(default_factory=lambda: [1])
    prefill_step_size: int = 2048

    @classmethod
    def from_options(cls, options: dict, args, generation_config: dict) -> "Settings":
        """Settings from options (checked against options.py) over generation_config over defaults."""
        options = resolve(OPTIONS, options, "DiffusionGemma")
        gen = generation_config or {}
        sampler_config = _gen(gen, "sampler_config", {})
        cls_name = sampler_config.get("_cls_name", "EntropyBoundSamplerConfig")
        if cls_name != "EntropyBoundSamplerConfig":
            raise GenerationError(f"generation_config.json: unsupported sampler_config {cls_name!r}")

        canvas = int(args.canvas_length)
        max_canvas = options.get("diffusion_max_canvas_length", canvas)
        if max_canvas > canvas:
            raise GenerationError(
                f"diffusion_max_canvas_length {max_canvas} exceeds the checkpoint's canvas_length {canvas}"
            )
        eos = _gen(gen, "eos_token_id", args.eos_token_ids)
        eos = [int(e) for e in (eos if isinstance(eos, list) else [eos])] if eos is not None else []
        debug = bool(options.get("debug_canvas", False)) or _env_debug_canvas()

        # Unset (missing or null) generation_config fields take transformers' global defaults.
        t_min, t_max = _gen(gen, "t_min", 0.4), _gen(gen, "t_max", 0.8)
        stability = _gen(gen, "stability_threshold", 1)
        conf = _gen(gen, "confidence_threshold", 0.005)
        denoise = DenoiseConfig(
            steps=options.get("max_denoising_steps", int(gen.get("max_denoising_steps") or 48)),
            sampler=options.get("diffusion_sampler", S.ENTROPY_BOUND),
            entropy_bound=float(sampler_config.get("entropy_bound", 0.1)),
            threshold=options.get("diffusion_threshold", 0.9),
            t_min=float(t_min),
            t_max=float(t_max),
            stability_threshold=int(stability),
            confidence_threshold=float(conf),
            temperature=options.get("temp", 1.0),
        )
        return cls(
            max_tokens=options.get("max_tokens", int(gen.get("max_new_tokens") or 256)),
            denoise=denoise,
            min_canvas=options.get("diffusion_min_canvas_length", 64),
            max_canvas=max_canvas,
            full_canvas=options.get("diffusion_full_canvas", False),
            seed=options.get("seed"),
            debug_canvas=debug,
            eos_token_ids=eos,
            prefill_step_size=options.get("prefill_step_size", 2048),
        )


def check_prompt(prompt_ids: list[int], args) -> None:
    if not prompt_ids:
        raise GenerationError("the prompt is empty")
    bad = [t for t in prompt_ids if not 0 <= int(t) < args.vocab_size]
    if bad:
        raise GenerationError(f"prompt token id {bad[0]} is outside the vocabulary (size {args.vocab_size})")
    if len(prompt_ids) >= args.max_position_embeddings:
        raise GenerationError(
            f"the prompt has {len(prompt_ids)} tokens; the model context is "
            f"{args.max_position_embeddings} (max_position_embeddings)"
        )


class CanvasSession:
    """DiffusionGemma's step for the shared loop (dlm.runtime.generate): the
    prompt prefill, then per canvas: encode the previous canvas into the prefix
    cache, draw a canvas, denoise it (canvas.py), commit its argmax."""

    block_name = "canvas"
    skip_special_tokens = False  # channel and tool-call markers are special tokens

    def __init__(self, loaded, prompt_ids: list[int], settings: Settings,
                 cancel: Optional[Callable[[], bool]] = None, on_step: Optional[StepHook] = None):
        self.model, args = loaded.model, loaded.args
        self.prompt_ids = [int(t) for t in prompt_ids]
        check_prompt(self.prompt_ids, args)
        self.settings, self.cancel, self.on_step = settings, cancel, on_step
        self.budget = min(settings.max_tokens, args.max_position_embeddings - len(self.prompt_ids))
        self.stop_ids = frozenset(settings.eos_token_ids)
        self.denoise = replace(settings.denoise, sc_dtype=self.model.dtype)
        if settings.debug_canvas:
            self.draws = DebugDraws(args.vocab_size)
        else:
            seed = settings.seed if settings.seed is not None else random.SystemRandom().randrange(2**31)
            self.draws = RandomDraws(args.vocab_size, seed)
        self.cache, self.pending = None, None

    def prefill(self) -> None:
        self.cache = self.model.make_cache()
        self.model.prefill(self.prompt_ids, self.cache, self.settings.prefill_step_size)

    def next_block(self, remaining: int) -> Block:
        model, cache, s = self.model, self.cache, self.settings
        if self.pending is not None:  # commit: encode the previous canvas at its positions
            model.encode(self.pending, cache)
        length = S.canvas_length(remaining, s.min_canvas, s.max_canvas, s.full_canvas)
        result = denoise_canvas(
            lambda c, sc: model.decode(c, cache, sc), self.draws, length, self.denoise,
            cancel=self.cancel, on_step=self.on_step,
        )
        if result.cancelled:
            return Block(steps=result.steps, cancelled=True)
        self.pending = result.tokens
        return Block(result.tokens[0].tolist(), result.steps, result.stopped_early)


def stream_generate(
    loaded, prompt_ids: list[int], settings: Settings,
    cancel: Optional[Callable[[], bool]] = None, *, on_step: Optional[StepHook] = None,
) -> Iterator[GenerationEvent]:
    """Events: one per committed canvas (sequence order), then a final event.

    ``on_step(step_index, logits, argmax)``: optional per-step hook (parity traces).
    """
    session = CanvasSession(loaded, prompt_ids, settings, cancel, on_step)
    return run(session, loaded, session.prompt_ids, cancel)

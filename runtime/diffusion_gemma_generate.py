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

Options (snake_case CLI flag names; None = unset) and defaults:

==============================  ==================================================
max_tokens                      generation_config max_new_tokens, else 256
max_denoising_steps             generation_config max_denoising_steps, else 48
diffusion_sampler               "entropy-bound" (the checkpoint's sampler_config;
                                entropy_bound from it, else 0.1) or
                                "confidence-threshold"
diffusion_threshold             0.9 (confidence-threshold only: top-1 probability)
diffusion_min_canvas_length     64
diffusion_max_canvas_length     the checkpoint's canvas_length (may not exceed it)
diffusion_full_canvas           False
seed                            random (a fresh seed per call)
temp                            1.0: the denoiser samples from the scheduled
                                distribution softmax(logits / T(step)) as the
                                reference does; temp t samples softmax(logits /
                                (T(step) * t)); 0 takes the argmax. The schedule
                                (t_min/t_max from generation_config) still sets
                                entropies, the stop rule and self-conditioning.
top_k / top_p                   do not apply (error unless 0 / 1.0)
debug_canvas                    False (or env DLM_DEBUG_CANVAS=1): fixed canvases
                                and argmax sampling (reference §4.9)
prefill_step_size               2048 prompt tokens per encoder chunk
==============================  ==================================================
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, Optional

import mlx.core as mx

from . import samplers as S
from .canvas import DebugDraws, DenoiseConfig, RandomDraws, StepHook, denoise_canvas
from .channels import ChannelParser
from .errors import GenerationError
from .events import GenerationEvent, GenerationStats

OPTIONS = (
    "max_tokens", "max_denoising_steps", "diffusion_sampler", "diffusion_threshold",
    "diffusion_min_canvas_length", "diffusion_max_canvas_length", "diffusion_full_canvas",
    "seed", "temp", "top_k", "top_p", "debug_canvas", "prefill_step_size",
)


def _env_debug_canvas() -> bool:
    return os.environ.get("DLM_DEBUG_CANVAS", "").strip().lower() in ("1", "true", "yes", "on")


def _gen(gen: dict, key: str, default):
    value = gen.get(key)
    return default if value is None else value


def _positive_int(options: dict, key: str, default: Optional[int], minimum: int = 1) -> Optional[int]:
    value = options.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise GenerationError(f"{key} must be an integer >= {minimum} (got {value!r})")
    return value


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
        options = {k: v for k, v in (options or {}).items() if v is not None}
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise GenerationError(
                f"option {unknown[0]!r} does not apply to DiffusionGemma "
                f"(it takes: {', '.join(OPTIONS)})"
            )
        gen = generation_config or {}
        top_k, top_p = options.get("top_k"), options.get("top_p")
        if top_k not in (None, 0):
            raise GenerationError("top_k does not apply to DiffusionGemma (its sampler is entropy- or confidence-based)")
        if top_p not in (None, 1, 1.0):
            raise GenerationError("top_p does not apply to DiffusionGemma (its sampler is entropy- or confidence-based)")

        sampler = options.get("diffusion_sampler", S.ENTROPY_BOUND)
        if sampler not in S.SAMPLERS:
            raise GenerationError(f"diffusion_sampler must be one of {', '.join(S.SAMPLERS)} (got {sampler!r})")
        sampler_config = _gen(gen, "sampler_config", {})
        cls_name = sampler_config.get("_cls_name", "EntropyBoundSamplerConfig")
        if cls_name != "EntropyBoundSamplerConfig":
            raise GenerationError(f"generation_config.json: unsupported sampler_config {cls_name!r}")
        threshold = float(options.get("diffusion_threshold", 0.9))
        if not 0.0 <= threshold <= 1.0:
            raise GenerationError(f"diffusion_threshold must be in [0, 1] (got {threshold})")
        temperature = float(options.get("temp", 1.0))
        if temperature < 0:
            raise GenerationError(f"temp must be >= 0 (got {temperature})")

        canvas = int(args.canvas_length)
        max_canvas = _positive_int(options, "diffusion_max_canvas_length", canvas)
        if max_canvas > canvas:
            raise GenerationError(
                f"diffusion_max_canvas_length {max_canvas} exceeds the checkpoint's canvas_length {canvas}"
            )
        eos = _gen(gen, "eos_token_id", args.eos_token_ids)
        eos = [int(e) for e in (eos if isinstance(eos, list) else [eos])] if eos is not None else []
        seed = _positive_int(options, "seed", None, minimum=0)
        debug = bool(options.get("debug_canvas", False)) or _env_debug_canvas()

        # Unset (missing or null) generation_config fields take transformers' global defaults.
        t_min, t_max = _gen(gen, "t_min", 0.4), _gen(gen, "t_max", 0.8)
        stability = _gen(gen, "stability_threshold", 1)
        conf = _gen(gen, "confidence_threshold", 0.005)
        denoise = DenoiseConfig(
            steps=_positive_int(options, "max_denoising_steps", int(gen.get("max_denoising_steps") or 48)),
            sampler=sampler,
            entropy_bound=float(sampler_config.get("entropy_bound", 0.1)),
            threshold=threshold,
            t_min=float(t_min),
            t_max=float(t_max),
            stability_threshold=int(stability),
            confidence_threshold=float(conf),
            temperature=temperature,
        )
        return cls(
            max_tokens=_positive_int(options, "max_tokens", int(gen.get("max_new_tokens") or 256)),
            denoise=denoise,
            min_canvas=_positive_int(options, "diffusion_min_canvas_length", 64),
            max_canvas=max_canvas,
            full_canvas=bool(options.get("diffusion_full_canvas", False)),
            seed=seed,
            debug_canvas=debug,
            eos_token_ids=eos,
            prefill_step_size=_positive_int(options, "prefill_step_size", 2048),
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


def stream_generate(
    loaded, prompt_ids: list[int], settings: Settings,
    cancel: Optional[Callable[[], bool]] = None, *, on_step: Optional[StepHook] = None,
) -> Iterator[GenerationEvent]:
    """Yield one event per committed canvas (sequence order), then a final event.

    ``on_step(step_index, logits, argmax)``: optional per-step hook (parity traces).
    """
    model, args = loaded.model, loaded.args
    prompt_ids = [int(t) for t in prompt_ids]
    check_prompt(prompt_ids, args)
    budget = min(settings.max_tokens, args.max_position_embeddings - len(prompt_ids))
    stats = GenerationStats(prompt_tokens=len(prompt_ids))
    parser = ChannelParser(loaded.tokenizer, prompt_ids) if loaded.tokenizer is not None else None
    denoise = replace(settings.denoise, sc_dtype=model.dtype)
    if settings.debug_canvas:
        draws = DebugDraws(args.vocab_size)
    else:
        seed = settings.seed if settings.seed is not None else random.SystemRandom().randrange(2**31)
        draws = RandomDraws(args.vocab_size, seed)

    mx.reset_peak_memory()
    start = time.perf_counter()
    cache = model.make_cache()
    model.prefill(prompt_ids, cache, settings.prefill_step_size)
    stats.prompt_seconds = time.perf_counter() - start

    start = time.perf_counter()
    produced, pending, finish = 0, None, "length"
    while True:
        remaining = budget - produced
        if remaining <= 0:
            break
        if pending is not None:  # commit: encode the previous canvas at its positions
            model.encode(pending, cache)
        length = S.canvas_length(remaining, settings.min_canvas, settings.max_canvas, settings.full_canvas)
        result = denoise_canvas(
            lambda c, sc: model.decode(c, cache, sc), draws, length, denoise,
            cancel=cancel, on_step=on_step,
        )
        stats.forwards += result.steps
        if result.cancelled:
            finish = "cancelled"
            break
        stats.steps_per_block.append(result.steps)
        stats.early_stops += int(result.stopped_early)
        committed = result.tokens[0].tolist()
        tokens, hit_eos = S.trim_commit(committed, remaining, settings.eos_token_ids)
        produced += len(tokens)
        text, reasoning = parser.feed(tokens) if parser is not None else ("", "")
        yield GenerationEvent(token_ids=tokens, text=text, reasoning=reasoning)
        if hit_eos:
            finish = "stop"
            break
        pending = result.tokens
    stats.completion_tokens = produced
    stats.generation_seconds = time.perf_counter() - start
    stats.peak_memory_gb = mx.get_peak_memory() / 1e9
    text, reasoning = parser.flush() if parser is not None else ("", "")
    yield GenerationEvent(text=text, reasoning=reasoning, finish_reason=finish, stats=stats)

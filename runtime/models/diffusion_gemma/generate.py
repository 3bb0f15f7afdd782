"""DiffusionGemma generation: block-autoregressive canvases, each denoised.

Per canvas (as transformers' ``DiffusionGemmaGenerationMixin.generate``):
re-encode the previously committed canvas into the prefix cache at its own
positions (the prompt at prefill), draw a canvas, run up to
``max_denoising_steps`` steps (canvas.py), commit the last step's argmax.
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

import random
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, Optional

import mlx.core as mx
import numpy as np

from ...platform import settings as env
from ...platform.errors import GenerationError
from ...generation.events import GenerationEvent
from ...generation.prefix_cache import Reuse, image_digest, shared_store
from ...generation.progress import Block, PrefixState, check_prompt, common_prefix, run
from ...platform.memory import check_budget, scores_materialized
from ..base import ConfigReader
from . import sampling as S
from .canvas import Canvas, DebugDraws, DenoiseConfig, RandomDraws, StepHook, drive
from .config import SLIDING
from .model import chunks, image_blocks
from .options import DEFAULTS as D
from .structured import Grammar
from .trace import CanvasTracer


def _env_debug_canvas() -> bool:
    return env.DEBUG_CANVAS.get()


@dataclass
class Settings:
    max_tokens: int = D["max_tokens"]
    denoise: DenoiseConfig = field(default_factory=DenoiseConfig)
    min_canvas: int = D["diffusion_min_canvas_length"]
    max_canvas: int = 256
    full_canvas: bool = False
    seed: Optional[int] = None
    debug_canvas: bool = False
    eos_token_ids: list[int] = field(default_factory=lambda: [1])
    prefill_step_size: int = D["prefill_step_size"]
    memory_budget: Optional[float] = None  # GB; None: the default (dlm.runtime.platform.memory)
    skip_special_tokens: bool = D["skip_special_tokens"]

    @classmethod
    def from_options(cls, options: dict, args, generation_config: dict) -> "Settings":
        """Settings from options (already checked: dlm.runtime.registry.settings) over
        generation_config over defaults."""
        # Every generation_config value typed and range-checked (a bad one names the key).
        g = ConfigReader(generation_config or {}, "generation_config.json", "generation config")
        sampler_config = g.dict("sampler_config", {})
        cls_name = sampler_config.get("_cls_name", "EntropyBoundSamplerConfig")
        if cls_name != "EntropyBoundSamplerConfig":
            raise GenerationError(f"generation_config.json: unsupported sampler_config {cls_name!r}")
        sampler = ConfigReader(sampler_config, "generation_config.json sampler_config")

        canvas = int(args.canvas_length)
        max_canvas = options.get("diffusion_max_canvas_length", canvas)
        if max_canvas > canvas:
            raise GenerationError(
                f"--diffusion-max-canvas-length {max_canvas} exceeds the checkpoint's canvas_length {canvas}"
            )
        min_canvas = options.get("diffusion_min_canvas_length", D["diffusion_min_canvas_length"])
        if "diffusion_min_canvas_length" in options and min_canvas > max_canvas:
            where = ("--diffusion-max-canvas-length" if "diffusion_max_canvas_length" in options
                     else "the checkpoint's canvas_length")
            raise GenerationError(f"--diffusion-min-canvas-length {min_canvas} exceeds {where} {max_canvas}")
        eos = g.token_ids("eos_token_id", list(args.eos_token_ids), vocab=args.vocab_size)
        debug = bool(options.get("debug_canvas", False)) or _env_debug_canvas()

        # Unset (missing or null) generation_config fields take transformers' global defaults.
        denoise = DenoiseConfig(
            steps=options.get("max_denoising_steps", g.int("max_denoising_steps", 0, minimum=0) or D["max_denoising_steps"]),
            sampler=options.get("diffusion_sampler", D["diffusion_sampler"]),
            entropy_bound=sampler.float("entropy_bound", 0.1, minimum=0.0),
            threshold=options.get("diffusion_threshold", D["diffusion_threshold"]),
            t_min=g.float("t_min", 0.4, positive=True),
            t_max=g.float("t_max", 0.8, positive=True),
            stability_threshold=g.int("stability_threshold", 1, minimum=0),
            confidence_threshold=g.float("confidence_threshold", 0.005, minimum=0.0),
            temperature=options.get("temp", D["temp"]),
        )
        return cls(
            max_tokens=options.get("max_tokens", g.int("max_new_tokens", 0, minimum=0) or D["max_tokens"]),
            denoise=denoise,
            min_canvas=min_canvas,
            max_canvas=max_canvas,
            full_canvas=options.get("diffusion_full_canvas", False),
            seed=options.get("seed"),
            debug_canvas=debug,
            eos_token_ids=eos,
            prefill_step_size=options.get("prefill_step_size", D["prefill_step_size"]),
            memory_budget=options.get("memory_budget"),
            skip_special_tokens=options.get("skip_special_tokens", D["skip_special_tokens"]),
        )


class CanvasSession:
    """DiffusionGemma's step for the shared loop (dlm.runtime.generation.progress): the
    prompt prefill, then per canvas: encode the previous canvas into the prefix
    cache, draw a canvas, denoise it (canvas.py), commit its argmax."""

    block_name = "canvas"

    def __init__(self, loaded, prompt_ids: list[int], settings: Settings,
                 cancel: Optional[Callable[[], bool]] = None, on_step: Optional[StepHook] = None,
                 prefix: Optional[PrefixState] = None, watch: Optional[Callable] = None,
                 images: Optional[list] = None, step_trace=None, structured=None, prefix_cache=None):
        self.model, args = loaded.model, loaded.args
        self.step_trace = step_trace  # a dlm.runtime.trace.Trace (--trace), or None
        self.prompt_ids = [int(t) for t in prompt_ids]
        check_prompt(self.prompt_ids, args, settings.max_tokens)
        self.images = list(images or [])
        self.vision_seconds, self.image_tokens = 0.0, sum(i.soft_tokens for i in self.images)
        self.blocks = self._image_blocks(args) if self.images else None
        self.settings, self.cancel, self.on_step = settings, cancel, on_step
        # The thinking channel is split on ids before decoding, so skipping
        # special tokens never loses its markers.
        self.skip_special_tokens = settings.skip_special_tokens
        self.budget = min(settings.max_tokens, args.max_position_embeddings - len(self.prompt_ids))
        self.stop_ids = frozenset(settings.eos_token_ids)
        self.denoise = replace(settings.denoise, sc_dtype=self.model.dtype)
        check_budget(self.memory_bytes(args), settings.memory_budget,
                     "prefix cache, canvas logits and attention scores",
                     "lower --max-tokens, --diffusion-max-canvas-length or --prefill-step-size, "
                     "or shorten the prompt")
        if settings.debug_canvas:
            self.draws = DebugDraws(args.vocab_size)
        else:
            seed = settings.seed if settings.seed is not None else random.SystemRandom().randrange(2**31)
            self.draws = RandomDraws(args.vocab_size, seed)
        self.cache, self.pending = None, None
        self.prefix, self.watch, self.cached_tokens = prefix, watch, 0
        self.store = shared_store(prefix_cache, prefix, self.model)  # a PrefixCache shared across requests
        self.canvas_index = 0
        self.tracer, self.grammar = None, None  # the canvas in progress's (open)
        # Structured output (dlm.runtime.structured): a grammar frontier over the canvases.
        self.frontier = None
        if structured is not None:
            if step_trace is not None:
                raise GenerationError("--trace does not apply to structured output (response_format / "
                                      "--json-schema); trace the unconstrained run")
            self.frontier = structured.frontier(loaded.tokenizer, args.vocab_size, settings.eos_token_ids,
                                                self.budget)

    def _image_blocks(self, args) -> np.ndarray:
        """Image block ids per prompt position, checked against the images' soft tokens."""
        if not self.model.has_vision:
            raise GenerationError("this DiffusionGemma model has no vision tower (a text-only conversion); "
                                  "it takes no images")
        blocks = image_blocks(self.prompt_ids, args.image_token_id)
        found = int((blocks >= 0).sum())
        if found != self.image_tokens:
            raise GenerationError(
                f"the prompt has {found} image tokens (id {args.image_token_id}) but its "
                f"{len(self.images)} image(s) make {self.image_tokens} soft tokens"
            )
        return blocks

    def memory_bytes(self, args) -> int:
        """Upper estimate of what one run holds: the prefix cache at its longest, a
        step's float32 canvas logits (logits, probabilities, self-conditioning,
        scores), and, where attention materializes it (the CPU backend), the widest
        score matrix (a prefill chunk or the canvas against every cached position)."""
        s = self.settings
        positions = len(self.prompt_ids) + self.budget
        item = 4 if self.model.dtype == mx.float32 else 2
        window = args.sliding_window - 1
        kv = sum((min(positions, window) if kind == SLIDING else positions) * heads * dim * 2 * item
                 for kind, heads, dim in zip(args.layer_types, args.layer_kv_heads, args.layer_head_dims))
        canvas = s.max_canvas
        logits = 8 * canvas * args.vocab_size * 4  # measured 7.4x at the released geometry (scores.py)
        rows = max(min(s.prefill_step_size, len(self.prompt_ids)), canvas)
        if self.blocks is not None:  # a chunk grows to hold a whole image block
            rows = max(rows, max(i.soft_tokens for i in self.images) + s.prefill_step_size)
        scores = 2 * args.num_attention_heads * rows * (positions + canvas) * 4 if scores_materialized() else 0
        return kv + logits + scores + self._vision_bytes(args)

    def _vision_bytes(self, args) -> int:
        """The vision tower's widest image: activations (float32) and, on the CPU
        backend, its patch x patch attention scores."""
        if not self.images:
            return 0
        v = args.vision_config or {}
        patches = max(int((i.position_ids >= 0).all(-1).sum()) for i in self.images)
        hidden, inter = int(v.get("hidden_size", 768)), int(v.get("intermediate_size", 3072))
        acts = patches * (6 * hidden + 3 * inter) * 4
        heads = int(v.get("num_attention_heads", 12))
        return acts + (2 * heads * patches * patches * 4 if scores_materialized() else 0)

    def prefill(self) -> None:
        if self.store is not None:
            self._prefill_shared()
            return
        if self.images:
            self._prefill_images()
            return
        state, prompt = self.prefix, self.prompt_ids
        # A kept cache serves the prompt's shared prefix when every layer can rewind to it
        # (sliding layers only hold their window); the last prompt token is always encoded.
        shared = common_prefix(state.ids, prompt[:-1]) if state is not None and state.cache is not None else 0
        if shared and all(c.can_rewind(shared) for c in state.cache):
            for c in state.cache:
                c.rewind(shared)
            self.cache, self.cached_tokens = state.cache, shared
        else:
            self.cache, self.cached_tokens = self.model.make_cache(), 0
        self.model.prefill(prompt[self.cached_tokens:], self.cache, self.settings.prefill_step_size)
        if state is not None:
            state.cache, state.ids = self.cache, list(prompt)

    def _prefill_images(self) -> None:
        """Vision encoder (timed on its own), then the prompt with the image
        features in place and each image block bidirectional. A fresh cache,
        and none kept for later runs (its image positions hold pixels the ids
        do not name)."""
        features = self._vision(self.images)
        self.cache, self.cached_tokens = self.model.make_cache(), 0
        self.model.prefill(self.prompt_ids, self.cache, self.settings.prefill_step_size, features, self.blocks)
        if self.prefix is not None:
            self.prefix.cache, self.prefix.ids = None, []

    def _prefill_shared(self) -> None:
        """The prompt's prefill chunks a PrefixCache holds restored, the rest run (and
        stored): the same forwards as without it (generation/prefix_cache.py). An
        image is keyed by a digest of its pixels; only the images after the
        restored chunks go through the vision tower."""
        prompt, size = self.prompt_ids, self.settings.prefill_step_size
        symbols = list(prompt)
        starts = []  # each image's first position, in order
        if self.blocks is not None:
            starts = [int(np.argmax(self.blocks == i)) for i in range(len(self.images))]
            for image, at in zip(self.images, starts):
                symbols[at] = ("image", image_digest(image))
        bounds = [end for _, end in chunks(len(prompt), size, self.blocks)]
        self.cache = self.model.make_cache()
        reuse = Reuse(self.store, ("diffusion_gemma",), symbols, bounds, self.cache)
        m = self.cached_tokens = reuse.start
        features = self._vision([image for image, at in zip(self.images, starts) if at >= m])
        blocks = self.blocks[m:] if self.blocks is not None else None
        self.model.prefill(prompt[m:], self.cache, size, features, blocks,
                           on_chunk=lambda a, b: reuse.stored(m + a, m + b))

    def _vision(self, images: list) -> Optional[mx.array]:
        """The soft tokens of ``images`` [n, hidden], evaluated and timed on their own
        (``vision_seconds``); None for no image."""
        start = time.perf_counter()
        features = None
        if images:
            features = [self.model.encode_image(i.pixel_values, i.position_ids) for i in images]
            features = mx.concatenate(features, axis=0) if len(features) > 1 else features[0]
            mx.eval(features)
        self.vision_seconds = time.perf_counter() - start
        return features

    def _step_hook(self, index: int) -> Optional[StepHook]:
        """on_step, plus the watcher (which sees the canvas as it stands: its argmax)."""
        if self.watch is None:
            return self.on_step

        def hook(step, logits, argmax):
            if self.on_step is not None:
                self.on_step(step, logits, argmax)
            self.watch(index, step, argmax.reshape(-1).tolist())

        return hook

    def next_block(self, remaining: int) -> Block:
        """One canvas alone: its Canvas (canvas.py) driven by itself, as batch.Batch drives many."""
        model, cache = self.model, self.cache
        encoding, length, canvas = self.open(remaining)
        if encoding is not None:
            model.encode(encoding, cache, compiled=True)
        decode = lambda c, sc: model.decode(c, cache, sc_probs=sc)  # noqa: E731
        return self.finish(drive(canvas, decode, speculate=model.speculates(length)))

    def open(self, remaining: int) -> tuple[Optional[mx.array], int, Canvas]:
        """The next canvas: (the committed canvas to encode at its positions first,
        or None; its length; its Canvas, under the grammar of a structured run)."""
        encoding, s = self.pending, self.settings
        if encoding is not None and self.prefix is not None:
            self.prefix.ids.extend(encoding[0].tolist())
        length = S.canvas_length(remaining, s.min_canvas, s.max_canvas, s.full_canvas)
        self.canvas_index += 1
        index = self.canvas_index - 1
        if self.frontier is not None:
            watch = None if self.watch is None else (lambda step, ids: self.watch(index, step, ids))
            self.grammar = Grammar(self.frontier, self.settings.eos_token_ids[0], watch)
            return encoding, length, Canvas(self.draws, (1, length), self.denoise, cancel=self.cancel,
                                            grammar=self.grammar)
        self.tracer = None if self.step_trace is None else CanvasTracer(self.step_trace, index, length, self.denoise)
        return encoding, length, Canvas(self.draws, (1, length), self.denoise, cancel=self.cancel,
                                        on_step=self._step_hook(index), on_summary=self.tracer)

    def finish(self, result) -> Block:
        """The Block of a canvas that ended (CanvasResult, or StructuredCanvas under
        a grammar); what it commits is encoded before the next canvas."""
        if self.tracer is not None:
            self.tracer.finish(result)
        if result.cancelled:
            return Block(steps=result.steps, cancelled=True)
        if self.frontier is not None:
            self.pending, block = self.grammar.block(result, self.denoise.steps)
            return block
        self.pending = result.tokens
        return Block(result.tokens[0].tolist(), result.steps, result.stopped_early)


Session = CanvasSession


def stream_generate(
    loaded, prompt_ids: list[int], settings: Settings,
    cancel: Optional[Callable[[], bool]] = None, *, on_step: Optional[StepHook] = None,
    prefix: Optional[PrefixState] = None, watch: Optional[Callable] = None,
    images: Optional[list] = None, step_trace=None, structured=None, prefix_cache=None,
) -> Iterator[GenerationEvent]:
    """Events: one per committed canvas (sequence order), then a final event.

    ``on_step(step_index, logits, argmax)``: optional per-step hook (parity traces);
    ``watch(canvas_index, step, token_ids)``: the canvas after every step (--verbose);
    ``prefix``: a PrefixState kept across runs (chat); ``images``: the
    ImageInputs of a PromptInputs (their placeholders are in ``prompt_ids``);
    ``step_trace``: a dlm.runtime.trace.Trace that records every step (--trace);
    ``structured``: a dlm.runtime.structured.Structured (the output follows its grammar);
    ``prefix_cache``: a dlm.runtime.generation.prefix_cache.PrefixCache shared across requests.
    """
    session = CanvasSession(loaded, prompt_ids, settings, cancel, on_step, prefix, watch, images,
                            step_trace=step_trace, structured=structured, prefix_cache=prefix_cache)
    return run(session, loaded, session.prompt_ids, cancel)

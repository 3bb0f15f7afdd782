"""LLaDA-2 block-diffusion generation (reference: llada2_moe.md §4, §6.3).

The sequence is the prompt followed by mask tokens, cut into blocks of
``block_length``. Blocks are generated in order; inside a block every step
runs the model on the active block, samples a token and its confidence per
position, and reveals every masked position whose confidence exceeds the
threshold, and at least the step's quota (``block_length // steps``, the
remainder going to the first steps, as the hub ``generate``), so a block is
always complete after ``steps`` steps: the output never holds a mask token.

KV cache: the prompt's full blocks are prefilled once; a finished block is
written to the cache by the first forward of the next block (the window is
[finished block ; active block] under the block-causal mask), so no forward is
spent only on caching. Attention is block-causal, so this equals the hub's full
recomputation (``kv_cache=False`` runs that instead, for tests).

Sampling: temperature 0 is argmax (the greedy fix); otherwise temperature /
top-k / top-p, drawn by inverse CDF from a seeded uniform stream (numpy PCG64)
so that the PyTorch reference draws the same samples. ``reference_sampling``
reproduces the hub 2.0 sampler (temperature 0 still samples at temperature 1).
LLaDA2.1 checkpoints add token-to-token editing (``editing_threshold``; on by
default at 0.9 when the checkpoint is recognised as 2.1). Unlike the 2.1 hub
code, whose mask is the raw 0/1 matrix (no blocking in effect), attention stays
block-causal, as dllm's fix and the committed-block cache require.

Mask predictions: the hub may commit the mask id as a token; dlm never samples
it (``suppress_mask``), so no output holds a mask token.

Stops: a block is final as soon as no masks remain before its first stop
token (or before the output budget); generation stops after the block holding
a stop token. Stop tokens: the checkpoint's EOS ids plus ``<|role_end|>``
(the chat turn end) when the tokenizer has it.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterator, Optional

import mlx.core as mx
import numpy as np

from .errors import GenerationError
from .events import GenerationEvent, GenerationStats
from .models.llada2_moe import block_causal_mask

BLOCK_LENGTH = 32
STEPS = 32
THRESHOLD = 0.95
LINEAR_FLOOR = 0.5  # --threshold-schedule linear without an explicit floor
EDITING_THRESHOLD_21 = 0.9  # the LLaDA2.1 hub generate() default
MAX_POST_STEPS = 16
PREFILL_STEP = 2048
ROLE_END = "<|role_end|>"

# Options of other families (or of nothing dlm runs): refused by name.
FOREIGN = {
    "diffusion_sampler": "--diffusion-sampler",
    "diffusion_threshold": "--diffusion-threshold",
    "diffusion_min_canvas_length": "--diffusion-min-canvas-length",
    "diffusion_max_canvas_length": "--diffusion-max-canvas-length",
    "diffusion_full_canvas": "--diffusion-full-canvas",
    "debug_canvas": "--debug-canvas",
    "draft_model": "--draft-model",
    "num_draft_tokens": "--num-draft-tokens",
    "image": "--image", "images": "--image",
    "audio": "--audio", "video": "--video",
}
_WHY = {
    "draft_model": "LLaDA-2 already unmasks whole blocks; a speculative draft model is not supported",
    "num_draft_tokens": "LLaDA-2 already unmasks whole blocks; a speculative draft model is not supported",
    "image": "LLaDA-2 is text-only", "images": "LLaDA-2 is text-only",
    "audio": "LLaDA-2 is text-only", "video": "LLaDA-2 is text-only",
}
OWN = {
    "max_tokens", "temp", "temperature", "top_k", "top_p", "seed", "max_denoising_steps",
    "block_length", "threshold", "threshold_schedule", "editing_threshold", "max_post_steps",
    "reference_sampling", "prefill_step_size",
}
# Prompt/output options handled before generation (CLI, API, server).
NEUTRAL = {"enable_thinking", "stop", "system", "chat_template", "profile", "json", "verbose", "stream"}


def _unset(value) -> bool:
    return value is None or value is False or (isinstance(value, (list, tuple, str)) and not value)


def parse_threshold_schedule(value, threshold: float) -> Optional[float]:
    """'constant' -> None; 'linear' -> floor 0.5; 'linear:F' -> floor F (decay to F over the steps)."""
    if value is None or value == "constant":
        return None
    m = re.fullmatch(r"linear(?::([0-9]*\.?[0-9]+))?", str(value).strip())
    if not m:
        raise GenerationError(
            f"--threshold-schedule must be 'constant', 'linear' or 'linear:FLOOR', not {value!r}"
        )
    floor = float(m.group(1)) if m.group(1) else min(LINEAR_FLOOR, threshold)
    if not 0.0 <= floor <= threshold:
        raise GenerationError(f"--threshold-schedule floor {floor} must be in [0, --threshold={threshold}]")
    return floor


@dataclass
class Settings:
    mask_token_id: int
    eos_token_ids: tuple[int, ...]
    max_tokens: int = 256
    block_length: int = BLOCK_LENGTH
    steps: int = STEPS
    threshold: float = THRESHOLD
    min_threshold: Optional[float] = None  # linear schedule floor; None: constant
    temperature: float = 0.0
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None
    reference_sampling: bool = False
    # None: no editing; "auto": LLaDA2.1 checkpoints edit at 0.9, others do not.
    editing_threshold: Optional[float] | str = "auto"
    max_post_steps: int = MAX_POST_STEPS
    prefill_step_size: int = PREFILL_STEP  # prompt tokens per prefill forward (rounded to blocks)
    # Internal switches (parity suite and tests; not CLI flags).
    kv_cache: bool = True
    suppress_mask: bool = True  # never sample the mask token (the hub does not exclude it)
    early_stop: bool = True  # end a block once its output is final
    stop_on_role_end: bool = True
    uniforms: Optional[Callable[[int], np.ndarray]] = None  # overrides the seeded stream
    on_step: Optional[Callable[[int, int, mx.array], None]] = None  # (block, step, logits [bl, V])
    trace: Optional[list] = None  # (block, step, positions, tokens) per step

    @classmethod
    def from_options(cls, options: dict, args, generation_config: dict) -> "Settings":
        options = dict(options or {})
        for key, value in options.items():
            if _unset(value) or key in OWN or key in NEUTRAL:
                continue
            if key in FOREIGN:
                why = _WHY.get(key, "it is a DiffusionGemma option")
                raise GenerationError(f"{FOREIGN[key]} does not apply to LLaDA-2 models: {why}")
            raise GenerationError(f"option {key!r} does not apply to LLaDA-2 models")
        gc = generation_config or {}

        def pick(*names, default=None):
            for n in names:
                if options.get(n) is not None:
                    return options[n]
            for n in names:
                if gc.get(n) is not None:
                    return gc[n]
            return default

        eos = gc.get("eos_token_id")
        eos_ids = list(args.eos_token_ids) if eos is None else (eos if isinstance(eos, list) else [eos])
        s = cls(
            mask_token_id=int(gc.get("mask_token_id", args.mask_token_id)),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            max_tokens=int(pick("max_tokens", "max_new_tokens", default=256)),
            block_length=int(pick("block_length", default=BLOCK_LENGTH)),
            steps=int(pick("max_denoising_steps", "steps", default=STEPS)),
            threshold=float(pick("threshold", default=THRESHOLD)),
            temperature=float(pick("temp", "temperature", default=0.0)),
            top_k=options.get("top_k"),
            top_p=options.get("top_p"),
            seed=options.get("seed"),
            reference_sampling=bool(options.get("reference_sampling") or False),
            max_post_steps=int(pick("max_post_steps", default=MAX_POST_STEPS)),
            prefill_step_size=int(pick("prefill_step_size", default=PREFILL_STEP)),
        )
        if options.get("editing_threshold") is not None:
            s.editing_threshold = float(options["editing_threshold"])
        s.min_threshold = parse_threshold_schedule(options.get("threshold_schedule"), s.threshold)
        s.validate()
        return s

    def validate(self) -> None:
        def bad(msg):
            raise GenerationError(msg)

        if self.max_tokens < 0:
            bad(f"--max-tokens must be >= 0, got {self.max_tokens}")
        if self.block_length < 1:
            bad(f"--block-length must be >= 1, got {self.block_length}")
        if self.steps < 1:
            bad(f"--max-denoising-steps must be >= 1, got {self.steps}")
        if not 0.0 <= self.threshold <= 1.0:
            bad(f"--threshold must be in [0, 1], got {self.threshold}")
        if self.temperature < 0:
            bad(f"--temp must be >= 0, got {self.temperature}")
        if self.top_k is not None and int(self.top_k) < 0:
            bad(f"--top-k must be >= 0, got {self.top_k}")
        if self.top_p is not None and not 0.0 < float(self.top_p) <= 1.0:
            bad(f"--top-p must be in (0, 1], got {self.top_p}")
        if isinstance(self.editing_threshold, float) and not 0.0 <= self.editing_threshold <= 1.0:
            bad(f"--editing-threshold must be in [0, 1], got {self.editing_threshold}")
        if self.prefill_step_size < 1:
            bad(f"--prefill-step-size must be >= 1, got {self.prefill_step_size}")
        if self.max_post_steps < 0:
            bad(f"--max-post-steps must be >= 0, got {self.max_post_steps}")

    def step_threshold(self, step: int, steps: int) -> float:
        if self.min_threshold is None:
            return self.threshold
        return self.threshold - (self.threshold - self.min_threshold) * step / max(1, steps - 1)


def transfer_quota(block_length: int, steps: int) -> list[int]:
    """What each step must reveal at least: bl // steps, remainder to the first steps."""
    base, extra = divmod(block_length, steps)
    return [base + (1 if s < extra else 0) for s in range(steps)]


class UniformStream:
    """The shared sampling randomness: uniforms in [0, 1) from numpy's PCG64.
    The PyTorch reference draws from the same stream, so both sample alike."""

    def __init__(self, seed: Optional[int]):
        if seed is None:
            seed = int.from_bytes(os.urandom(8), "little")
        self.rng = np.random.default_rng(seed)

    def __call__(self, n: int) -> np.ndarray:
        return self.rng.random(n, dtype=np.float64).astype(np.float32)


def is_llada21(loaded) -> bool:
    """LLaDA2.1 shares 2.0's architecture and config; recognise it by name
    (directory, _name_or_path, dlm source) or by a shipped modeling file whose
    generate() takes editing_threshold (read as text, never executed)."""
    names = [str(getattr(loaded, "path", "")), str(loaded.config.get("_name_or_path", ""))]
    names.append(str((loaded.config.get("dlm") or {}).get("source", "")))
    if any(re.search(r"llada[-_]?2[._-]?1(?!\d)", n, re.IGNORECASE) for n in names):
        return True
    path = getattr(loaded, "path", None)
    if path:
        for f in Path(path).glob("modeling_*.py"):
            try:
                if "editing_threshold" in f.read_text(errors="ignore"):
                    return True
            except OSError:
                pass
    return False


# ---------------------------------------------------------------------------
# Per-step rules (MLX, no host syncs)
# ---------------------------------------------------------------------------


def filter_logits(logits, top_k=None, top_p=None):
    """Hub top-k (ties kept) and top-p (drop tokens whose exclusive cumulative mass > p)."""
    if top_k:
        k = min(int(top_k), logits.shape[-1])
        kth = mx.topk(logits, k, axis=-1).min(axis=-1, keepdims=True)
        logits = mx.where(logits < kth, -mx.inf, logits)
    if top_p is not None and top_p < 1:
        order = mx.argsort(-logits, axis=-1)
        sorted_logits = mx.take_along_axis(logits, order, axis=-1)
        probs = mx.softmax(sorted_logits, axis=-1)
        drop = (mx.cumsum(probs, axis=-1) - probs) > top_p
        drop = mx.concatenate([mx.zeros_like(drop[..., :1]), drop[..., 1:]], axis=-1)
        drop = mx.take_along_axis(drop, mx.argsort(order, axis=-1), axis=-1)
        logits = mx.where(drop, -mx.inf, logits)
    return logits


def sample(logits, s: Settings, uniforms: Optional[np.ndarray]):
    """(tokens, confidence of each chosen token) for [n, V] float32 logits."""
    if s.temperature == 0 and not s.reference_sampling:
        tok = mx.argmax(logits, axis=-1)
        conf = mx.exp(mx.max(logits, axis=-1) - mx.logsumexp(logits, axis=-1))
        return tok, conf
    if s.temperature > 0 and s.temperature != 1:
        logits = logits / s.temperature
    probs = mx.softmax(filter_logits(logits, s.top_k, s.top_p), axis=-1)
    cdf = mx.cumsum(probs, axis=-1)
    target = mx.array(uniforms)[:, None] * cdf[:, -1:]
    tok = mx.minimum((cdf <= target).sum(axis=-1), probs.shape[-1] - 1)
    return tok, mx.take_along_axis(probs, tok[:, None], axis=-1)[:, 0]


def reveal(active, conf, threshold: float, quota: int):
    """Every active position above the threshold if there are at least
    ``quota`` of them, else the ``quota`` most confident active positions."""
    conf = mx.where(active, conf, -mx.inf)
    high = conf > threshold
    # Rank = positions ahead in (confidence desc, position asc): exact ties go
    # to the lowest position, as in the reference.
    n = conf.shape[-1]
    ahead = (conf[None, :] > conf[:, None]) | (
        (conf[None, :] == conf[:, None]) & (mx.arange(n)[None, :] < mx.arange(n)[:, None])
    )
    top = (ahead.sum(-1) < quota) & active
    return mx.where(high.sum() >= quota, high, top)


# ---------------------------------------------------------------------------
# The block loop
# ---------------------------------------------------------------------------


class _Detokenizer:
    """Text deltas of a growing token list (holds back a trailing partial character)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = 0

    def add(self, ids: list[int], final: bool = False) -> str:
        if self.tokenizer is None:
            return ""
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if not final and text.endswith("\ufffd"):
            text = text[:-1]
        delta = text[self.emitted:]
        self.emitted = len(text)
        return delta


def stop_ids(loaded, s: Settings) -> set[int]:
    ids = set(s.eos_token_ids)
    tok = getattr(loaded, "tokenizer", None)
    if s.stop_on_role_end and tok is not None:
        rid = tok.convert_tokens_to_ids(ROLE_END)
        if isinstance(rid, int) and rid != getattr(tok, "unk_token_id", None) and rid >= 0:
            ids.add(rid)
    return ids


_HOOKS = (
    "on_step", "trace", "uniforms", "kv_cache", "suppress_mask", "early_stop", "stop_on_role_end",
    "editing_threshold",
)


def stream_generate(
    loaded, prompt_ids: list[int], settings: Settings, cancel: Optional[Callable[[], bool]] = None,
    *, stop_ids: Optional[list[int]] = None, **hooks,
) -> Iterator[GenerationEvent]:
    """Events: one per finished block (its new tokens and text, in sequence
    order), then the final event with finish_reason and stats.

    ``hooks`` override the internal Settings switches (parity suite, tests):
    on_step(block, step, logits), trace, uniforms, kv_cache, suppress_mask,
    early_stop, stop_on_role_end, editing_threshold (None: 2.0 decoding);
    ``stop_ids`` replaces the stop-token set."""
    unknown = sorted(set(hooks) - set(_HOOKS))
    if unknown:
        raise GenerationError(f"unknown LLaDA-2 generation hook(s): {', '.join(unknown)}")
    if hooks:
        settings = replace(settings, **hooks)
    loop = _BlockLoop(loaded, list(prompt_ids), settings, cancel)
    if stop_ids is not None:
        loop.set_stops(stop_ids)
    return loop.run()


class _BlockLoop:
    def __init__(self, loaded, prompt_ids, s: Settings, cancel):
        self.model, self.s, self.cancel = loaded.model, s, cancel
        self.prompt = prompt_ids
        self.P, self.bl = len(prompt_ids), s.block_length
        vocab = loaded.args.vocab_size
        bad = [t for t in prompt_ids if not 0 <= int(t) < vocab]
        if bad:
            raise GenerationError(f"prompt token id {bad[0]} is outside the vocabulary (size {vocab})")
        if not 0 <= s.mask_token_id < vocab:
            raise GenerationError(f"mask token id {s.mask_token_id} is outside the vocabulary (size {vocab})")
        self.editing = s.editing_threshold
        if self.editing == "auto":
            self.editing = EDITING_THRESHOLD_21 if is_llada21(loaded) else None
        self.steps = max(1, min(s.steps, s.max_tokens))  # hub: min(steps, gen_length // minimal_topk)
        self.quota = transfer_quota(self.bl, self.steps)
        self.uniforms = s.uniforms or UniformStream(s.seed)
        self.needs_uniforms = s.temperature > 0 or s.reference_sampling
        self.logit_bias = None
        if s.suppress_mask:
            self.logit_bias = mx.where(mx.arange(vocab) == s.mask_token_id, -mx.inf, 0.0)
        self.set_stops(stop_ids(loaded, s))
        self.detok = _Detokenizer(getattr(loaded, "tokenizer", None))
        self.stats = GenerationStats(prompt_tokens=self.P, block_name="block")

    def set_stops(self, ids) -> None:
        self.stops = {int(i) for i in ids}
        self.stop_arr = mx.array(sorted(self.stops), dtype=mx.int32) if self.stops else None

    # -- model calls -------------------------------------------------------

    def _prefill(self, upto: int) -> None:
        """The prompt's full blocks into the cache, a whole number of blocks per forward."""
        if self.cache is None:
            return
        bl = self.bl
        chunk = max(bl, self.s.prefill_step_size // bl * bl)
        for a in range(0, upto, chunk):
            b = min(upto, a + chunk)
            ids = mx.array(self.prompt[a:b], dtype=mx.int32)[None]
            logits = self.model(ids, self.cache, block_causal_mask(a, b - a, a, bl), last=1)
            mx.eval(logits, [(c.keys, c.values) for c in self.cache])
            for c in self.cache:
                c.commit(b - a)

    def _forward(self, start: int, block):
        """Raw float32 logits [bl, V] of the active block at [start, start + bl)."""
        bl = self.bl
        if self.cache is None:
            ids = mx.concatenate([self.committed[:start], block])[None]
            logits = self.model(ids, mask=block_causal_mask(0, start + bl, 0, bl), last=bl)
        else:
            offset = self.cache[0].offset
            ids = block if self.pending is None else mx.concatenate([self.pending, block])
            mask = block_causal_mask(offset, ids.shape[0], offset, bl)
            logits = self.model(ids[None], self.cache, mask, last=bl)
            if self.pending is not None:
                for c in self.cache:
                    c.commit(bl)
                self.pending = None
        self.stats.forwards += 1
        return logits[0]

    def _step(self, b: int, s: int, start: int, block):
        """One forward + sample. Returns (tokens, confidences)."""
        logits = self._forward(start, block)
        if self.s.on_step is not None:
            self.s.on_step(b, s, logits)
        if self.logit_bias is not None:
            logits = logits + self.logit_bias
        u = self.uniforms(self.bl) if self.needs_uniforms else None
        return sample(logits, self.s, u)

    def _trace(self, b: int, s: int, start: int, write, tok) -> None:
        if self.s.trace is not None:
            w = np.nonzero(np.array(write))[0]
            self.s.trace.append((b, s, [int(start + i) for i in w], np.array(tok)[w].tolist()))

    # -- loop --------------------------------------------------------------

    def run(self) -> Iterator[GenerationEvent]:
        s, bl, P = self.s, self.bl, self.P
        t0 = time.perf_counter()
        limit = P + s.max_tokens
        if s.max_tokens == 0:
            yield self._final("length", t0, t0)
            return
        nb = -(-limit // bl)
        first = P // bl
        self.cache = self.model.make_cache(nb * bl) if s.kv_cache else None
        self.pending = None
        x = np.full(nb * bl, s.mask_token_id, dtype=np.int32)
        x[:P] = self.prompt
        self.committed = mx.array(x[: first * bl])
        self._prefill(first * bl)
        t1 = time.perf_counter()
        self.stats.prompt_seconds = t1 - t0
        pos = mx.arange(bl)
        emitted, finish = 0, "length"
        for b in range(first, nb):
            start = b * bl
            gen_from = max(P - start, 0)  # first generated position in the block
            need = min(limit - start, bl)  # positions that reach the output
            block = mx.array(x[start : start + bl])
            # The hub denoises the whole block, including positions past the
            # budget (they influence the rest); only the stop test uses ``need``.
            in_gen = pos >= gen_from
            if self.editing is None:
                block, steps, cancelled = self._denoise(b, start, block, in_gen, need)
            else:
                block, steps, cancelled = self._edit(b, start, block, gen_from)
            self.stats.steps_per_block.append(steps)
            if cancelled:
                finish = "cancelled"
                break
            if steps < self.steps:
                self.stats.early_stops += 1
            out = np.array(block)
            x[start : start + bl] = out
            if self.cache is not None:
                self.pending = block
            else:
                self.committed = mx.array(x[: start + bl])
            new = out[gen_from:need].tolist()
            stop_at = next((i for i, t in enumerate(new) if t in self.stops), None)
            if stop_at is not None:
                new, finish = new[:stop_at], "stop"
            emitted += len(new)
            self.stats.completion_tokens = emitted
            text = self.detok.add(new, final=finish == "stop" or b == nb - 1)
            yield GenerationEvent(token_ids=new, text=text)
            if finish == "stop":
                break
        yield self._final(finish, t0, t1)

    def _final(self, finish: str, t0: float, t1: float) -> GenerationEvent:
        self.stats.generation_seconds = time.perf_counter() - t1
        self.stats.peak_memory_gb = mx.get_peak_memory() / 1e9
        return GenerationEvent(finish_reason=finish, stats=self.stats)

    def _denoise(self, b: int, start: int, block, in_gen, need: int):
        """LLaDA2.0: up to ``steps`` steps, each revealing >= its quota."""
        mask_id = self.s.mask_token_id
        pos = mx.arange(self.bl)
        for s in range(self.steps):
            if self.cancel is not None and self.cancel():
                return block, s, True
            active = (block == mask_id) & in_gen
            tok, conf = self._step(b, s, start, block)
            write = reveal(active, conf, self.s.step_threshold(s, self.steps), self.quota[s])
            block = mx.where(write, tok.astype(block.dtype), block)
            self._trace(b, s, start, write, tok)
            # Final once no mask is left before the output budget or before a stop token.
            masked = (block == mask_id) & in_gen
            first_mask = mx.min(mx.where(masked, pos, self.bl))
            done = first_mask >= need
            if self.s.early_stop and self.stop_arr is not None:
                is_stop = (block[:, None] == self.stop_arr[None]).any(-1) & in_gen
                done = done | (mx.min(mx.where(is_stop, pos, self.bl)) < first_mask)
            elif not self.s.early_stop:
                done = ~masked.any()
            if done.item():
                return block, s + 1, False
        return block, self.steps, False

    def _edit(self, b: int, start: int, block, gen_from: int):
        """LLaDA2.1 draft-and-edit (§6.3): mask-to-token reveals as in 2.0 (quota
        fallback), plus token-to-token edits of generated positions whose new
        token has confidence > editing_threshold; after the last mask, editing
        passes until nothing changes (at most max_post_steps)."""
        mask_id, post, s = self.s.mask_token_id, 0, 0
        editable = mx.arange(self.bl) >= gen_from
        n_active = int(((block == mask_id) & editable).sum().item())
        while True:
            if n_active == 0:
                post += 1
            if post > self.s.max_post_steps:
                return block, s, False
            if self.cancel is not None and self.cancel():
                return block, s, True
            active = (block == mask_id) & editable
            tok, conf = self._step(b, s, start, block)
            tok = tok.astype(block.dtype)
            if n_active:
                q = max(self.quota[s] if s < len(self.quota) else 1, 1)
                thr = self.s.step_threshold(min(s, self.steps - 1), self.steps)
                write = reveal(active, conf, thr, q)
            else:
                write = mx.zeros_like(active)
            edit = editable & ~active & (tok != block) & (conf > self.editing)
            write = write | edit
            block = mx.where(write, tok, block)
            self._trace(b, s, start, write, tok)
            counts = mx.stack([((block == mask_id) & editable).sum(), edit.sum()]).tolist()
            s += 1
            was_active, n_active = n_active, int(counts[0])
            if was_active == 0 and counts[1] == 0:
                return block, s, False
